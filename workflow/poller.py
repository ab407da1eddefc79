"""The poller: claims runs left for any process, oldest first, and executes them.

A claim is one statement (`FOR UPDATE SKIP LOCKED`, so pollers in many processes
never claim the same run) that also returns each run's task snapshot. It claims
only runs of workflows registered here, at most `batch_size` at a time and never
more than the free share of `concurrency`.
"""

from __future__ import annotations

import threading

from workflow.config import RunnerSettings
from workflow.executor import Engine, Job, execute
from workflow.runthreads import RunThreads
from workflow.service import Service


class Poller(Service):
    """Claims and executes runs until stopped; `wake()` polls at once."""

    name = "workflow-poller"

    def __init__(self, engine: Engine, settings: RunnerSettings) -> None:
        super().__init__()
        self._engine = engine
        self._settings = settings
        self._workflows = engine.registry.names()
        self._threads = RunThreads(settings.concurrency, "workflow-worker", engine.logger)
        self._in_flight = 0
        self._idle = threading.Condition()

    @property
    def in_flight(self) -> int:
        """Executions running now."""
        return self._in_flight

    def wait_idle(self, timeout: float | None) -> bool:
        """Block until no execution is in flight (or `timeout`); True when idle."""
        with self._idle:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout)

    def stop(self, timeout: float | None = None) -> None:
        """Stop claiming; in-flight executions go on (the manager drains them)."""
        super().stop(timeout)
        self._threads.shutdown(wait=False)

    def _loop(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            free = self._settings.concurrency - self._in_flight
            if free <= 0 or self._engine.draining.is_set():
                self._sleep(self._settings.poll_interval)
                continue
            limit = min(self._settings.batch_size, free)
            try:
                claimed = self._engine.store.claim_runs(self._workflows, limit)
            except Exception:
                failures += 1
                self._engine.logger.exception("workflow: poller: claiming runs failed")
                self._sleep(min(self._settings.poll_interval, 0.5 * 2 ** min(failures, 6)))
                continue
            failures = 0
            for run in claimed:
                with self._idle:
                    self._in_flight += 1
                try:
                    self._threads.submit(self._execute, Job(run=run))
                except RuntimeError:  # stop() gave up joining us and shut the pool down
                    with self._idle:
                        self._in_flight -= 1
                        self._idle.notify_all()
                    self._engine.store.release_claim(run.id, run.claim_id)
            if len(claimed) < limit:
                self._sleep(self._settings.poll_interval)

    def _execute(self, job: Job) -> None:
        try:
            execute(self._engine, job)
        finally:
            with self._idle:
                self._in_flight -= 1
                self._idle.notify_all()
            self.wake()
