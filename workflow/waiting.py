"""Waiting for runs: local wake-ups, plus the database poll for runs executed elsewhere.

`Endings` keeps how this process's executions ended: a waiter on a run executed
here is woken the moment it ends, and asks nothing of the database (the last
`RECENT` outcomes are kept for waiters that come late). A run executed elsewhere
is read from the database about once a second; one that is claimable now and
unclaimed is claimed and executed here (a `wait()` kick, SPEC 9).
"""

from __future__ import annotations

import collections
import threading
import uuid
import weakref
from typing import TYPE_CHECKING

from workflow.durations import time_left
from workflow.errors import RunNotFound, WorkflowError
from workflow.run import Failure, RunStatus, Status
from workflow.store import StatusRow, Store

if TYPE_CHECKING:
    from workflow.executor import Executor
    from workflow.fastpath import FastPath

RECENT = 4096
"""How many outcomes of local executions are kept for waiters that come late."""

POLL = 1.0
"""Seconds between database reads while waiting for a run executed elsewhere."""


class Ending:
    """How a local execution of a run ended: `wait()` for `set()`, then read `status`.

    A bare lock rather than a `threading.Event`: set once, waited on by the
    (usually one) caller of `run.wait()`, on the hot path of every local run.
    """

    __slots__ = ("_lock", "done", "status")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self.done = False
        self.status: Status | None = None

    def set(self) -> None:
        """Mark the execution ended and wake every waiter (call once)."""
        self.done = True
        self._lock.release()

    def wait(self, timeout: float) -> bool:
        """Block until `set()` or `timeout` seconds; True once it was set."""
        if self.done:
            return True
        if self._lock.acquire(timeout=timeout):
            self._lock.release()  # pass the wake on to the next waiter
            return True
        return self.done


def _ended(status: Status) -> Ending:
    ending = Ending()
    ending.status = status
    ending.set()
    return ending


_ENDED = {status: _ended(status) for status in Status}
"""An ended execution's record, one per status, for the executions nobody waited on
while they ran (a poller's): making and setting a latch for each cost a worker's every
run."""


class Endings:
    """This process's executions, and how the recent ones ended."""

    def __init__(self) -> None:
        self._local: dict[uuid.UUID, Ending] = {}
        self._recent: collections.OrderedDict[uuid.UUID, Ending] = collections.OrderedDict()
        self._waiters: weakref.WeakValueDictionary[uuid.UUID, threading.Event] = (
            weakref.WeakValueDictionary()
        )
        self._lock = threading.Lock()

    def executing(self, run_id: uuid.UUID) -> None:
        """A local execution of `run_id` is about to begin."""
        with self._lock:
            self._local.setdefault(run_id, Ending())

    def ended(self, run_id: uuid.UUID, status: Status | None) -> None:
        """A local execution of `run_id` ended, with the terminal status it wrote or None.

        Only a success is kept for late waiters: a parked (or cancelled) run may be
        resumed, so its waiters read the database.
        """
        with self._lock:
            ending = self._local.pop(run_id, None)
            if ending is not None:
                ending.status = status
            elif status is not None:
                # Begun without `executing` (by a poller): no latch of its own is waited on.
                ending = _ENDED[status]
            if status is Status.SUCCEEDED and ending is not None:
                self._recent[run_id] = ending
                if len(self._recent) > RECENT:
                    self._recent.popitem(last=False)
            waiter = self._waiters.get(run_id) if self._waiters else None
        if ending is not None and not ending.done:
            ending.set()
        if waiter is not None:
            waiter.set()

    def abandoned(self, run_id: uuid.UUID) -> None:
        """The local execution of `run_id` announced by `executing` never began (no thread
        took it; its claim was released). Whoever waits on that execution re-reads the
        database; a `wait()` that kicked the run is not woken to kick it again at once."""
        with self._lock:
            ending = self._local.pop(run_id, None)
        if ending is not None and not ending.done:
            ending.set()

    def of(self, run_id: uuid.UUID) -> Ending | None:
        """The local execution of `run_id`, running or recently ended, if any."""
        with self._lock:
            return self._local.get(run_id) or self._recent.get(run_id)

    def waiter(self, run_id: uuid.UUID) -> threading.Event:
        """An event set when any local execution of `run_id` ends (kept while referenced)."""
        with self._lock:
            waiter = self._waiters.get(run_id)
            if waiter is None:
                waiter = self._waiters[run_id] = threading.Event()
            return waiter


def read_status(store: Store, run_id: uuid.UUID, shown: object) -> StatusRow:
    """The run's status row; `RunNotFound` (naming `shown`, the id as given) for an unknown id."""
    row = store.run_status(run_id)
    if row is None:
        raise RunNotFound(f"no run has id {str(shown)!r}")
    return row


def run_status(row: StatusRow) -> RunStatus:
    """The public `RunStatus` of a status row (a `Failure` when parked)."""
    status = Status(row.status)
    failure = None
    if status is Status.PARKED:
        failure = Failure(
            task=row.task or "",
            error=row.error or "",
            code=row.error_code,
            attempts=row.attempts or 0,
        )
    return RunStatus(
        status=status, failure=failure, created_at=row.created_at, finished_at=row.finished_at
    )


def wait(
    run_id: uuid.UUID,
    shown: object,
    limit: float | None,
    *,
    endings: Endings,
    store: Store,
    executor: Executor,
    fastpath: FastPath,
) -> Status:
    """Block until the run is terminal, or `limit` seconds (then RUNNING); see `Run.wait`.

    Raises `RunNotFound` for an unknown run and `WorkflowError` when called from
    inside one of the run's own handlers.
    """
    if executor.executing_here() == run_id:
        raise WorkflowError(
            f"workflow: wait() on run {shown} from inside one of its own handlers: its "
            "own run cannot end before the handler returns"
        )
    left = time_left(limit)

    waiter: threading.Event | None = None
    while True:
        local = endings.of(run_id)
        if local is not None and not local.done:
            # Executing here: its end wakes us at once. Still read the database
            # every second (and at once when no time is left): a hung local attempt
            # may have been swept and the run finished by another executor, or the
            # attempt here failed and released its claim for a retry that is due now
            # while its execution is still ending.
            remaining = left()
            if local.wait(POLL if remaining is None else min(POLL, remaining)):
                continue
            row = read_status(store, run_id, shown)
            status = Status(row.status)
            if status.terminal:
                return status
            if _kick(row, run_id, executor, fastpath):
                continue
            if left() == 0.0:
                return Status.RUNNING
            continue
        if local is not None and local.status is not None:
            return local.status
        if waiter is None:
            # Registered before the status read, so an end here after it wakes us.
            waiter = endings.waiter(run_id)
            continue
        waiter.clear()  # before the read: an end after the read must stay seen
        row = read_status(store, run_id, shown)
        status = Status(row.status)
        if status.terminal:
            return status
        if _kick(row, run_id, executor, fastpath):
            continue
        remaining = left()
        if remaining is not None and remaining <= 0:
            return Status.RUNNING
        waiter.wait(POLL if remaining is None else min(POLL, remaining))


def _kick(row: StatusRow, run_id: uuid.UUID, executor: Executor, fastpath: FastPath) -> bool:
    """Claim and launch the run here when it is claimable now; True when it was.

    Only a run that is claimable now (no round trip otherwise), and never one of a
    workflow this manager cannot execute: several services may share the tables."""
    return (
        row.claimable
        and executor.registry.definition(row.workflow) is not None
        and fastpath.kick(run_id)
    )
