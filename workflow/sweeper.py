"""The sweeper: releases claims whose executor stopped heartbeating, counting the attempt.

One guarded statement (`FOR UPDATE SKIP LOCKED`, re-checking staleness under the
row lock) releases a batch and bumps each current task's attempt count, so many
replicas may sweep at once and a crash loop still spends the budget.
"""

from __future__ import annotations

from collections.abc import Callable

from workflow.executor import Engine
from workflow.service import Service

_BATCH = 500


class Sweeper(Service):
    """Sweeps stale claims every `interval` seconds until stopped."""

    name = "workflow-sweeper"

    def __init__(self, engine: Engine, interval: float, swept: Callable[[], None]) -> None:
        super().__init__()
        self._engine = engine
        self._interval = interval
        self._swept = swept

    def sweep(self) -> int:
        """Release every stale claim now; how many were released."""
        engine = self._engine
        total = 0
        while True:
            run_ids = engine.store.sweep(engine.settings.sweep_max_age, _BATCH)
            for run_id in run_ids:
                engine.logger.warning(
                    "workflow: run %s: released a stale claim (no heartbeat for %gs); the "
                    "abandoned attempt counts",
                    run_id,
                    engine.settings.sweep_max_age,
                    extra={"run_id": str(run_id)},
                )
            total += len(run_ids)
            if len(run_ids) < _BATCH:
                break
        if total:
            self._swept()
        return total

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self.sweep()
            except Exception:
                self._engine.logger.exception("workflow: sweeper: sweeping stale claims failed")
            self._sleep(self._interval)
