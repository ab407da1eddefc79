"""A TCP proxy between psycopg and PostgreSQL that loses replies after the server committed.

Fault tests use it for the "lost reply after commit" fault, as a failover or a cut
network produces it: the server fully executes (in autocommit: commits) a statement,
and the client never hears back, its connection just dies.

    with ReplyProxy() as proxy:
        conn = psycopg.connect(proxy.url_for(db_url), autocommit=True, prepare_threshold=None)
        proxy.drop_reply("INSERT INTO jobs")
        conn.execute("INSERT INTO jobs ...")  # psycopg.OperationalError; the row is committed
        assert proxy.dropped == 1

`drop_reply(text)` arms it: the next statement whose SQL text contains `text` is
forwarded to the server, everything the server sends back from then on is withheld
from the client, and when the server's ReadyForQuery for that statement arrives, both
sockets of the proxied connection are shut down and closed. `drop_randomly(p)` does the
same to any statement with probability `p` (chaos mode). `cut_all()` is a plain
network cut of every proxied connection; `stop()` ends everything.

How statements are found (PostgreSQL wire protocol v3, client to server):
- a simple Query (`Q`) carries its SQL text;
- in the extended protocol a statement runs when a Bind (`B`) names a prepared
  statement; its text is the one the last Parse (`P`) of that name (the unnamed
  statement included) carried on the connection. So a statement re-executed by name
  (psycopg's automatic prepared statements, `prepare_threshold`) is matched as well as
  one parsed for each execution (`prepare_threshold=None`). Matching is on the Bind,
  not on the Parse, because psycopg prepares a named statement in a round trip of its
  own (Parse + Sync): dooming that one would cut the connection before the statement
  ran. A Bind of a statement prepared with SQL `PREPARE` has no known text (it matches
  only `drop_randomly` without `contains`); tests should use `prepare_threshold=None`
  or psycopg's own prepared statements.
- the match is on bytes: `contains` is encoded as UTF-8 (psycopg's default client
  encoding).

The ReadyForQuery that ends a doomed statement's reply is found by counting: each
StartupMessage, Query, Sync and FunctionCall the client sent gets exactly one
ReadyForQuery, in order (a Sync the server ignores in COPY FROM STDIN started in the
extended protocol is accounted for), so pipelined statements before the doomed one
still get their replies. What happens to a statement pipelined after the doomed one
is up to the server (it gets the bytes, but the connection is cut at the doomed
statement's ReadyForQuery). One statement per proxied connection is doomed at most;
the connection is gone afterwards.

`url_for(url)` turns off SSL and GSS encryption (the proxy reads the stream); an
SSLRequest or GSSENCRequest that still arrives is answered "N" by the proxy itself.
A CancelRequest is passed through. The upstream is TCP, or a Unix-domain socket when
`upstream_host` is a directory (as libpq's `host=/path`).

Threads: one accepting, two per proxied connection (daemon threads). Every blocking
receive waits on a selector with a short timeout, and `stop()`/`cut_all()` shut the
sockets down, so nothing outlives `stop()` for long.
"""

from __future__ import annotations

import contextlib
import os
import random
import selectors
import socket
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from urllib.parse import unquote, urlsplit, urlunsplit

_CANCEL_REQUEST = 80877102
_SSL_REQUEST = 80877103
_GSSENC_REQUEST = 80877104
_MAX_STARTUP_LENGTH = 10_000  # PostgreSQL's own limit on a startup packet

_RECV_SIZE = 65536
_POLL_SECONDS = 0.2  # how often a blocked receive looks whether its connection was cut
_CONNECT_TIMEOUT = 10.0
_JOIN_TIMEOUT = 5.0

# Client messages that each get exactly one ReadyForQuery (besides the StartupMessage).
_QUERY, _SYNC, _FUNCTION_CALL = ord("Q"), ord("S"), ord("F")
_PARSE, _BIND, _CLOSE, _EXECUTE = ord("P"), ord("B"), ord("C"), ord("E")
_COPY_DONE, _COPY_FAIL = ord("c"), ord("f")
_READY_FOR_QUERY = ord("Z")


class ProtocolError(Exception):
    """The byte stream is not PostgreSQL protocol v3 as the proxy understands it."""


