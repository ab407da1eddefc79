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
import threading
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


WORKER_SCRIPT = textwrap.dedent(
    """
    import sys, threading
    import workflow
    from workflow.events import ExecutionEnded, FinishHandedOver

    WF = workflow.Workflow("Exit.Worker", int)
    ONLY = workflow.Task("exit.only", int)
    reg = workflow.Registry()
    reg.register(workflow.define(WF, workflow.handle(ONLY, lambda run: run.input)))
    mgr = workflow.Manager(sys.argv[1], reg)
    handed = threading.Event()
    mgr.events.subscribe(lambda e: isinstance(e, FinishHandedOver) and handed.set())
    # Announced once the finish has committed (by the completer, here during exit).
    mgr.events.subscribe(lambda e: isinstance(e, ExecutionEnded) and print("ended", flush=True))
    runnable = mgr.new_runnable(workflow.RunnerConfig(poll_interval=0.1, listen=False))
    runnable.start()
    assert handed.wait(30)
    print("handed", flush=True)
    # No stop(), no close(): the main thread ends with the finish still held (the test
    # holds a lock on its run).
    """
)


def test_a_workers_finish_handed_over_at_interpreter_exit_is_written(
    engine_url: str, db: psycopg.Connection[Any], db_url: str
) -> None:
    """A worker's run thread hands its run's finish to the completer and is done; the
    process then ends without stopping its runnable, while the completer's statement
    waits on a lock the test holds. Exit waits for the completer too: the finish is
    written once the lock goes, and the run is not left claimed for a sweeper to count
    a failed attempt that succeeded."""
    with db.transaction():
        db.execute(
            "INSERT INTO workflow_runs (id, workflow, status, input, task_count, current_seq) "
            "VALUES (gen_random_uuid(), 'Exit.Worker', 'pending', '7'::jsonb, 1, 1)"
        )
        db.execute(
            "INSERT INTO workflow_tasks (run_id, seq, name) "
            "SELECT id, 1, 'exit.only' FROM workflow_runs WHERE workflow = 'Exit.Worker'"
        )
    with psycopg.connect(db_url) as blocker:
        # A lock the claim does not need (a run's task row) but the finish does.
        blocker.execute("SELECT FROM workflow_tasks WHERE seq = 1 FOR UPDATE")
        proc = subprocess.Popen(
            [sys.executable, "-c", WORKER_SCRIPT, engine_url],
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        lines: list[str] = []
        assert proc.stdout is not None
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True)
        reader.start()
        try:
            deadline = time.monotonic() + 30
            while "handed\n" not in lines and time.monotonic() < deadline:
                time.sleep(0.05)
            assert lines == ["handed\n"], lines
            time.sleep(0.5)
            assert proc.poll() is None, "exit waits for the finish held on the lock"
            blocker.rollback()
            assert proc.wait(timeout=30) == 0, proc.stderr.read() if proc.stderr else ""
            reader.join(timeout=10)
            # The execution ended in the process, after its finish committed: not a
            # statement its backend went on to commit after the process had died.
            assert lines == ["handed\n", "ended\n"], lines
        finally:
            if proc.poll() is None:
                proc.kill()
    assert db.execute(
        "SELECT r.status, r.claim_id IS NULL, t.output FROM workflow_runs r "
        "JOIN workflow_tasks t ON t.run_id = r.id WHERE r.workflow = 'Exit.Worker'"
    ).fetchone() == ("succeeded", True, 7)
