"""How the store reaches PostgreSQL: URLs, the one pool factory, warm connections, retries.

- `connect()` / `connect_explained()`: one plain connection from a URL, for
  migrations, checks and a Manager's first look at its database.
- `make_pool()`: the connection pool every part of the library builds (the
  Manager from a URL, the worker CLI, the Flask and Django integrations, the
  demo), so its settings live in one place.
- `Connections`: what `Store` runs its statements on: one statement per
  transaction on a connection borrowed from the pool (or kept warm), retried
  with backoff when the connection is lost, with a recovery statement first when
  the lost try may have committed.
"""

from __future__ import annotations

import math
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from typing import Any

import psycopg
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import tuple_row
from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout

from workflow.errors import ThreadNotStarted, WorkflowError
from workflow.logs import EngineLog
from workflow.store.direct import Direct

CONNECT_TIMEOUT = 10
"""Seconds to wait for the server, unless the URL or `$PGCONNECT_TIMEOUT` says otherwise."""

RETRY_FOR = 30.0
"""Seconds a statement keeps retrying after losing its connection."""

POOL_PATIENCE = 0.05
"""Seconds a statement waits on the pool before connections stop staying warm for
it: long enough that only a pool really exhausted counts, short enough that a
burst wider than the pool is served promptly."""

WARM_IDLE = 30.0
"""Seconds a warm connection may go unused before it returns to the pool."""

WARM_FOR = 300.0
"""Seconds a connection may stay out of the pool in all, so the pool's own
lifetime and idle limits still apply to it."""

_LOST_STATES = ("57P01", "57P02", "57P03")


def normalize_url(url: str) -> str:
    """`url` with the SQLAlchemy/yoyo spelling (`postgresql+psycopg://`) made plain."""
    return re.sub(r"^postgres(?:ql)?\+psycopg2?://", "postgresql://", url)


def one_line(text: object) -> str:
    """`text` with every run of whitespace (newlines included) made one space."""
    return " ".join(str(text).split())


def connect(url: str) -> psycopg.Connection[Any]:
    """An autocommit connection to `url`, giving up after `CONNECT_TIMEOUT` by default.

    Raises `psycopg.Error` for a malformed URL or an unreachable server.
    """
    params: dict[str, Any] = conninfo_to_dict(normalize_url(url))
    if "connect_timeout" not in params and "PGCONNECT_TIMEOUT" not in os.environ:
        params["connect_timeout"] = CONNECT_TIMEOUT
    return psycopg.connect(**params, autocommit=True)


def connect_explained(url: str) -> psycopg.Connection[Any]:
    """`connect(url)`, raising `WorkflowError` with one line saying why it failed.

    A malformed URL: "invalid database URL: ..."; an unreachable server, a missing
    database or a refused login: "cannot connect to the database: " and the
    server's own reason. The psycopg error is kept as the cause.
    """
    try:
        conninfo_to_dict(normalize_url(url))
    except psycopg.Error as e:
        raise WorkflowError(f"workflow: invalid database URL: {one_line(e)}") from e
    try:
        return connect(url)
    except psycopg.Error as e:
        raise WorkflowError(f"workflow: cannot connect to the database: {one_line(e)}") from e


def make_pool(
    conninfo: str,
    *,
    max_size: int,
    prepared: bool = True,
    kwargs: dict[str, Any] | None = None,
    name: str = "workflow",
    **options: Any,
) -> ConnectionPool[Any]:
    """A pool of autocommit connections for a Manager, not open yet (`pool.open()`).

    `min_size=1`, `max_size` as given (`Settings.pool_size` sizes it for the fast
    path). Statements are prepared at their first execution on a connection
    (`prepare_threshold=0`, psycopg's default being the fifth): the engine runs a fixed
    set of statements, so a new connection parses and plans each once instead of up to
    five times. Preparing costs one round trip, now at a statement's first execution
    instead of its fifth: a statement run fewer than five times on a connection pays
    one it did not pay before.
    `prepared=False` turns off psycopg's server-side prepared statements, for a
    transaction-mode pooler (PgBouncer before 1.21 cannot carry them).
    `kwargs` are more connection arguments; `options` more pool arguments (they
    override these defaults).
    """
    connection: dict[str, Any] = {"autocommit": True}
    connection["prepare_threshold"] = 0 if prepared else None
    connection.update(kwargs or {})
    settings: dict[str, Any] = {"min_size": 1, "max_size": max_size, "name": name}
    settings.update(options)
    settings["open"] = False
    return ConnectionPool(normalize_url(conninfo), kwargs=connection, **settings)


def open_pool(pool: ConnectionPool[Any], timeout: float) -> None:
    """`pool.open(wait=True, timeout=timeout)`; `ThreadNotStarted` (a `WorkflowError`, still
    a `RuntimeError`) where the pool's own threads cannot start."""
    try:
        pool.open(wait=True, timeout=timeout)
    except RuntimeError as exc:  # psycopg_pool starts its scheduler and workers
        pool.close()  # the threads that did start
        raise ThreadNotStarted("the connection pool", exc) from exc


