"""The only code that talks to PostgreSQL.

`queries.sql` holds every statement under a name; `Store` has one typed method per
statement and runs it, one round trip each, through `connections.Connections`
(autocommit: each statement is its own transaction). `rows.py` holds what the
statements read back, `migrate.py` the schema chain, `connections.py` URLs, the
pool factory and the retries.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import random
import re
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from importlib import resources
from typing import Any

import attrs
import psycopg
from psycopg import pq
from psycopg.rows import tuple_row
from psycopg_pool import ConnectionPool, PoolTimeout

from workflow import ids
from workflow.errors import WorkflowError
from workflow.logs import EngineLog
from workflow.store.connections import Connections, Rows, connection_lost
from workflow.store.floors import Floors, floor_times
from workflow.store.group_commit import GroupCommit
from workflow.store.migrate import (
    SCHEMA_VERSION,
    SchemaOutdated,
    check_schema,
    migrate,
    schema_version,
)
from workflow.store.rows import (
    ClaimedRun,
    DetailRow,
    DetailTaskRow,
    EventRow,
    ListedRow,
    QueueDepth,
    ScheduleState,
    StatusRow,
    SweptRow,
    TaskRow,
    WorkflowStats,
    claimed_runs,
)

__all__ = [
    "ANY_CODE",
    "CANCELS",
    "CHANNEL",
    "KEY_SLOTS",
    "SCHEMA_VERSION",
    "AnyCode",
    "ClaimedRun",
    "DetailRow",
    "DetailTaskRow",
    "EventRow",
    "ListedRow",
    "QueueDepth",
    "ScheduleState",
    "SchemaOutdated",
    "StatusRow",
    "Store",
    "SweptRow",
    "TaskRow",
    "WorkflowStats",
    "array_literal",
    "check_schema",
    "current_database",
    "in_transaction",
    "migrate",
    "schema_version",
    "slot_race",
    "start_arrays",
    "step_arrays",
    "storable",
]

CHANNEL = "workflow_runs"
"""The LISTEN/NOTIFY channel of wake-ups; each payload is a workflow name."""

CANCELS = "workflow_cancels"
"""The LISTEN/NOTIFY channel of cancellations; each payload is a run id."""

KEY_VISITS = 64
"""The fewest keys with runs waiting that one `claim_key_heads` reads per workflow."""

KEY_SLOTS = "workflow_runs_key_slots"
"""The unique index of the slots keyed runs hold: a violation of it is a race for a slot."""

OUTLAST_PATIENCE = 5.0
"""Seconds a combined write whose connection was lost may go on running on the server
before its backend is terminated (`Store._outlast`)."""

RUNS_PRIMARY_KEY = "workflow_runs_pkey"
"""The primary key of the runs: an insert that violates it met an earlier try of its own."""

ERROR_CHARS = 4000
"""The most characters of an error text stored (the rest is cut, marked "(truncated)")."""

CODE_CHARS = 200
"""The most characters of a failure code stored."""

KEY_WAIT = "5s"
"""How long `Store.insert_run` waits, in its own transaction, for an idempotency key that a
transaction still open has inserted (say a `start_tx` not committed yet), before
giving up with `psycopg.errors.LockNotAvailable`."""

_UNSTORABLE = re.compile("[\\x00\\ud800-\\udfff]")


def storable(text: str, limit: int) -> str:
    """`text` as PostgreSQL can store it: NUL characters and lone surrogates (which
    text columns and UTF-8 refuse) replaced by U+FFFD, and at most `limit` characters."""
    if _UNSTORABLE.search(text):
        text = _UNSTORABLE.sub("\ufffd", text)
    if len(text) > limit:
        marker = "... (truncated)"
        text = text[: limit - len(marker)] + marker
    return text


def _failure(error: str, code: str | None) -> dict[str, str | None]:
    """A failure's error text and code as they are stored (see `storable`)."""
    return {
        "error": storable(error, ERROR_CHARS),
        "code": None if code is None else storable(code, CODE_CHARS),
    }


def array_literal(values: Sequence[object]) -> str:
    """A PostgreSQL array literal of uuids, integers, booleans, text, datetimes (their ISO
    text, offset included) or None (NULL), sent as one text parameter and cast by the
    statement: far cheaper than psycopg's dump of a list, on every start (compute a
    constant one once), claim and combined write."""
    parts: list[str] = []
    for value in values:
        if value is None:
            parts.append("NULL")
        elif value is True or value is False:
            parts.append("t" if value else "f")
        elif isinstance(value, uuid.UUID):
            parts.append(value.hex)  # the server reads a uuid's 32 digits without dashes too
        elif isinstance(value, int):
            parts.append(str(value))
        else:
            text = str(value).replace("\\", "\\\\").replace('"', '\\"')
            parts.append(f'"{text}"')
    return "{" + ",".join(parts) + "}"


def _load_queries() -> dict[str, str]:
    text = resources.files("workflow.store").joinpath("queries.sql").read_text("utf-8")
    queries: dict[str, str] = {}
    for block in re.split(r"^-- name: ", text, flags=re.M)[1:]:
        name, _, body = block.partition("\n")
        lines = [line for line in body.splitlines() if not line.startswith("-- ")]
        queries[name.strip()] = "\n".join(lines).strip().rstrip(";")
    return queries


