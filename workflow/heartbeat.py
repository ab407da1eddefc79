"""Keeping this process's claims alive, and setting `cancelled` at deadlines and cancels.

One `Heartbeat` per manager: a thread that refreshes every live claim in a single
statement per tick. A claim whose attempt is past its deadline is no longer
heartbeated, so a handler hung past its timeout is reclaimed by a sweeper after
`sweep_max_age`. Every `CHECK_EVERY` second (or at once, on a cancellation
notice) it also reads whether its claims are still held: a claim the database
no longer shows was lost (swept, taken) or its run was cancelled; its `Claim` is
cancelled and its execution ends without writing.
"""

from __future__ import annotations

import math
import threading
import time
import uuid

from workflow.logs import EngineLog
from workflow.service import Service
from workflow.store import Store

DEADLINE = "deadline"
LOST = "lost"
CANCELLED = "cancelled"
SHUTDOWN = "shutdown"

_GONE = (LOST, CANCELLED)
"""Reasons that end the claim for good: they outrank the others."""

CHECK_EVERY = 1.0
"""Seconds between reads of whether this process's claims are still held, so a
handler sees `cancelled` within about a second of its run being cancelled."""


class CancelEvent(threading.Event):
    """A `threading.Event` that makes its condition (a lock and a waiters' queue) only
    when first waited on, set or cleared.

    Every execution's claim carries one, and most are never touched: a worker's runs
    mostly end without a deadline passing, a cancel or a shutdown, and most handlers
    never wait on `cancelled`. Making an Event's condition costs about 3 us, a few
    per cent of the Python a worker spends on a one-task job. `is_set()` reads the
    flag, as an Event's does; every other method is the Event's own, which reaches
    the condition through `_cond` and the flag through `_flag` (so in CPython 3.10 to
    3.13; tests/test_heartbeat.py fails should that change).
    """

    def __init__(self) -> None:  # not the Event's: its condition is what costs
        self._flag = False

    @property
    def _cond(self) -> threading.Condition:
        made: threading.Condition | None = self.__dict__.get("_made")
        if made is None:
            # Threads making their first use at once may each make one, but setdefault
            # stores only the first and hands it to all. No lock of the module's: one
            # held by another thread at a fork() would stay held in the child.
            made = self.__dict__.setdefault("_made", threading.Condition(threading.Lock()))
        return made


class Claim:
    """A claim on one run, held by one execution in this process.

    Its `cancelled` event is the one the current attempt's handler sees; `reason`
    says why it was set (DEADLINE, SHUTDOWN, LOST, CANCELLED: the run was).
    """

    def __init__(self, run_id: uuid.UUID, claim_id: uuid.UUID) -> None:
        self.run_id = run_id
        self.claim_id = claim_id
        self.cancelled: threading.Event = CancelEvent()
        self.deadline = math.inf
        self.reason: str | None = None
        self.leaving = False
        self._lock = threading.Lock()

    def leave(self) -> None:
        """The execution's next write lets go of the claim (it finishes, parks or
        releases the run): from now on a check that finds the claim gone is seeing
        that write, not another executor's claim. The write's own fence still tells
        the execution whether it held the claim."""
        self.leaving = True

    def begin_attempt(self, deadline: float) -> threading.Event:
        """A fresh `cancelled` event for an attempt ending at `deadline` (monotonic)."""
        with self._lock:
            if self.reason in (LOST, CANCELLED, SHUTDOWN):
                event = self.cancelled
            elif self.cancelled.is_set():
                self.reason = None
                event = self.cancelled = CancelEvent()
            else:
                event = self.cancelled
            self.deadline = deadline
        return event

    def expire(self, now: float) -> bool:
        """Cancel the attempt (reason DEADLINE) if its deadline is at or before `now`.

        The deadline is read under the claim's lock, so an attempt that ended
        and gave way to the next one since the caller looked is left alone.
        True when the current attempt is past its deadline.
        """
        with self._lock:
            if self.deadline > now:
                return False
            if self.reason not in (LOST, CANCELLED, SHUTDOWN) and not self.cancelled.is_set():
                self.reason = DEADLINE
                self.cancelled.set()
            return True

    def end_attempt(self) -> None:
        """The attempt is over: heartbeat the claim again while the executor goes on."""
        with self._lock:
            self.deadline = math.inf

    def cancel(self, reason: str) -> None:
        """Set `cancelled`; a lost claim or a cancel outranks a shutdown, which outranks
        a deadline."""
        with self._lock:
            if self.reason in (*_GONE, SHUTDOWN) and reason == DEADLINE:
                return
            if self.reason not in _GONE:
                self.reason = reason
            self.cancelled.set()

    @property
    def lost(self) -> bool:
        """True once the claim is known to be gone (another executor's, or the run cancelled)."""
        return self.reason in _GONE


