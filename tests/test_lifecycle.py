"""SPEC 3, 6 and 9: start, stop and close from any thread, at any moment.

They never raise a race's error, never hang and never strand a run: a stop right
after a start, starts and stops from many threads at once, a submit racing a
shutdown, a close or stop from inside a handler, a close in a forked child, one
deadline for a whole close, a closed manager, a handler's idempotency key held by
the same thread's open transaction.

The race tests shrink the interpreter's thread switch interval so that the
windows the old code left open are hit within a few hundred rounds.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers import Inp, Out, registry, wait_until

import workflow
from workflow import Status
from workflow.heartbeat import DEADLINE, Claim
from workflow.runthreads import RunThreads
from workflow.service import Service

A = workflow.Task("a", Out)
B = workflow.Task("b", Out)


@pytest.fixture
def busy_switching() -> Iterator[None]:
    """Switch threads every microsecond, so that racing statements interleave."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


class Idle(Service):
    name = "test-idle"

    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._sleep(10)


# --- services, runnables and the run threads ---------------------------------------------


def test_a_stop_right_after_a_start_on_another_thread_never_raises(
    busy_switching: None,
) -> None:
    """The stopper acts as soon as the service's thread is visible, before it has run."""
    for _ in range(200):
        service = Idle()
        errors: list[BaseException] = []

        def stop(service: Service = service, errors: list[BaseException] = errors) -> None:
            deadline = time.monotonic() + 5
            while service._thread is None and time.monotonic() < deadline:
                pass
            try:
                service.stop(timeout=5)
            except BaseException as e:
                errors.append(e)

        stopper = threading.Thread(target=stop)
        stopper.start()
        service.start()
        stopper.join(10)
        service.stop(timeout=5)
        assert not errors, errors
        assert service._thread is None or not service._thread.is_alive()


def test_runnable_stop_right_after_run_began_on_another_thread_returns_both(
    make_manager: Any, busy_switching: None
) -> None:
    reg, _ = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)
    for _ in range(40):
        runnable = mgr.new_runnable(workflow.RunnerConfig(listen=False, sweep_enabled=False))
        runner = threading.Thread(target=runnable.run, daemon=True)
        runner.start()
        deadline = time.monotonic() + 5
        while runnable._poller._thread is None and time.monotonic() < deadline:
            pass
        runnable.stop(timeout=10)  # must not raise "cannot join thread before it is started"
        runner.join(10)
        assert not runner.is_alive(), "run() did not return after stop()"
        poller = runnable._poller._thread
        assert poller is None or not poller.is_alive(), "the poller outlived stop()"


def test_a_job_submitted_while_the_threads_shut_down_is_run_or_refused(
    busy_switching: None,
) -> None:
    import logging

    for _ in range(300):
        threads = RunThreads(2, "test-run", logging.getLogger("test"))
        ran: list[int] = []
        accepted: list[int] = []
        first = threading.Event()

        def submit(threads: RunThreads = threads, accepted: list[int] = accepted,
                   ran: list[int] = ran, first: threading.Event = first) -> None:
            for i in range(10_000):
                try:
                    threads.submit(ran.append, i)
                except RuntimeError:
                    return
                accepted.append(i)
                first.set()

        submitter = threading.Thread(target=submit)
        submitter.start()
        first.wait(10)
        threads.shutdown(wait=False)
        submitter.join(10)
        threads.shutdown(wait=True, timeout=10)
        assert sorted(ran) == accepted, (
            f"{len(accepted) - len(ran)} jobs were accepted but never run"
        )


def test_a_deadline_seen_late_does_not_cancel_the_next_attempt() -> None:
    """The heartbeat reads an attempt's deadline, the attempt ends and the next begins,
    then the heartbeat acts on what it read: the new attempt must not start cancelled."""
    lease = Claim(workflow_run_id(), workflow_run_id())
    lease.begin_attempt(time.monotonic() - 1)  # this attempt is past its deadline
    seen = time.monotonic()  # what the heartbeat read
    lease.end_attempt()
    second = lease.begin_attempt(time.monotonic() + 60)
    lease.expire(seen)
    assert not second.is_set(), "the next attempt started already cancelled"
    lease.end_attempt()
    third = lease.begin_attempt(time.monotonic() - 1)
    lease.expire(time.monotonic())
    assert third.is_set() and lease.reason == DEADLINE


