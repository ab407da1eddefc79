"""Watching runs: `Run` handles, `Status`, `RunStatus` and `Failure`."""

from __future__ import annotations

import datetime
import enum
import uuid
from typing import TYPE_CHECKING

import attrs

from workflow.durations import Duration

if TYPE_CHECKING:
    from workflow.manager import Manager


class Status(str, enum.Enum):
    """Where a run is. Terminal: SUCCEEDED, PARKED, CANCELLED."""

    PENDING = "pending"
    """Never claimed."""
    RUNNING = "running"
    """Claimed, or waiting to retry."""
    SUCCEEDED = "succeeded"
    """Every task is done."""
    PARKED = "parked"
    """Stopped; needs a person (`Admin.resume` goes on). `RunStatus.failure` says why."""
    CANCELLED = "cancelled"
    """Cancelled by a person (`Admin.cancel`); resumable while it has tasks left."""

    @property
    def terminal(self) -> bool:
        """True for SUCCEEDED, PARKED and CANCELLED."""
        return self in _TERMINAL


_TERMINAL = frozenset({Status.SUCCEEDED, Status.PARKED, Status.CANCELLED})


@attrs.frozen
class Failure:
    """Why a run parked: the task it was on, the last error text, its code, attempts.

    `error` is shown to people: handlers must raise PII-free messages.
    `attempts` is the task's persisted attempt count when the run parked.
    """

    task: str
    error: str
    code: str | None
    attempts: int


@attrs.frozen
class RunStatus:
    """A plain database read of a run; times come from the database clock."""

    status: Status
    failure: Failure | None
    created_at: datetime.datetime
    finished_at: datetime.datetime | None


class Run:
    """A handle on one run, by id. Cheap to build; every method reads the database."""

    def __init__(self, manager: Manager, run_id: str, key: uuid.UUID | None = None) -> None:
        self._manager = manager
        self._id = run_id
        self._key = key  # the parsed id, when the manager already has it

    @property
    def id(self) -> str:
        """The run's opaque id."""
        return self._id

    def __repr__(self) -> str:
        return f"Run({self._id!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Run) and other.id == self._id

    def __hash__(self) -> int:
        return hash(self._id)

    def wait(self, timeout: Duration | None = None) -> Status:
        """Block until the run is terminal and return its status.

        After `timeout` seconds it returns `Status.RUNNING` and the run goes on. A
        run finished in this process wakes the waiter at once; one finished
        elsewhere is seen within about a second. A run that is claimable now and
        unclaimed is claimed and executed here, on the fast path, when there is room.
        """
        return self._manager.wait(self._id if self._key is None else self._key, timeout)

    def status(self) -> RunStatus:
        """Read the run's status, failure and times (one query)."""
        return self._manager.status(self._id if self._key is None else self._key)
