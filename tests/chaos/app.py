"""The chaos workflow and its worker app: `--app tests.chaos.app:app`.

`Chaos.Three` has three tasks, each recording a string output: the id of the
execution that produced it. Every handler execution writes a ledger row when it
begins and when it ends (`ledger.py`). The input asks for a little work, and
sometimes for a failure on the first attempt of one task (a retry) or for a hang
past the task's timeout on the first attempt of one task, ignoring `cancelled`:
its claim stops being heartbeated, a sweeper releases it after `sweep_max_age`,
another executor runs the task again, and the hung one comes back late to a
fenced write that must not land (unless it came back before the sweep, while its
claim was still valid: a late success, which is recorded).
"""

from __future__ import annotations

import sys
import time
import uuid
from typing import Any

import attrs

import workflow

from . import ledger

MAX_ATTEMPTS = 12

CONFIG_SWEEP_MAX_AGE = 3.0

CONFIG = workflow.Config(
    sweep_max_age=CONFIG_SWEEP_MAX_AGE,
    default_task_timeout=1.5,
    max_in_process_backoff=0.5,
    backoff_base=0.1,
    backoff_max=0.4,
    default_max_attempts=MAX_ATTEMPTS,
)
"""A killed or hung executor's claim is stale after 3 s; timeout 1.5 s + 0.5 s < 3 s."""


@attrs.frozen
class Job:
    n: int
    work_ms: int = 0
    fail_seq: int = 0
    hang_seq: int = 0
    hang_s: float = 0.0


Chaos = workflow.Workflow("Chaos.Three", Job)
TASKS = (
    workflow.Task("chaos.first", str),
    workflow.Task("chaos.second", str),
    workflow.Task("chaos.third", str),
)


def _claim_of_executor() -> uuid.UUID | None:
    """The claim id of the engine's execution calling this handler, from its frame.

    Test-only introspection: the executor method that calls a handler has the
    execution as `self`, holding its `claim` (run id, claim id). None if the
    engine's internals no longer look like that (the checks then use the claim the
    database showed when the handler began).
    """
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            break
        held = getattr(frame.f_locals.get("self"), "claim", None)
        claim = getattr(held, "claim_id", None)
        if isinstance(claim, uuid.UUID):
            return claim
        frame = frame.f_back
    return None


def _handler(seq: int) -> Any:
    def run_task(run: workflow.TaskRun[Job]) -> str:
        exec_id = uuid.uuid4()
        claim = _claim_of_executor()
        prev = run.output(TASKS[seq - 2]) if seq > 1 else None
        ledger.begin(exec_id, run.run_id, seq, run.attempt, claim, prev)
        job = run.input
        if job.hang_seq == seq and run.attempt == 1:
            time.sleep(job.hang_s)  # ignores `cancelled`, like a stuck call
        elif job.work_ms:
            run.cancelled.wait(job.work_ms / 1000)
        if job.fail_seq == seq and run.attempt == 1:
            ledger.end(exec_id, "raised")
            raise RuntimeError("injected transient failure (first attempt)")
        ledger.end(exec_id, "returned")
        return str(exec_id)

    run_task.__name__ = f"chaos_task_{seq}"
    return run_task


SCHEDULE = "chaos.minutely"
"""A schedule every worker fires: each minute's tick must start exactly one run."""


def _tick_input(tick: Any) -> Job:
    return Job(n=-1)


KEYS = 8
"""One run in three has a concurrency key (SPEC 15), one of this many accounts."""


def account(job: Job) -> str | None:
    """The run's concurrency key: `account-{n % KEYS}` for every third n, else none."""
    return f"account-{job.n % KEYS}" if job.n % 3 == 0 else None


def registry() -> workflow.Registry:
    """A fresh registry with `Chaos.Three` (one run per account at once, for the runs
    that have one) and its minutely schedule (catch-up: all)."""
    reg = workflow.Registry()
    reg.register(
        workflow.define(
            Chaos,
            *(workflow.handle(t, _handler(i + 1)) for i, t in enumerate(TASKS)),
            concurrency_key=account,
        )
    )
    reg.schedule(workflow.Schedule(SCHEDULE, Chaos, "* * * * *", input=_tick_input,
                                   catchup="all"))
    return reg


def app() -> workflow.App:
    """The worker's `--app` factory."""
    return workflow.App(registry(), config=CONFIG)