class _Frames:
    """Splits a byte stream into whole messages: type byte, int32 length (with itself), body.

    `feed(data)` returns the messages completed by `data`; a partial one is kept for the
    next call.
    """

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf
        buf += data
        messages: list[bytes] = []
        pos, size = 0, len(buf)
        while size - pos >= 5:
            length = int.from_bytes(buf[pos + 1 : pos + 5], "big")
            if length < 4:
                raise ProtocolError(f"message {chr(buf[pos])!r} with length {length}")
            end = pos + 1 + length
            if end > size:
                break
            messages.append(bytes(buf[pos:end]))
            pos = end
        if pos:
            del buf[:pos]
        return messages


def _cstring(body: bytes, start: int) -> tuple[bytes, int]:
    """The NUL-terminated string of `body` at `start`, and the offset after its NUL."""
    end = body.find(b"\0", start)
    if end < 0:
        raise ProtocolError("unterminated string in a message")
    return body[start:end], end + 1


class _Arm:
    """One `drop_reply` arming: the text to look for, and how many more statements to doom."""

    def __init__(self, needle: bytes, remaining: int) -> None:
        self.needle = needle
        self.remaining = remaining


class _Link:
    """One proxied connection: the client's socket, the server's, and their two pumps."""

    def __init__(self, client: socket.socket, number: int) -> None:
        self.client = client
        self.server: socket.socket | None = None
        self.number = number
        self._lock = threading.Lock()
        self.cut_done = False
        # The ordinal (1-based, counted from the startup's) of the ReadyForQuery that ends
        # the doomed statement's reply; None while no statement of this link is doomed.
        self.doom_ready: int | None = None
        self.pump_client: threading.Thread | None = None
        self.pump_server: threading.Thread | None = None

    def attach_server(self, server: socket.socket) -> bool:
        """Record the upstream socket; False (and the socket closed) when already cut."""
        with self._lock:
            if not self.cut_done:
                self.server = server
                return True
        server.close()
        return False

    def cut(self) -> None:
        """Shut both sockets down (the peers get EOF; blocked pumps wake up).

        The sockets are closed by the client pump once both pumps have ended, so no
        thread ever uses a closed (and maybe reused) file descriptor.
        """
        with self._lock:
            self.cut_done = True
            socks = [self.client, self.server]
        for sock in socks:
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def half_close_server(self) -> None:
        """The client is done sending: pass its EOF on, and let the server finish."""
        with self._lock:
            server = self.server
        if server is not None:
            with contextlib.suppress(OSError):
                server.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        for sock in (self.client, self.server):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()


class _ClientState:
    """What the client pump tracks of the client's stream (touched by that thread only)."""

    def __init__(self) -> None:
        self.statements: dict[bytes, bytes] = {}  # prepared statement name -> SQL text
        self.readies_due = 0  # ReadyForQuery messages the client's messages so far will get
        # For COPY FROM STDIN in the extended protocol: the last Query or Execute sent,
        # and the Syncs sent since.
        self.last_command = 0
        self.syncs_since_command = 0


