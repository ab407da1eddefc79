"""A process that ends with fast-path runs in flight lets them finish.

The fast path's threads are daemons (an idle one must not hold the interpreter
open), so the engine waits for them at interpreter exit: a script that starts
runs and simply returns, never calling `close()` or `wait()`, still leaves every
run succeeded, and exits promptly once they are done. Real subprocesses, real
PostgreSQL.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from typing import Any

import psycopg

SCRIPT = textwrap.dedent(
    """
    import sys, time
    import workflow

    WF = workflow.Workflow("Exit.Slow", int)
    FIRST = workflow.Task("exit.first", int)
    SECOND = workflow.Task("exit.second", int)

    def slow(run):
        time.sleep(0.5)
        return run.input

    def second(run):
        return run.output(FIRST) + 1

    reg = workflow.Registry()
    reg.register(workflow.define(WF, workflow.handle(FIRST, slow), workflow.handle(SECOND, second)))
    mgr = workflow.Manager(sys.argv[1], reg)
    for i in range(5):
        WF.start(mgr, i)
    print("started", flush=True)
    # No close(), no wait(): the main thread ends here.
    """
)


def test_runs_in_flight_at_interpreter_exit_finish_and_the_process_exits(
    engine_url: str, db: psycopg.Connection[Any]
) -> None:
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, engine_url],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    elapsed = time.monotonic() - began
    assert done.returncode == 0, done.stderr
    assert "started" in done.stdout
    rows = db.execute(
        "SELECT r.status, r.claim_id IS NULL, t.output "
        "FROM workflow_runs r JOIN workflow_tasks t ON t.run_id = r.id AND t.seq = 2 "
        "WHERE r.workflow = 'Exit.Slow' ORDER BY t.output"
    ).fetchall()
    assert rows == [("succeeded", True, i + 1) for i in range(5)]
    # It did not hang on idle threads (the heartbeat's 15 s tick, say).
    assert elapsed < 30, f"the process took {elapsed:.1f}s to exit"
