"""The run threads of the fast path and of each poller: a few threads taking jobs from one queue.

`concurrent.futures.ThreadPoolExecutor` does more per job than the fast path
needs: a `Future` with its `Condition`, and a Python-level semaphore taken on
submit and released after every job, both contended when many web threads start
runs at once. Here a submit is one short lock and one queue put, and a thread
back from a job takes one short lock.

A process out of threads (its limit of threads or of memory for their stacks) goes on
with the threads it has: when one more cannot start, the job waits for one of those
already running, and `capacity` tells the callers (the fast path's slots, the
poller's claims) to count on no more than those until a new one is tried
(`GROW_RETRY`, doubling up to `GROW_RETRY_MAX`), so that they do not take runs only to
give them back. Only a `RunThreads` that has no thread at all raises.

Exit keeps the executor's promise: at interpreter exit (and at `shutdown()`)
every thread gets a stop marker behind the jobs already queued, and exit waits
for the threads, so executions in flight finish rather than being cut off (a
worker's finishes handed to its completer are then written by the completer's own
exit hook).
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from workflow.errors import ThreadNotStarted
from workflow.logs import EngineLog
from workflow.service import start_thread

GROW_RETRY = 1.0
"""Seconds after a thread failed to start before another is tried (doubling after each
failed try, up to `GROW_RETRY_MAX`); meanwhile `capacity` is the threads running."""
GROW_RETRY_MAX = 60.0

CLOSED = "the fast path's threads are shut down"

Job = tuple[Callable[[Any], None], Any]

_live: weakref.WeakSet[RunThreads] = weakref.WeakSet()


class RunThreads:
    """Up to `size` threads, started on demand (or all at once, `start_all`), running
    submitted calls in order."""

    def __init__(self, size: int, name: str, log: EngineLog) -> None:
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._size = size
        self._name = name
        self._log = log
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads back from a job and not yet handed another
        self._waiting = 0  # jobs queued for whichever thread is back first
        self._starting = 0  # threads being started outside the lock (`_reserve`, `_start`)
        self._lock = threading.Lock()
        self._closed = False
        # After a thread failed to start: no other is tried before this (monotonic),
        # and the wait the next failure sets.
        self._grow_after: float | None = None
        self._grow_retry = GROW_RETRY
        _live.add(self)

    @property
    def capacity(self) -> int:
        """How many jobs can run at once: `size`, or, from a thread that failed to start
        until another is tried, the threads running (at least one)."""
        return self._size if self._may_grow() else len(self._threads)

    def _may_grow(self) -> bool:
        """Whether a new thread may be tried: none failed to start, or the retry is due."""
        after = self._grow_after
        return after is None or time.monotonic() >= after

    def start_all(self) -> None:
        """Start every thread now rather than one by one as jobs come: for a worker's
        poller, whose threads all work as soon as a backlog is found.

        A thread started on demand is started by the thread submitting the job, under
        the lock every thread back from a job takes; in a process busy with its other
        threads the new one can wait several switch intervals for the GIL before it
        runs, and the submitter and those threads wait with it (measured: the first
        half second of eight workers draining a backlog ran at a fraction of their
        rate). When the OS refuses a thread beside some started, this goes on as
        `submit` does (`capacity` is those, one warning); with none started it returns
        quietly, and the first `submit` raises as it would have.

        Each thread is started outside the lock (a signal handler calling `shutdown()`
        on this thread meanwhile must not wait for it) and counted under it; one
        counted after a `shutdown()` gets its own stop marker. A thread started and
        then interrupted (Ctrl-C in the wait for it) is counted before the interrupt
        goes on up.
        """
        refused: tuple[ThreadNotStarted, float] | None = None
        while True:
            with self._lock:
                if (self._closed or len(self._threads) + self._starting >= self._size
                        or not self._may_grow()):
                    break
                number = self._reserve()
            exc = self._start(number, None)
            if exc is not None:
                with self._lock:
                    if self._threads:
                        refused = self._refused(exc)
                break
        if refused is not None:
            self._warn_refused(refused, len(self._threads))

    def _reserve(self) -> int:
        """Under the lock: a place for one more thread, which `_start` starts; its number."""
        number = len(self._threads) + self._starting
        self._starting += 1
        return number

    def _start(self, number: int, job: Job | None) -> ThreadNotStarted | None:
        """Start the thread of a place `_reserve` gave, outside the lock; the OS's
        refusal, or None. Counted under the lock once it runs, then given `job` (queued
        for it; RuntimeError if `shutdown()` came meanwhile, the thread then stopping
        by a marker of its own) or, with None, free for the next job. A thread started
        and then interrupted (Ctrl-C in the wait for it) is counted, free, before the
        interrupt goes on up, and `job` is not queued."""
        thread = threading.Thread(
            target=self._serve, name=f"{self._name}_{number}", daemon=True
        )
        try:
            start_thread(thread)
        except ThreadNotStarted as exc:
            with self._lock:
                self._starting -= 1
            return exc
        except BaseException:
            with self._lock:
                self._starting -= 1
                if thread.ident is not None:  # started, then interrupted
                    self._count(thread)
                    self._back()
            raise
        with self._lock:
            self._starting -= 1
            self._count(thread)
            if job is None:
                self._back()
            elif self._closed:
                raise RuntimeError(CLOSED)
            else:
                self._queue.put(job)
        return None

    def _count(self, thread: threading.Thread) -> None:
        """Under the lock: `thread` has started; after `shutdown()` it is told to stop."""
        self._threads.append(thread)
        self._grow_after = None
        self._grow_retry = GROW_RETRY
        if self._closed:
            self._queue.put(None)

    def _back(self) -> None:
        """Under the lock: a thread is free, for a job queued meanwhile or idle."""
        if self._waiting:
            self._waiting -= 1
        else:
            self._idle += 1

    def _refused(self, exc: ThreadNotStarted) -> tuple[ThreadNotStarted, float] | None:
        """Under the lock, a thread refused beside running ones: no other is tried for a
        while; the refusal and that wait if it is the first since a thread last started
        (said once), else None."""
        first = self._grow_after is None
        wait = self._grow_retry
        self._grow_after = time.monotonic() + wait
        self._grow_retry = min(2 * wait, GROW_RETRY_MAX)
        return (exc, wait) if first else None

    def _warn_refused(self, refused: tuple[ThreadNotStarted, float], running: int) -> None:
        exc, wait = refused
        self._log.warning(
            "%s: can't start a new thread (%s); going on with %d of %d, trying again "
            "in %gs, later less often", self._name, exc, running, self._size, wait,
        )

    def submit(self, fn: Callable[[Any], None], arg: Any) -> None:
        """Run `fn(arg)` on a thread; RuntimeError after `shutdown()`, and
        `ThreadNotStarted` when there is no thread and none can start.

        The job is queued under the lock that checks for shutdown, so it is
        queued ahead of the threads' stop markers or refused, never lost behind them.
        When every thread is busy and no other can start, it waits for one of them.
        A thread it needs is started outside the lock, as `start_all`'s are: the
        threads coming back from jobs do not wait for it, nor does a signal handler's
        `shutdown()` on this thread.
        """
        job = (fn, arg)
        with self._lock:
            if self._closed:
                raise RuntimeError(CLOSED)
            if self._idle > 0:
                self._idle -= 1
                self._queue.put(job)
                return
            if len(self._threads) + self._starting >= self._size or not self._may_grow():
                self._waiting += 1  # all are busy: the next one back takes the job
                self._queue.put(job)
                return
            number = self._reserve()
        exc = self._start(number, job)
        if exc is None:
            return
        with self._lock:
            if not self._threads:
                raise exc  # none runs: nothing is queued, a later submit tries again
            refused = self._refused(exc)
            if self._closed:
                raise RuntimeError(CLOSED)
            self._waiting += 1  # refused beside running ones: it waits for one of them
            self._queue.put(job)
            running = len(self._threads)
        if refused is not None:
            self._warn_refused(refused, running)

    def _serve(self) -> None:
        get = self._queue.get
        while True:
            item = get()
            if item is None:
                return
            fn, arg = item
            try:
                fn(arg)
            except BaseException:
                self._log.exception("a run thread's job raised")
            del item, fn, arg
            with self._lock:
                self._back()  # it takes a job queued while every thread was busy, or idles

    @property
    def closed(self) -> bool:
        """Whether jobs are refused (`shutdown()`, or interpreter exit)."""
        return self._closed

    def shutdown(self, wait: bool = False, timeout: float | None = None) -> None:
        """Refuse new jobs; each thread stops after the jobs already queued.

        With `wait`, block until the threads have stopped (up to `timeout` each).
        """
        with self._lock:
            if not self._closed:
                self._closed = True
                for _ in self._threads:
                    self._queue.put(None)
            threads = list(self._threads)
        if wait:
            current = threading.current_thread()
            for thread in threads:
                if thread is not current and thread.is_alive():
                    thread.join(timeout)


def _forget_after_fork() -> None:
    # A child has none of the parent's threads (and its copy of their lock may
    # be held): its exit must not wait on them.
    _live.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def wait_for_run_threads() -> None:
    """Refuse new jobs and wait for every live `RunThreads`' jobs (at interpreter exit)."""
    for threads in list(_live):
        threads.shutdown(wait=True)


@atexit.register
def _finish_at_exit() -> None:
    # The threads are daemons, so they do not hold the interpreter open by
    # themselves; atexit runs while they still can, and waits for their jobs. (A
    # worker's jobs may end by handing their last write to a completer: completer.py
    # waits for these threads too, then for its own writes.)
    wait_for_run_threads()
