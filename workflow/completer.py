"""A worker's completer: the finishing writes of its runs, made in batches by threads of
their own, so that a worker thread goes on with another run as soon as its run's last
handler has returned (River's batch completer is the model).

Without it a worker thread waits for its run's finish to commit before it can take
another run, and its run counts against `concurrency` until then: under load half a
worker's threads wait on the statement that carries their finishes while the other
half runs, so a worker drains at most `concurrency` runs per round trip of that
statement, often half of it (bench/README.md, "One worker's 16 threads").

Here a poller's execution of an unkeyed run whose last task succeeded hands its
finishing write to the completer (`hand`, which waits while the completer is full)
and ends: its thread and its place in `concurrency` are free from then on. Keyed
runs, and every run during a drain, write their last step as before. A thread of
the completer takes every finish handed to it that no statement carries yet and
writes them in one statement and one commit, which also claims a run for each place
they left free (`Store.finish_runs`). The completer has `FLIGHTS` such threads:
while one statement is on its way, the finishes handed over meanwhile go in a second
one at once instead of waiting for the first to commit. The claimed runs go to the
poller's threads (`deliver`), and each finished execution's end (its events, its
waiters, its count in flight) follows from the completer thread that wrote it, once
its write has committed (from the handing thread itself once the completer has
stopped: it writes the finish at once). At interpreter exit the completer writes
what it holds, after the run threads' jobs have ended.
Nothing is announced before its write commits, and a run's next task never begins
on an output that is not durable: only a run's *last* write is handed over.

Each finish still learns whether its own fence matched: one whose claim was lost
ends as lost, the others succeed. When the statement fails, what it may have claimed
is let go of and each finish is written again alone, first looking for what the
failed try did; one that cannot be written is counted as a failed attempt, as a
thread's own would be.

At most `limit` finishes are on their way at once (waiting for a statement, or in
one being written); a thread handing one more waits for room, so a worker holds
at most twice `concurrency` claims: its runs executing, and the finishes on their
way. A statement that ends wakes as many of the threads waiting for room as it made
room for, not all of them to find it full again (all of them once stopping: each
may have to write its own), and a first finish waiting for a statement wakes one of
the completer's threads, not both.

A drain (`Executor.drain`) waits for every finish handed over, as for any execution
in flight; `stop()` follows it.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from workflow.logs import EngineLog
from workflow.runthreads import wait_for_run_threads
from workflow.service import start_thread
from workflow.store import ClaimedRun, Store

FLIGHTS = 2
"""How many of a completer's statements may be on their way at once, each with the finishes
handed over since the last one left. With one, a worker draining a backlog of
one-task runs kept its completer writing nine tenths of the time (statements of about
nine finishes and nine claims, 1.7 ms each). With two, measured against one on
10,000-job drains (bench/README.md): 1.23x the jobs/s from one worker process
(medians of four drains each way; 1.13x in an earlier series of eight), 1.02x and
1.05x from four and eight, which keep a 2-core machine busy either way."""

EXIT_PATIENCE = 60.0
"""Seconds interpreter exit waits for a completer to write what it holds; after that
(a database unreachable, a row lock held by an idle transaction) exit goes on, and
the runs left claimed are released by a sweeper, which counts an attempt for each."""


class Finish(Protocol):
    """What the completer needs of an execution whose finishing write it makes."""

    params: dict[str, Any]
    """The write's parameters (`Store.step_params`)."""

    def resolve(self, answer: bool | Exception) -> None:
        """End the execution on what the write did: whether its claim matched, or the error
        that writing it raised. Raises nothing of its own."""


