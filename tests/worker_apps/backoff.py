"""A workflow whose first task fails once and retries only after a long backoff.

The 6 s delay is above `max_in_process_backoff` (5 s by default), so the failing
executor releases its claim with `next_retry_at` set and any worker may resume it.
"""

from __future__ import annotations

import workflow

from .ledger import record

DELAY = 6

Flaky = workflow.Workflow("Ledger.Flaky", str)
flaky = workflow.Task("ledger.flaky", str)
after = workflow.Task("ledger.after")


def _flaky(run: workflow.TaskRun[str]) -> str:
    record(run, 1)
    if run.attempt == 1:
        raise RuntimeError("transient failure (first attempt)")
    return "ok"


def _after(run: workflow.TaskRun[str]) -> None:
    record(run, 2)


def registry() -> workflow.Registry:
    """A fresh registry with `Flaky`."""
    reg = workflow.Registry()
    reg.register(
        workflow.define(
            Flaky,
            workflow.handle(flaky, _flaky, backoff_schedule=[DELAY]),
            workflow.handle(after, _after),
        )
    )
    return reg
