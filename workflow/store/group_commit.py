"""Group commit: writes that several threads of one process make at the same moment
share one statement and one commit. The store uses it for task steps and for the
fast path's starts.

A write that arrives while no write of its kind is in flight is made at once,
alone, by its own thread (so a lone run, or one thread, waits for nothing more than
its own round trip). So is a write that arrives while one other write is in flight
alone and none queues: two threads' writes then ride side by side instead of one
waiting out the other's round trip to be made alone anyway (`flights`). Any other
write queues: behind a combined statement in flight, behind a queue that has
formed, or behind `flights` writes. When the last write in flight ends, the first
of the queue is woken to make the whole queue in one statement (the others are
woken with their answers when it ends); a write in flight that ends while another
still is leaves the queue to that one, so under load the writes collapse into one
flight of ever larger statements, as they would with one. Each caller gets its
own answer: for a task step, whether *its* claim matched. A write waiting in the
queue that is interrupted (Ctrl-C on the main thread) waits on, makes the queue if
it is handed it, and raises the interrupt then: the writes behind it never wait on
a thread that went away.

A combined statement that fails for any reason (a lost connection, a row the
server refuses, a deadlock) is followed by the same writes made again one by one,
each by its own caller's thread and told that an earlier try may have landed (so it
first looks for what that try did): one bad row cannot fail another caller, a write
whose reply was lost is not taken for one that never happened, and no caller waits
behind another's retries. Nothing returns to a caller before its write has
committed: a run never moves to its next task on an output that is not durable.

A combined statement whose connection was lost may still be running on the server
(waiting on a row lock, say) and commit after its writer gave up on it. So before
the writes are made again, `combined` itself waits it out: the store's combined
statements hold an advisory lock of their own for their transaction, and the store
waits for that lock (and, for steps that claimed runs, lets go of those) before it
raises. That wait is the one thing every caller of the batch, and every write queued
behind it, waits for: at most `store.OUTLAST_PATIENCE` seconds, after which the
store terminates the statement's backend, plus the ride over a lost connection any
statement makes while the database is unreachable.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from workflow.logs import EngineLog

__all__ = ["FLIGHTS", "GroupCommit"]

FLIGHTS = 2
"""How many lone writes of one kind may be in flight at once (combined statements are
one at a time). Measured on the typed 3-task fast path against one flight
(bench/README.md): 1.2-1.4x the runs/s at 2 threads, 1.0-1.2x at 4, no change
from 8 up nor for a worker's finishes (the queue forms, and one flight carries
it)."""

_Params = dict[str, Any]
T = TypeVar("T")


class _Write(Generic[T]):
    """One caller's write: its parameters, its answer, and the latch it waits on."""

    __slots__ = ("again", "answer", "batch", "error", "latch", "params", "woken")

    # Set only when the write queues: the one made at once never waits on a latch.
    latch: threading.Lock

    def __init__(self, params: _Params) -> None:
        self.params = params
        self.answer: T | None = None
        self.error: BaseException | None = None
        # Set when this write is woken to make a batch (itself first) rather than
        # with its answer.
        self.batch: list[_Write[T]] | None = None
        # Set when the combined statement it was in failed: its own thread makes it
        # again, alone.
        self.again = False
        # Set, before its latch is let go of, when it is woken (to make a batch or
        # with its answer).
        self.woken = False


