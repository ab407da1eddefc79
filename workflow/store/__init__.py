"""The only code that talks to PostgreSQL.

`queries.sql` holds every statement under a name; `Store` runs them, one round
trip each, on connections borrowed from a `psycopg_pool.ConnectionPool` in
autocommit mode (each statement is its own transaction). `migrate.py` applies the
schema chain.
"""

from __future__ import annotations

import datetime
import logging
import math
import random
import re
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from importlib import resources
from typing import Any

import attrs
import psycopg
from psycopg import pq, sql
from psycopg.rows import tuple_row
from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout

from workflow.errors import WorkflowError
from workflow.store.migrate import (
    SCHEMA_VERSION,
    SchemaOutdated,
    check_schema,
    migrate,
    schema_version,
)

__all__ = [
    "SCHEMA_VERSION",
    "ClaimedRun",
    "RunRow",
    "SchemaOutdated",
    "Store",
    "TaskRow",
    "check_schema",
    "current_database",
    "migrate",
    "schema_version",
    "storable",
]

RETRY_FOR = 30.0
"""Seconds a statement keeps retrying after losing its connection."""

_LOST_STATES = ("57P01", "57P02", "57P03")


def _connection_lost(e: Exception) -> bool:
    """True for errors that mean the connection, not the statement, failed."""
    if isinstance(e, PoolTimeout):
        return True
    if isinstance(e, psycopg.OperationalError):
        state = e.sqlstate
        return state is None or state.startswith("08") or state in _LOST_STATES
    return False


CHANNEL = "workflow_runs"
"""The LISTEN/NOTIFY channel; the payload is the workflow name."""

ERROR_CHARS = 4000
"""The most characters of an error text stored (the rest is cut, marked "(truncated)")."""

CODE_CHARS = 200
"""The most characters of a failure code stored."""

KEY_WAIT = "5s"
"""How long `insert_run` waits, in its own transaction, for an idempotency key that a
transaction still open has inserted (say a `start_tx` not committed yet), before
giving up with `psycopg.errors.LockNotAvailable`."""

_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def storable(text: str, limit: int) -> str:
    """`text` as PostgreSQL can store it: NUL characters and lone surrogates (which
    text columns and UTF-8 refuse) replaced by U+FFFD, and at most `limit` characters."""
    if _UNSTORABLE.search(text):
        text = _UNSTORABLE.sub("\ufffd", text)
    if len(text) > limit:
        marker = "... (truncated)"
        text = text[: limit - len(marker)] + marker
    return text


def _load_queries() -> dict[str, str]:
    text = resources.files("workflow.store").joinpath("queries.sql").read_text("utf-8")
    queries: dict[str, str] = {}
    for block in re.split(r"^-- name: ", text, flags=re.M)[1:]:
        name, _, body = block.partition("\n")
        lines = [line for line in body.splitlines() if not line.startswith("-- ")]
        queries[name.strip()] = "\n".join(lines).strip().rstrip(";")
    return queries


_Q = _load_queries()


@attrs.frozen
class TaskRow:
    """One task of a claimed run's snapshot."""

    seq: int
    name: str
    skipped: bool
    attempts: int
    has_output: bool
    output: Any
    failed_at: datetime.datetime | None


@attrs.frozen
class ClaimedRun:
    """A run this process now holds a claim on, with its whole task snapshot."""

    id: uuid.UUID
    workflow: str
    claim_id: uuid.UUID
    input: Any
    input_sealed: bytes | None
    context: str | None
    context_sealed: bytes | None
    current_seq: int
    db_now: datetime.datetime | None
    tasks: tuple[TaskRow, ...]


@attrs.frozen
class RunRow:
    """A run's status as `run_status` reads it (task fields: the task it is on)."""

    workflow: str
    status: str
    created_at: datetime.datetime
    finished_at: datetime.datetime | None
    task: str | None
    error: str | None
    error_code: str | None
    attempts: int | None
    claimable: bool


def _execute(
    conn: psycopg.Connection[Any], name: str, params: dict[str, Any]
) -> list[tuple[Any, ...]]:
    """Run a named statement on `conn`, rows as tuples whatever its row factory."""
    return conn.cursor(row_factory=tuple_row).execute(_Q[name], params).fetchall()


@contextmanager
def _autocommit(conn: psycopg.Connection[Any]) -> Iterator[None]:
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


def _claimed(rows: Sequence[tuple[Any, ...]]) -> list[ClaimedRun]:
    runs: list[ClaimedRun] = []
    tasks: list[TaskRow] = []
    for i, row in enumerate(rows):
        tasks.append(TaskRow(*row[9:]))
        if i + 1 == len(rows) or rows[i + 1][0] != row[0]:
            runs.append(
                ClaimedRun(
                    id=row[0],
                    workflow=row[1],
                    claim_id=row[2],
                    input=row[3],
                    input_sealed=row[4],
                    context=row[5],
                    context_sealed=row[6],
                    current_seq=row[7],
                    db_now=row[8],
                    tasks=tuple(tasks),
                )
            )
            tasks = []
    return runs


