"""SPEC sections 3, 6, 9 (invariant 6) and 11 "Shutdown": draining a manager.

`mgr.close()` (and `runnable.stop()`) sets `cancelled` on in-flight handlers and
awaits them: a success is persisted before the claim is released, a failure
caused by the shutdown spends no attempt, the run's next task is not started,
and the run is left RUNNING and immediately claimable for another executor.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from helpers import Inp, Out, Records, poll, registry
from pgbouncer import runner_config

import workflow
from workflow import Status

# --- helpers -------------------------------------------------------------------------


A = workflow.Task("a", Out)
B = workflow.Task("b", Out)
C = workflow.Task("c", Out)


STATE_SQL = """
SELECT r.status, r.claim_id, r.heartbeat_at, r.next_retry_at <= now(), r.current_seq,
       r.finished_at
FROM workflow_runs r WHERE r.id = %s
"""


def tasks(db: psycopg.Connection[Any], run_id: str) -> list[Any]:
    return db.execute(
        "SELECT seq, attempts, output, error FROM workflow_tasks WHERE run_id = %s ORDER BY seq",
        (run_id,),
    ).fetchall()


class Calls:
    """Per-task call counts, thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: dict[str, list[int]] = {"a": [], "b": [], "c": []}

    def add(self, name: str, attempt: int) -> None:
        with self._lock:
            self.counts[name].append(attempt)

    def simple(self, name: str) -> Callable[[workflow.TaskRun[Inp]], Out]:
        def fn(run: workflow.TaskRun[Inp]) -> Out:
            self.add(name, run.attempt)
            return Out(name)

        return fn


def drain(how: str, mgr: workflow.Manager, runnable: Any) -> None:
    if how == "close":
        mgr.close(timeout=20)
    else:
        assert runnable.stop(timeout=20)


# --- a success in flight -------------------------------------------------------------


@pytest.mark.parametrize("how", ["close", "runnable.stop"])
def test_invariant_6_success_during_shutdown_is_persisted_then_the_claim_released(
    make_manager: Any, db: psycopg.Connection[Any], how: str
) -> None:
    calls = Calls()
    started = threading.Event()
    cancelled_seen: list[bool] = []

    def a(run: workflow.TaskRun[Inp]) -> Out:
        calls.add("a", run.attempt)
        if len(calls.counts["a"]) == 1:
            started.set()
            cancelled_seen.append(run.cancelled.wait(20))
            return Out("finished while shutting down")
        return Out("rerun")

    reg, wf = registry(
        workflow.handle(A, a),
        workflow.handle(B, calls.simple("b")),
        workflow.handle(C, calls.simple("c")),
    )
    mgr = make_manager(reg)
    runnable = None
    if how == "close":
        run = wf.start(mgr, Inp(1))
    else:
        runnable = mgr.new_runnable(runner_config(poll_interval=0.1))
        with db.transaction():
            run = wf.start_tx(db, mgr, Inp(1))
        runnable.start()
    assert started.wait(15)
    drain(how, mgr, runnable)  # returns once the handler returned and was recorded

    assert cancelled_seen == [True], "cancelled is set on the in-flight handler"
    status, claim, beat, due, current_seq, finished_at = db.execute(STATE_SQL, (run.id,)).fetchone()
    assert (status, claim, beat, due) == ("running", None, None, True)
    assert (current_seq, finished_at) == (2, None)
    assert tasks(db, run.id) == [
        (1, 0, {"value": "finished while shutting down"}, None),
        (2, 0, None, None),
        (3, 0, None, None),
    ]
    assert calls.counts["b"] == [] and calls.counts["c"] == [], "the next task is not started"

    other = make_manager(reg)
    assert other.run(run.id).wait(timeout=30) is Status.SUCCEEDED
    assert calls.counts == {"a": [1], "b": [1], "c": [1]}, "resumed from the next task"
    assert tasks(db, run.id)[0][2] == {"value": "finished while shutting down"}


