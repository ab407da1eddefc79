"""Operating runs (SPEC 12): see, cancel, resume, fork and prune them; queue figures.

`Admin` needs only the database: no Registry, no application code, no cipher, so
an operator can use it (or `python -m workflow runs ...`) from any machine. What
a person does is recorded in the run's history (`workflow_events`) with the
actor and the reason, beside every failed attempt, sweep and park the engine
recorded there.

Cancelling is a fenced revocation: one statement makes the run CANCELLED and
drops its claim, so its executor's next write matches nothing and it stops
without touching the run; the executing process sets `run.cancelled` within
about a second. Resuming gives the task the run stopped on a fresh attempt
budget and makes the run claimable now.
"""

from __future__ import annotations

import datetime
import getpass
import logging
import os
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
from psycopg_pool import ConnectionPool

from workflow.durations import Duration, seconds
from workflow.errors import NotResumable, RunNotFound, ScheduleNotFound, WorkflowError
from workflow.run import Failure, RunStatus, Status
from workflow.store import (
    ANY_CODE,
    AnyCode,
    DetailRow,
    ListedRow,
    QueueDepth,
    ScheduleState,
    Store,
    WorkflowStats,
    check_schema,
)
from workflow.store.connections import connect_explained, make_pool, normalize_url, open_pool
from workflow.waiting import read_status, run_status

__all__ = [
    "ANY_CODE",
    "Admin",
    "HistoryEntry",
    "QueueDepth",
    "QueueStats",
    "RunDetail",
    "RunPage",
    "RunSummary",
    "ScheduleState",
    "TaskState",
    "Throughput",
    "WorkflowStats",
]

Statuses = Status | str | Iterable[Status | str] | None
"""A status filter: one status, its name, several, or None for any."""

When = datetime.datetime | datetime.timedelta | None
"""A time filter: an aware datetime, or a timedelta meaning that long ago."""


@attrs.frozen
class RunSummary:
    """One run as a list shows it; `task` is the task it is on (None when done),
    `failure` is set when it is parked."""

    id: str
    workflow: str
    status: Status
    created_at: datetime.datetime
    finished_at: datetime.datetime | None
    idempotency_key: str | None
    task: str | None
    failure: Failure | None


@attrs.frozen
class RunPage:
    """A page of runs, newest first; `next` is the `after` of the next page (None: the last)."""

    items: tuple[RunSummary, ...]
    next: str | None


@attrs.frozen
class TaskState:
    """One task of a run: `state` is done, skipped, current (the task the run is on or
    stopped on) or waiting; `error` and `code` are its last failure's."""

    seq: int
    name: str
    state: str
    attempts: int
    error: str | None
    code: str | None
    finished_at: datetime.datetime | None


@attrs.frozen
class HistoryEntry:
    """One event of a run's history (database time): a failed attempt, a sweep, a park,
    a cancel, a resume or a fork; `actor` and `reason` are a person's."""

    at: datetime.datetime
    kind: str
    task: str | None
    attempt: int | None
    error: str | None
    code: str | None
    actor: str | None
    reason: str | None
    other_run: str | None


@attrs.frozen
class RunDetail(RunSummary):
    """One run in full: the summary, its task timeline, its input (the decoded JSON, or
    the string "sealed"), where it was forked from, and its history.

    `concurrency_key` is the hex SHA-256 digest of its key (SPEC 15; None: no key),
    and `key_state` says where the run stands with it: "held" (it holds one of its
    key's slots), "waiting" (unfinished, for a slot) or None (no key, or finished).
    """

    tasks: tuple[TaskState, ...]
    input: Any
    forked_from: str | None
    history: tuple[HistoryEntry, ...]
    concurrency_key: str | None = None
    key_state: str | None = None


@attrs.frozen
class Throughput:
    """Runs finished per minute over the last `minutes` (database clock), oldest minute
    first, every minute present: (minute, succeeded, parked, cancelled)."""

    minutes: tuple[tuple[datetime.datetime, int, int, int], ...]


@attrs.frozen
class QueueStats:
    """Every workflow's `WorkflowStats`, and the heartbeat age that counted as stale."""

    workflows: tuple[WorkflowStats, ...]
    stale_after: float


def _key_state(row: DetailRow) -> str | None:
    if row.concurrency_key is None or row.finished_at is not None:
        return None
    return "waiting" if row.key_slot is None else "held"