POOL_PATIENCE = 0.05
"""Seconds a statement waits on the pool before connections stop staying warm for
it: long enough that only a pool really exhausted counts, short enough that a
burst wider than the pool is served promptly."""

_Warm = tuple[psycopg.Connection[Any], psycopg.Cursor[Any], float, float]

WARM_IDLE = 30.0
"""Seconds a warm connection may go unused before it returns to the pool."""

WARM_FOR = 300.0
"""Seconds a connection may stay out of the pool in all, so the pool's own
lifetime and idle limits still apply to it."""


class Store:
    """Runs the named statements of `queries.sql` on a connection pool.

    With `keep_warm=True` (for a pool the Manager built and nothing else uses) a
    connection just used is kept, with its cursor, in a last-in-first-out stack
    in front of the pool rather than returned to it: the next statement reuses
    the most recently used backend, with no pool bookkeeping, where the pool
    would hand out the least recently used one. A warm connection goes back to
    the pool while another thread has waited on the pool for `POOL_PATIENCE`,
    after `WARM_IDLE` seconds unused or `WARM_FOR` seconds out, after any error,
    and at `close()`.
    """

    def __init__(
        self,
        pool: ConnectionPool[Any],
        logger: logging.Logger | None = None,
        *,
        keep_warm: bool = False,
    ) -> None:
        self._pool = pool
        self._logger = logger or logging.getLogger("workflow")
        self._keep_warm = keep_warm
        # Most recently used last: a connection, a cursor on it to reuse, when it
        # was taken from the pool, when it was last given back.
        self._warm: list[_Warm] = []
        self._closed = False
        # Threads waiting on the pool: while there are any, connections go back
        # to the pool instead of staying warm, or a burst wider than the pool
        # would leave them waiting (up to the pool's timeout) beside idle ones.
        self._waiting = 0
        self._waiting_lock = threading.Lock()

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
            self._pool.putconn(conn)

    def tidy(self) -> None:
        """Return the warm connections unused for `WARM_IDLE` seconds to the pool.

        The heartbeat thread calls this every tick, so a burst's connections go
        back (and the pool may close them) even when no statement follows.
        """
        now = time.monotonic()
        warm = self._warm
        while warm:
            try:
                entry = warm[0]
                if now - entry[3] < WARM_IDLE:
                    return
                warm.remove(entry)
            except (IndexError, ValueError):  # taken by a statement meanwhile
                continue
            self._pool.putconn(entry[0])

    @contextmanager
    def _conn(self) -> Iterator[psycopg.Connection[Any]]:
        # getconn/putconn rather than pool.connection(): its exit sends a COMMIT
        # call even in autocommit mode, a cost on every statement of the hot path.
        conn = self._pool.getconn()
        try:
            with _autocommit(conn):
                yield conn
        finally:
            self._pool.putconn(conn)

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
            return self._pool.getconn(), None, time.monotonic()
        # Usually the pool has one at once. If not within POOL_PATIENCE, count
        # ourselves as waiting: from then on connections given back go to the
        # pool (which hands them to its waiters) instead of staying warm.
        deadline = time.monotonic() + self._pool.timeout
        try:
            return self._pool.getconn(POOL_PATIENCE), None, time.monotonic()
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
            return self._pool.getconn(left), None, time.monotonic()
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
            now = time.monotonic()
            if now - taken_at < WARM_FOR:
                entry = (conn, cursor, taken_at, now)
                warm = self._warm
                warm.append(entry)
                if self._closed:
                    with suppress(ValueError):
                        warm.remove(entry)
                        self._pool.putconn(conn)
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
        self._pool.putconn(conn)

    def _once(self, name: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        """Run one statement in its own transaction, on a warm or pooled connection."""
        conn, cursor, taken_at = self._take()
        reuse = None
        try:
            if cursor is None:
                cursor = conn.cursor(row_factory=tuple_row)
            if conn.autocommit:  # always, on a pool the Manager built
                rows = cursor.execute(_Q[name], params).fetchall()
            else:
                with _autocommit(conn):
                    rows = cursor.execute(_Q[name], params).fetchall()
            if conn.info.transaction_status == pq.TransactionStatus.IDLE:
                reuse = cursor
            return rows
        finally:
            self._give_back(conn, reuse, taken_at)

    def _run(
        self, name: str, params: dict[str, Any], recover: str | None = None
    ) -> list[tuple[Any, ...]]:
        """Run one statement in its own transaction, riding out connection failures.

        A lost connection (a server restart, a terminated backend, a pool that
        cannot connect yet) is retried with jittered exponential backoff for up to
        `RETRY_FOR` seconds. The server may have committed the lost try and lost
        only its reply: so each retry first runs `recover` (with the same
        parameters), a statement that finds what an earlier try did, and returns
        its rows when it finds anything; only otherwise is `name` run again.
        Without `recover`, `name` must be safe to repeat as it is.

        Raises `WorkflowError` when the pool is closed, and the database's error
        for anything else.
        """
        deadline = math.inf
        failures = 0
        while True:
            try:
                if failures and recover is not None:
                    found = self._once(recover, params)
                    if found:
                        return found
                return self._once(name, params)
            except PoolClosed as e:
                raise WorkflowError(
                    f"workflow: the connection pool is closed ({e}); a closed Manager or pool "
                    "cannot be used again: build a new one"
                ) from e
            except Exception as e:
                if not _connection_lost(e):
                    raise
                if failures == 0:
                    deadline = time.monotonic() + RETRY_FOR
                elif time.monotonic() >= deadline:
                    raise
                failures += 1
                delay = random.uniform(0.0, min(2.0, 0.05 * 2**failures))
                self._logger.warning(
                    "workflow: %s: connection lost (%s); retrying in %.2fs", name, e, delay
                )
                time.sleep(delay)

    def check_schema(self) -> tuple[str, str]:
        """Raise `SchemaOutdated` when the database is behind `SCHEMA_VERSION`.

        Returns the database's name as the pool's connections give it and as
        the server knows it (they differ behind an alias).
        """
        with self._conn() as conn:
            check_schema(conn)
            return conn.info.dbname, current_database(conn)

    def insert_run(
        self, conn: psycopg.Connection[Any] | None, params: dict[str, Any]
    ) -> uuid.UUID | None:
        """Insert a run and its tasks; its id, or None when the idempotency key exists.

        With `conn`, inside the caller's transaction. Without, in a transaction of
        its own that waits at most `KEY_WAIT` for a key held by a transaction still
        open (then `psycopg.errors.LockNotAvailable`), and that recognises its own
        row when a retry follows a lost reply: the run id is random, so a row with
        it can only be this insert's.
        """
        if conn is None:
            rows = self._run("insert_run", {**params, "key_wait": KEY_WAIT}, "inserted_run")
        else:
            try:
                rows = _execute(conn, "insert_run", {**params, "key_wait": None})
            except psycopg.errors.UndefinedTable as e:
                raise WorkflowError(
                    f"workflow: start_tx(): database {conn.info.dbname!r} has no pgworkflow "
                    "tables; run `python -m workflow migrate` on it, or start the run on a "
                    "connection to the manager's database"
                ) from e
        return rows[0][0] if rows else None

    def find_idempotent_run(
        self, conn: psycopg.Connection[Any] | None, workflow: str, key: str
    ) -> uuid.UUID | None:
        """The id of the run already started with this workflow and key, if any."""
        params = {"workflow": workflow, "idempotency_key": key}
        if conn is None:
            rows = self._run("find_idempotent_run", params)
        else:
            rows = _execute(conn, "find_idempotent_run", params)
        return rows[0][0] if rows else None

    def claim_run(self, run_id: uuid.UUID, claim_id: uuid.UUID) -> ClaimedRun | None:
        """Claim one run by id when it is claimable now and unlocked; None otherwise.

        After a lost reply the retry re-selects the run under `claim_id`.
        """
        params = {"id": run_id, "claim_id": claim_id, "claims": [claim_id]}
        runs = _claimed(self._run("claim_run", params, "claimed_runs"))
        return runs[0] if runs else None

    def claim_runs(self, workflows: Sequence[str], limit: int) -> list[ClaimedRun]:
        """Claim up to `limit` claimable runs of `workflows`, oldest first.

        The claim ids are chosen here, so a retry after a lost reply re-selects
        what the lost try claimed instead of stranding it.
        """
        params = {
            "workflows": list(workflows),
            "limit": limit,
            "claims": [uuid.uuid4() for _ in range(limit)],
        }
        return _claimed(self._run("claim_runs", params, "claimed_runs"))

    def complete_task(
        self,
        run_id: uuid.UUID,
        claim_id: uuid.UUID,
        seq: int,
        output: str | None,
        next_seq: int,
        done: bool,
    ) -> bool:
        """Record `seq`'s output and advance the run; False when the claim was lost."""
        rows = self._run_fenced(
            "complete_task",
            {
                "id": run_id,
                "claim_id": claim_id,
                "seq": seq,
                "output": output,
                "next_seq": next_seq,
                "done": done,
            },
        )
        return bool(rows)

    def fail_task(
        self,
        run_id: uuid.UUID,
        claim_id: uuid.UUID,
        seq: int,
        *,
        error: str,
        code: str | None,
        attempts: int,
        spent: bool,
        park: bool,
        keep_claim: bool,
        delay: float,
    ) -> bool:
        """Record a failure of `seq` with its attempt count now; False when the claim was lost.

        `error` and `code` are made storable first (NUL and lone surrogates
        replaced, length bounded), so no text a handler raises can fail the write.
        """
        rows = self._run_fenced(
            "fail_task",
            {
                "id": run_id,
                "claim_id": claim_id,
                "seq": seq,
                "error": storable(error, ERROR_CHARS),
                "code": None if code is None else storable(code, CODE_CHARS),
                "attempts": attempts,
                "spent": spent,
                "park": park,
                "keep_claim": keep_claim and not park,
                "delay": delay,
            },
        )
        return bool(rows)

    def release_claim(
        self,
        run_id: uuid.UUID,
        claim_id: uuid.UUID,
        retry_at: datetime.datetime | None = None,
        *,
        delay: float | None = None,
    ) -> bool:
        """Drop a claim without ending an attempt; False when it was already lost.

        Not claimable before `retry_at`, or for `delay` seconds, when given.
        """
        rows = self._run_fenced(
            "release_claim",
            {"id": run_id, "claim_id": claim_id, "retry_at": retry_at, "delay": delay},
        )
        return bool(rows)

    def _run_fenced(self, name: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        """Run a write fenced by `params["claim_id"]`; a retry whose earlier try let
        go of the claim (its reply lost) finds that in `released`, not "claim lost"."""
        return self._run(name, params, "released")

    def heartbeat(self, claims: Sequence[uuid.UUID]) -> set[uuid.UUID]:
        """Refresh the heartbeat of `claims`; the subset still held."""
        rows = self._run("heartbeat", {"claims": list(claims)})
        return {row[0] for row in rows}

    def sweep(self, max_age: float, limit: int) -> list[uuid.UUID]:
        """Release up to `limit` claims staler than `max_age` seconds; their run ids."""
        return [row[0] for row in self._run("sweep", {"max_age": max_age, "limit": limit})]

    def run_status(self, run_id: uuid.UUID) -> RunRow | None:
        """A run's status row, or None for an unknown id."""
        rows = self._run("run_status", {"id": run_id})
        return RunRow(*rows[0]) if rows else None

    def run_input(self, run_id: uuid.UUID) -> tuple[str, Any, bytes | None] | None:
        """A run's (workflow, plain input, sealed input), or None for an unknown id."""
        rows = self._run("run_input", {"id": run_id})
        return (rows[0][0], rows[0][1], rows[0][2]) if rows else None

    def listen_connection(self, conninfo: str, **kwargs: Any) -> psycopg.Connection[Any]:
        """A new dedicated autocommit connection LISTENing on the wake-up channel."""
        conn = psycopg.connect(conninfo, autocommit=True, **kwargs)
        conn.execute(_Q["listen"])
        return conn


def current_database(conn: psycopg.Connection[Any]) -> str:
    """The name of the database `conn` is connected to, as the server knows it."""
    name: str = _execute(conn, "current_database", {})[0][0]
    return name


def create_database(conn: psycopg.Connection[Any], name: str) -> bool:
    """Create database `name` (autocommit `conn`); False when the role may not."""
    try:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    except psycopg.errors.InsufficientPrivilege:
        return False
    return True


def drop_database(conn: psycopg.Connection[Any], name: str) -> None:
    """Drop database `name` if it exists, ending its sessions (autocommit `conn`)."""
    force = " WITH (FORCE)" if conn.info.server_version >= 130000 else ""
    conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}" + force).format(sql.Identifier(name)))


def in_transaction(conn: psycopg.Connection[Any]) -> None:
    """Raise `WorkflowError` unless `conn` can carry a statement of the caller's transaction."""
    status = conn.info.transaction_status
    if status == pq.TransactionStatus.INERROR:
        raise WorkflowError(
            "workflow: start_tx() got a connection whose transaction has failed; roll it "
            "back before starting runs with it"
        )
    if status == pq.TransactionStatus.IDLE and conn.autocommit:
        raise WorkflowError(
            "workflow: start_tx() needs a connection inside a transaction (use "
            "`with conn.transaction():`); in autocommit mode the run would commit on its own"
        )
    if status not in (pq.TransactionStatus.IDLE, pq.TransactionStatus.INTRANS):
        raise WorkflowError(
            f"workflow: start_tx() cannot use a connection in state {status.name}"
        )
