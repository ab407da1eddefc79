"""Ctrl-C (SIGINT, a real signal to a real process) while a runnable runs or stops.

`runnable.run()` in the main thread, interrupted, drains before the
KeyboardInterrupt goes on: the handler in flight sees `cancelled`, its attempt is
recorded and nothing is left claimed. A `stop()` interrupted part-way still tells
every service to stop, and a `run()` waiting on another thread returns.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from typing import Any

import psycopg

COMMON = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    import workflow

    WF = workflow.Workflow("Interrupt.Hold", int)
    HOLD = workflow.Task("interrupt.hold", int)
    returned = threading.Event()

    def hold(run):
        print("inside", flush=True)
        run.cancelled.wait(60)
        if MODE == "stop":
            # Interrupt the stop() that cancelled this handler, then keep it waiting.
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(2)
        returned.set()
        return 1

    reg = workflow.Registry()
    reg.register(workflow.define(WF, workflow.handle(HOLD, hold)))
    mgr = workflow.Manager(sys.argv[1], reg)
    runnable = mgr.new_runnable(workflow.RunnerConfig(poll_interval=0.2, listen=False))
    with mgr.pool.connection() as conn, conn.transaction():
        run = WF.start_tx(conn, mgr, 7)
    """
)

RUN_INTERRUPTED = COMMON.replace('MODE == "stop"', "False") + textwrap.dedent(
    """
    try:
        runnable.run()
    except KeyboardInterrupt:
        print("interrupted; handler returned:", returned.is_set(), flush=True)
        print("status:", run.status().status.value, flush=True)
    """
)

STOP_INTERRUPTED = COMMON.replace('MODE == "stop"', "True") + textwrap.dedent(
    """
    runner = threading.Thread(target=runnable.run, daemon=True)
    runner.start()
    while not returned.is_set() and run.status().status.value == "pending":
        time.sleep(0.05)
    time.sleep(0.2)
    try:
        runnable.stop()
    except KeyboardInterrupt:
        runner.join(10)
        print("stop interrupted; run() returned:", not runner.is_alive(), flush=True)
    """
)


def _popen(script: str, url: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, url],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_ctrl_c_in_run_drains_before_the_interrupt_goes_on(
    engine_url: str, db: psycopg.Connection[Any]
) -> None:
    proc = _popen(RUN_INTERRUPTED, engine_url)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "inside\n"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert out.splitlines() == ["interrupted; handler returned: True", "status: succeeded"]
    assert db.execute(
        "SELECT status, claim_id FROM workflow_runs WHERE workflow = 'Interrupt.Hold'"
    ).fetchall() == [("succeeded", None)]


def test_an_interrupted_stop_still_lets_run_return(engine_url: str) -> None:
    proc = _popen(STOP_INTERRUPTED, engine_url)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert out.splitlines() == ["inside", "stop interrupted; run() returned: True"]
