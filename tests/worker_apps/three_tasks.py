"""A three-task workflow whose handlers record each execution in the ledger.

The input (`Plan`) can make one task hold: `hang` sleeps for an hour on its first
attempt (an executor to kill), `finish` works for `seconds` ignoring shutdown and
then succeeds, `cancellable` waits up to `seconds` for `cancelled` and then
raises `Cancelled`.
"""

from __future__ import annotations

import time

import attrs

import workflow

from .ledger import record


@attrs.frozen
class Plan:
    hold_seq: int = 0
    hold: str = ""
    seconds: float = 0.0


Three = workflow.Workflow("Ledger.Three", Plan)
first = workflow.Task("ledger.first", int)
second = workflow.Task("ledger.second", int)
third = workflow.Task("ledger.third")


def _hold(run: workflow.TaskRun[Plan], seq: int) -> None:
    plan = run.input
    if plan.hold_seq != seq:
        return
    if plan.hold == "hang" and run.attempt == 1:
        time.sleep(3600)
    elif plan.hold == "finish":
        time.sleep(plan.seconds)
        record(run, seq, "end")
    elif plan.hold == "cancellable":
        run.cancelled.wait(plan.seconds)
        record(run, seq, "end")
        run.raise_if_cancelled()


def _first(run: workflow.TaskRun[Plan]) -> int:
    record(run, 1)
    _hold(run, 1)
    return 1


def _second(run: workflow.TaskRun[Plan]) -> int:
    record(run, 2)
    assert run.output(first) == 1
    _hold(run, 2)
    return 2


def _third(run: workflow.TaskRun[Plan]) -> None:
    record(run, 3)
    assert run.output(second) == 2
    _hold(run, 3)


def registry() -> workflow.Registry:
    """A fresh registry with `Three` (a manager freezes the registry it is given)."""
    reg = workflow.Registry()
    reg.register(
        workflow.define(
            Three,
            workflow.handle(first, _first),
            workflow.handle(second, _second),
            workflow.handle(third, _third),
        )
    )
    return reg


QUICK_SWEEP = workflow.Config(
    sweep_max_age=3,
    default_task_timeout=2,
    max_in_process_backoff=0.5,
    backoff_base=0.2,
)
"""Stale after 3 s: timeout 2 s + in-process backoff 0.5 s stays under sweep_max_age."""


def quick_sweep_app() -> workflow.App:
    """`Three` with `QUICK_SWEEP`, so a killed worker's claim is swept within seconds."""
    return workflow.App(registry(), config=QUICK_SWEEP)


def poll_only_app() -> workflow.App:
    """`Three` with a runner that does not LISTEN (what a worker behind a
    transaction-mode pooler runs), polling every 0.2 s; no flag says so."""
    return workflow.App(registry(), runner=workflow.RunnerConfig(listen=False, poll_interval=0.2))
