"""Resume a run in this (separate) process: `python -m context_apps.resume URL RUN_ID MODE`.

MODE `kick`: a manager built from `context_apps.app()` calls `run.wait()`, which
claims and executes the run here. MODE `runnable`: a runnable (poller) built the
same way picks it up. Prints one JSON line: the final status and this pid.
"""

from __future__ import annotations

import json
import os
import sys
import time

import workflow
from context_apps import app


def main(url: str, run_id: str, mode: str) -> int:
    built = app()
    with workflow.Manager(url, built.registry, built.config) as mgr:
        run = mgr.run(run_id)
        if mode == "kick":
            status = run.wait(timeout=60)
        else:
            runnable = mgr.new_runnable(workflow.RunnerConfig(poll_interval=0.2))
            runnable.start()
            deadline = time.monotonic() + 60
            status = run.status().status
            while not status.terminal and time.monotonic() < deadline:
                time.sleep(0.1)
                status = run.status().status
            runnable.stop(timeout=10)
    print(json.dumps({"status": status.value, "pid": os.getpid()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