_Q = _load_queries()


_DETAIL_FIELDS = [field.name for field in attrs.fields(DetailRow)][:-1]  # all but tasks


_UTC = datetime.timezone.utc


def _definitions(mine: Sequence[tuple[str, str, str]]) -> dict[str, list[str]]:
    """(name, cron, time zone) triples as the three parallel arrays the schedule
    statements unnest."""
    return {
        "names": [m[0] for m in mine],
        "crons": [m[1] for m in mine],
        "zones": [m[2] for m in mine],
    }


class AnyCode:
    """The type of `ANY_CODE`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "ANY_CODE"


ANY_CODE = AnyCode()
"""For a `code` filter: any code, or none (the filter is off)."""


def _task_filter(task: str | None, code: str | AnyCode | None) -> dict[str, Any]:
    matching = not isinstance(code, AnyCode)
    return {"task": task, "match_code": matching, "code": code if matching else None}


def _step(
    run_id: uuid.UUID,
    claim_id: uuid.UUID,
    seq: int,
    output: str | None,
    next_seq: int,
    finishes: bool,
    wake_key: bool,
) -> dict[str, Any]:
    """One step's parameters."""
    return {
        "id": run_id,
        "claim_id": claim_id,
        "seq": seq,
        "output": output,
        "next_seq": next_seq,
        "finishes": finishes,
        "wake_key": wake_key,
        "channel": CHANNEL,
    }


def step_arrays(
    steps: Sequence[dict[str, Any]],
    claim_from: Sequence[str] = (),
    new_claims: Sequence[uuid.UUID] = (),
    floors: Sequence[datetime.datetime | None] = (),
) -> dict[str, Any]:
    """The parameters of `complete_tasks` for several `complete_task` parameter sets, in
    run id order (so that the rows are locked in that order); with `claim_from` (each
    workflow once) and `new_claims`, of `complete_tasks_claiming`, claiming as many runs
    of `claim_from` as `new_claims` gives claim ids, from the `floors` given (`Floors`;
    none: from the front)."""
    ordered = sorted(steps, key=lambda p: p["id"])
    params: dict[str, Any] = {
        "ids": array_literal([p["id"] for p in ordered]),
        "claims": array_literal([p["claim_id"] for p in ordered]),
        "seqs": array_literal([p["seq"] for p in ordered]),
        "outputs": array_literal([p["output"] for p in ordered]),
        "next_seqs": array_literal([p["next_seq"] for p in ordered]),
        "finishes": array_literal([p["finishes"] for p in ordered]),
        "wake_keys": array_literal([p["wake_key"] for p in ordered]),
        "channel": CHANNEL,
        "fence": new_fence(),
    }
    if new_claims:  # the fast path's batches never claim: no parameters to build for it
        params.update(workflows=array_literal(claim_from), limit=len(new_claims),
                      new_claims=array_literal(new_claims),
                      floors=array_literal(floors or [None] * len(claim_from)))
    return params