def test_success_of_the_last_task_during_shutdown_completes_the_run(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    started = threading.Event()

    def a(run: workflow.TaskRun[Inp]) -> Out:
        started.set()
        run.cancelled.wait(20)
        return Out("last")

    reg, wf = registry(workflow.handle(A, a))
    mgr = make_manager(reg)
    run = wf.start(mgr, Inp(1))
    assert started.wait(15)
    mgr.close(timeout=20)
    status, claim, _, _, _, finished_at = db.execute(STATE_SQL, (run.id,)).fetchone()
    assert (status, claim) == ("succeeded", None) and finished_at is not None


# --- a failure caused by the shutdown ------------------------------------------------


@pytest.mark.parametrize("how", ["close", "runnable.stop"])
def test_failure_caused_by_shutdown_spends_no_attempt_and_releases_the_claim(
    make_manager: Any, db: psycopg.Connection[Any], how: str
) -> None:
    calls = Calls()
    started = threading.Event()

    def a(run: workflow.TaskRun[Inp]) -> Out:
        calls.add("a", run.attempt)
        if len(calls.counts["a"]) == 1:
            started.set()
            run.cancelled.wait(20)
            run.raise_if_cancelled()
        return Out("second execution")

    # One attempt only: had the shutdown failure counted, the run would park.
    reg, wf = registry(workflow.handle(A, a, max_attempts=1), workflow.handle(B, calls.simple("b")))
    mgr = make_manager(reg)
    runnable = None
    if how == "close":
        run = wf.start(mgr, Inp(1))
    else:
        runnable = mgr.new_runnable(runner_config(poll_interval=0.1))
        with db.transaction():
            run = wf.start_tx(db, mgr, Inp(1))
        runnable.start()
    assert started.wait(15)
    drain(how, mgr, runnable)

    status, claim, beat, due, current_seq, finished_at = db.execute(STATE_SQL, (run.id,)).fetchone()
    assert (status, claim, beat, due, current_seq, finished_at) == (
        "running",
        None,
        None,
        True,
        1,
        None,
    )
    attempts, failed_at = db.execute(
        "SELECT attempts, failed_at FROM workflow_tasks WHERE run_id = %s AND seq = 1",
        (run.id,),
    ).fetchone()
    assert (attempts, failed_at) == (0, None), "shutdown does not end an attempt"
    assert calls.counts["b"] == []

    other = make_manager(reg)
    assert other.run(run.id).wait(timeout=30) is Status.SUCCEEDED
    assert calls.counts["a"] == [1, 1], "the interrupted attempt is attempt 1 again"
    assert calls.counts["b"] == [1]


def test_close_during_an_in_process_backoff_releases_the_claim(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    calls = Calls()
    failed = threading.Event()

    def a(run: workflow.TaskRun[Inp]) -> Out:
        calls.add("a", run.attempt)
        if run.attempt == 1:
            failed.set()
            raise RuntimeError("retry me")
        return Out("retried")

    reg, wf = registry(workflow.handle(A, a, max_attempts=3, backoff_schedule=[3]))
    mgr = make_manager(reg, workflow.Config(max_in_process_backoff=5))
    run = wf.start(mgr, Inp(1))
    assert failed.wait(15)
    poll(
        db,
        "SELECT attempts FROM workflow_tasks WHERE run_id = %s AND seq = 1",
        (run.id,),
        until=lambda r: r[0] == 1,
    )
    mgr.close(timeout=20)  # cuts the in-process sleep short
    status, claim, *_ = db.execute(STATE_SQL, (run.id,)).fetchone()
    assert (status, claim) == ("running", None)
    attempts, gap = db.execute(
        "SELECT t.attempts, r.next_retry_at - t.failed_at FROM workflow_runs r "
        "JOIN workflow_tasks t ON t.run_id = r.id AND t.seq = 1 WHERE r.id = %s",
        (run.id,),
    ).fetchone()
    assert attempts == 1, "the failure before the shutdown counts; the shutdown does not"
    assert gap.total_seconds() == 3.0, "the owed delay is kept for the next executor"
    assert calls.counts["a"] == [1]
    other = make_manager(reg)
    assert other.run(run.id).wait(timeout=30) is Status.SUCCEEDED
    assert calls.counts["a"] == [1, 2]


# --- after close ---------------------------------------------------------------------


def test_start_after_close_with_a_borrowed_pool_inserts_pending_and_launches_nothing(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    calls = Calls()
    reg, wf = registry(workflow.handle(A, calls.simple("a")))
    mgr = make_manager(reg)
    mgr.close()
    run = wf.start(mgr, Inp(1))
    with db.transaction():
        run_tx = wf.start_tx(db, mgr, Inp(2))
    for r in (run, run_tx):
        status, claim, beat, due, _current_seq, finished_at = db.execute(
            STATE_SQL, (r.id,)
        ).fetchone()
        assert (status, claim, beat, due, finished_at) == ("pending", None, None, True, None)
        assert r.status().status is Status.PENDING
    assert mgr.run(run.id).wait(timeout=0.5) is Status.RUNNING, "wait() kicks nothing"
    assert db.execute(STATE_SQL, (run.id,)).fetchone()[:2] == ("pending", None)
    assert calls.counts["a"] == []
    # The rows wait for a poller (here: another manager's worker).
    other = make_manager(reg)
    runnable = other.new_runnable(runner_config(poll_interval=0.1))
    runnable.start()
    try:
        for r in (run, run_tx):
            poll(db, STATE_SQL, (r.id,), until=lambda row: row[0] == "succeeded", timeout=30)
    finally:
        runnable.stop(timeout=10)
    assert sorted(calls.counts["a"]) == [1, 1]


def test_close_with_timeout_returns_when_a_handler_ignores_cancellation(
    make_manager: Any, logs: tuple[logging.Logger, Records], db: psycopg.Connection[Any]
) -> None:
    logger, records = logs
    calls = Calls()
    started = threading.Event()
    release = threading.Event()

    def stubborn(run: workflow.TaskRun[Inp]) -> Out:
        calls.add("a", run.attempt)
        started.set()
        assert release.wait(30)  # ignores `cancelled`
        return Out("eventually")

    reg, wf = registry(workflow.handle(A, stubborn), workflow.handle(B, calls.simple("b")))
    mgr = make_manager(reg, logger=logger)
    run = wf.start(mgr, Inp(1))
    assert started.wait(15)
    closer = threading.Thread(target=mgr.close, kwargs={"timeout": 0.2})
    try:
        closer.start()
        closer.join(15)
        assert not closer.is_alive(), "close(timeout) returned with the handler still running"
        assert any("timed out" in m for m in records.messages())
        assert all(m.startswith("workflow: ") for m in records.messages())
    finally:
        release.set()
    # The straggler still records its success and releases its claim.
    poll(db, STATE_SQL, (run.id,), until=lambda r: r[1] is None and r[4] == 2)
    assert db.execute(STATE_SQL, (run.id,)).fetchone()[:2] == ("running", None)
    assert tasks(db, run.id)[0][2] == {"value": "eventually"}
    assert calls.counts["b"] == []


def test_close_is_idempotent_and_a_context_manager_closes(
    pool: Any, db: psycopg.Connection[Any]
) -> None:
    calls = Calls()
    reg, wf = registry(workflow.handle(A, calls.simple("a")))
    with workflow.Manager(pool, reg) as mgr:
        run = wf.start(mgr, Inp(1))
        assert run.wait(timeout=30) is Status.SUCCEEDED
    mgr.close()
    mgr.close(timeout=1)
    later = wf.start(mgr, Inp(2))
    assert later.status().status is Status.PENDING
    assert calls.counts["a"] == [1]


def test_close_awaits_an_execution_claimed_by_its_poller(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    """SPEC 11: close() drains the whole manager, its worker's executions included."""
    calls = Calls()
    started = threading.Event()
    close_returned = threading.Event()
    seen: list[tuple[bool, bool]] = []

    def a(run: workflow.TaskRun[Inp]) -> Out:
        calls.add("a", run.attempt)
        started.set()
        cancelled = run.cancelled.wait(20)
        # A drained close() cannot return while this handler is still running.
        seen.append((cancelled, close_returned.wait(3)))
        return Out("claimed by the poller")

    reg, wf = registry(workflow.handle(A, a), workflow.handle(B, calls.simple("b")))
    mgr = make_manager(reg)
    runnable = mgr.new_runnable(runner_config(poll_interval=0.1))
    with db.transaction():
        run = wf.start_tx(db, mgr, Inp(1))
    runnable.start()
    try:
        assert started.wait(15)
        mgr.close()
        close_returned.set()
        assert seen == [(True, False)], "close() returned before the in-flight handler ended"
        status, claim, beat, due, current_seq, _ = db.execute(STATE_SQL, (run.id,)).fetchone()
        assert (status, claim, beat, due, current_seq) == ("running", None, None, True, 2)
        assert tasks(db, run.id)[0][2] == {"value": "claimed by the poller"}
        assert calls.counts["b"] == []
    finally:
        close_returned.set()
        runnable.stop(timeout=10)
