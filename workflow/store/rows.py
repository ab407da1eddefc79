"""The rows the store reads back: frozen values, one class per shape a statement returns."""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Sequence
from typing import Any

import attrs


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

    def with_output(self, output: Any) -> TaskRow:
        """This row with its recorded output (`attrs.evolve`'s result, built directly: a
        task's success is on the fast path)."""
        return TaskRow(
            seq=self.seq, name=self.name, skipped=self.skipped, attempts=self.attempts,
            has_output=True, output=output, failed_at=self.failed_at,
        )


@attrs.frozen
class ClaimedRun:
    """A run this process now holds a claim on, with its whole task snapshot.

    `db_now` is the database clock at the claim (None for a run inserted already
    claimed by the fast path, which has no failure to wait out). `sealed_for` is
    the run its sealed documents were sealed for, when not this one (a fork).
    `waited` is how long it had been claimable when claimed, by the database
    clock (None on the fast path); `traceparent` and `tracestate` the span context
    of its start (W3C trace-context headers), when one was stored;
    `concurrency_key` the digest of its key (SPEC 15), when it has one; `due_at` the
    time it was due from (its `next_retry_at`; None on the fast path).
    """

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
    sealed_for: uuid.UUID | None = None
    waited: float | None = None
    traceparent: str | None = None
    tracestate: str | None = None
    concurrency_key: bytes | None = None
    due_at: datetime.datetime | None = None


@attrs.frozen
class StatusRow:
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


def claimed_runs(rows: Sequence[tuple[Any, ...]]) -> list[ClaimedRun]:
    """The claim statements' rows (one per task, grouped by run) as `ClaimedRun`s."""
    runs: list[ClaimedRun] = []
    tasks: list[TaskRow] = []
    for i, row in enumerate(rows):
        tasks.append(TaskRow(*row[15:]))
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
                    sealed_for=row[9],
                    waited=row[10],
                    traceparent=row[11],
                    tracestate=row[12],
                    concurrency_key=row[13],
                    due_at=row[14],
                    tasks=tuple(tasks),
                )
            )
            tasks = []
    return runs


@attrs.frozen
class ListedRow:
    """One run as `list_runs` reads it (task fields: the task it is on, None when done)."""

    id: uuid.UUID
    workflow: str
    status: str
    created_at: datetime.datetime
    finished_at: datetime.datetime | None
    idempotency_key: str | None
    task: str | None
    error: str | None
    error_code: str | None
    attempts: int | None


@attrs.frozen
class DetailTaskRow:
    """One task of a run as `run_detail` reads it."""

    seq: int
    name: str
    skipped: bool
    attempts: int
    error: str | None
    error_code: str | None
    finished_at: datetime.datetime | None


@attrs.frozen
class DetailRow:
    """One run as `run_detail` reads it, with every task of its snapshot."""

    id: uuid.UUID
    workflow: str
    status: str
    created_at: datetime.datetime
    finished_at: datetime.datetime | None
    idempotency_key: str | None
    current_seq: int
    task_count: int
    input: Any
    sealed: bool
    forked_from: uuid.UUID | None
    claimed: bool
    next_retry_at: datetime.datetime
    concurrency_key: bytes | None
    key_slot: int | None
    tasks: tuple[DetailTaskRow, ...]


@attrs.frozen
class EventRow:
    """One row of a run's history."""

    at: datetime.datetime
    kind: str
    seq: int | None
    attempt: int | None
    error: str | None
    error_code: str | None
    actor: str | None
    reason: str | None
    other_run: uuid.UUID | None


@attrs.frozen
class WorkflowStats:
    """One workflow's queue: unfinished runs by status, those claimable now and the
    oldest one's age in seconds, stale claims, parked runs, and runs finished in the
    last day (`Admin.stats`)."""

    workflow: str
    pending: int
    running: int
    claimable: int
    oldest_claimable_seconds: float | None
    stale_claims: int
    parked: int
    succeeded_last_day: int
    cancelled_last_day: int


@attrs.frozen
class QueueDepth:
    """One workflow and status of the queue (`Admin.depth`): its runs not finished
    (or parked), how many of them are claimable now, the oldest claimable's age in
    seconds (None when none is), and claims whose heartbeat is older than the
    stale limit."""

    workflow: str
    status: str
    runs: int
    claimable: int
    oldest_claimable_seconds: float | None
    stale_claims: int


@attrs.frozen
class SweptRow:
    """A run `sweep` released: its workflow, and the task, seq and attempt count of
    the abandoned attempt it counted (None when the run had no task there)."""

    run_id: uuid.UUID
    workflow: str
    task: str | None
    seq: int | None
    attempts: int | None


@attrs.frozen
class ScheduleState:
    """One schedule as the table holds it (`Admin.schedules`): its definition as the
    workers last registered it, the next tick to fire, the last tick fired and its
    run, whether it is paused or orphaned (no longer in the code), and a trigger
    not yet handled."""

    name: str
    workflow: str
    cron: str
    timezone: str
    catchup: str
    next_tick: datetime.datetime
    last_tick: datetime.datetime | None
    last_run: uuid.UUID | None
    paused: bool
    orphaned: bool
    triggered_at: datetime.datetime | None
