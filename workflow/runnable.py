"""A worker: the poller, the sweeper and the listener over one manager."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from workflow.config import RunnerConfig, RunnerSettings
from workflow.durations import Duration, seconds
from workflow.listener import Listener
from workflow.poller import Poller
from workflow.sweeper import Sweeper

if TYPE_CHECKING:
    from workflow.manager import Manager


class Runnable:
    """Drains runs left in the tables: build with `Manager.new_runnable(RunnerConfig(...))`.

    `run()` blocks until `stop()`; `start()` returns at once. `stop()` drains the
    whole manager: no new claims or launches, in-flight attempts finish and are
    recorded, claims are released.
    """

    def __init__(self, manager: Manager, config: RunnerConfig) -> None:
        self._manager = manager
        self._settings = RunnerSettings.of(config)
        engine = manager._engine
        self._poller = Poller(engine, self._settings)
        self._sweeper = (
            Sweeper(engine, self._settings.sweep_interval, self._poller.wake)
            if self._settings.sweep_enabled
            else None
        )
        pool = manager._pool
        conninfo = pool.conninfo() if callable(pool.conninfo) else pool.conninfo
        kwargs = pool.kwargs() if callable(pool.kwargs) else pool.kwargs
        self._listener = (
            Listener(
                engine,
                conninfo,
                dict(kwargs or {}),
                engine.registry.names(),
                self._poller.wake,
            )
            if self._settings.listen
            else None
        )
        self._stopped = threading.Event()
        self._started = False

    @property
    def sweeper(self) -> Sweeper | None:
        """The sweeper, or None when sweeping is disabled."""
        return self._sweeper

    def start(self) -> None:
        """Start the poller, sweeper and listener threads; returns at once."""
        self._manager._check_usable()
        if self._started:
            return
        self._started = True
        for service in (self._listener, self._sweeper, self._poller):
            if service is not None:
                service.start()

    def run(self) -> None:
        """Start, then block until `stop()` is called (from another thread or a signal)."""
        self.start()
        self._stopped.wait()

    def stop(self, timeout: Duration | None = None) -> bool:
        """Stop claiming, drain in-flight executions, stop the services.

        Blocks until in-flight attempts end (or `timeout`); True when all ended.
        """
        limit = None if timeout is None else seconds(timeout, "timeout")
        deadline = None if limit is None else time.monotonic() + limit
        for service in (self._listener, self._poller):
            if service is not None:
                service.stop(limit)
        drained = self._manager._drain(limit)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        drained = self._poller.wait_idle(left) and drained
        if self._sweeper is not None:
            self._sweeper.stop(limit)
        self._stopped.set()
        return drained
