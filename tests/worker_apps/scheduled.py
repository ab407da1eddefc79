"""A workflow started by cron schedules, for the schedule tests.

`registry()` holds `Sched.Tick` (one task recording nothing but its input, the
tick) and the schedule named by `$SCHED_NAME` (default "nightly", daily at
midnight UTC, `$SCHED_CATCHUP` default "all"). With `$SCHED_HANG` set, the
input callable hangs for an hour on its first call in the process: a worker
stuck in the middle of a tick's transaction, holding the schedule's row.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time

import workflow

Tick = workflow.Workflow("Sched.Tick", str)
note = workflow.Task("sched.note", str)
_hung = threading.Event()


def _note(run: workflow.TaskRun[str]) -> str:
    return run.input


def _input(tick: datetime.datetime) -> str:
    if os.environ.get("SCHED_HANG") and not _hung.is_set():
        _hung.set()
        print("hanging in the tick's transaction", file=sys.stderr, flush=True)
        time.sleep(3600)
    return tick.isoformat()


def registry() -> workflow.Registry:
    reg = workflow.Registry()
    reg.register(workflow.define(Tick, workflow.handle(note, _note)))
    reg.schedule(
        workflow.Schedule(
            os.environ.get("SCHED_NAME", "nightly"), Tick, "0 0 * * *", input=_input,
            catchup=os.environ.get("SCHED_CATCHUP", "all"),
        )
    )
    return reg
