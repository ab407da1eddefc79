"""The hot statements straight through libpq (`workflow.store.direct`): which connections
take them, what they send and read back, and that their errors are psycopg's."""

from __future__ import annotations

import datetime
import logging
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import workflow
from workflow.logs import EngineLog
from workflow.store import _Q, CHANNEL, KEY_WAIT
from workflow.store.connections import Connections, make_pool, open_pool
from workflow.store.direct import DIRECT, Direct, _dump, _reader

LOG = EngineLog(logging.getLogger("test.direct"))
WF = workflow.Workflow("Direct.Echo", str)
ECHO = workflow.Task("direct.echo", str)
AGAIN = workflow.Task("direct.again", str)


def registry() -> workflow.Registry:
    reg = workflow.Registry()
    reg.register(workflow.define(
        WF,
        workflow.handle(ECHO, lambda run: run.input),
        workflow.handle(AGAIN, lambda run: run.output(ECHO) + "!"),
    ))
    return reg


def direct_statements(conn: psycopg.Connection[Any]) -> set[str]:
    rows = conn.execute(
        "SELECT name FROM pg_prepared_statements WHERE name LIKE 'workflow_direct_%'"
    ).fetchall()
    return {row[0] for row in rows}


@pytest.fixture
def one_connection(db_url: str) -> Iterator[Any]:
    """A pool of one connection as `make_pool` builds it for a Manager."""
    pool = make_pool(db_url, max_size=1)
    open_pool(pool, 10.0)
    yield pool
    pool.close()


def insert_params(**changes: Any) -> dict[str, Any]:
    params: dict[str, Any] = {
        "id": uuid.uuid4(), "workflow": WF.name, "status": "running", "idempotency_key": None,
        "input": '"x"', "input_sealed": None, "context": None, "context_sealed": None,
        "task_count": 2, "current_seq": 1, "claim_id": uuid.uuid4(),
        "names": "{direct.echo,direct.again}", "skipped": "{f,f}", "wake": False,
        "traceparent": None, "tracestate": None, "delay": None, "run_at": None,
        "concurrency_key": None, "concurrency": 1, "channel": CHANNEL, "key_wait": KEY_WAIT,
    }
    params.update(changes)
    return params


@pytest.mark.direct("reads the prepared statements of the pool's one backend")
def test_a_fast_path_run_writes_its_start_and_steps_through_libpq(
    one_connection: Any, db: psycopg.Connection[Any]
) -> None:
    mgr = workflow.Manager(one_connection, registry())
    try:
        run = WF.start(mgr, "a")
        assert run.wait(timeout=30) is workflow.Status.SUCCEEDED
    finally:
        mgr.close(timeout=10)
    with one_connection.connection() as conn:
        assert direct_statements(conn) == {
            "workflow_direct_insert_run", "workflow_direct_complete_task"
        }
    assert db.execute(
        "SELECT output #>> '{}' FROM workflow_tasks WHERE run_id = %s AND seq = 2", (run.id,)
    ).fetchone() == ("a!",)


@pytest.mark.direct("reads the prepared statements of the pool's one backend")
def test_a_pool_for_pgbouncer_never_takes_direct_statements(db_url: str) -> None:
    pool = make_pool(db_url, max_size=1, prepared=False)
    open_pool(pool, 10.0)
    mgr = workflow.Manager(pool, registry())
    try:
        assert WF.start(mgr, "a").wait(timeout=30) is workflow.Status.SUCCEEDED
        with pool.connection() as conn:
            assert direct_statements(conn) == set()
    finally:
        mgr.close(timeout=10)
        pool.close()


@pytest.mark.direct("reads what the pool's one backend stored")
def test_text_of_every_kind_is_stored_and_read_back_exactly(
    one_connection: Any, db: psycopg.Connection[Any]
) -> None:
    text = "quote ' double \" backslash \\ braces {} comma , é 中 \U0001f600 $1 %(id)s %%"
    mgr = workflow.Manager(one_connection, registry())
    try:
        run = WF.start(mgr, text)
        assert run.wait(timeout=30) is workflow.Status.SUCCEEDED
    finally:
        mgr.close(timeout=10)
    outputs = db.execute(
        "SELECT output #>> '{}' FROM workflow_tasks WHERE run_id = %s ORDER BY seq", (run.id,)
    ).fetchall()
    assert [row[0] for row in outputs] == [text, text + "!"]
    assert db.execute(
        "SELECT input #>> '{}' FROM workflow_runs WHERE id = %s", (run.id,)
    ).fetchone() == (text,)


def test_a_database_error_is_psycopgs_and_the_connection_goes_on(one_connection: Any) -> None:
    connections = Connections(one_connection, LOG, queries=_Q)
    params = insert_params()
    assert connections.once("insert_run", params) == [(params["id"], None, True)]
    with pytest.raises(psycopg.errors.UniqueViolation):
        connections.once("insert_run", params)
    other = insert_params(wake=True)
    assert connections.once("insert_run", other) == [(other["id"], "", True)]
    with one_connection.connection() as conn:
        assert "workflow_direct_insert_run" in direct_statements(conn)