def connection_lost(e: Exception) -> bool:
    """True for errors that mean the connection, not the statement, failed."""
    if isinstance(e, PoolClosed):
        return False
    if isinstance(e, PoolTimeout):
        return True
    if isinstance(e, psycopg.OperationalError):
        state = e.sqlstate
        return state is None or state.startswith("08") or state in _LOST_STATES
    return False


@contextmanager
def autocommit(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """Autocommit on `conn` for the block, restored after when no transaction is open."""
    if conn.autocommit:
        yield
        return
    conn.autocommit = True
    try:
        yield
    finally:
        if conn.info.transaction_status == pq.TransactionStatus.IDLE:
            conn.autocommit = False


Rows = list[tuple[Any, ...]]
_Warm = tuple[psycopg.Connection[Any], psycopg.Cursor[Any], float, float]


class Connections:
    """One statement per transaction, on a borrowed (or warm) connection, retried when lost.

    With `keep_warm=True` (for a pool the Manager built and nothing else uses) a
    connection just used is kept, with its cursor, in a last-in-first-out stack
    in front of the pool rather than returned to it: the next statement reuses
    the most recently used backend, with no pool bookkeeping, where the pool
    would hand out the least recently used one. A warm connection goes back to
    the pool while another thread has waited on the pool for `POOL_PATIENCE`,
    after `WARM_IDLE` seconds unused or `WARM_FOR` seconds out, after any error,
    and at `close()`. `clock` (monotonic seconds) is what those ages are read on.
    """

    def __init__(
        self,
        pool: ConnectionPool[Any],
        log: EngineLog,
        *,
        queries: Mapping[str, str] | None = None,
        keep_warm: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self._queries = queries or {}
        self._direct = Direct(self._queries)
        self._log = log
        self._keep_warm = keep_warm
        self._clock = clock
        # Most recently used last: a connection, a cursor on it to reuse, when it
        # was taken from the pool, when it was last given back.
        self._warm: list[_Warm] = []
        self._closed = False
        # Threads waiting on the pool: while there are any, connections go back
        # to the pool instead of staying warm, or a burst wider than the pool
        # would leave them waiting (up to the pool's timeout) beside idle ones.
        self._waiting = 0
        self._waiting_lock = threading.Lock()

    @property
    def warm(self) -> int:
        """How many connections are kept warm now."""
        return len(self._warm)

    def close(self, *, forked: bool = False) -> None:
        """Return the warm connections to the pool; later ones go straight back.

        `forked`: this is a child process, where the connections are the
        parent's: forget them without touching them or the pool.
        """
        self._closed = True
        if forked:
            self._warm = []
            return
        while self._warm:
            try:
                conn = self._warm.pop()[0]
            except IndexError:
                break
            self.pool.putconn(conn)

    def tidy(self) -> None:
        """Return the warm connections unused for `WARM_IDLE` seconds to the pool.

        The heartbeat thread calls this every tick, so a burst's connections go
        back (and the pool may close them) even when no statement follows.
        """
        now = self._clock()
        warm = self._warm
        while warm:
            try:
                entry = warm[0]
                if now - entry[3] < WARM_IDLE:
                    return
                warm.remove(entry)
            except (IndexError, ValueError):  # taken by a statement meanwhile
                continue
            self.pool.putconn(entry[0])

    @contextmanager
    def borrow(self) -> Iterator[psycopg.Connection[Any]]:
        """A connection from the pool in autocommit mode, given back after the block."""
        # getconn/putconn rather than pool.connection(): its exit sends a COMMIT
        # call even in autocommit mode, a cost on every statement of the hot path.
        try:
            conn = self.pool.getconn()
        except PoolClosed as e:
            raise self._closed_error(e) from e
        try:
            with autocommit(conn):
                yield conn
        finally:
            self.pool.putconn(conn)

    def run(
        self,
        name: str,
        params: dict[str, Any],
        recover: str | None = None,
        *,
        may_have_landed: bool = False,
    ) -> Rows:
        """Run statement `name` (of `queries`, else `name` is the SQL itself) in its own
        transaction, riding out lost connections.

        A lost connection (a server restart, a terminated backend, a pool that
        cannot connect yet) is retried with jittered exponential backoff for up to
        `RETRY_FOR` seconds. The server may have committed the lost try and lost
        only its reply: so each retry first runs `recover` (named like `name`, with
        the same parameters), a statement that finds what an earlier try did, and
        returns its rows when it finds anything; only otherwise is `name` run again.
        Without `recover`, the statement must be safe to repeat as it is.
        `may_have_landed`: an earlier try by other means (a combined statement
        whose reply was lost) may have committed, so `recover` runs first from the
        start.

        Raises `WorkflowError` when the pool is closed, and the database's error
        for anything else.
        """
        queries = self._queries
        sql = queries.get(name, name)
        deadline = math.inf
        failures = 0
        while True:
            try:
                if (failures or may_have_landed) and recover is not None:
                    found = self._once(queries.get(recover, recover), params)
                    if found:
                        return found
                return self._once(sql, params)
            except PoolClosed as e:
                raise self._closed_error(e) from e
            except Exception as e:
                if not connection_lost(e):
                    raise
                if failures == 0:
                    deadline = self._clock() + RETRY_FOR
                elif self._clock() >= deadline:
                    raise
                failures += 1
                delay = random.uniform(0.0, min(2.0, 0.05 * 2**failures))
                self._log.warning("%s: connection lost (%s); retrying in %.2fs", name, e, delay)
                time.sleep(delay)

    @staticmethod
    def _closed_error(e: Exception) -> WorkflowError:
        return WorkflowError(
            f"workflow: the connection pool is closed ({e}); a closed Manager or pool "
            "cannot be used again: build a new one"
        )

    def once(self, name: str, params: dict[str, Any]) -> Rows:
        """Run statement `name` once in its own transaction: no retry, whatever fails."""
        try:
            return self._once(self._queries.get(name, name), params)
        except PoolClosed as e:
            raise self._closed_error(e) from e

    def _once(self, sql: str, params: dict[str, Any]) -> Rows:
        """Run one statement in its own transaction, on a warm or pooled connection."""
        conn, cursor, taken_at = self._take()
        reuse = None
        try:
            if cursor is None:
                cursor = conn.cursor(row_factory=tuple_row)
            rows: Rows | None = None
            direct = self._direct.statement(sql)
            if direct is not None and self._direct.suits(conn):
                rows = self._direct.execute(conn, direct, params)
            if rows is None:  # not a direct statement, or parameters it does not write
                if conn.autocommit:  # always, on a pool the Manager built
                    rows = cursor.execute(sql, params).fetchall()
                else:
                    with autocommit(conn):
                        rows = cursor.execute(sql, params).fetchall()
            if conn.pgconn.transaction_status == pq.TransactionStatus.IDLE:
                reuse = cursor
            return rows
        finally:
            self._give_back(conn, reuse, taken_at)

    def _pop_warm(self) -> tuple[psycopg.Connection[Any], psycopg.Cursor[Any], float] | None:
        """The most recently used warm connection, its cursor and when it left the pool."""
        if not self._warm:
            return None
        try:
            conn, cursor, taken_at, _ = self._warm.pop()
        except IndexError:  # another thread took the last one
            return None
        return conn, cursor, taken_at

    def _take(self) -> tuple[psycopg.Connection[Any], psycopg.Cursor[Any] | None, float]:
        """The last warm connection (with its cursor), or one from the pool.

        Also returns when the connection left the pool.
        """
        warm = self._pop_warm()
        if warm is not None:
            return warm
        if not self._keep_warm:
            return self.pool.getconn(), None, self._clock()
        # Usually the pool has one at once. If not within POOL_PATIENCE, count
        # ourselves as waiting: from then on connections given back go to the
        # pool (which hands them to its waiters) instead of staying warm.
        deadline = time.monotonic() + self.pool.timeout
        try:
            return self.pool.getconn(POOL_PATIENCE), None, self._clock()
        except PoolTimeout:
            pass
        with self._waiting_lock:
            self._waiting += 1
        try:
            # Again, now that we are counted: a connection kept warm before that
            # would otherwise sit there while we wait on the pool.
            warm = self._pop_warm()
            if warm is not None:
                return warm
            left = max(deadline - time.monotonic(), 0.001)
            return self.pool.getconn(left), None, self._clock()
        finally:
            with self._waiting_lock:
                self._waiting -= 1

    def _pool_waiters(self) -> int:
        """How many threads are waiting for a connection from the pool now."""
        return self._waiting

    def _give_back(
        self,
        conn: psycopg.Connection[Any],
        cursor: psycopg.Cursor[Any] | None,
        taken_at: float,
    ) -> None:
        """Keep `conn` (with `cursor`) warm after a clean statement, else return it to the pool.

        `cursor` is None when the statement failed or left the connection unfit.
        No lock: list appends and pops are atomic, and a connection kept while
        `close()` runs is taken back out by whichever of the two gets to it.
        """
        if cursor is not None and self._keep_warm and not self._pool_waiters():
            now = self._clock()
            if now - taken_at < WARM_FOR:
                entry = (conn, cursor, taken_at, now)
                warm = self._warm
                warm.append(entry)
                if self._closed:
                    with suppress(ValueError):
                        warm.remove(entry)
                        self.pool.putconn(conn)
                    return
                try:
                    if self._pool_waiters():
                        # A thread began waiting on the pool meanwhile (it found
                        # nothing warm): hand it a connection through the pool.
                        conn = warm.pop()[0]
                    elif now - warm[0][3] < WARM_IDLE:
                        return
                    else:
                        # The least recently used one went unused too long.
                        conn = warm.pop(0)[0]
                except IndexError:
                    return
        self.pool.putconn(conn)
