"""What happened in the engine, announced in one place for whoever listens.

The executor, the start of a run and the sweeper announce events on their
manager's `Events`; metrics, traces and the run history subscribe there rather
than reaching into the engine. A subscriber is called on the thread where the
event happened, right after it happened (so an attempt's `AttemptBegan` and
`AttemptEnded` arrive on the handler's own thread, around its call, except for a
worker's run whose last write its completer makes: after `FinishHandedOver` on
the handler's thread, the rest of that execution's events come from the
completer thread that wrote its finish (or, once the completer has stopped, the
handler's), once the write has committed); it must be
quick and must not block, and must treat the event as read-only (the classes are
not frozen only because a frozen attrs instance costs four times as much to
build, on the fast path). An exception it raises is logged and dropped: it
never changes what the engine does. (A `SystemExit` or `KeyboardInterrupt` is
raised to the code that announced the event, once every other subscriber has had
it: what becomes of it then depends on the thread and the event, and a subscriber
should not raise one.) With no subscriber nothing is built:
announcing costs one attribute check.
"""

from __future__ import annotations

import enum
import threading
import time
import uuid
from collections.abc import Callable

import attrs

from workflow.logs import EngineLog
from workflow.run import Status


class Outcome(str, enum.Enum):
    """How an attempt ended."""

    SUCCEEDED = "succeeded"
    """The handler returned; its output is recorded."""
    FAILED = "failed"
    """The handler raised (or its output could not be encoded or recorded); counted."""
    TIMED_OUT = "timed_out"
    """The handler raised after its deadline; counted."""
    ABANDONED = "abandoned"
    """It ended without counting: shutdown, or its claim was lost (a sweeper counts that)."""
    CANCELLED = "cancelled"
    """The run was cancelled while it ran; not counted."""


@attrs.define
class RunStarted:
    """A run was inserted (by `start`, or by `start_tx` in a transaction not committed yet)."""

    run_id: uuid.UUID
    workflow: str


@attrs.define
class RunClaimed:
    """An execution began on a run this process claimed (on the fast path or by a poller).

    `fast`: claimed by its own `start` on the fast path. `waited`: how long the
    run had been claimable when a poller (or a kick) claimed it, by the database
    clock (None on the fast path). `traceparent`, `tracestate`: the span context
    stored at its start (W3C trace-context headers), when there is one.
    """

    run_id: uuid.UUID
    workflow: str
    fast: bool = False
    waited: float | None = None
    traceparent: str | None = None
    tracestate: str | None = None


@attrs.define
class AttemptBegan:
    """A handler is about to be called."""

    run_id: uuid.UUID
    workflow: str
    task: str
    seq: int
    attempt: int


@attrs.define
class AttemptEnded:
    """A handler's attempt ended, and how; `error` is what it raised (None on success).

    `claim_lost`: it ended ABANDONED because its claim was taken (a sweeper
    released it): the sweeper's `ClaimsSwept` is what counts that attempt.
    """

    run_id: uuid.UUID
    workflow: str
    task: str
    seq: int
    attempt: int
    outcome: Outcome
    seconds: float
    error: BaseException | None = None
    claim_lost: bool = False


@attrs.define
class RunFinished:
    """A run this process executed or started reached a terminal status here:
    SUCCEEDED or PARKED written by it, or CANCELLED seen by the execution the
    cancel stopped. (A run cancelled while no process executes it is announced
    nowhere: the `Admin` that cancelled it has no events.)"""

    run_id: uuid.UUID
    workflow: str
    status: Status


@attrs.define
class ClaimLost:
    """A fenced write matched nothing: another executor owns the run; this one stopped."""

    run_id: uuid.UUID
    workflow: str


@attrs.define
class FinishHandedOver:
    """A worker's run's last task succeeded and its thread is about to hand the finishing
    write to the worker's completer: the handler's thread is done with the execution,
    and its remaining events (`AttemptEnded` and the rest) follow on the completer
    thread that writes it (on the handler's, once the completer has stopped) once
    that write has committed."""

    run_id: uuid.UUID
    workflow: str