def test_statements_gone_from_the_session_are_prepared_again(one_connection: Any) -> None:
    connections = Connections(one_connection, LOG, queries=_Q)
    first = insert_params()
    connections.once("insert_run", first)
    with one_connection.connection() as conn:
        conn.execute("DEALLOCATE ALL")
        assert direct_statements(conn) == set()
    second = insert_params()
    assert connections.once("insert_run", second) == [(second["id"], None, True)]


def test_a_connection_outside_autocommit_writes_in_a_transaction_of_its_own(
    db_url: str, db: psycopg.Connection[Any]
) -> None:
    conn = psycopg.connect(db_url)  # autocommit off, psycopg's default threshold
    try:
        direct = Direct(_Q)
        assert direct.suits(conn)
        params = insert_params()
        rows = direct.execute(conn, direct.statement(_Q["insert_run"]), params)  # type: ignore[arg-type]
        assert rows == [(params["id"], None, True)]
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert db.execute("SELECT count(*) FROM workflow_runs WHERE id = %s",
                          (params["id"],)).fetchone() == (1,)
        conn.execute("SELECT 1")  # psycopg opens a transaction: no direct statement now
        assert not direct.suits(conn)
    finally:
        conn.close()


def test_parameters_of_other_kinds_go_through_psycopg(one_connection: Any) -> None:
    connections = Connections(one_connection, LOG, queries=_Q)
    due = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)
    params = insert_params(status="pending", claim_id=None, run_at=due, input_sealed=b"\x00")
    params["input"] = None
    assert connections.once("insert_run", params) == [(params["id"], None, False)]
    with one_connection.connection() as conn:
        assert direct_statements(conn) == set()
        assert conn.execute(
            "SELECT next_retry_at, input_sealed FROM workflow_runs WHERE id = %s", (params["id"],)
        ).fetchone() == (due, b"\x00")


@pytest.mark.parametrize(
    "value",
    [1.5, b"x", bytearray(b"x"), [1], datetime.date(2026, 1, 1), True.__class__, "a\x00b"],
)
def test_dump_refuses_kinds_it_does_not_write(value: Any) -> None:
    with pytest.raises(TypeError):
        _dump(value)


def test_dump_writes_what_the_server_reads() -> None:
    some = uuid.uuid4()
    assert [_dump(v) for v in (None, True, False, 0, -7, "é", some)] == [
        None, b"t", b"f", b"0", b"-7", "é".encode(), some.hex.encode()
    ]


def test_a_column_of_a_type_not_read_here_is_refused() -> None:
    with pytest.raises(TypeError):
        _reader(1184)  # timestamptz: no direct statement returns one


def test_every_direct_statement_is_known_and_prepares_with_inferred_types(
    db: psycopg.Connection[Any],
) -> None:
    direct = Direct(_Q)
    for name in DIRECT:
        statement = direct.statement(_Q[name])
        assert statement is not None, name
        result = db.pgconn.prepare(b"probe_" + statement.name, statement.text)
        assert result.status == psycopg.pq.ExecStatus.COMMAND_OK, (
            name, result.error_message.decode()
        )


def test_two_stores_on_one_pool_share_the_connections_statements(one_connection: Any) -> None:
    """A Manager's store and an Admin's, or a worker's, may share a pool: the second
    to run a statement on a connection finds it prepared, by either account."""
    first = Connections(one_connection, LOG, queries=_Q)
    second = Connections(one_connection, LOG, queries=_Q)
    for connections in (first, second, first):
        params = insert_params()
        assert connections.once("insert_run", params) == [(params["id"], None, True)]


def test_a_statement_prepared_where_the_registry_did_not_see_it_is_used(
    one_connection: Any,
) -> None:
    connections = Connections(one_connection, LOG, queries=_Q)
    statement = Direct(_Q).statement(_Q["insert_run"])
    assert statement is not None
    with one_connection.connection() as conn:
        conn.pgconn.prepare(statement.name, statement.text)  # behind the registry's back
    params = insert_params()
    assert connections.once("insert_run", params) == [(params["id"], None, True)]


def test_a_string_holding_nul_is_refused_as_psycopg_refuses_it(one_connection: Any) -> None:
    """libpq would send the text up to the NUL and store it cut short."""
    connections = Connections(one_connection, LOG, queries=_Q)
    with pytest.raises(psycopg.DataError):
        connections.once("insert_run", insert_params(workflow="Direct.\x00Cut"))


def test_a_connection_in_pipeline_mode_takes_no_direct_statement(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        direct = Direct(_Q)
        assert direct.suits(conn)
        with conn.pipeline():
            assert not direct.suits(conn)


@pytest.mark.parametrize("encoding", ["LATIN1", "SQL_ASCII"])
def test_a_connection_in_another_client_encoding_takes_no_direct_statement(
    db_url: str, encoding: str
) -> None:
    """Direct statements send and read UTF-8; psycopg converts for any other encoding."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        direct = Direct(_Q)
        assert direct.suits(conn)
        conn.execute(f"SET client_encoding TO {encoding}")
        assert not direct.suits(conn)
        conn.execute("SET client_encoding TO 'utf8'")  # the server reports its own name
        assert direct.suits(conn)
        conn.execute("SET client_encoding TO 'UNICODE'")  # kept as spelled: still UTF-8
        assert conn.pgconn.parameter_status(b"client_encoding") == b"UNICODE"
        assert direct.suits(conn)