class ReplyProxy:
    """A TCP proxy in front of PostgreSQL that can drop a statement's reply after it ran.

    See the module docstring. Counters (`dropped`, `dropped_in_transaction`,
    `connections`) are read-only properties; arming is thread-safe while connections
    are live. A context manager: `start()` on enter, `stop()` on exit.
    """

    def __init__(self, upstream_host: str = "127.0.0.1", upstream_port: int = 5432) -> None:
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.port = 0
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._arms: list[_Arm] = []
        self._random_probability = 0.0
        self._random_contains: tuple[bytes, ...] = ()
        self._random = random.Random()
        self._dropped = 0
        self._dropped_in_transaction = 0
        self._connections = 0
        self._links: set[_Link] = set()
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._stopping = threading.Event()

    # --- life cycle -------------------------------------------------------------------

    def start(self) -> None:
        """Listen on 127.0.0.1, on a free port (`port`), and accept on a thread."""
        if self._listener is not None:
            raise RuntimeError("ReplyProxy already started")
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        listener.settimeout(_POLL_SECONDS)
        self.port = int(listener.getsockname()[1])
        self._stopping.clear()
        self._listener = listener
        self._acceptor = threading.Thread(
            target=self._accept_loop, args=(listener,), name="replyproxy-accept", daemon=True
        )
        self._acceptor.start()

    def stop(self) -> None:
        """Close the listener and every proxied connection; join the threads. Idempotent."""
        self._stopping.set()
        acceptor, self._acceptor = self._acceptor, None
        if acceptor is not None:
            acceptor.join(_JOIN_TIMEOUT)
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        deadline = time.monotonic() + _JOIN_TIMEOUT
        for link in self._live_links():
            link.cut()
        for link in self._live_links():
            if link.pump_client is not None:
                link.pump_client.join(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> ReplyProxy:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def url_for(self, url: str) -> str:
        """`url` (a libpq URL, or a `key=value` conninfo) pointed at the proxy.

        Host and port become the proxy's; `sslmode=disable` and `gssencmode=disable`
        are set, so that the stream is plain protocol. User, password, database and the
        other parameters are kept.
        """
        if self.port == 0:
            raise RuntimeError("ReplyProxy not started")
        forced = {
            "host": "127.0.0.1",
            "port": str(self.port),
            "sslmode": "disable",
            "gssencmode": "disable",
        }
        if "://" not in url:
            from psycopg.conninfo import conninfo_to_dict, make_conninfo

            params = conninfo_to_dict(url)
            params.pop("hostaddr", None)
            params.update(forced)
            return make_conninfo("", **params)
        parts = urlsplit(url)
        userinfo, at, _ = parts.netloc.rpartition("@")
        netloc = f"{userinfo}{at}127.0.0.1:{self.port}"
        # The other parameters are kept as written: libpq decodes only %XX (not "+").
        replaced = ("host", "hostaddr", "port", "sslmode", "gssencmode")
        query = [
            item
            for item in parts.query.split("&")
            if item and unquote(item.partition("=")[0]) not in replaced
        ]
        query += ["sslmode=disable", "gssencmode=disable"]
        return urlunsplit(parts._replace(netloc=netloc, query="&".join(query)))

    # --- faults -----------------------------------------------------------------------

    def drop_reply(self, contains: str, *, count: int = 1) -> None:
        """Drop the replies of the next `count` statements whose SQL text contains `contains`.

        Each is forwarded to the server; the server's whole reply is withheld from the
        client, and at its ReadyForQuery both sockets of that proxied connection are
        closed. Arming again adds to what is armed (the first matching arm is used).
        """
        if not contains:
            raise ValueError("contains must be a non-empty string")
        if count < 1:
            raise ValueError("count must be at least 1")
        with self._lock:
            self._arms.append(_Arm(contains.encode(), count))

    def drop_randomly(
        self, probability: float, *, contains: Sequence[str] = (), seed: int | None = None
    ) -> None:
        """Chaos: drop the reply of each statement with `probability` (0 turns it off).

        Only statements whose text contains one of `contains`, when given. `seed` makes
        the draws reproducible (they are made in the order the statements arrive).
        """
        if not 0.0 <= probability <= 1.0:
            raise ValueError("probability must be between 0 and 1")
        if isinstance(contains, str):
            contains = (contains,)
        with self._lock:
            self._random_probability = probability
            self._random_contains = tuple(c.encode() for c in contains)
            if seed is not None:
                self._random = random.Random(seed)

    def cut_all(self) -> None:
        """Cut every proxied connection now, as a network failure does."""
        for link in self._live_links():
            link.cut()

    @property
    def dropped(self) -> int:
        """Dropped replies whose ReadyForQuery said idle ('I'): the statement committed."""
        with self._lock:
            return self._dropped

    @property
    def dropped_in_transaction(self) -> int:
        """Dropped replies whose ReadyForQuery said 'T' or 'E' (a transaction left open)."""
        with self._lock:
            return self._dropped_in_transaction

    @property
    def connections(self) -> int:
        """Proxied connections accepted so far."""
        with self._lock:
            return self._connections

    def wait_dropped(self, n: int, timeout: float = 20.0) -> None:
        """Block until `dropped >= n`; AssertionError after `timeout` seconds."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._dropped >= n, timeout):
                raise AssertionError(
                    f"ReplyProxy: {self._dropped} replies dropped after {timeout}s, "
                    f"expected {n} ({self._dropped_in_transaction} in a transaction)"
                )

    # --- internals --------------------------------------------------------------------

    def _live_links(self) -> list[_Link]:
        with self._lock:
            return list(self._links)

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:  # e.g. out of file descriptors: try again a little later
                self._stopping.wait(_POLL_SECONDS)
                continue
            client.settimeout(None)
            with contextlib.suppress(OSError):
                client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._stopping.is_set():
                    client.close()
                    return
                self._connections += 1
                link = _Link(client, self._connections)
                link.pump_client = threading.Thread(
                    target=self._run_link,
                    args=(link,),
                    name=f"replyproxy-{link.number}-c2s",
                    daemon=True,
                )
                self._links.add(link)
                link.pump_client.start()  # under the lock: stop() may join it

    def _connect_upstream(self) -> socket.socket:
        host, port = self.upstream_host, self.upstream_port
        if host.startswith("/"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(_CONNECT_TIMEOUT)
                sock.connect(os.path.join(host, f".s.PGSQL.{port}"))
            except OSError:
                sock.close()
                raise
        else:
            sock = socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
        return sock

    def _run_link(self, link: _Link) -> None:
        """The client pump: connect upstream, start the server pump, forward the client."""
        try:
            try:
                server: socket.socket | None = self._connect_upstream()
            except OSError:
                server = None
            if server is None or not link.attach_server(server):
                return
            link.pump_server = threading.Thread(
                target=self._pump_server,
                args=(link, server),
                name=f"replyproxy-{link.number}-s2c",
                daemon=True,
            )
            link.pump_server.start()
            try:
                client_ended = self._pump_client(link, server)
            except (OSError, ProtocolError):
                client_ended = False
            if client_ended:
                link.half_close_server()  # the server ends the session and closes
            else:
                link.cut()
            # Ends at the server's EOF, or soon after a cut (its receive polls).
            link.pump_server.join()
        finally:
            link.cut()
            link.close()
            with self._lock:
                self._links.discard(link)

    @staticmethod
    def _receive(link: _Link, sock: socket.socket, selector: selectors.BaseSelector) -> bytes:
        """The next bytes from `sock`; b"" at EOF, on an error, or once `link` is cut.

        `selector` has `sock` registered for reading.
        """
        while not link.cut_done:
            if selector.select(_POLL_SECONDS):
                try:
                    return sock.recv(_RECV_SIZE)
                except OSError:
                    return b""
        return b""

    def _pump_client(self, link: _Link, server: socket.socket) -> bool:
        """Forward client -> server until the end; True when the client closed first."""
        client = link.client
        with selectors.DefaultSelector() as selector:
            selector.register(client, selectors.EVENT_READ)
            # The startup phase: untyped messages (int32 length, int32 code, ...).
            pending = bytearray()
            while True:
                data = self._receive(link, client, selector)
                if not data:
                    return not link.cut_done
                pending += data
                startup, rest = self._startup(link, pending)
                if startup is not None:
                    break
            server.sendall(startup)
            if int.from_bytes(startup[4:8], "big") == _CANCEL_REQUEST:
                if rest:
                    server.sendall(rest)
                return self._pump_raw(link, client, server, selector)
            state = _ClientState()
            state.readies_due = 1  # the startup gets the first ReadyForQuery
            frames = _Frames()
            data = rest
            while True:
                if data:
                    messages = frames.feed(data)
                    for message in messages:
                        self._inspect(link, state, message)
                    if messages:
                        # Dooming happened above, before the server can see the statement.
                        server.sendall(b"".join(messages))
                data = self._receive(link, client, selector)
                if not data:
                    return not link.cut_done

    def _startup(self, link: _Link, pending: bytearray) -> tuple[bytes | None, bytes]:
        """(the first startup message of `pending`, the bytes after it), or (None, b"").

        An SSLRequest or GSSENCRequest is answered "N" here and removed from `pending`.
        """
        while len(pending) >= 8:
            length = int.from_bytes(pending[:4], "big")
            if not 8 <= length <= _MAX_STARTUP_LENGTH:
                raise ProtocolError(f"startup packet of length {length}")
            if len(pending) < length:
                return None, b""
            code = int.from_bytes(pending[4:8], "big")
            if code in (_SSL_REQUEST, _GSSENC_REQUEST):
                del pending[:length]
                link.client.sendall(b"N")
                continue
            return bytes(pending[:length]), bytes(pending[length:])
        return None, b""

    def _pump_raw(
        self,
        link: _Link,
        source: socket.socket,
        sink: socket.socket,
        selector: selectors.BaseSelector,
    ) -> bool:
        """Forward bytes as they are until the end; True when `source` closed first."""
        while True:
            data = self._receive(link, source, selector)
            if not data:
                return not link.cut_done
            sink.sendall(data)

    def _inspect(self, link: _Link, state: _ClientState, message: bytes) -> None:
        """Track one client message; doom `link` when it runs a statement to be dropped."""
        kind = message[0]
        body = message[5:]
        if kind == _PARSE:
            name, at = _cstring(body, 0)
            text, _ = _cstring(body, at)
            state.statements[name] = text
        elif kind == _CLOSE:
            if body[:1] == b"S":
                name, _ = _cstring(body, 1)
                state.statements.pop(name, None)
        elif kind == _BIND:
            _, at = _cstring(body, 0)
            name, _ = _cstring(body, at)
            self._consider(link, state.statements.get(name, b""), state.readies_due + 1)
        elif kind == _QUERY:
            text, _ = _cstring(body, 0)
            self._consider(link, text, state.readies_due + 1)
        elif kind in (_COPY_DONE, _COPY_FAIL) and state.last_command == _EXECUTE:
            # The end of a COPY FROM STDIN started by an Execute: the server ignored the
            # Syncs sent in copy-in mode (libpq sends one right after the Execute, and
            # another after CopyDone/CopyFail, which does get a ReadyForQuery).
            state.readies_due -= state.syncs_since_command
            state.syncs_since_command = 0
        if kind in (_QUERY, _EXECUTE):
            state.last_command = kind
            state.syncs_since_command = 0
        if kind == _SYNC:
            state.syncs_since_command += 1
        if kind in (_QUERY, _SYNC, _FUNCTION_CALL):
            state.readies_due += 1

    def _consider(self, link: _Link, text: bytes, ready: int) -> None:
        """Doom `link` at ReadyForQuery number `ready` if a statement of `text` is to drop."""
        if link.doom_ready is not None:
            return
        with self._lock:
            doomed = False
            for arm in self._arms:
                if arm.needle in text:
                    doomed = True
                    arm.remaining -= 1
                    if arm.remaining <= 0:
                        self._arms.remove(arm)
                    break
            if not doomed and self._random_probability > 0.0:
                wanted = self._random_contains
                if not wanted or any(needle in text for needle in wanted):
                    doomed = self._random.random() < self._random_probability
            if doomed:
                link.doom_ready = ready

    def _pump_server(self, link: _Link, server: socket.socket) -> None:
        """Forward server -> client, withholding a doomed statement's reply."""
        client = link.client
        frames = _Frames()
        readies = 0  # ReadyForQuery messages seen
        selector = selectors.DefaultSelector()
        try:
            selector.register(server, selectors.EVENT_READ)
            while True:
                data = self._receive(link, server, selector)
                if not data:
                    return
                forward: list[bytes] = []
                for message in frames.feed(data):
                    reply_to = readies + 1  # the ReadyForQuery this message comes before
                    if message[0] == _READY_FOR_QUERY:
                        readies += 1
                    doom = link.doom_ready
                    if doom is None or reply_to < doom:
                        forward.append(message)
                    elif message[0] == _READY_FOR_QUERY and reply_to == doom:
                        if forward:
                            client.sendall(b"".join(forward))
                        self._record_drop(message[5:6])
                        return
                if forward:
                    client.sendall(b"".join(forward))
        except (OSError, ProtocolError):
            return
        finally:
            selector.close()
            link.cut()

    def _record_drop(self, status: bytes) -> None:
        with self._changed:
            if status == b"I":
                self._dropped += 1
            else:
                self._dropped_in_transaction += 1
            self._changed.notify_all()
