"""Starting runs: input to row, then the fast path.

`Starter.start` refuses what cannot be stored before any SQL is sent (a key the
index cannot carry, an input that does not encode, a connection that cannot
carry the caller's transaction or is on another database), encodes and seals
the input and the calling context, evaluates `skip_if` and the concurrency
key (stored as its digest), honours the idempotency key, inserts the run with
its task snapshot, and hands it to the fast path when there is room (inserted
already claimed: no claim of its own) and, for a keyed run, when its key has a
free slot and no run waiting for one.
"""

from __future__ import annotations

import datetime
import hashlib
import uuid
from collections.abc import Callable
from typing import Any

import psycopg

from workflow import codec, ids
from workflow.config import Config
from workflow.definition import Definition, Registry, Workflow
from workflow.durations import Duration, seconds
from workflow.errors import EncodeError, WorkflowError
from workflow.events import Events, RunFinished, RunStarted
from workflow.fastpath import FastPath
from workflow.limits import MAX_KEY_BYTES, text_problem
from workflow.run import Status
from workflow.sealing import seal_document
from workflow.store import (
    ClaimedRun,
    Store,
    TaskRow,
    array_literal,
    current_database,
    in_transaction,
    slot_race,
)


class _Shape:
    """What every start of one workflow shares, computed once per manager."""

    __slots__ = ("definition", "key", "limit", "names", "no_skips", "skips", "tasks")

    def __init__(self, definition: Definition[Any]) -> None:
        steps = definition.steps
        self.definition = definition
        self.key = definition.concurrency_key
        self.limit = definition.limit
        self.skips = any(step.skip is not None for step in steps)
        self.names = array_literal([step.task.name for step in steps])
        self.no_skips = array_literal([False] * len(steps))
        self.tasks = self.snapshot([False] * len(steps))

    def snapshot(self, skipped: list[bool]) -> tuple[TaskRow, ...]:
        """The task rows of a run just inserted with these skips."""
        return tuple(
            TaskRow(
                seq=i + 1,
                name=step.task.name,
                skipped=skipped[i],
                attempts=0,
                has_output=False,
                output=None,
                failed_at=None,
            )
            for i, step in enumerate(self.definition.steps)
        )


def check_key(key: object) -> None:
    """Refuse an idempotency key before any SQL is sent (EncodeError, TypeError)."""
    if not isinstance(key, str) or not key:
        raise TypeError(f"idempotency_key must be a non-empty str, got {key!r}")
    problem = text_problem(key, MAX_KEY_BYTES)
    if problem is not None:
        raise EncodeError(f"idempotency_key {key[:60]!r} {problem}")


def key_digest(workflow: str, key: object) -> bytes | None:
    """The stored form of a run's concurrency key: the SHA-256 digest of its text (an
    `int` or a `uuid.UUID` as `str()` writes it), or None for None (no key).
    `TypeError` for any other type, before any SQL is sent."""
    if key is None:
        return None
    if isinstance(key, (int, uuid.UUID)) and not isinstance(key, bool):
        key = str(key)
    if not isinstance(key, str):
        raise TypeError(
            f"workflow {workflow!r}: concurrency_key returned {type(key).__name__}; it must "
            "return a str, an int, a uuid.UUID, or None for a run with no key"
        )
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def check_due(
    delay: object, run_at: object
) -> tuple[float | None, datetime.datetime | None]:
    """(delay in seconds, run_at) checked before any SQL is sent: `TypeError` for both,
    or for a value of the wrong type; `ValueError` for a naive datetime, or a delay
    that is negative, NaN or beyond what a duration may be. (None, None): due now."""
    if delay is not None and run_at is not None:
        raise TypeError("start(): give delay or run_at, not both")
    if run_at is not None:
        if not isinstance(run_at, datetime.datetime):
            raise TypeError(f"run_at must be a datetime.datetime, not {type(run_at).__name__}")
        if run_at.tzinfo is None or run_at.utcoffset() is None:
            raise ValueError(
                f"run_at {run_at.isoformat()} is naive: give an aware datetime "
                "(e.g. datetime.datetime.now(datetime.timezone.utc) + ...)"
            )
        return None, run_at
    if delay is not None:
        value = seconds(delay, "delay")
        if value < 0:
            raise ValueError(f"delay must be zero or more seconds, got {delay!r}")
        return value, None
    return None, None