def _actor(actor: str | None) -> str:
    if actor is not None:
        if not isinstance(actor, str):
            raise TypeError(f"actor must be a str, not {type(actor).__name__}")
        return actor
    try:
        return os.environ.get("USER") or getpass.getuser()
    except Exception:
        return "unknown"


def _statuses(status: Statuses) -> list[str] | None:
    if status is None:
        return None
    items = [status] if isinstance(status, (Status, str)) else list(status)
    names = []
    for item in items:
        try:
            names.append(Status(item).value)
        except ValueError:
            known = ", ".join(s.value for s in Status)
            raise ValueError(f"unknown status {item!r} (one of {known})") from None
    return names


def _when(value: When, what: str) -> datetime.datetime | None:
    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        return datetime.datetime.now(datetime.timezone.utc) - value
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:
            raise ValueError(f"{what} must be timezone-aware (a naive datetime is ambiguous)")
        return value
    raise TypeError(f"{what} must be a datetime or a timedelta, not {type(value).__name__}")


def _cursor(after: str | None) -> tuple[datetime.datetime, uuid.UUID] | None:
    if after is None:
        return None
    try:
        at, _, run_id = after.rpartition("_")
        return datetime.datetime.fromisoformat(at), uuid.UUID(run_id)
    except (ValueError, AttributeError):
        raise ValueError(f"after {after!r} is not a page token from RunPage.next") from None


def _parse_id(run_id: str) -> uuid.UUID:
    try:
        return uuid.UUID(run_id)
    except (TypeError, ValueError, AttributeError):
        raise RunNotFound(f"no run has id {run_id!r}") from None


def _failure(status: Status, task: str | None, error: str | None, code: str | None,
             attempts: int | None) -> Failure | None:
    if status is not Status.PARKED:
        return None
    return Failure(task=task or "", error=error or "", code=code, attempts=attempts or 0)


def _summary(row: ListedRow) -> RunSummary:
    status = Status(row.status)
    return RunSummary(
        id=str(row.id),
        workflow=row.workflow,
        status=status,
        created_at=row.created_at,
        finished_at=row.finished_at,
        idempotency_key=row.idempotency_key,
        task=row.task,
        failure=_failure(status, row.task, row.error, row.error_code, row.attempts),
    )


def _task_states(row: DetailRow) -> tuple[TaskState, ...]:
    finished = row.status == Status.SUCCEEDED.value
    states = []
    for task in row.tasks:
        if task.skipped:
            state = "skipped"
        elif task.seq < row.current_seq or finished:
            state = "done"
        elif task.seq == row.current_seq:
            state = "current"
        else:
            state = "waiting"
        states.append(
            TaskState(
                seq=task.seq,
                name=task.name,
                state=state,
                attempts=task.attempts,
                error=task.error,
                code=task.error_code,
                finished_at=task.finished_at,
            )
        )
    return tuple(states)