def workflow_run_id() -> Any:
    import uuid

    return uuid.uuid4()


# --- close and stop from inside a handler ---------------------------------------------


def test_close_from_inside_a_handler_raises_instead_of_waiting_for_itself(
    make_manager: Any,
) -> None:
    seen: list[str] = []
    holder: dict[str, workflow.Manager] = {}

    def closes(run: workflow.TaskRun[Inp]) -> Out:
        try:
            holder["mgr"].close(timeout=30)
        except workflow.WorkflowError as e:
            seen.append(str(e))
        return Out("done")

    reg, wf = registry(workflow.handle(A, closes))
    holder["mgr"] = mgr = make_manager(reg)
    began = time.monotonic()
    assert wf.start(mgr, Inp(1)).wait(timeout=20) is Status.SUCCEEDED
    assert time.monotonic() - began < 10
    (message,) = seen
    assert "inside" in message and "handler" in message


def test_stop_from_inside_a_handler_raises_instead_of_waiting_for_itself(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    seen: list[str] = []
    holder: dict[str, Any] = {}

    def stops(run: workflow.TaskRun[Inp]) -> Out:
        try:
            holder["runnable"].stop(timeout=30)
        except workflow.WorkflowError as e:
            seen.append(str(e))
        return Out("done")

    reg, wf = registry(workflow.handle(A, stops))
    mgr = make_manager(reg)
    holder["runnable"] = runnable = mgr.new_runnable(
        workflow.RunnerConfig(poll_interval=0.2, listen=False)
    )
    with db.transaction():
        run = wf.start_tx(db, mgr, Inp(1))
    runnable.start()
    try:
        wait_until(lambda: bool(seen), "the handler's stop() to answer", timeout=20)
        assert run.wait(timeout=20) is Status.SUCCEEDED
    finally:
        runnable.stop(timeout=10)
    (message,) = seen
    assert "inside" in message and "handler" in message


def test_wait_on_its_own_run_from_inside_a_handler_raises(make_manager: Any) -> None:
    seen: list[str] = []

    def waits(run: workflow.TaskRun[Inp]) -> Out:
        try:
            holder["mgr"].run(run.run_id).wait(timeout=30)
        except workflow.WorkflowError as e:
            seen.append(str(e))
        return Out("done")

    holder: dict[str, workflow.Manager] = {}
    reg, wf = registry(workflow.handle(A, waits))
    holder["mgr"] = mgr = make_manager(reg)
    began = time.monotonic()
    assert wf.start(mgr, Inp(1)).wait(timeout=20) is Status.SUCCEEDED
    assert time.monotonic() - began < 10
    (message,) = seen
    assert "its own run" in message


# --- close in a forked child; one deadline for a whole close ----------------------------


def test_close_in_a_forked_child_does_not_wait_for_the_parents_executions(
    make_manager: Any,
) -> None:
    entered = threading.Event()
    release = threading.Event()

    def blocks(run: workflow.TaskRun[Inp]) -> Out:
        entered.set()
        release.wait(30)
        return Out("done")

    reg, wf = registry(workflow.handle(A, blocks, timeout=40))
    mgr = make_manager(reg)
    run = wf.start(mgr, Inp(1))
    assert entered.wait(10)
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                signal.alarm(20)
                mgr.close()  # the parent's execution is not the child's to wait for
                code = 0
            finally:
                os._exit(code)
        deadline = time.monotonic() + 20
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail("close() in the forked child hung")
            time.sleep(0.05)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    finally:
        release.set()
    assert run.wait(timeout=20) is Status.SUCCEEDED


def test_close_with_several_runnables_keeps_one_deadline(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    release = threading.Event()
    entered: list[int] = []

    def ignores_cancellation(run: workflow.TaskRun[Inp]) -> Out:
        entered.append(run.input.n)
        release.wait(20)
        return Out("late")

    reg, wf = registry(workflow.handle(A, ignores_cancellation, timeout=30))
    mgr = make_manager(reg, workflow.Config(max_local_runs=1))
    runnables = [
        mgr.new_runnable(
            workflow.RunnerConfig(poll_interval=0.1, batch_size=1, concurrency=1, listen=False)
        )
        for _ in range(3)
    ]
    with db.transaction():
        for n in range(3):
            wf.start_tx(db, mgr, Inp(n))
    for runnable in runnables:
        runnable.start()
    try:
        wait_until(lambda: len(entered) == 3, "each runnable to hold one run", timeout=20)
        began = time.monotonic()
        mgr.close(timeout=1)
        took = time.monotonic() - began
    finally:
        release.set()
    assert took < 2.5, f"close(timeout=1) took {took:.1f}s with 3 runnables"


# --- a closed manager ------------------------------------------------------------------


def test_every_call_on_a_closed_manager_that_owned_its_pool_raises_at_once(
    db_url: str,
) -> None:
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = workflow.Manager(db_url, reg)
    run = wf.start(mgr, Inp(1))
    assert run.wait(timeout=20) is Status.SUCCEEDED
    mgr.close()
    calls = {
        "start": lambda: wf.start(mgr, Inp(2)),
        "run": lambda: mgr.run(run.id),
        "status": run.status,
        "wait": lambda: run.wait(timeout=1),
        "input": lambda: wf.input(mgr, run.id),
        "new_runnable": mgr.new_runnable,
    }
    for name, call in calls.items():
        began = time.monotonic()
        with pytest.raises(workflow.WorkflowError, match="closed"):
            call()
        assert time.monotonic() - began < 2, f"{name} did not raise at once"


def test_a_runnable_of_a_closed_manager_refuses_to_run(make_manager: Any) -> None:
    reg, _ = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)
    runnable = mgr.new_runnable(workflow.RunnerConfig(listen=False))
    mgr.close()
    with pytest.raises(workflow.WorkflowError, match="closed"):
        runnable.run()
    with pytest.raises(workflow.WorkflowError, match="closed"):
        mgr.new_runnable()


@pytest.mark.parametrize("timeout", [math.inf, -math.inf, math.nan, 1e300])
def test_wait_stop_and_close_refuse_durations_out_of_range_at_once(
    make_manager: Any, timeout: float
) -> None:
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)
    run = wf.start(mgr, Inp(1))
    runnable = mgr.new_runnable(workflow.RunnerConfig(listen=False))
    with pytest.raises(ValueError):
        run.wait(timeout=timeout)
    with pytest.raises(ValueError):
        runnable.stop(timeout=timeout)
    with pytest.raises(ValueError):
        mgr.close(timeout=timeout)
    assert run.wait(timeout=20) is Status.SUCCEEDED


# --- an idempotency key held by the same thread's open transaction ----------------------


def test_start_with_a_key_held_by_this_threads_open_transaction_raises_instead_of_hanging(
    make_manager: Any, db_url: str
) -> None:
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)
    outcome: dict[str, Any] = {}

    def start_twice() -> None:
        with (
            psycopg.connect(db_url) as conn,
            contextlib.suppress(psycopg.Error),
            conn.transaction(),
        ):
            wf.start_tx(conn, mgr, Inp(1), idempotency_key="order-7")
            try:
                wf.start(mgr, Inp(1), idempotency_key="order-7")
                outcome["raised"] = None
            except workflow.WorkflowError as e:
                outcome["raised"] = str(e)

    thread = threading.Thread(target=start_twice, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "start() blocked on the key its own thread holds"
    message = outcome["raised"]
    assert message is not None and "order-7" in message and "transaction" in message