@attrs.define
class ExecutionEnded:
    """An execution of a run in this process ended, however: finished, parked,
    released for a retry or a shutdown, cancelled, or its claim lost. The last event
    of an execution, on its thread (after `FinishHandedOver`, the completer thread
    that wrote its finish, unless the completer had stopped)."""

    run_id: uuid.UUID
    workflow: str


@attrs.define
class SweptAttempt:
    """The abandoned attempt a sweep counted: its run, workflow, task, seq, and the
    task's attempt count with it."""

    run_id: uuid.UUID
    workflow: str
    task: str
    seq: int
    attempts: int


@attrs.define
class ClaimsSwept:
    """A sweeper released these runs' stale claims, counting an abandoned attempt each
    (`attempts`: which)."""

    run_ids: tuple[uuid.UUID, ...]
    attempts: tuple[SweptAttempt, ...] = ()


Event = (
    RunStarted
    | RunClaimed
    | AttemptBegan
    | AttemptEnded
    | RunFinished
    | FinishHandedOver
    | ExecutionEnded
    | ClaimLost
    | ClaimsSwept
)

Subscriber = Callable[[Event], None]

LOOK_EVERY = 1.0
"""The shortest time, in seconds, between two calls of the lookouts (`Events.watch`)."""


class Events:
    """A manager's announcements: `subscribe(fn)`, then `fn(event)` for each event."""

    def __init__(self, log: EngineLog) -> None:
        self._log = log
        self._subscribers: tuple[Subscriber, ...] = ()
        self._lock = threading.Lock()
        self.active = False
        """True while anyone listens: check it before building an event."""
        self._lookouts: tuple[Callable[[], object], ...] = ()
        self._next_look = -float("inf")  # monotonic

    def subscribe(self, subscriber: Subscriber) -> Callable[[], None]:
        """Call `subscriber(event)` for every event from now on; returns the unsubscribe."""

        def unsubscribe() -> None:
            with self._lock:
                self._subscribers = tuple(s for s in self._subscribers if s is not subscriber)
                self.active = bool(self._subscribers)

        with self._lock:
            self._subscribers = (*self._subscribers, subscriber)
            self.active = True
        return unsubscribe

    def watch(self, lookout: Callable[[], object]) -> Callable[[], None]:
        """Call `lookout()` from `look()` at most every `LOOK_EVERY` seconds, until the
        returned stop is called: for a would-be subscriber with nothing to do yet (a
        tracer without an SDK), which subscribes once it has, while no event is built
        for it meanwhile. Lookouts may be called from several threads at once, and a
        look already under way may call one once more after its stop."""

        def stop() -> None:
            with self._lock:
                self._lookouts = tuple(w for w in self._lookouts if w is not lookout)

        with self._lock:
            self._lookouts = (*self._lookouts, lookout)
        return stop

    def look(self) -> None:
        """Call the lookouts when their time has come (the executor calls this as each
        execution begins); an exception of one is logged, never raised."""
        if not self._lookouts:
            return
        now = time.monotonic()
        if now < self._next_look:
            return
        self._next_look = now + LOOK_EVERY
        for lookout in self._lookouts:
            try:
                lookout()
            except Exception:
                self._log.exception("an event lookout raised")

    def emit(self, event: Event) -> None:
        """Hand `event` to every subscriber; an exception of one is logged, never raised.

        An interrupt (`SystemExit`, `KeyboardInterrupt`) that a subscriber raises is
        raised here, but only once every other subscriber has had the event: one that
        missed it would keep a wrong picture from then on (tracing that misses a run's
        `FinishHandedOver` never ends its spans). A second interrupt is logged."""
        interrupt: BaseException | None = None
        for subscriber in self._subscribers:
            try:
                subscriber(event)
            except BaseException as e:
                if interrupt is None and not isinstance(e, Exception):
                    interrupt = e
                else:
                    self._log.exception("an event subscriber raised on %s", type(event).__name__)
        if interrupt is not None:
            raise interrupt