class Admin:
    """Operations on runs over a database: list, show, cancel, resume, fork, prune, stats.

    `db` is a `psycopg_pool.ConnectionPool` (borrowed, never closed here) or a
    connection string (an own small pool, closed by `close()`). No Registry is
    needed: it works on any workflow's runs. `actor` defaults to `$USER`.
    `stale_after` is the heartbeat age `stats()` counts as a stale claim (the
    workers' `sweep_max_age`, 600 s by default). Every method blocks on the
    statements it names and raises `RunNotFound` for an unknown or malformed run
    id; `WorkflowError` when the database cannot be reached or is behind.
    """

    def __init__(
        self,
        db: ConnectionPool[Any] | str,
        *,
        logger: logging.Logger | None = None,
        stale_after: Duration = 600.0,
    ) -> None:
        self._stale_after = seconds(stale_after, "stale_after")
        if isinstance(db, str):
            url = normalize_url(db)
            with connect_explained(url) as conn:
                check_schema(conn)
            self._pool: ConnectionPool[Any] = make_pool(url, max_size=2, name="workflow-admin")
            open_pool(self._pool, 30.0)
            self._owns_pool = True
        elif isinstance(db, ConnectionPool):
            self._pool = db
            self._owns_pool = False
        else:
            raise TypeError(
                "Admin needs a psycopg_pool.ConnectionPool or a connection string, "
                f"not {type(db).__name__}"
            )
        self._store = Store(self._pool, logger)
        if not self._owns_pool:
            self._store.check_schema()

    def close(self) -> None:
        """Close the pool this Admin built (a borrowed one is left open)."""
        if self._owns_pool:
            self._pool.close()

    def __enter__(self) -> Admin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Seeing runs.

    def runs(
        self,
        *,
        status: Statuses = None,
        workflow: str | None = None,
        since: When = None,
        until: When = None,
        limit: int = 50,
        after: str | None = None,
        task: str | None = None,
        code: str | AnyCode | None = ANY_CODE,
    ) -> RunPage:
        """Runs newest first, matching every filter given; one page of at most `limit`.

        `since`/`until` bound `created_at` (an aware datetime, or a timedelta: that
        long ago); `after` is the `next` of the previous page; `task` is the task a
        run is on (or stopped on), `code` its last failure's code (None: failures
        without one; `ANY_CODE`, the default: any). Raises `ValueError` for an
        unknown status, a naive datetime, a bad limit or page token.
        """
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= 10_000:
            raise ValueError(f"limit must be an int from 1 to 10000, got {limit!r}")
        rows = self._store.list_runs(
            statuses=_statuses(status),
            workflow=workflow,
            since=_when(since, "since"),
            until=_when(until, "until"),
            after=_cursor(after),
            limit=limit + 1,
            task=task,
            code=code,
        )
        items = tuple(_summary(row) for row in rows[:limit])
        more = len(rows) > limit
        last = rows[limit - 1] if more else None
        token = None if last is None else f"{last.created_at.isoformat()}_{last.id}"
        return RunPage(items=items, next=token)

    def count(
        self,
        *,
        status: Statuses = None,
        workflow: str | None = None,
        since: When = None,
        until: When = None,
        task: str | None = None,
        code: str | AnyCode | None = ANY_CODE,
    ) -> int:
        """How many runs match the filters of `runs()` (what a bulk action would touch)."""
        return self._store.count_runs(
            statuses=_statuses(status),
            workflow=workflow,
            since=_when(since, "since"),
            until=_when(until, "until"),
            task=task,
            code=code,
        )

    def run(self, run_id: str) -> RunDetail:
        """One run with its task timeline, input (or "sealed") and history."""
        key = _parse_id(run_id)
        row = self._store.run_detail(key)
        if row is None:
            raise RunNotFound(f"no run has id {run_id!r}")
        status = Status(row.status)
        current = row.tasks[row.current_seq - 1] if row.current_seq <= row.task_count else None
        names = {task.seq: task.name for task in row.tasks}
        history = tuple(
            HistoryEntry(
                at=event.at,
                kind=event.kind,
                task=None if event.seq is None else names.get(event.seq),
                attempt=event.attempt,
                error=event.error,
                code=event.error_code,
                actor=event.actor,
                reason=event.reason,
                other_run=None if event.other_run is None else str(event.other_run),
            )
            for event in self._store.run_history(key)
        )
        return RunDetail(
            id=str(row.id),
            workflow=row.workflow,
            status=status,
            created_at=row.created_at,
            finished_at=row.finished_at,
            idempotency_key=row.idempotency_key,
            task=None if current is None else current.name,
            failure=None
            if current is None
            else _failure(status, current.name, current.error, current.error_code,
                          current.attempts),
            tasks=_task_states(row),
            input="sealed" if row.sealed else row.input,
            forked_from=None if row.forked_from is None else str(row.forked_from),
            history=history,
            concurrency_key=None if row.concurrency_key is None else row.concurrency_key.hex(),
            key_state=_key_state(row),
        )

    def stats(self) -> QueueStats:
        """Per workflow: pending, running, claimable now, the oldest claimable's age,
        stale claims, parked, finished in the last day. Index-backed reads only."""
        return QueueStats(
            workflows=tuple(self._store.queue_stats(self._stale_after)),
            stale_after=self._stale_after,
        )

    def throughput(self, minutes: int = 60) -> Throughput:
        """Runs finished in each of the last `minutes` minutes (1 to 1440), by status; one
        index range scan per status."""
        if not isinstance(minutes, int) or isinstance(minutes, bool) or not 1 <= minutes <= 1440:
            raise ValueError(f"minutes must be an int from 1 to 1440, got {minutes!r}")
        counts: dict[tuple[datetime.datetime, str], int] = {
            (minute, status): n for minute, status, n in self._store.finished_per_minute(minutes)
        }
        now = self._store.db_now().replace(second=0, microsecond=0)
        rows = []
        for back in range(minutes - 1, -1, -1):
            minute = now - datetime.timedelta(minutes=back)
            rows.append((
                minute, counts.get((minute, "succeeded"), 0), counts.get((minute, "parked"), 0),
                counts.get((minute, "cancelled"), 0),
            ))
        return Throughput(minutes=tuple(rows))

    def depth(self) -> tuple[QueueDepth, ...]:
        """Per workflow and status, the runs not finished and the parked ones, with how
        many are claimable now, the oldest claimable's age and the stale claims: the
        numbers a metrics scrape reads, in one query over partial indexes only (its
        cost follows the open runs, never the finished history)."""
        return tuple(self._store.queue_gauges(self._stale_after))

    # Schedules.

    def schedules(self) -> tuple[ScheduleState, ...]:
        """Every schedule the workers have registered, by name."""
        return tuple(self._store.list_schedules())

    def pause_schedule(self, name: str) -> None:
        """Stop `name` from firing until `resume_schedule`; `ScheduleNotFound` when unknown."""
        if not self._store.pause_schedule(name, True):
            raise ScheduleNotFound(f"no schedule is named {name!r}")

    def resume_schedule(self, name: str) -> None:
        """Let a paused `name` fire again: ticks missed while paused follow its catch-up
        policy (`latest` fires the most recent one). `ScheduleNotFound` when unknown."""
        if not self._store.pause_schedule(name, False):
            raise ScheduleNotFound(f"no schedule is named {name!r}")

    def trigger_schedule(self, name: str) -> None:
        """Ask for one run of `name` now, paused or not, under an idempotency key of its
        own (`schedule:{name}:trigger:{when}`): a worker holding the schedule starts it
        within about a second. `ScheduleNotFound` when unknown."""
        if not self._store.trigger_schedule(name):
            raise ScheduleNotFound(f"no schedule is named {name!r}")

    # Steering runs.

    def cancel(
        self, run_id: str, *, reason: str | None = None, actor: str | None = None
    ) -> RunStatus:
        """Cancel a run that is neither SUCCEEDED nor CANCELLED; its status after.

        Pending, waiting to retry, parked or running: it becomes CANCELLED at once
        (`finished_at` set) in one statement that drops its claim, so its executor
        stops without writing; the executing process sets `run.cancelled` within
        about a second. A SUCCEEDED or CANCELLED run is left as it is.
        """
        key = _parse_id(run_id)
        self._store.cancel_run(key, actor=_actor(actor), reason=reason)
        return run_status(read_status(self._store, key, run_id))

    def resume(
        self, run_id: str, *, reason: str | None = None, actor: str | None = None
    ) -> RunStatus:
        """Make a PARKED run, or a CANCELLED one with tasks left, claimable now; its status.

        It goes on from the task it stopped on, with a fresh attempt budget and its
        earlier outputs kept (the old errors stay in the history); pollers are
        woken. Raises `NotResumable` naming the status otherwise.
        """
        key = _parse_id(run_id)
        if not self._store.resume_run(key, actor=_actor(actor), reason=reason):
            status = Status(read_status(self._store, key, run_id).status)
            raise NotResumable(
                f"run {run_id} is {status.value}: only a parked run, or a cancelled one with "
                "tasks left, can be resumed"
            )
        return run_status(read_status(self._store, key, run_id))

    def fork(
        self,
        run_id: str,
        *,
        from_task: str | None = None,
        reason: str | None = None,
        actor: str | None = None,
    ) -> str:
        """Start a new run of the same workflow and stored input, from `from_task`; its id.

        The outputs of the tasks before `from_task` (default: the task the run is
        on) are copied; the new run records `forked_from`; the original is not
        changed. A sealed input stays sealed and opens for the fork. Raises
        `ValueError` for a task the run does not have, and `WorkflowError` for a
        finished run without `from_task` or one with nothing left to run from it.
        """
        key = _parse_id(run_id)
        row = self._store.run_detail(key)
        if row is None:
            raise RunNotFound(f"no run has id {run_id!r}")
        if from_task is None:
            if row.current_seq > row.task_count:
                raise WorkflowError(
                    f"workflow: run {run_id} has no task left (it {row.status}): give "
                    "from_task, the task to fork from"
                )
            from_seq = row.current_seq
        else:
            seqs = [task.seq for task in row.tasks if task.name == from_task]
            if not seqs:
                names = ", ".join(task.name for task in row.tasks)
                raise ValueError(f"run {run_id} has no task {from_task!r} (its tasks: {names})")
            from_seq = seqs[0]
        current = next(
            (task.seq for task in row.tasks if task.seq >= from_seq and not task.skipped), None
        )
        if current is None:
            raise WorkflowError(
                f"workflow: run {run_id}: every task from {from_task or 'its current task'} on "
                "is skipped; there is nothing to run"
            )
        new_id = self._store.fork_run(
            key, from_seq=from_seq, current_seq=current, actor=_actor(actor), reason=reason
        )
        if new_id is None:
            raise RunNotFound(f"no run has id {run_id!r}")
        return str(new_id)

    def cancel_matching(
        self,
        *,
        status: Statuses = None,
        workflow: str | None = None,
        since: When = None,
        until: When = None,
        reason: str | None = None,
        actor: str | None = None,
        batch_size: int = 100,
        progress: Callable[[int], None] | None = None,
        task: str | None = None,
        code: str | AnyCode | None = ANY_CODE,
    ) -> int:
        """Cancel every run matching the filters of `runs()` (`task` and `code` included),
        in batches; how many changed.

        `progress(count)` is called after each batch with the running total.
        """
        return self._matching(
            self._store.cancel_runs, status, workflow, since, until, reason, actor,
            batch_size, progress, task, code,
        )

    def resume_matching(
        self,
        *,
        status: Statuses = Status.PARKED,
        workflow: str | None = None,
        since: When = None,
        until: When = None,
        reason: str | None = None,
        actor: str | None = None,
        batch_size: int = 100,
        progress: Callable[[int], None] | None = None,
        task: str | None = None,
        code: str | AnyCode | None = ANY_CODE,
    ) -> int:
        """Resume every resumable run matching the filters of `runs()` (default: parked
        ones), in batches; how many changed."""
        return self._matching(
            self._store.resume_runs, status, workflow, since, until, reason, actor,
            batch_size, progress, task, code,
        )

    def _matching(
        self,
        act: Callable[..., Sequence[uuid.UUID]],
        status: Statuses,
        workflow: str | None,
        since: When,
        until: When,
        reason: str | None,
        actor: str | None,
        batch_size: int,
        progress: Callable[[int], None] | None,
        task: str | None,
        code: str | AnyCode | None,
    ) -> int:
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        who = _actor(actor)
        filters: dict[str, Any] = {
            "statuses": _statuses(status),
            "workflow": workflow,
            "since": _when(since, "since"),
            "until": _when(until, "until"),
            "task": task,
            "code": code,
        }
        after: tuple[datetime.datetime, uuid.UUID] | None = None
        total = 0
        while True:
            rows = self._store.list_runs(**filters, after=after, limit=batch_size)
            if not rows:
                return total
            total += len(act([row.id for row in rows], actor=who, reason=reason))
            if progress is not None:
                progress(total)
            if len(rows) < batch_size:
                return total
            after = (rows[-1].created_at, rows[-1].id)

    # Retention.

    def prune(
        self,
        *,
        older_than: Duration,
        statuses: Iterable[Status | str] = (Status.SUCCEEDED, Status.CANCELLED),
        batch_size: int = 1000,
        progress: Callable[[int], None] | None = None,
    ) -> int:
        """Delete runs of `statuses` finished more than `older_than` ago, with their tasks
        and history; how many. In committed batches of `batch_size`, oldest first,
        skipping rows others hold: it never blocks claims (unfinished runs are not
        touched). A pruned run frees its idempotency key."""
        age = seconds(older_than, "older_than")
        if age < 0:
            raise ValueError(f"older_than must not be negative, got {older_than!r}")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        names = _statuses(list(statuses)) or []
        unfinished = {Status.PENDING.value, Status.RUNNING.value} & set(names)
        if unfinished:
            raise ValueError(f"only finished runs are pruned, not {sorted(unfinished)}")
        total = 0
        for name in names:
            while True:
                deleted = self._store.prune_runs(name, age, batch_size)
                total += deleted
                if progress is not None and deleted:
                    progress(total)
                if deleted < batch_size:
                    break
        return total

    def count_prunable(
        self,
        *,
        older_than: Duration,
        statuses: Iterable[Status | str] = (Status.SUCCEEDED, Status.CANCELLED),
    ) -> int:
        """How many runs `prune()` with these arguments would delete (a dry run)."""
        age = seconds(older_than, "older_than")
        return sum(
            self._store.count_prunable(name, age) for name in _statuses(list(statuses)) or []
        )