class Heartbeat(Service):
    """The manager's heartbeat thread: `start()`, `add()`/`remove()` claims, `stop()`."""

    name = "workflow-heartbeat"

    def __init__(self, store: Store, interval: float, log: EngineLog) -> None:
        super().__init__()
        self._store = store
        self._interval = interval
        self._log = log
        self._claims: dict[uuid.UUID, Claim] = {}
        self._lock = threading.Lock()
        self._next_wake = math.inf
        self._check_now = False

    def check_soon(self, run_id: object = None) -> None:
        """Read at once whether the claims are still held (a cancellation notice came)."""
        self._check_now = True
        self._wake.set()

    def add(self, claim: Claim) -> None:
        """Heartbeat this claim until `remove`, and check it about every second."""
        with self._lock:
            self._claims[claim.claim_id] = claim
        # An idle thread sleeps until its next beat: wake it to plan the checks.
        if self._next_wake > time.monotonic() + CHECK_EVERY:
            self._wake.set()

    def remove(self, claim: Claim) -> None:
        """Stop heartbeating this claim."""
        with self._lock:
            self._claims.pop(claim.claim_id, None)

    def watch_deadline(self, deadline: float) -> None:
        """Make sure the thread wakes by `deadline` to set `cancelled` on time."""
        # While the thread is awake `_next_wake` is infinite, so a deadline added
        # after its scan still wakes it.
        if deadline < self._next_wake:
            self._wake.set()

    def claims(self) -> list[Claim]:
        """The claims held now."""
        with self._lock:
            return list(self._claims.values())

    def _loop(self) -> None:
        next_beat = time.monotonic() + self._interval
        next_check = time.monotonic() + CHECK_EVERY
        while not self._stopping.is_set():
            self._next_wake = math.inf
            now = time.monotonic()
            earliest = math.inf
            claims = self.claims()
            for claim in claims:
                if not claim.expire(now):
                    earliest = min(earliest, claim.deadline)
            if now >= next_beat:
                self._beat(now)
                self._tidy()
                next_beat = time.monotonic() + self._interval
                next_check = time.monotonic() + CHECK_EVERY
            elif claims and (self._check_now or now >= next_check):
                self._check_now = False
                self._check(claims)
                next_check = time.monotonic() + CHECK_EVERY
            planned = min(next_beat, earliest, next_check if claims else math.inf)
            self._next_wake = planned
            self._wake.wait(max(0.0, planned - time.monotonic()))
            self._wake.clear()

    def _tidy(self) -> None:
        try:
            self._store.tidy()
        except Exception:
            self._log.exception("returning idle connections to the pool failed")

    def _check(self, claims: list[Claim]) -> None:
        """Cancel the claims the database no longer shows as held (CANCELLED when their run was)."""
        try:
            state = self._store.check_claims([(claim.run_id, claim.claim_id) for claim in claims])
        except Exception:
            self._log.exception("checking %d claims failed", len(claims))
            return
        with self._lock:
            current = set(self._claims)
        for claim in claims:
            held, cancelled = state.get(claim.claim_id, (False, False))
            if held or claim.claim_id not in current or claim.lost or claim.leaving:
                continue
            log = self._log.for_run(claim.run_id)
            if cancelled:
                log.info("the run was cancelled; its handler sees cancelled")
                claim.cancel(CANCELLED)
            else:
                log.warning("claim lost (another executor owns the run); stopping")
                claim.cancel(LOST)

    def _beat(self, now: float) -> None:
        live = [claim for claim in self.claims() if claim.deadline > now]
        if not live:
            return
        try:
            held = self._store.heartbeat([claim.claim_id for claim in live])
        except Exception:
            self._log.exception("heartbeat of %d claims failed", len(live))
            return
        missing = [claim for claim in live if claim.claim_id not in held]
        if missing:
            self._check(missing)  # lost, or cancelled: the check tells which
