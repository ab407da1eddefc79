"""The fault-test proxy `replyproxy.ReplyProxy`, against the real server.

A statement whose reply is dropped has run on the server (committed, in autocommit)
while its client sees the connection die; everything else passes through unchanged.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers import poll
from psycopg_pool import ConnectionPool
from replyproxy import ReplyProxy

pytestmark = pytest.mark.timeout(60)

APP = "replyproxy-test"
"""The application_name of every connection through the proxy, to find their backends."""


@pytest.fixture
def proxy(db: psycopg.Connection[Any]) -> Iterator[ReplyProxy]:
    """A started proxy in front of the test server (its host and port as `db` reached it)."""
    db.execute("CREATE TABLE proxy_t (id int PRIMARY KEY, note text)")
    with ReplyProxy(db.info.host, db.info.port) as p:
        yield p


def connect(proxy: ReplyProxy, db_url: str, **kwargs: Any) -> psycopg.Connection[Any]:
    """An autocommit connection through `proxy`, parsing every statement afresh."""
    options: dict[str, Any] = {
        "autocommit": True,
        "prepare_threshold": None,
        "application_name": APP,
        "connect_timeout": 10,
    }
    options.update(kwargs)
    return psycopg.connect(proxy.url_for(db_url), **options)


def proxied_backends(db: psycopg.Connection[Any]) -> int:
    """Sessions of the test database opened through the proxy."""
    row = db.execute(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() AND application_name = %s",
        (APP,),
    ).fetchone()
    assert row is not None
    return int(row[0])


def wait_no_backends(db: psycopg.Connection[Any]) -> None:
    """Until every backend opened through the proxy has ended."""
    poll(
        db,
        "SELECT count(*) = 0 FROM pg_stat_activity "
        "WHERE datname = current_database() AND application_name = %s",
        (APP,),
        timeout=10,
        what="the proxied backends to end",
    )


def notes(db: psycopg.Connection[Any]) -> dict[int, str]:
    return dict(db.execute("SELECT id, note FROM proxy_t").fetchall())


def test_armed_insert_commits_and_the_reply_is_lost(
    db_url: str, db: psycopg.Connection[Any], proxy: ReplyProxy
) -> None:
    with connect(proxy, db_url) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
        proxy.drop_reply("INSERT INTO proxy_t")
        with pytest.raises(psycopg.OperationalError):
            conn.execute("INSERT INTO proxy_t VALUES (%s, %s)", (1, "one"))
        assert conn.broken
    assert notes(db) == {1: "one"}
    assert proxy.dropped == 1
    assert proxy.dropped_in_transaction == 0
    assert proxy.connections == 1
    wait_no_backends(db)  # the server side of the proxied connection was closed too


def test_unarmed_statements_pass_through(
    db_url: str, db: psycopg.Connection[Any], proxy: ReplyProxy
) -> None:
    with connect(proxy, db_url) as conn:
        for i in range(20):
            conn.execute("INSERT INTO proxy_t VALUES (%s, %s)", (i, f"n{i}"))
        assert conn.execute("SELECT count(*), max(note) FROM proxy_t").fetchone() == (20, "n9")
        row = conn.execute(
            "SELECT %s::int + 1, %s::text || '!', %s::jsonb", (41, "hé", '{"a": [1, 2]}')
        ).fetchone()
        assert row == (42, "hé!", {"a": [1, 2]})
        # ~1 MB in one DataRow, then ~1 MB in 10 000 rows: replies split across reads.
        assert conn.execute("SELECT repeat('x', 1000000)").fetchone() == ("x" * 1_000_000,)
        rows = conn.execute(
            "SELECT g, repeat(chr(97 + g % 26), 100) FROM generate_series(1, 10000) g"
        ).fetchall()
        assert len(rows) == 10_000
        assert rows[-1] == (10000, chr(97 + 10000 % 26) * 100)
        # A simple query with several statements, an error, and the session after it.
        with pytest.raises(psycopg.errors.DivisionByZero):
            conn.execute("SELECT 1/0")
        conn.execute("SET application_name = 'replyproxy-test'; SELECT 1")
        # Asynchronous messages: a notice and a notification.
        seen: list[str] = []
        conn.add_notice_handler(lambda diag: seen.append(str(diag.message_primary)))
        conn.execute("DO $$ BEGIN RAISE NOTICE 'hello from the server'; END $$")
        assert seen == ["hello from the server"]
        conn.execute("LISTEN proxy_channel")
        db.execute("NOTIFY proxy_channel, 'ping'")
        got = [n.payload for n in conn.notifies(timeout=10, stop_after=1)]
        assert got == ["ping"]
        # COPY both ways (simple protocol).
        with conn.cursor().copy("COPY proxy_t (id, note) FROM STDIN") as copy:
            for i in range(100, 110):
                copy.write_row((i, f"c{i}"))
        with conn.cursor().copy("COPY (SELECT id FROM proxy_t WHERE id >= 100) TO STDOUT") as c:
            assert len(list(c.rows())) == 10
    assert len(notes(db)) == 30
    assert proxy.dropped == 0
    assert proxy.dropped_in_transaction == 0
    assert proxy.connections == 1


def test_arming_matches_only_its_text_and_count_drops_that_many(
    db_url: str, db: psycopg.Connection[Any], proxy: ReplyProxy
) -> None:
    proxy.drop_reply("marker_a", count=2)
    with connect(proxy, db_url) as conn:
        conn.execute("INSERT INTO proxy_t VALUES (1, 'marker_b')")
        conn.execute("INSERT INTO proxy_t VALUES (2, %s)", ("marker_a",))  # a parameter
        conn.execute("SELECT * FROM proxy_t")
        with pytest.raises(psycopg.OperationalError):
            conn.execute("INSERT INTO proxy_t VALUES (3, 'x') -- marker_a")
    assert proxy.dropped == 1
    with connect(proxy, db_url) as conn, pytest.raises(psycopg.OperationalError):
        conn.execute("UPDATE proxy_t SET note = 'marker_a' WHERE id = 1")
    proxy.wait_dropped(2)
    with connect(proxy, db_url) as conn:  # the arm is spent
        conn.execute("INSERT INTO proxy_t VALUES (4, 'y') -- marker_a")
    assert notes(db) == {1: "marker_a", 2: "marker_a", 3: "x", 4: "y"}
    assert proxy.dropped == 2
    assert proxy.connections == 3


@pytest.mark.parametrize("style", ["transaction-block", "implicit"])
def test_a_drop_inside_a_transaction_commits_nothing(
    db_url: str, db: psycopg.Connection[Any], proxy: ReplyProxy, style: str
) -> None:
    proxy.drop_reply("INSERT INTO proxy_t")
    if style == "transaction-block":
        with (
            connect(proxy, db_url) as conn,
            pytest.raises(psycopg.OperationalError),
            conn.transaction(),
        ):
            conn.execute("SELECT 1")
            conn.execute("INSERT INTO proxy_t VALUES (1, 'one')")
    else:
        with connect(proxy, db_url, autocommit=False) as conn:
            with pytest.raises(psycopg.OperationalError):
                conn.execute("INSERT INTO proxy_t VALUES (1, 'one')")
            assert conn.broken
    assert proxy.dropped_in_transaction == 1
    assert proxy.dropped == 0
    wait_no_backends(db)  # its backend is gone: the transaction was rolled back
    assert notes(db) == {}


def test_a_pool_sees_an_operational_error_and_recovers(
    db_url: str, db: psycopg.Connection[Any], proxy: ReplyProxy
) -> None:
    with ConnectionPool(
        proxy.url_for(db_url),
        min_size=1,
        max_size=2,
        open=True,
        timeout=10,
        kwargs={"autocommit": True, "prepare_threshold": None, "application_name": APP},
    ) as pool:
        pool.wait(10)
        with pool.connection() as conn:
            conn.execute("SELECT 1")
        proxy.drop_reply("INSERT INTO proxy_t")
        with pytest.raises(psycopg.OperationalError), pool.connection() as conn:
            conn.execute("INSERT INTO proxy_t VALUES (1, 'one')")
        for i in (2, 3):
            with pool.connection() as conn:
                conn.execute("INSERT INTO proxy_t VALUES (%s, 'again')", (i,))
        assert proxy.connections >= 2
    assert notes(db) == {1: "one", 2: "again", 3: "again"}
    assert proxy.dropped == 1


def test_a_named_prepared_statement_is_dropped_when_executed_again(
    db_url: str, db: psycopg.Connection[Any], proxy: ReplyProxy
) -> None:
    insert = "INSERT INTO proxy_t VALUES (%s, %s)"
    with connect(proxy, db_url, prepare_threshold=0) as conn:
        conn.execute(insert, (1, "one"))  # Parse (named) + Sync, then Bind/Execute/Sync
        prepared = conn.execute("SELECT statement FROM pg_prepared_statements").fetchall()
        assert any("INSERT INTO proxy_t" in s for (s,) in prepared), prepared
        proxy.drop_reply("INSERT INTO proxy_t")
        with pytest.raises(psycopg.OperationalError):
            conn.execute(insert, (2, "two"))  # Bind of the statement by name, no Parse
    assert notes(db) == {1: "one", 2: "two"}
    assert proxy.dropped == 1


def test_stop_with_live_idle_connections_is_prompt(
    db_url: str, db: psycopg.Connection[Any], proxy: ReplyProxy
) -> None:
    conns = [connect(proxy, db_url) for _ in range(3)]
    try:
        for conn in conns:
            conn.execute("SELECT 1")
        assert proxied_backends(db) == 3
        began = time.monotonic()
        proxy.stop()
        assert time.monotonic() - began < 5
        assert not [t for t in threading.enumerate() if t.name.startswith("replyproxy-")]
        for conn in conns:
            with pytest.raises(psycopg.OperationalError):
                conn.execute("SELECT 1")
        wait_no_backends(db)
        with pytest.raises(psycopg.OperationalError):
            connect(proxy, db_url, connect_timeout=2)  # nothing listens any more
    finally:
        for conn in conns:
            conn.close()


def test_drop_randomly(db_url: str, db: psycopg.Connection[Any], proxy: ReplyProxy) -> None:
    proxy.drop_randomly(1.0, contains=["marker"], seed=7)
    with connect(proxy, db_url) as conn:
        conn.execute("INSERT INTO proxy_t VALUES (1, 'plain')")
        with pytest.raises(psycopg.OperationalError):
            conn.execute("INSERT INTO proxy_t VALUES (2, 'marker')")
    assert proxy.dropped == 1
    proxy.drop_randomly(0)
    with connect(proxy, db_url) as conn:
        conn.execute("INSERT INTO proxy_t VALUES (3, 'marker')")
    assert proxy.dropped == 1
    # In between, some of the statements: reproducible with a seed.
    outcomes: list[list[bool]] = []
    for _ in range(2):
        proxy.drop_randomly(0.5, seed=3)
        lost: list[bool] = []
        conn = connect(proxy, db_url)
        for _ in range(20):
            try:
                conn.execute("SELECT 1")
                lost.append(False)
            except psycopg.OperationalError:
                lost.append(True)
                conn.close()
                conn = connect(proxy, db_url)
        conn.close()
        outcomes.append(lost)
        proxy.drop_randomly(0)
    assert outcomes[0] == outcomes[1]
    assert 0 < sum(outcomes[0]) < 20
    assert notes(db) == {1: "plain", 2: "marker", 3: "marker"}


def test_server_closing_first_closes_the_client(
    db_url: str, db: psycopg.Connection[Any], proxy: ReplyProxy
) -> None:
    with connect(proxy, db_url) as conn:
        pid = conn.info.backend_pid
        db.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with pytest.raises(psycopg.OperationalError):
            for _ in range(100):  # the FATAL may be read by the first statement or the next
                conn.execute("SELECT 1")
                time.sleep(0.05)
    with connect(proxy, db_url) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_cut_all(db_url: str, db: psycopg.Connection[Any], proxy: ReplyProxy) -> None:
    conns = [connect(proxy, db_url) for _ in range(2)]
    try:
        proxy.cut_all()
        for conn in conns:
            with pytest.raises(psycopg.OperationalError):
                conn.execute("SELECT 1")
        wait_no_backends(db)
        assert proxy.dropped == 0
        with connect(proxy, db_url) as conn:  # still accepting
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        for conn in conns:
            conn.close()


def test_ssl_request_is_refused_and_libpq_goes_on_in_plain_text(
    db_url: str, proxy: ReplyProxy
) -> None:
    url = proxy.url_for(db_url).replace("sslmode=disable", "sslmode=prefer")
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
        assert not conn.pgconn.ssl_in_use


class Wire:
    """A minimal protocol-v3 client on a raw socket, for what psycopg never sends.

    (A COPY FROM STDIN started by the extended protocol, pipelined Syncs. libpq's
    blocking calls would hold the GIL, and with it the proxy's threads, in this process.)
    Every read has a deadline: a reply the proxy wrongly withholds fails the test.
    """

    def __init__(self, proxy: ReplyProxy, db: psycopg.Connection[Any]) -> None:
        self.sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
        self.buf = b""
        params = {"user": db.info.user, "database": db.info.dbname, "application_name": APP}
        body = (196608).to_bytes(4, "big")  # protocol 3.0
        for key, value in params.items():
            body += key.encode() + b"\0" + value.encode() + b"\0"
        body += b"\0"
        self.sock.sendall((len(body) + 4).to_bytes(4, "big") + body)
        for kind, payload in self.until_ready():
            if kind == b"R" and payload[:4] != b"\0\0\0\0":
                pytest.skip("the raw protocol client speaks only trust authentication")

    def close(self) -> None:
        self.sock.close()

    @staticmethod
    def message(kind: bytes, body: bytes = b"") -> bytes:
        return kind + (len(body) + 4).to_bytes(4, "big") + body

    @classmethod
    def extended(cls, sql: bytes) -> bytes:
        """Parse, Bind, Execute (unnamed statement and portal, no parameters), Sync."""
        return (
            cls.message(b"P", b"\0" + sql + b"\0" + b"\0\0")
            + cls.message(b"B", b"\0\0" + b"\0\0" * 3)
            + cls.message(b"E", b"\0" + b"\0\0\0\0")
            + cls.message(b"S")
        )

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read(self) -> tuple[bytes, bytes] | None:
        """The next message (type, body), or None at EOF or a reset."""
        while True:
            if len(self.buf) >= 5:
                end = 1 + int.from_bytes(self.buf[1:5], "big")
                if len(self.buf) >= end:
                    kind, body = self.buf[:1], self.buf[5:end]
                    self.buf = self.buf[end:]
                    return kind, body
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:
                return None
            if not data:
                return None
            self.buf += data

    def until(self, kinds: bytes) -> list[tuple[bytes, bytes]]:
        """Messages up to and including the first of a type in `kinds`."""
        got: list[tuple[bytes, bytes]] = []
        while True:
            message = self.read()
            assert message is not None, f"connection closed after {got}"
            assert message[0] != b"E", f"server error: {message[1]!r}"
            got.append(message)
            if message[0] in kinds:
                return got

    def until_ready(self) -> list[tuple[bytes, bytes]]:
        return self.until(b"Z")

    def read_to_eof(self) -> list[tuple[bytes, bytes]]:
        got: list[tuple[bytes, bytes]] = []
        while (message := self.read()) is not None:
            got.append(message)
        return got


def test_copy_in_started_by_the_extended_protocol_keeps_the_count(
    db: psycopg.Connection[Any], proxy: ReplyProxy
) -> None:
    # The server ignores the Sync sent right after an Execute that starts COPY FROM
    # STDIN; libpq sends another after CopyDone. Miscounting would withhold a reply.
    wire = Wire(proxy, db)
    try:
        wire.send(wire.extended(b"COPY proxy_t (id, note) FROM STDIN"))
        assert [k for k, _ in wire.until(b"G")] == [b"1", b"2", b"G"]
        wire.send(wire.message(b"d", b"1\tone\n") + wire.message(b"c") + wire.message(b"S"))
        assert [k for k, _ in wire.until_ready()] == [b"C", b"Z"]
        wire.send(wire.message(b"Q", b"SELECT 1\0"))
        assert [k for k, _ in wire.until_ready()] == [b"T", b"D", b"C", b"Z"]
        proxy.drop_reply("INSERT INTO proxy_t")
        wire.send(wire.extended(b"INSERT INTO proxy_t VALUES (2, 'two')"))
        assert wire.read_to_eof() == []
    finally:
        wire.close()
    assert notes(db) == {1: "one", 2: "two"}
    assert proxy.dropped == 1


def test_pipelined_statements_before_the_doomed_one_get_their_replies(
    db: psycopg.Connection[Any], proxy: ReplyProxy
) -> None:
    wire = Wire(proxy, db)
    try:
        proxy.drop_reply("marker")
        wire.send(
            wire.extended(b"INSERT INTO proxy_t VALUES (1, 'first')")
            + wire.extended(b"INSERT INTO proxy_t VALUES (2, 'marker')")
            + wire.extended(b"SELECT 3")
        )
        first = wire.until_ready()
        assert [k for k, _ in first] == [b"1", b"2", b"C", b"Z"]
        assert first[2][1] == b"INSERT 0 1\0"
        assert wire.read_to_eof() == []  # the marker's reply, and everything after it
    finally:
        wire.close()
    proxy.wait_dropped(1)
    assert notes(db) == {1: "first", 2: "marker"}


def test_url_for(proxy: ReplyProxy) -> None:
    port = proxy.port
    assert proxy.url_for(
        "postgresql://u:p%40ss@db.example:6543/name?application_name=x&sslmode=require"
    ) == (
        f"postgresql://u:p%40ss@127.0.0.1:{port}/name?application_name=x"
        "&sslmode=disable&gssencmode=disable"
    )
    assert proxy.url_for(
        "postgresql://h/name?options=-c%20a%3D1+b&port=1&target_session_attrs=any"
    ) == (
        f"postgresql://127.0.0.1:{port}/name?options=-c%20a%3D1+b&target_session_attrs=any"
        "&sslmode=disable&gssencmode=disable"
    )
    assert proxy.url_for("postgresql://postgres:@/name?host=/tmp/sock") == (
        f"postgresql://postgres:@127.0.0.1:{port}/name?sslmode=disable&gssencmode=disable"
    )
    conninfo = psycopg.conninfo.conninfo_to_dict(
        proxy.url_for("host=/tmp dbname=name user=u sslmode=verify-full")
    )
    assert conninfo == {
        "host": "127.0.0.1",
        "port": str(port),
        "dbname": "name",
        "user": "u",
        "sslmode": "disable",
        "gssencmode": "disable",
    }
