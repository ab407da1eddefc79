"""The sweeper: releases claims whose executor stopped heartbeating, counting the attempt.

One guarded statement (`FOR UPDATE SKIP LOCKED`, re-checking staleness under the
row lock) releases a batch and bumps each current task's attempt count, so many
replicas may sweep at once and a crash loop still spends the budget.
"""

from __future__ import annotations

from collections.abc import Callable

from workflow.events import ClaimsSwept, SweptAttempt
from workflow.executor import Executor
from workflow.service import Service

_BATCH = 500


class Sweeper(Service):
    """Sweeps stale claims every `interval` seconds until stopped; `wake()`s after a sweep."""

    name = "workflow-sweeper"

    def __init__(self, executor: Executor, interval: float, wake: Callable[[], None]) -> None:
        super().__init__()
        self._executor = executor
        self._interval = interval
        self._wake_poller = wake

    def sweep(self) -> int:
        """Release every stale claim now; how many were released."""
        executor = self._executor
        max_age = executor.settings.sweep_max_age
        total = 0
        while True:
            swept = executor.store.sweep(max_age, _BATCH)
            for row in swept:
                executor.log.for_run(row.run_id).warning(
                    "released a stale claim (no heartbeat for %gs); the abandoned attempt counts",
                    max_age,
                )
            if swept and executor.events.active:
                executor.events.emit(
                    ClaimsSwept(
                        tuple(row.run_id for row in swept),
                        tuple(
                            SweptAttempt(row.run_id, row.workflow, row.task, row.seq, row.attempts)
                            for row in swept
                            if row.task is not None and row.seq is not None
                            and row.attempts is not None
                        ),
                    )
                )
            total += len(swept)
            if len(swept) < _BATCH:
                break
        if total:
            self._wake_poller()
        return total

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self.sweep()
            except Exception:
                self._executor.log.exception("sweeper: sweeping stale claims failed")
            self._sleep(self._interval)
