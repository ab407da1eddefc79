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

    INTERRUPTS_THE_STOP, PATIENCE, SIGNALS_ITS_THREAD = {interrupts!r}, {patience!r}, {own!r}

    WF = workflow.Workflow("Interrupt.Hold", int)
    HOLD = workflow.Task("interrupt.hold", int)
    entered = threading.Event()
    returned = threading.Event()

    def hold(run):
        print("inside", flush=True)
        entered.set()
        if SIGNALS_ITS_THREAD:
            # A Ctrl-C the kernel hands to this thread, not to the main one (its choice).
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)
        run.cancelled.wait(60)
        if INTERRUPTS_THE_STOP:
            # Interrupt the stop() that cancelled this handler, then keep it waiting.
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(PATIENCE)  # then ignores the cancellation this long
            print("handler returned", flush=True)
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



def script(
    body: str, *, interrupts: bool = False, patience: float = 0.0, own: bool = False
) -> str:
    """COMMON, its handler set up, then `body`. With `interrupts`, the handler sends the
    process a SIGINT once cancelled (inside the stop() that cancelled it), then goes
    on for `patience` seconds; with `own`, it sends its own thread one on entering."""
    return COMMON.format(interrupts=interrupts, patience=patience, own=own) + textwrap.dedent(
        body
    )


RUN_INTERRUPTED = script(
    """
    try:
        runnable.run()
    except KeyboardInterrupt:
        print("interrupted; handler returned:", returned.is_set(), flush=True)
        print("status:", run.status().status.value, flush=True)
    """
)

RUN_INTERRUPTED_THROUGH_ANOTHER_THREAD = script(
    """
    try:
        runnable.run()
    except KeyboardInterrupt:
        print("interrupted; handler returned:", returned.is_set(), flush=True)
    """,
    own=True,
)

STOP_INTERRUPTED = script(
    """
    runner = threading.Thread(target=runnable.run, daemon=True)
    runner.start()
    entered.wait(60)
    try:
        runnable.stop()
    except KeyboardInterrupt:
        runner.join(10)
        print("stop interrupted; run() returned:", not runner.is_alive(), flush=True)
    """,
    interrupts=True,
    patience=8,
)

SIGNAL_STOP_INTERRUPTED = script(
    """
    # A SIGTERM handler of the application's stops the runnable with a limit; the
    # handler in flight ignores its cancellation, and a Ctrl-C comes during that stop.
    signal.signal(signal.SIGTERM, lambda *_: runnable.stop(timeout=30))
    try:
        runnable.run()
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    """,
    interrupts=True,
    patience=8,
)

STOP_INTERRUPTED_AT_THE_LOCK = script(
    """
    # Something holds the runnable's lock (a start() undoing a failure may, for 10 s)
    # while stop() waits for it, and a Ctrl-C comes.
    runnable.start()
    entered.wait(60)
    held = threading.Event()
    release = threading.Event()

    def hold_the_lock():
        with runnable._lock:
            held.set()
            release.wait(60)

    threading.Thread(target=hold_the_lock, daemon=True).start()
    held.wait(60)

    class Announcing:  # the runnable's lock, saying when stop() comes to take it
        def __init__(self, lock):
            self.lock, self.wanted = lock, threading.Event()

        def __enter__(self):
            self.wanted.set()
            return self.lock.__enter__()

        def __exit__(self, *exc):
            return self.lock.__exit__(*exc)

    runnable._lock = Announcing(runnable._lock)

    def ctrl_c_once_stop_waits():
        runnable._lock.wanted.wait(60)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    threading.Thread(target=ctrl_c_once_stop_waits, daemon=True).start()
    try:
        runnable.stop()
    except KeyboardInterrupt:
        returned.wait(60)  # the drain was begun: the handler saw its cancellation
        print("handler cancelled:", returned.is_set(), flush=True)
        print("stopped:", runnable._done.is_set(), flush=True)
    release.set()
    """
)


def lines_of(script: str, url: str, send: signal.Signals | None = None) -> list[str]:
    """Run `script` (exit 0 expected) and return its stdout lines; with `send`, send that
    signal once the handler is entered (its "inside" line, then not returned)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, url],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first: list[str] = []
        if send is not None:
            assert proc.stdout is not None
            first.append(proc.stdout.readline().rstrip("\n"))
            assert first == ["inside"]
            proc.send_signal(send)
        out, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    return first + out.splitlines()


def test_ctrl_c_in_run_drains_before_the_interrupt_goes_on(
    engine_url: str, db: psycopg.Connection[Any]
) -> None:
    assert lines_of(RUN_INTERRUPTED, engine_url, signal.SIGINT) == [
        "inside", "interrupted; handler returned: True", "status: succeeded"
    ]
    assert db.execute(
        "SELECT status, claim_id FROM workflow_runs WHERE workflow = 'Interrupt.Hold'"
    ).fetchall() == [("succeeded", None)]


def test_a_ctrl_c_delivered_to_another_thread_still_reaches_run(engine_url: str) -> None:
    # The main thread, blocked in run(), runs Python at least once a second, so the
    # KeyboardInterrupt Python owes it is raised there.
    assert lines_of(RUN_INTERRUPTED_THROUGH_ANOTHER_THREAD, engine_url) == [
        "inside", "interrupted; handler returned: True"
    ]


def test_an_interrupted_stop_still_lets_run_return(engine_url: str) -> None:
    assert lines_of(STOP_INTERRUPTED, engine_url) == [
        "inside", "stop interrupted; run() returned: True", "handler returned"
    ]


def test_a_ctrl_c_during_a_signal_handlers_stop_does_not_start_an_unbounded_drain(
    engine_url: str,
) -> None:
    # The stop in the SIGTERM handler is cut short; run() then must not drain again,
    # without a limit, behind the handler that ignores its cancellation: the
    # KeyboardInterrupt reaches the application before that handler returns.
    assert lines_of(SIGNAL_STOP_INTERRUPTED, engine_url, signal.SIGTERM) == [
        "inside", "interrupted", "handler returned"
    ]


def test_a_stop_interrupted_while_it_waits_for_the_lock_still_stops(engine_url: str) -> None:
    assert lines_of(STOP_INTERRUPTED_AT_THE_LOCK, engine_url) == [
        "inside", "handler cancelled: True", "stopped: True"
    ]