class GroupCommit(Generic[T]):
    """Makes writes of one kind alone when little else is in flight, together when more is.

    `single(params, may_have_landed)` makes one write (riding out lost connections
    itself, and first looking for what an earlier try did when `may_have_landed`)
    and returns its answer; `combined(batch)` makes several in one statement, one
    try, and returns their answers in the same order. `what` names the writes in
    the log; `flights` is how many lone writes may be in flight at once.
    """

    def __init__(
        self,
        single: Callable[[_Params, bool], T],
        combined: Callable[[list[_Params]], list[T]],
        log: EngineLog,
        what: str,
        flights: int = FLIGHTS,
    ) -> None:
        if flights < 1:
            raise ValueError(f"flights must be at least 1, not {flights}")
        self._single = single
        self._combined = combined
        self._log = log
        self._what = what
        self.flights = flights
        """How many lone writes may be in flight at once; change it only while none is."""
        self._lock = threading.Lock()
        self._flying = 0  # writes and statements in flight
        self._combining = False  # whether one of them is a combined statement
        self._queue: list[_Write[T]] = []
        self.flushes = 0
        """Statements made (alone or combined), for tests and benchmarks."""
        self.combined = 0
        """Writes that went in a combined statement."""

    @property
    def busy(self) -> bool:
        """Whether a write arriving now would queue (and join the next statement)."""
        with self._lock:
            return not self._may_fly()

    @property
    def in_flight(self) -> int:
        """How many statements (lone writes or combined ones) are in flight."""
        return self._flying

    def _may_fly(self) -> bool:
        """Whether a write arriving now is made at once (the lock held)."""
        if self._flying == 0:
            return True
        return self._flying < self.flights and not self._combining and not self._queue

    @property
    def queued(self) -> int:
        """How many writes wait for the last one in flight to end."""
        return len(self._queue)

    def write(self, params: _Params) -> T:
        """Make one write; its answer. Blocks until it has committed.

        Raises what making it alone raised (a closed pool, an error of the
        database's that is not a lost connection).
        """
        step: _Write[T] = _Write(params)
        with self._lock:
            lead = self._may_fly()
            if lead:
                self._flying += 1
            else:
                latch = step.latch = threading.Lock()
                latch.acquire()
                self._queue.append(step)
        if lead:
            self._flush([step])
        else:
            interrupt = self._wait(step)
            if step.batch is not None:
                self._flush(step.batch)
            if interrupt is not None:
                raise interrupt
        if step.again:
            self._alone(step, True)
        if step.error is not None:
            raise step.error
        return step.answer  # type: ignore[return-value]  # set when no error was

    @staticmethod
    def _wait(step: _Write[T]) -> BaseException | None:
        """Wait until `step` is woken; an interrupt meanwhile (Ctrl-C on the main thread)
        is held back until then and returned, for the caller to raise once it has made
        the batch it may have been handed: a write that stopped waiting would leave its
        queue unmade, and every later write of its kind waiting for ever. (`woken` is
        set before the latch is let go of, so while it is unset the latch is not this
        thread's yet, whichever bytecode the interrupt came at.)"""
        interrupt: BaseException | None = None
        while True:
            try:
                if not step.woken:
                    step.latch.acquire()
                return interrupt
            except BaseException as e:
                interrupt = interrupt or e

    def _flush(self, batch: list[_Write[T]]) -> None:
        """Make `batch` (its first write is the caller's), hand the queue on, wake the rest.

        The queue is handed on by the last write in flight to end (the lock orders the
        ends, so one of them always finds no other in flight): it stays in flight, as
        the queue's statement. When a combined statement fails, each of its writes is
        made again alone by its own caller's thread, in parallel: none waits behind
        another's retries.
        """
        try:
            if len(batch) == 1:
                self._alone(batch[0], False)
            else:
                self._together(batch)
        finally:
            with self._lock:
                self.flushes += 1
                if len(batch) > 1:
                    self._combining = False
                following: list[_Write[T]] = []
                if self._flying == 1:
                    following, self._queue = self._queue, []
                if not following:
                    self._flying -= 1
                elif len(following) > 1:
                    self._combining = True
            # Every write woken here queued, so it has its latch.
            if following:
                following[0].batch = following
                following[0].woken = True
                following[0].latch.release()
            for step in batch[1:]:
                step.woken = True
                step.latch.release()

    def _alone(self, step: _Write[T], may_have_landed: bool) -> None:
        try:
            step.answer = self._single(step.params, may_have_landed)
        except BaseException as e:
            step.error = e

    def _together(self, batch: list[_Write[T]]) -> None:
        try:
            answers = self._combined([step.params for step in batch])
            if len(answers) != len(batch):
                raise RuntimeError(f"{len(answers)} answers for {len(batch)} writes")
        except BaseException as e:
            if not isinstance(e, Exception):  # an interrupt: no step may pass for written
                for step in batch:
                    step.error = e
                raise
            self._log.warning(
                "a combined write of %d %s failed (%s); making them one by one",
                len(batch), self._what, e,
            )
            for step in batch:
                step.again = True
            return
        self.combined += len(batch)
        for step, answer in zip(batch, answers, strict=True):
            step.answer = answer