def start_arrays(starts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The parameters of `insert_runs` for several `insert_run` parameter sets (runs with
    neither an idempotency key nor a concurrency key), in the order given."""
    literal = ("id", "workflow", "status", "input", "context", "task_count", "current_seq",
               "claim_id", "names", "skipped", "wake", "traceparent", "tracestate")
    arrays: dict[str, Any] = {column: array_literal([p[column] for p in starts])
                              for column in literal}
    # Seldom set: a NULL array when none is (unnest pads it with NULLs).
    for column in ("input_sealed", "context_sealed", "run_at", "delay"):
        values = [p[column] for p in starts]
        arrays[column] = values if any(v is not None for v in values) else None
    arrays["channel"] = CHANNEL
    arrays["fence"] = new_fence()
    return arrays


def new_fence() -> int:
    """A random key of an advisory lock that a combined write holds for its transaction,
    so that its caller can wait it out after a lost connection (`Store._outlast`)."""
    return random.getrandbits(63)


def _execute(conn: psycopg.Connection[Any], name: str, params: dict[str, Any]) -> Rows:
    """Run a named statement on `conn`, rows as tuples whatever its row factory."""
    return conn.cursor(row_factory=tuple_row).execute(_Q[name], params).fetchall()


class Store:
    """The named statements of `queries.sql`, one typed method each, on a connection pool.

    Writes made after a claim are fenced by its claim id: a method returning
    False (or None) says the claim was lost, and the caller stops. `keep_warm`
    and `clock` are `Connections`' (warm connections for a pool only the Manager
    uses; the clock their ages are read on).
    """

    def __init__(
        self,
        pool: ConnectionPool[Any],
        logger: logging.Logger | None = None,
        *,
        keep_warm: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.connections = Connections(
            pool,
            EngineLog(logger or logging.getLogger("workflow")),
            queries=_Q,
            keep_warm=keep_warm,
            clock=clock,
        )
        self._run = self.connections.run
        log = self._log = EngineLog(logger or logging.getLogger("workflow"))
        self.steps = GroupCommit(self._complete_alone, self._complete_together, log,
                                 "task steps")
        """How task steps are written: alone, or together with other runs' (group commit)."""
        self.starts = GroupCommit(self._insert_alone, self._insert_together, log,
                                  "starts")
        """How runs started without a transaction or key of the caller's are inserted."""
        self.floors = Floors()
        """Where this store's claims of a backlog left off (`claim_runs`, `finish_runs`)."""

    def close(self, *, forked: bool = False) -> None:
        """Give the warm connections back (`forked`: forget them, they are the parent's)."""
        self.connections.close(forked=forked)

    def tidy(self) -> None:
        """Give back the warm connections left unused too long."""
        self.connections.tidy()


    def check_schema(self) -> tuple[str, str]:
        """Raise `SchemaOutdated` when the database is behind `SCHEMA_VERSION`.

        Returns the database's name as the pool's connections give it and as
        the server knows it (they differ behind an alias).
        """
        with self.connections.borrow() as conn:
            check_schema(conn)
            return conn.info.dbname, current_database(conn)

    # Starting runs.

    def insert_run(
        self,
        conn: psycopg.Connection[Any] | None,
        *,
        run_id: uuid.UUID,
        workflow: str,
        status: str,
        idempotency_key: str | None,
        input: str | None,
        input_sealed: bytes | None,
        context: str | None,
        context_sealed: bytes | None,
        task_count: int,
        current_seq: int,
        claim_id: uuid.UUID | None,
        names: str,
        skipped: str,
        wake: bool,
        traceparent: str | None = None,
        tracestate: str | None = None,
        delay: float | None = None,
        run_at: datetime.datetime | None = None,
        concurrency_key: bytes | None = None,
        concurrency: int = 1,
    ) -> tuple[uuid.UUID, bool] | None:
        """Insert a run and its tasks; (its id, whether it is claimed under `claim_id`), or
        None when the idempotency key exists.

        `names` and `skipped` are array literals (`array_literal`) of
        the task snapshot; `claim_id` set means inserted already claimed by the
        caller, except for a keyed run (`concurrency_key`, a digest) whose key has
        no slot free below `concurrency` or has runs waiting: that one is inserted
        waiting for a slot, and the pollers are woken. Two starts racing for a key's
        last slot make one fail with `psycopg.errors.UniqueViolation` (constraint
        `KEY_SLOTS`), nothing inserted. `wake` sends the pollers' wake-up with it; `traceparent` and
        `tracestate` are the caller's span context, stored; `run_at` (aware) or
        `delay` (seconds, database clock) make it due later. With `conn`, inside the
        caller's transaction (`WorkflowError` when its database lacks the
        tables). Without, in a transaction of its own that waits at most
        `KEY_WAIT` for a key held by a transaction still open (then
        `psycopg.errors.LockNotAvailable`), and that recognises its own row when a
        retry follows a lost reply: the run id is random, so a row with it can
        only be this insert's.
        """
        params = {
            "id": run_id,
            "workflow": workflow,
            "status": status,
            "idempotency_key": idempotency_key,
            "input": input,
            "input_sealed": input_sealed,
            "context": context,
            "context_sealed": context_sealed,
            "task_count": task_count,
            "current_seq": current_seq,
            "claim_id": claim_id,
            "names": names,
            "skipped": skipped,
            "wake": wake,
            "traceparent": traceparent,
            "tracestate": tracestate,
            "delay": delay,
            "run_at": run_at,
            "concurrency_key": concurrency_key,
            "concurrency": concurrency,
            "channel": CHANNEL,
            "key_wait": KEY_WAIT if conn is None else None,
        }
        if conn is None and idempotency_key is None and concurrency_key is None:
            return self.starts.write(params)  # `insert_run` alone, or `insert_runs`
        # A run without a concurrency key pays nothing for keys: its statement reads no
        # slot; without an idempotency key either, it is no speculative insertion
        # (`insert_run` has no ON CONFLICT).
        if concurrency_key is not None:
            name = "insert_keyed_run"
        elif idempotency_key is not None:
            name = "insert_idempotent_run"
        else:
            name = "insert_run"
        if conn is None:
            rows = self._insert_or_find(name, params, False)
        else:
            try:
                rows = _execute(conn, name, params)
            except psycopg.errors.UndefinedTable as e:
                raise WorkflowError(
                    f"workflow: start_tx(): database {conn.info.dbname!r} has no pgworkflow "
                    "tables; run `python -m workflow migrate` on it, or start the run on a "
                    "connection to the manager's database"
                ) from e
        return (rows[0][0], bool(rows[0][2])) if rows else None

    def _insert_alone(
        self, params: dict[str, Any], may_have_landed: bool
    ) -> tuple[uuid.UUID, bool] | None:
        rows = self._insert_or_find("insert_run", params, may_have_landed)
        return (rows[0][0], bool(rows[0][2])) if rows else None

    def _insert_or_find(self, name: str, params: dict[str, Any], may_have_landed: bool) -> Rows:
        """Insert statement `name`, riding out lost connections; when the insert finds its
        own id taken, or its idempotency key taken and so inserts nothing, the run an
        earlier try inserted if there is one (the id is random: only an earlier try of
        this start has it), committed after this one looked for it (a try whose
        connection was lost while the server still ran it)."""
        try:
            rows = self._run(name, params, "inserted_run", may_have_landed=may_have_landed)
        except psycopg.errors.UniqueViolation as e:
            if e.diag.constraint_name != RUNS_PRIMARY_KEY:
                raise
            found = self._run("inserted_run", params)
            if not found:
                raise
            return found
        if not rows:  # the key is another start's, or an earlier try's: look for ours
            rows = self._run("inserted_run", params)
        return rows

    def _insert_together(self, batch: list[dict[str, Any]]) -> list[tuple[uuid.UUID, bool] | None]:
        params = start_arrays(batch)
        try:
            rows = self.connections.once("insert_runs", params)
        except Exception as e:
            self._outlast(params["fence"], e)
            raise
        inserted = {row[0]: bool(row[2]) for row in rows}
        if len(inserted) != len(batch):
            # Only a clash of random ids could do this: let each insert go alone.
            raise RuntimeError(f"{len(batch) - len(inserted)} of {len(batch)} runs not inserted")
        return [(params["id"], inserted[params["id"]]) for params in batch]

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

    # Claims.

    def claim_run(self, run_id: uuid.UUID, claim_id: uuid.UUID) -> ClaimedRun | None:
        """Claim one run by id when it is claimable now and unlocked; None otherwise.

        After a lost reply the retry re-selects the run under `claim_id`.
        """
        params = {"id": run_id, "claim_id": claim_id, "claims": [claim_id]}
        runs = claimed_runs(self._run("claim_run", params, "claimed_runs"))
        return runs[0] if runs else None

    def claim_runs(self, workflows: Sequence[str], limit: int) -> list[ClaimedRun]:
        """Claim up to `limit` claimable runs of `workflows`, longest due first (new runs in
        creation order), from this store's floors while it drains a backlog (`Floors`).

        The claim ids are chosen here, so a retry after a lost reply re-selects
        what the lost try claimed instead of stranding it.
        """
        names = list(dict.fromkeys(workflows))
        floors = self.floors.of(names)
        params = {
            "workflows": array_literal(names),
            "floors": array_literal(floor_times(floors)),
            "limit": limit,
            "claims": array_literal([ids.new_id() for _ in range(limit)]),
        }
        runs = claimed_runs(self._run("claim_runs", params, "claimed_runs"))
        self.floors.claimed(names, floors, runs, limit)
        return runs

    def claim_key_heads(
        self, workflows: Sequence[str], limits: Sequence[int], limit: int
    ) -> list[ClaimedRun]:
        """Give free slots of keys of the keyed `workflows` (each allowing `limits[i]` runs
        per key at once) to their oldest waiting runs, and claim up to `limit` of them.

        Reads at most `KEY_VISITS` (or 8 x `limit`) keys with runs waiting per
        workflow, from a random point of the digests' order: a claim's cost does
        not grow with the number of busy keys, and every key's turn comes alike.

        Two claims racing for one slot (rare: only a start, a resume or a fork can
        make a claim's view of a key stale) make one of them fail with
        `psycopg.errors.UniqueViolation` or `DeadlockDetected`, nothing claimed; the
        caller claims again.
        """
        params = {
            "workflows": list(workflows),
            "limits": list(limits),
            "limit": limit,
            "start": os.urandom(32),
            "visit": max(KEY_VISITS, 8 * limit),
            "claims": [ids.new_id() for _ in range(limit)],
        }
        return claimed_runs(self._run("claim_key_heads", params, "claimed_runs"))

    def wake(self, workflow: str) -> None:
        """Wake the pollers of `workflow` (a notification on `CHANNEL`)."""
        self._run("wake", {"channel": CHANNEL, "workflow": workflow})

    def claim_key_head(
        self, workflow: str, concurrency_key: bytes, concurrency: int
    ) -> ClaimedRun | None:
        """Claim the next run of one key of `workflow` (its oldest due waiting run) when
        the key has a slot free below `concurrency`; None when it has none, or that run
        is being claimed elsewhere. A race for the slot raises as `claim_key_heads`'."""
        claim_id = ids.new_id()
        params = {
            "workflow": workflow,
            "concurrency_key": concurrency_key,
            "concurrency": concurrency,
            "claim_id": claim_id,
            "claims": [claim_id],
        }
        runs = claimed_runs(self._run("claim_key_head", params, "claimed_runs"))
        return runs[0] if runs else None

    def next_due(self, workflows: Sequence[str]) -> float | None:
        """Seconds until the earliest unclaimed run of `workflows` is due (negative when
        overdue), by the database clock; None when there is none."""
        rows = self._run("next_due", {"workflows": list(workflows)})
        due: float | None = rows[0][0] if rows else None
        return due

    def heartbeat(self, claims: Sequence[uuid.UUID]) -> set[uuid.UUID]:
        """Refresh the heartbeat of `claims`; the subset still held."""
        rows = self._run("heartbeat", {"claims": list(claims)})
        return {row[0] for row in rows}

    def sweep(self, max_age: float, limit: int) -> list[SweptRow]:
        """Release up to `limit` claims staler than `max_age` seconds; what each released.

        Each counts the abandoned attempt of its run's current task.
        """
        params = {"max_age": max_age, "limit": limit, "channel": CHANNEL}
        return [SweptRow(*row[:5]) for row in self._run("sweep", params)]

    # Writes under a claim (fenced).

    def complete_task(
        self,
        run_id: uuid.UUID,
        claim_id: uuid.UUID,
        seq: int,
        output: str | None,
        next_seq: int,
        finishes: bool,
        *,
        wake_key: bool = True,
    ) -> bool:
        """Record `seq`'s output and move the run to `next_seq`, or finish it; False when
        the claim was lost. A keyed run that finishes wakes the pollers when runs of its
        key wait, unless `wake_key` is false (the caller claims the key's next run).

        Steps that other threads record at the same moment share one statement and
        one commit (`GroupCommit`); this one returns once it has committed."""
        return self.steps.write(_step(run_id, claim_id, seq, output, next_seq, finishes, wake_key))

    @staticmethod
    def step_params(
        run_id: uuid.UUID, claim_id: uuid.UUID, seq: int, output: str | None, next_seq: int
    ) -> dict[str, Any]:
        """The parameters of the finishing `complete_task` of an unkeyed run, for
        `finish_runs`."""
        return _step(run_id, claim_id, seq, output, next_seq, True, True)

    def finish_runs(
        self, steps: Sequence[dict[str, Any]], workflows: Sequence[str], claim: int
    ) -> tuple[list[bool | Exception], list[ClaimedRun]]:
        """Write the runs' finishing `steps` (`step_params`) in one statement and one
        commit, and claim in that commit up to `claim` claimable runs of `workflows`
        (a worker's completer: the runs its finished ones leave room for).

        Returns, in the order given, each step's answer (whether its claim matched,
        or the error that writing it raised), and the runs claimed, in claim order.
        When the statement fails, whatever it may have claimed is let go of and each
        step is written again alone, first looking for what the failed try did (as
        `GroupCommit` does for the steps of threads); those steps claim nothing."""
        new_claims = [ids.new_id() for _ in range(claim)]
        try:
            if not new_claims:  # outlasts a lost connection itself
                return list[bool | Exception](self._complete_together(list(steps))), []
            names = list(dict.fromkeys(workflows))
            floors = self.floors.of(names)
            params = step_arrays(steps, names, new_claims, floor_times(floors))
            try:
                rows = self.connections.once("complete_tasks_claiming", params)
            except Exception as e:
                self._outlast(params["fence"], e)
                self.let_go(new_claims)
                raise
        except Exception as e:
            self._log.warning(
                "a combined write of %d finishing steps failed (%s); making them one by one",
                len(steps), e,
            )
            answers: list[bool | Exception] = []
            for step in steps:
                try:
                    answers.append(self._complete_alone(step, True))
                except Exception as alone:
                    answers.append(alone)
            return answers, []
        matched = {(row[1], row[3]) for row in rows if row[0]}
        runs = claimed_runs([row[1:] for row in rows if not row[0]])
        self.floors.claimed(names, floors, runs, claim)
        return [(step["id"], step["claim_id"]) in matched for step in steps], runs

    def _complete_alone(self, params: dict[str, Any], may_have_landed: bool) -> bool:
        rows = self._run(
            "complete_task",
            params,
            "released",  # a retry whose earlier try let go of the claim finds it here
            may_have_landed=may_have_landed,
        )
        if not rows and params["finishes"]:
            # The claim is gone: maybe by an earlier try of this very step, committed
            # after the retry looked for it (its connection was lost while the server
            # still ran it). A claim truly lost was not let go of by this claim.
            rows = self._run("released", params)
        return bool(rows)

    def _complete_together(self, batch: list[dict[str, Any]]) -> list[bool]:
        # One try only: on any failure GroupCommit writes the steps alone, each
        # looking first for what this try may have done, once this try has ended
        # (`_outlast`).
        params = step_arrays(batch)
        try:
            rows = self.connections.once("complete_tasks", params)
        except Exception as e:
            self._outlast(params["fence"], e)
            raise
        matched = {(row[0], row[1]) for row in rows}
        return [(p["id"], p["claim_id"]) in matched for p in batch]

    def _outlast(self, fence: int, error: Exception) -> None:
        """After a combined write holding advisory lock `fence` failed with `error`: when its
        connection was lost, wait until the server has ended that write's transaction
        (it may still be running it, on a row lock say, and commit later), so that
        what is done next (the writes one by one, each first looking for what this
        one did; a release of what it claimed) sees all it did.

        A statement the server answered with an error has ended, and one that never
        got a connection (`PoolTimeout`) never began. A write still running after
        `OUTLAST_PATIENCE` seconds (waiting on a lock some idle transaction holds)
        has its backend terminated, its transaction rolled back: nobody waits for its
        answer. If even that cannot be made sure of, the writes go on regardless:
        each one alone still recognises an earlier try that committed meanwhile."""
        if isinstance(error, PoolTimeout) or not connection_lost(error):
            return
        patience = {"fence": fence, "patience": f"{round(OUTLAST_PATIENCE * 1000)}ms"}
        try:
            try:
                self._run("outlast", patience)
                return
            except psycopg.errors.LockNotAvailable:
                self._log.warning(
                    "a combined write whose connection was lost still runs after %gs; "
                    "terminating its backend", OUTLAST_PATIENCE,
                )
            self._run("end_fenced", {"fence": fence})
            self._run("outlast", patience)
        except Exception:
            self._log.exception(
                "waiting for a combined write whose connection was lost to end failed; "
                "its writes are made again one by one"
            )

    def let_go(self, claims: list[uuid.UUID]) -> None:
        """Release the runs held by `claims`, unattempted: claims nobody will execute (made by
        a combined write that failed, or taken for a thread an interrupt ended). A
        failure is logged, not raised: the sweeper releases them later."""
        try:
            self._run("release_claims", {"claims": array_literal(claims), "channel": CHANNEL})
        except Exception:
            self._log.exception(
                "letting go of runs claimed for nobody failed: the sweeper will release them"
            )

    def fail_task(
        self,
        run_id: uuid.UUID,
        claim_id: uuid.UUID,
        seq: int,
        *,
        error: str,
        code: str | None,
        attempts: int,
        keep_claim: bool,
        delay: float,
    ) -> bool:
        """Record a failed attempt of `seq` (its count now `attempts`), retried after
        `delay` seconds, under the claim or released for a poller; False when the
        claim was lost.

        `error` and `code` are made storable first (NUL and lone surrogates
        replaced, length bounded), so no text a handler raises can fail the write.
        """
        rows = self._run(
            "fail_task",
            {
                "id": run_id,
                "claim_id": claim_id,
                "seq": seq,
                **_failure(error, code),
                "attempts": attempts,
                "keep_claim": keep_claim,
                "delay": delay,
                "event_id": ids.new_id(),
            },
            "released",  # a retry whose earlier try let go of the claim finds it here
        )
        return bool(rows)

    def park_run(
        self,
        run_id: uuid.UUID,
        claim_id: uuid.UUID,
        seq: int,
        *,
        error: str,
        code: str | None,
        attempts: int,
        spent: bool,
        wake_key: bool = True,
    ) -> bool:
        """Park the run on task `seq` with `error` (its attempt count now `attempts`;
        `spent`: the park ends an attempt); False when the claim was lost. `wake_key` as
        `complete_task`'s."""
        rows = self._run(
            "park_run",
            {
                "id": run_id,
                "claim_id": claim_id,
                "seq": seq,
                **_failure(error, code),
                "attempts": attempts,
                "spent": spent,
                "wake_key": wake_key,
                "channel": CHANNEL,
                "event_id": ids.new_id(),
            },
            "released",  # a retry whose earlier try let go of the claim finds it here
        )
        return bool(rows)

    def release_claim(
        self,
        run_id: uuid.UUID,
        claim_id: uuid.UUID,
        retry_at: datetime.datetime | None = None,
        *,
        delay: float | None = None,
        once: bool = False,
    ) -> bool:
        """Drop a claim without ending an attempt; False when it was already lost.

        Not claimable before `retry_at`, or for `delay` seconds, when given. With
        `once`, one try and no riding out of a lost connection (after an interrupt:
        a sweeper releases a claim left behind).
        """
        params = {
            "id": run_id,
            "claim_id": claim_id,
            "retry_at": retry_at,
            "delay": delay,
            "channel": CHANNEL,
        }
        if once:
            return bool(self.connections.once("release_claim", params))
        # A retry whose earlier try let go of the claim finds it with `released`.
        return bool(self._run("release_claim", params, "released"))

    # Reads.

    def run_status(self, run_id: uuid.UUID) -> StatusRow | None:
        """A run's status row, or None for an unknown id."""
        rows = self._run("run_status", {"id": run_id})
        return StatusRow(*rows[0]) if rows else None

    def run_input(
        self, run_id: uuid.UUID
    ) -> tuple[str, Any, bytes | None, uuid.UUID | None] | None:
        """A run's (workflow, plain input, sealed input, the run it was sealed for when
        not itself), or None for an unknown id."""
        rows = self._run("run_input", {"id": run_id})
        return (rows[0][0], rows[0][1], rows[0][2], rows[0][3]) if rows else None

    def check_claims(
        self, claims: Sequence[tuple[uuid.UUID, uuid.UUID]]
    ) -> dict[uuid.UUID, tuple[bool, bool]]:
        """For (run id, claim id) pairs: claim id -> (still held, its run was cancelled)."""
        rows = self._run(
            "check_claims",
            {"runs": [run for run, _ in claims], "claims": [claim for _, claim in claims]},
        )
        return {row[0]: (bool(row[1]), bool(row[2])) for row in rows}

    # Operating runs (workflow.Admin).

    def cancel_run(
        self, run_id: uuid.UUID, *, actor: str | None, reason: str | None
    ) -> bool:
        """Cancel the run unless it succeeded or is cancelled; True when this cancelled it.

        Drops any claim in the same statement and tells the executing process
        (`CANCELS`). A retry after a lost reply recognises its own cancel.
        """
        return bool(self.cancel_runs([run_id], actor=actor, reason=reason))

    def resume_run(
        self, run_id: uuid.UUID, *, actor: str | None, reason: str | None
    ) -> bool:
        """Make a parked (or cancelled, unfinished) run claimable now; True when this did."""
        return bool(self.resume_runs([run_id], actor=actor, reason=reason))

    def fork_run(
        self,
        run_id: uuid.UUID,
        *,
        from_seq: int,
        current_seq: int,
        actor: str | None,
        reason: str | None,
    ) -> uuid.UUID | None:
        """A new run with `run_id`'s input and the outputs of its tasks before `from_seq`,
        on task `current_seq`; its id, or None when `run_id` does not exist."""
        new_id = ids.new_id()
        rows = self._run(
            "fork_run",
            {
                "id": run_id,
                "new_id": new_id,
                "from_seq": from_seq,
                "current_seq": current_seq,
                "event_ids": [ids.new_id()],
                "actor": actor,
                "reason": reason,
                "channel": CHANNEL,
            },
            "admin_events",
        )
        return new_id if rows else None

    def list_runs(
        self,
        *,
        statuses: Sequence[str] | None,
        workflow: str | None,
        since: datetime.datetime | None,
        until: datetime.datetime | None,
        after: tuple[datetime.datetime, uuid.UUID] | None,
        limit: int,
        task: str | None = None,
        code: str | AnyCode | None = ANY_CODE,
    ) -> list[ListedRow]:
        """Runs newest first, matching every filter given, after the keyset `after`.

        `task`: the task the run is on; `code`: its last failure's code (None: no
        code), unless `ANY_CODE`.
        """
        rows = self._run(
            "list_runs",
            {
                "statuses": None if statuses is None else list(statuses),
                "workflow": workflow,
                "since": since,
                "until": until,
                **_task_filter(task, code),
                "after_at": None if after is None else after[0],
                "after_id": None if after is None else after[1],
                "limit": limit,
            },
        )
        return [ListedRow(*row) for row in rows]

    def count_runs(
        self,
        *,
        statuses: Sequence[str] | None,
        workflow: str | None,
        since: datetime.datetime | None,
        until: datetime.datetime | None,
        task: str | None = None,
        code: str | AnyCode | None = ANY_CODE,
    ) -> int:
        """How many runs match every filter given (those of `list_runs`)."""
        rows = self._run(
            "count_runs",
            {
                "statuses": None if statuses is None else list(statuses),
                "workflow": workflow,
                "since": since,
                "until": until,
                **_task_filter(task, code),
            },
        )
        return int(rows[0][0])

    def finished_per_minute(self, minutes: int) -> list[tuple[datetime.datetime, str, int]]:
        """(minute, status, runs) finished in each of the last `minutes` minutes that had any."""
        return [
            (row[0].astimezone(_UTC), row[1], int(row[2]))
            for row in self._run("finished_per_minute", {"minutes": minutes})
        ]

    def cancel_runs(
        self, run_ids: Sequence[uuid.UUID], *, actor: str | None, reason: str | None
    ) -> list[uuid.UUID]:
        """`cancel_run` for each of `run_ids` in one statement; those it cancelled.

        Each run's history row carries an event id chosen here, so that a retry
        after a lost reply finds exactly the runs the committed try changed.
        """
        return self._steer(
            "cancel_runs", run_ids, actor, reason, {"cancels": CANCELS, "channel": CHANNEL}
        )

    def resume_runs(
        self, run_ids: Sequence[uuid.UUID], *, actor: str | None, reason: str | None
    ) -> list[uuid.UUID]:
        """`resume_run` for each of `run_ids` in one statement; those it resumed."""
        return self._steer("resume_runs", run_ids, actor, reason, {"channel": CHANNEL})

    def _steer(
        self,
        name: str,
        run_ids: Sequence[uuid.UUID],
        actor: str | None,
        reason: str | None,
        extra: dict[str, Any],
    ) -> list[uuid.UUID]:
        # In id order, as group commit writes steps: two statements that lock the same
        # runs in the same order cannot deadlock.
        ordered = sorted(set(run_ids))
        params = {
            "ids": ordered,
            "event_ids": [ids.new_id() for _ in ordered],
            "actor": actor,
            "reason": reason,
            **extra,
        }
        return [row[0] for row in self._run(name, params, "admin_events")]

    def run_detail(self, run_id: uuid.UUID) -> DetailRow | None:
        """One run with its tasks, or None for an unknown id."""
        rows = self._run("run_detail", {"id": run_id})
        if not rows:
            return None
        first = rows[0]
        head: dict[str, Any] = dict(zip(_DETAIL_FIELDS, first[:15], strict=True))
        return DetailRow(**head, tasks=tuple(DetailTaskRow(*row[15:]) for row in rows))

    def run_history(self, run_id: uuid.UUID) -> list[EventRow]:
        """A run's history, oldest first."""
        return [EventRow(*row) for row in self._run("run_history", {"id": run_id})]

    def prune_runs(self, status: str, older_than: float, limit: int) -> int:
        """Delete up to `limit` runs of `status` finished `older_than` seconds ago; how many."""
        params = {"status": status, "older_than": older_than, "limit": limit}
        return len(self._run("prune_runs", params))

    def count_prunable(self, status: str, older_than: float) -> int:
        """How many runs of `status` finished more than `older_than` seconds ago."""
        rows = self._run("count_prunable", {"status": status, "older_than": older_than})
        return int(rows[0][0])

    def queue_stats(self, stale_after: float) -> list[WorkflowStats]:
        """Per workflow: pending, running, claimable, oldest claimable age, stale claims
        (heartbeat older than `stale_after` s), parked, finished in the last day."""
        rows = self._run("queue_stats", {"stale_after": stale_after})
        return [WorkflowStats(*row) for row in rows]

    def queue_gauges(self, stale_after: float) -> list[QueueDepth]:
        """Per workflow and status: unfinished and parked runs, claimable ones, the oldest
        claimable's age, stale claims (heartbeat older than `stale_after` s)."""
        return [QueueDepth(*row) for row in self._run("queue_gauges", {"stale_after": stale_after})]

    # Schedules.

    def db_now(self) -> datetime.datetime:
        """The database clock, in UTC."""
        now: datetime.datetime = self._run("db_now", {})[0][0]
        return now.astimezone(_UTC)

    def upsert_schedule(
        self, *, name: str, workflow: str, cron: str, timezone: str, catchup: str,
        next_tick: datetime.datetime,
    ) -> None:
        """Record a registered schedule (`next_tick` is taken when it is new or its cron or
        time zone changed)."""
        self._run("upsert_schedule", {
            "name": name, "workflow": workflow, "cron": cron, "timezone": timezone,
            "catchup": catchup, "next_tick": next_tick,
        })

    def orphan_schedules(self, workflows: Sequence[str], names: Sequence[str]) -> list[str]:
        """Mark orphaned the schedules of `workflows` not among `names`; their names."""
        rows = self._run("orphan_schedules", {"workflows": list(workflows), "names": list(names)})
        return [row[0] for row in rows]

    @contextlib.contextmanager
    def transaction(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection inside a transaction, committed at the end of the block
        (rolled back on an exception)."""
        with self.connections.borrow() as conn, conn.transaction():
            yield conn

    @staticmethod
    def claim_schedule(
        conn: psycopg.Connection[Any], mine: Sequence[tuple[str, str, str]], skip: Sequence[str]
    ) -> tuple[str, datetime.datetime, datetime.datetime | None, bool, datetime.datetime] | None:
        """In `conn`'s transaction, lock one due or triggered schedule whose row matches one
        of `mine` (name, cron, time zone), its name not in `skip`: (name, next tick,
        triggered at, paused, database now), the times in UTC; or None."""
        rows = _execute(conn, "claim_schedule", {**_definitions(mine), "skip": list(skip)})
        if not rows:
            return None
        name, next_tick, triggered_at, paused, now = rows[0]
        return (
            name, next_tick.astimezone(_UTC),
            None if triggered_at is None else triggered_at.astimezone(_UTC),
            paused, now.astimezone(_UTC),
        )

    @staticmethod
    def advance_schedule(
        conn: psycopg.Connection[Any], name: str, *, next_tick: datetime.datetime,
        last_tick: datetime.datetime | None, last_run: uuid.UUID | None, triggered: bool,
    ) -> None:
        """In `conn`'s transaction, record what firing `name` did."""
        _execute(conn, "advance_schedule", {
            "name": name, "next_tick": next_tick, "last_tick": last_tick,
            "last_run": last_run, "triggered": triggered,
        })

    def next_schedule_due(self, mine: Sequence[tuple[str, str, str]]) -> float | None:
        """Seconds until the earliest schedule matching one of `mine` (name, cron, time
        zone) is due or triggered; None when none is."""
        rows = self._run("next_schedule_due", _definitions(mine))
        due: float | None = rows[0][0] if rows else None
        return due

    def list_schedules(self) -> list[ScheduleState]:
        """Every schedule, by name."""
        return [ScheduleState(*row) for row in self._run("list_schedules", {})]

    def pause_schedule(self, name: str, paused: bool) -> bool:
        """Pause or resume `name`; False when there is no such schedule."""
        return bool(self._run("pause_schedule", {"name": name, "paused": paused}))

    def trigger_schedule(self, name: str) -> bool:
        """Ask for one run of `name` now; False when there is no such schedule."""
        return bool(self._run("trigger_schedule", {"name": name}))

    # Wake-ups.

    def listen_connection(self, conninfo: str, **kwargs: Any) -> psycopg.Connection[Any]:
        """A new dedicated autocommit connection LISTENing on the wake-up channel."""
        conn = psycopg.connect(conninfo, autocommit=True, **kwargs)
        conn.execute(_Q["listen_cancels"])
        conn.execute(_Q["listen"])
        return conn


def current_database(conn: psycopg.Connection[Any]) -> str:
    """The name of the database `conn` is connected to, as the server knows it."""
    name: str = _execute(conn, "current_database", {})[0][0]
    return name


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


def slot_race(error: BaseException) -> bool:
    """Whether `error` is two claims racing for one slot of a key (the statement did
    nothing; claiming again is safe): a violation of `KEY_SLOTS`, or the deadlock
    two such claims can make."""
    if isinstance(error, psycopg.errors.DeadlockDetected):
        return True
    return (
        isinstance(error, psycopg.errors.UniqueViolation)
        and error.diag.constraint_name == KEY_SLOTS
    )