class Starter:
    """Inserts runs for one manager, and launches them on its fast path."""

    def __init__(
        self,
        registry: Registry,
        config: Config,
        store: Store,
        fastpath: FastPath,
        events: Events,
        database: tuple[str, str],
        *,
        capture: Callable[[], tuple[str | None, str | None]] | None = None,
    ) -> None:
        self._config = config
        self._capture = capture
        self._store = store
        self._fastpath = fastpath
        self._events = events
        self._dbname, self._database = database
        self._shapes: dict[str, _Shape] = {}
        for name in registry.names():
            definition = registry.definition(name)
            assert definition is not None
            self._shapes[name] = _Shape(definition)

    def start(
        self,
        wf: Workflow[Any],
        input: Any,
        *,
        idempotency_key: str | None,
        conn: psycopg.Connection[Any] | None = None,
        delay: Duration | None = None,
        run_at: datetime.datetime | None = None,
    ) -> tuple[uuid.UUID, bool]:
        """Insert a run (in `conn`'s transaction when given) and launch it when there is room.

        With `delay` or `run_at` the run is due later: it is inserted pending and
        never launched here (a poller or a `wait()` kick claims it once due).

        Returns its id, and whether it is a new run (False: an earlier start's,
        found by the idempotency key). Raises what `Manager.start` and
        `Manager.start_tx` document.
        """
        shape = self._shapes.get(wf.name)
        if shape is None:
            raise WorkflowError(
                f"workflow {wf.name!r} is not registered with this manager; register it "
                "before building the Manager"
            )
        if idempotency_key is not None:
            check_key(idempotency_key)
        delay_s, due_at = check_due(delay, run_at)
        delayed = delay_s is not None or due_at is not None
        if conn is not None:
            if not isinstance(conn, psycopg.Connection):
                raise TypeError(
                    f"start_tx() needs a psycopg.Connection, not {type(conn).__name__}"
                )
            in_transaction(conn)
            self._check_same_database(conn)
        run_id = ids.new_id()
        # Fast-path handlers get `stored_input`, decoded from what is stored: never
        # the caller's object, which the caller may go on changing.
        input_text, _, stored_input = codec.encode_document(input, wf.input_type)
        cipher = self._config.cipher
        input_plain, input_sealed = seal_document(input_text, run_id, cipher)
        context_plain = context_sealed = None
        if self._config.context is not None:
            context_plain, context_sealed = seal_document(
                self._config.context.capture_document(), run_id, cipher
            )
        concurrency_key = None
        if shape.key is not None:  # from the plaintext input, as skip_if
            concurrency_key = key_digest(wf.name, shape.key(input))
        store = self._store
        if idempotency_key is not None:
            existing = store.find_idempotent_run(conn, wf.name, idempotency_key)
            if existing is not None:
                return existing, False
        steps = shape.definition.steps
        if shape.skips:
            skipped = [bool(step.skip(input)) if step.skip else False for step in steps]
            current = next((i + 1 for i, s in enumerate(skipped) if not s), len(steps) + 1)
            skipped_literal = array_literal(skipped)
        else:
            skipped, current, skipped_literal = None, 1, shape.no_skips
        all_skipped = current > len(steps)
        traceparent, tracestate = (None, None) if self._capture is None else self._capture()
        fastpath = self._fastpath
        fast = conn is None and not all_skipped and not delayed and fastpath.try_slot()
        claim_id = ids.new_id() if fast else None

        def insert(claim_id: uuid.UUID | None) -> tuple[uuid.UUID, bool] | None:
            claims = claim_id is not None
            return store.insert_run(
                conn,
                run_id=run_id,
                workflow=wf.name,
                status="succeeded" if all_skipped else ("running" if claims else "pending"),
                idempotency_key=idempotency_key,
                input=input_plain,
                input_sealed=input_sealed,
                context=context_plain,
                context_sealed=context_sealed,
                task_count=len(steps),
                current_seq=current,
                claim_id=claim_id,
                names=shape.names,
                skipped=skipped_literal,
                wake=not claims and not all_skipped,
                traceparent=traceparent,
                tracestate=tracestate,
                delay=delay_s,
                run_at=due_at,
                concurrency_key=concurrency_key,
                concurrency=shape.limit,
            )

        try:
            try:
                inserted = insert(claim_id)
            except psycopg.errors.Error as e:
                # Another start, or a poller, took the key's last slot as this one did:
                # nothing was inserted; insert the run waiting for its key instead.
                if claim_id is None or not slot_race(e):
                    raise
                inserted = insert(None)
        except psycopg.errors.LockNotAvailable as e:
            if fast:
                fastpath.release_slot()
            raise WorkflowError(
                f"workflow {wf.name!r}: idempotency key {idempotency_key!r} is held by a "
                "transaction still open (a start_tx() of this key not committed yet, maybe "
                "on this very thread): commit or roll back that transaction first"
            ) from e
        except Exception:
            if fast:
                fastpath.release_slot()
            raise
        except BaseException:
            # An interrupt, maybe raised as the insert's reply came (a direct statement
            # cannot be interrupted before): the run may be committed, claimed for us.
            if fast:
                assert claim_id is not None
                fastpath.abandon(run_id, claim_id)
            raise
        if inserted is not None and fast and not inserted[1]:
            fast = False  # its key is busy: it waits for a poller
            fastpath.release_slot()
        if inserted is None:
            if fast:
                fastpath.release_slot()
            assert idempotency_key is not None
            existing = store.find_idempotent_run(conn, wf.name, idempotency_key)
            if existing is None:
                raise WorkflowError(
                    f"workflow {wf.name!r}: idempotency key {idempotency_key!r} collided with "
                    "a run that is not visible yet (started in a transaction still open)"
                )
            return existing, False
        if not fast:
            self._announce(run_id, wf.name, all_skipped)
            return run_id, True
        assert claim_id is not None
        try:  # a subscriber's interrupt, say: the run is not launched here
            claimed = ClaimedRun(
                id=run_id,
                workflow=wf.name,
                claim_id=claim_id,
                input=None,
                input_sealed=None,
                context=context_plain,
                context_sealed=context_sealed,
                current_seq=current,
                db_now=None,
                tasks=shape.tasks if skipped is None else shape.snapshot(skipped),
                traceparent=traceparent,
                tracestate=tracestate,
                concurrency_key=concurrency_key,
            )
            self._announce(run_id, wf.name, all_skipped)
        except BaseException:
            fastpath.abandon(run_id, claim_id)
            raise
        fastpath.launch(claimed, stored_input)
        return run_id, True

    def _announce(self, run_id: uuid.UUID, workflow: str, all_skipped: bool) -> None:
        if self._events.active:
            self._events.emit(RunStarted(run_id, workflow))
            if all_skipped:
                self._events.emit(RunFinished(run_id, workflow, Status.SUCCEEDED))

    def _check_same_database(self, conn: psycopg.Connection[Any]) -> None:
        """`WorkflowError` unless `conn` is on this manager's database.

        The connection's own name costs nothing to read; only when it differs
        (another alias of the same database, say) is the server asked.
        """
        if conn.info.dbname == self._dbname:
            return
        theirs = current_database(conn)
        if theirs != self._database:
            raise WorkflowError(
                f"workflow: start_tx() got a connection to database {theirs!r}, but this "
                f"manager's runs live in database {self._database!r}: start the run on a "
                "connection to that database (or build the Manager on this one)"
            )
