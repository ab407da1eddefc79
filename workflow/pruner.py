"""The pruner: deletes finished runs past their retention, in committed batches.

Every `prune_interval` a worker deletes, for each status `Retention` keeps for a
while, the runs finished longer ago than that, with their tasks and history,
oldest first, a batch per statement. Each batch is an index scan over finished
runs only (`workflow_runs_finished`) that skips rows others hold, so it never
blocks a claim and many workers may prune at once.
"""

from __future__ import annotations

from workflow.config import Retention
from workflow.executor import Executor
from workflow.service import Service

BATCH = 1000
"""Runs deleted per statement (each its own transaction)."""


class Pruner(Service):
    """Prunes finished runs every `interval` seconds until stopped."""

    name = "workflow-pruner"

    def __init__(self, executor: Executor, retention: Retention, interval: float) -> None:
        super().__init__()
        self._executor = executor
        self._retention = retention
        self._interval = interval

    def prune(self) -> int:
        """Delete every run past its retention now; how many."""
        store = self._executor.store
        total = 0
        for status, age in self._retention.ages().items():
            while not self._stopping.is_set():
                deleted = store.prune_runs(status, age, BATCH)
                total += deleted
                if deleted < BATCH:
                    break
        if total:
            self._executor.log.info("pruner: deleted %d finished runs past their retention", total)
        return total

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self.prune()
            except Exception:
                self._executor.log.exception("pruner: pruning finished runs failed")
            self._sleep(self._interval)