class Completer:
    """Writes the finishes handed to it in batches, claiming runs for the room they leave.

    `release()` frees the place of the run whose finish is being handed over (called
    on the handing thread before the finish can be taken, so a batch's claim sees
    it); `reserve(n)` takes up to `n` free places of the poller's `concurrency` (maybe
    none: it stops, or leaves this batch's places to its own loop) for the claim that
    rides with a batch; `deliver(runs, reserved)` hands the runs claimed to the
    poller's threads and frees the places left unused; `unsettled()` follows a batch in
    which a finish could not be written (its run, released for a retry, may fall due
    before the poller would otherwise read its next due time again). `reserve`,
    `deliver` and `unsettled` are called from up to `flights` threads at once,
    `release` from the handing threads.
    """

    name = "workflow-completer"

    def __init__(
        self,
        store: Store,
        log: EngineLog,
        workflows: Sequence[str],
        limit: int,
        release: Callable[[], None],
        reserve: Callable[[int], int],
        deliver: Callable[[list[ClaimedRun], int], None],
        unsettled: Callable[[], None] = lambda: None,
        flights: int = FLIGHTS,
    ) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, not {limit}")
        if flights < 1:
            raise ValueError(f"flights must be at least 1, not {flights}")
        self._store = store
        self._log = log
        self._workflows = tuple(workflows)
        self._limit = limit
        self._release = release
        self._reserve = reserve
        self._deliver = deliver
        self._unsettled = unsettled
        self._flights = flights
        self._pending: list[Finish] = []
        self._writing = 0  # finishes in the statements being written
        lock = threading.Lock()
        self._cond = threading.Condition(lock)  # the completer's threads wait on it
        self._room = threading.Condition(lock)  # the handing threads wait on it
        self._threads: list[threading.Thread] = []
        self._alive = 0  # threads that take finishes
        self._stopping = False
        self.statements = 0
        """Statements made, for tests and benchmarks."""
        _live.add(self)

    @property
    def pending(self) -> int:
        """How many finishes wait for the next statement."""
        return len(self._pending)

    def start(self) -> None:
        """Start the threads, once; does nothing after `stop()`. A thread that cannot
        start raises, and stops those started before it."""
        with self._cond:
            if self._threads or self._stopping:
                return
            for _ in range(self._flights):
                thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                try:
                    start_thread(thread)
                except BaseException:
                    self._stopping = True
                    self._cond.notify_all()
                    raise
                self._threads.append(thread)
                self._alive += 1

    def hand(self, finish: Finish) -> None:
        """Queue `finish` for the next statement; waits while `limit` are on their way.

        Once the completer stops taking finishes (it was never started, or it is
        stopping with none left), the finish is written at once on the caller's
        thread."""
        with self._cond:
            try:
                while len(self._pending) + self._writing >= self._limit and self._running():
                    self._room.wait()
                self._release()
            except BaseException:  # an interrupt: the wake-up it may have come with is passed on
                self._room.notify()
                raise
            if self._running():
                self._pending.append(finish)
                if len(self._pending) == 1:
                    self._cond.notify()
                return
        self._write([finish])

    def stop(self, timeout: float | None = None) -> None:
        """Stop once every finish handed over is written and resolved (waiting up to `timeout`)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            self._room.notify_all()
            threads = list(self._threads)
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def stop_at_exit(self, deadline: float) -> None:
        """`stop()` until `deadline` (monotonic); then log what is left for a sweeper."""
        self.stop(max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in self._threads):  # still writing
            self._log.warning(
                "exit: %d finishes not written after %gs; a sweeper will release their runs",
                len(self._pending) + self._writing, EXIT_PATIENCE,
            )

    def _running(self) -> bool:
        """Whether the threads take finishes (the lock held)."""
        return self._alive > 0 and not (self._stopping and not self._pending)

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._pending and not self._stopping:
                        self._cond.wait()
                    if not self._pending:
                        return
                    batch, self._pending = self._pending, []
                    self._writing += len(batch)
                    if self._stopping:  # nothing left to take: the waiting write their own
                        self._room.notify_all()
                try:
                    self._write(batch)
                finally:
                    with self._cond:
                        self._writing -= len(batch)
                        # Room for as many threads waiting to hand one (all of them once
                        # stopping: they may have to write their own).
                        if self._stopping:
                            self._room.notify_all()
                        else:
                            self._room.notify(len(batch))
        finally:
            left: list[Finish] = []
            with self._cond:
                self._alive -= 1
                if not self._alive:  # from now on `hand` writes on its caller's thread
                    left, self._pending = self._pending, []
                self._cond.notify_all()
                self._room.notify_all()
            if left:  # only after a failure of the loop itself: never leave one unwritten
                self._write(left)

    def _write(self, batch: list[Finish]) -> None:
        """One statement for `batch` (and a claim for the room it leaves), then each end.
        Raises nothing: every finish of the batch is resolved, whatever fails."""
        reserved = 0
        runs: list[ClaimedRun] = []
        answers: list[bool | Exception] = []
        try:
            reserved = self._reserve(len(batch))
            answers, runs = self._store.finish_runs(
                [finish.params for finish in batch], self._workflows, reserved
            )
            if len(answers) != len(batch):
                raise RuntimeError(f"{len(answers)} answers for {len(batch)} finishes")
        except Exception as e:  # finish_runs writes alone what fails together: a bug
            self._log.exception("writing %d finishing steps failed", len(batch))
            answers = [e] * len(batch)
        with self._cond:
            self.statements += 1
        try:
            self._deliver(runs, reserved)
        except BaseException:  # the batch's executions must end all the same
            self._log.exception("handing over the runs a batch claimed failed")
        for finish, answer in zip(batch, answers, strict=True):
            try:
                finish.resolve(answer)
            except BaseException:  # a subscriber's SystemExit, say: the others still end
                self._log.exception("ending an execution whose finish was written raised")
        if any(isinstance(answer, Exception) for answer in answers):  # a lost claim frees none
            try:
                self._unsettled()
            except Exception:
                self._log.exception("telling the poller of a finish not written raised")


_live: weakref.WeakSet[Completer] = weakref.WeakSet()


def _forget_after_fork() -> None:
    # A child has none of the parent's threads: its exit must not wait on them.
    _live.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


@atexit.register
def _finish_at_exit() -> None:
    # A process that exits without stopping its runnables (runthreads.py waits for the
    # run threads' jobs at exit) must not leave the finishes those jobs handed over
    # unwritten: a run that succeeded would be swept and charged a failed attempt. So
    # the run threads are waited for first (whichever exit hook runs first), then each
    # completer writes what it holds and stops.
    wait_for_run_threads()
    deadline = time.monotonic() + EXIT_PATIENCE
    for completer in list(_live):
        completer.stop_at_exit(deadline)
