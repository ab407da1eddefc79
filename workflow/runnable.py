"""A runnable: the poller, sweeper, pruner, scheduler and listener over one manager's executor.

What happens at stop (and at SIGTERM, which the worker CLI turns into `stop()`):
the listener and the poller stop, so nothing new is claimed; then the executor
drains (`Executor.drain`): no attempt begins, every in-flight handler sees
`cancelled`, and each execution records its attempt (a success is persisted, a
failure caused by the shutdown is not counted) and releases its claim for
immediate re-claim, and the finishes handed to the poller's completer are
written; then the completer, the sweeper and the pruner stop. One deadline bounds the
whole stop. A stop interrupted part-way (Ctrl-C) tells what is left to stop without
waiting; a Ctrl-C that ends `run()` drains first, unless a stop had already begun.
`stop()` may be called from a signal handler, even one that lands inside `start()`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from workflow.config import RunnerSettings
from workflow.durations import Duration, seconds, time_left, wait_in_slices
from workflow.errors import WorkflowError
from workflow.executor import Executor, refuse_inside_handler
from workflow.listener import Listener
from workflow.poller import Poller
from workflow.pruner import Pruner
from workflow.scheduler import Scheduler
from workflow.service import Service
from workflow.sweeper import Sweeper

UNDO_PATIENCE = 10.0  # seconds a failed start() waits, in all, for what it started to stop


class Runnable:
    """Drains runs left in the tables: build with `Manager.new_runnable(RunnerConfig(...))`.

    `run()` blocks until `stop()`; `start()` returns at once. `stop()` drains the
    whole manager: no new claims or launches, in-flight attempts finish and are
    recorded, claims are released.
    """

    def __init__(
        self,
        executor: Executor,
        settings: RunnerSettings,
        *,
        conninfo: str,
        kwargs: dict[str, Any],
        check: Callable[[], None],
        start_tx: Callable[..., Any] | None = None,
    ) -> None:
        self._executor = executor
        self._settings = settings
        self._check = check
        self._poller = Poller(executor, settings)
        self._sweeper = (
            Sweeper(executor, settings.sweep_interval, self._poller.wake)
            if settings.sweep_enabled
            else None
        )
        self._pruner = (
            Pruner(executor, settings.retention, settings.prune_interval)
            if settings.prune_enabled
            else None
        )
        self._scheduler = (
            Scheduler(executor, executor.registry.schedules(), start_tx, self._poller.wake)
            if start_tx is not None
            else None
        )
        self._listener = (
            Listener(
                executor.store,
                executor.log,
                conninfo,
                kwargs,
                executor.registry.names(),
                self._poller.wake,
                executor.heartbeat.check_soon,
            )
            if settings.listen
            else None
        )
        self._stopped = threading.Event()  # stop() has begun: start() does nothing
        self._done = threading.Event()  # stop() has drained: run() returns
        self._started = False
        self._failed: BaseException | None = None  # what a start() that failed raised
        # Reentrant: a signal handler calling stop() runs on the thread that may be
        # inside start() holding it.
        self._lock = threading.RLock()

    @property
    def sweeper(self) -> Sweeper | None:
        """The sweeper, or None when sweeping is disabled."""
        return self._sweeper

    @property
    def pruner(self) -> Pruner | None:
        """The pruner, or None when pruning is disabled."""
        return self._pruner

    @property
    def scheduler(self) -> Scheduler | None:
        """The scheduler (with no schedules it only marks removed ones orphaned)."""
        return self._scheduler

    def start(self) -> None:
        """Start the poller, sweeper and listener threads; returns at once.

        Safe from several threads at once (one set of services starts) and does
        nothing after `stop()`. Raises `WorkflowError` when the manager is closed
        or was built before a `fork()`. When a service's thread cannot start (the
        process is out of threads, say), the services already started are stopped
        and a `WorkflowError` that is also a `RuntimeError`, as Python raises, names
        the thread; from then on `start()` and `run()` raise
        `WorkflowError` (make another runnable). The manager is left as it was.
        """
        self._check()
        with self._lock:
            if self._failed is not None:
                raise WorkflowError(
                    f"this runnable could not start ({self._failed!r}): make another"
                    " with Manager.new_runnable()"
                ) from self._failed
            if self._started or self._stopped.is_set():
                return
            self._started = True
            services = (
                self._listener, self._sweeper, self._pruner, self._scheduler, self._poller
            )
            try:
                for service in services:
                    if service is not None:
                        service.start()
            except BaseException as e:
                self._failed = e
                self._undo_start(services)
                raise

    def _undo_start(self, services: tuple[Service | None, ...]) -> None:
        """Stop what a failed `start()` started (none has claimed a run: the poller
        never ran, and the listener and scheduler only wake it or insert)."""
        left = time_left(UNDO_PATIENCE)
        _stop_each(reversed(services), left)
        self._poller.completer.stop(left())

    def run(self) -> None:
        """Start, then block until `stop()` (from another thread or a signal) has drained.

        Interrupted (Ctrl-C's `KeyboardInterrupt` in the main thread, a signal
        handler's `SystemExit`), it drains as `stop()` does, then lets the exception
        go on: a second Ctrl-C cuts that drain short. When a `stop()` had already
        begun (a signal handler's, with its own timeout), it only tells what is left
        to stop, without waiting. Raises `WorkflowError` from inside a handler this
        manager executes (it would wait for a stop that waits for that handler).
        """
        refuse_inside_handler(self._executor, "run()")
        started = False
        try:
            self.start()
            started = True
            wait_in_slices(self._done.wait, None)  # a Ctrl-C meant for it gets through
        except BaseException as exc:
            # A start() that failed has undone itself; an interrupt anywhere stops.
            if started or not isinstance(exc, Exception):
                if self._stopped.is_set():
                    self._stop_without_waiting()
                else:
                    self.stop()
            raise

    def stop(self, timeout: Duration | None = None) -> bool:
        """Stop claiming, drain in-flight executions, stop the services.

        Blocks until in-flight attempts end, or until `timeout` seconds in all;
        True when all ended. Raises `ValueError` for a timeout that is not a
        finite duration, and `WorkflowError` when called from inside a handler
        this manager executes (it would wait for its own execution). Interrupted
        part-way (Ctrl-C while it waits), it still tells every service and
        execution to stop, without waiting, before the exception goes on; `run()`
        returns either way.
        """
        limit = None if timeout is None else seconds(timeout, "timeout")
        refuse_inside_handler(self._executor, "stop()")
        left = time_left(limit)
        try:
            with self._lock:  # a start() undoing a failure holds it for a while
                self._stopped.set()
            _stop_each((self._listener, self._scheduler, self._poller), left)
            drained = self._executor.drain(left())
            # The drain waited for the finishes handed to the completer too: none is left.
            self._poller.completer.stop(left())
            _stop_each((self._sweeper, self._pruner), left)
        except BaseException:
            self._stop_without_waiting()
            raise
        finally:
            self._done.set()
        return drained

    def _stop_without_waiting(self) -> None:
        """Tell everything `stop()` stops to stop, and return at once."""
        services = (self._listener, self._scheduler, self._poller, self._sweeper, self._pruner)
        _stop_each(services, lambda: 0.0)
        self._executor.drain(0.0)
        self._poller.completer.stop(0.0)


def _stop_each(services: Iterable[Service | None], left: Callable[[], float | None]) -> None:
    """Stop each service there is, in turn, within what `left()` says is left."""
    for service in services:
        if service is not None:
            service.stop(left())
