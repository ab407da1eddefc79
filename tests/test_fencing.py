"""SPEC section 9, invariant 1: every write after a claim is fenced by the claim id.

A second executor "steals" the claim while the first one's handler is blocked:
the test sets `claim_id` to a new uuid by SQL, exactly what a sweep followed by
another executor's claim leaves behind. When the first handler then returns (or
raises), its late write matches zero rows and changes nothing; its execution
stops without touching state and does not go on to the next task.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
from helpers import Inp, Out, Records, registry, snapshot

import workflow
from workflow import Status

# --- helpers -------------------------------------------------------------------------


A = workflow.Task("a", Out)
B = workflow.Task("b", Out)
C = workflow.Task("c", Out)


def steal(db: psycopg.Connection[Any], run_id: str) -> uuid.UUID:
    """What a sweep + another executor's claim leave behind: a new claim id."""
    thief = uuid.uuid4()
    updated = db.execute(
        "UPDATE workflow_runs SET claim_id = %s, heartbeat_at = now() "
        "WHERE id = %s AND claim_id IS NOT NULL RETURNING id",
        (thief, run_id),
    ).fetchall()
    assert len(updated) == 1, "the run was not claimed when the thief came"
    return thief


class Blocking:
    """A handler that signals it started, then blocks until released."""

    def __init__(self, *, fail: bool = False) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.fail = fail
        self.calls: list[int] = []
        self.run_ids: list[str] = []

    def __call__(self, run: workflow.TaskRun[Inp]) -> Out:
        self.calls.append(run.attempt)
        self.run_ids.append(run.run_id)
        self.started.set()
        assert self.release.wait(20)
        if self.fail:
            raise RuntimeError("late failure")
        return Out("late write")


class Counting:
    def __init__(self) -> None:
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self, run: workflow.TaskRun[Inp]) -> Out:
        with self._lock:
            self.calls += 1
        return Out("next")


# --- invariant 1 ---------------------------------------------------------------------


def test_invariant_1_late_success_after_a_stolen_claim_changes_nothing(
    make_manager: Any, logs: tuple[logging.Logger, Records], db: psycopg.Connection[Any]
) -> None:
    logger, records = logs
    first = Blocking()
    second = Counting()
    reg, wf = registry(workflow.handle(A, first), workflow.handle(B, second))
    mgr = make_manager(reg, logger=logger)  # default heartbeat: no tick during the test
    try:
        run = wf.start(mgr, Inp(1))
        assert first.started.wait(10)
        thief = steal(db, run.id)
        # The thief recorded something of its own meanwhile.
        db.execute(
            'UPDATE workflow_tasks SET output = \'{"value": "thief"}\'::jsonb, '
            "error = 'thief was here' WHERE run_id = %s AND seq = 1",
            (run.id,),
        )
        before = snapshot(db, run.id)
    finally:
        first.release.set()
    lost = records.wait_for("claim lost")
    assert lost.levelno == logging.WARNING
    assert lost.run_id == run.id  # type: ignore[attr-defined]
    mgr.close(timeout=10)  # the first execution has ended
    assert snapshot(db, run.id) == before
    _run_after, tasks_after = before
    assert tasks_after[0][5] == {"value": "thief"}
    status, claim, current_seq = db.execute(
        "SELECT status, claim_id, current_seq FROM workflow_runs WHERE id = %s", (run.id,)
    ).fetchone()
    assert (status, claim, current_seq) == ("running", thief, 1)
    assert second.calls == 0, "the next task is not run by the executor that lost the claim"
    assert first.calls == [1]


def test_invariant_1_late_success_leaves_an_unwritten_output_null(
    make_manager: Any, logs: tuple[logging.Logger, Records], db: psycopg.Connection[Any]
) -> None:
    logger, records = logs
    first = Blocking()
    second = Counting()
    reg, wf = registry(workflow.handle(A, first), workflow.handle(B, second))
    mgr = make_manager(reg, logger=logger)
    try:
        run = wf.start(mgr, Inp(1))
        assert first.started.wait(10)
        steal(db, run.id)
        before = snapshot(db, run.id)
    finally:
        first.release.set()
    records.wait_for("claim lost")
    mgr.close(timeout=10)
    assert snapshot(db, run.id) == before
    output, finished_at = db.execute(
        "SELECT output, finished_at FROM workflow_tasks WHERE run_id = %s AND seq = 1",
        (run.id,),
    ).fetchone()
    assert (output, finished_at) == (None, None)
    assert second.calls == 0


def test_invariant_1_failure_write_after_a_stolen_claim_changes_nothing(
    make_manager: Any, logs: tuple[logging.Logger, Records], db: psycopg.Connection[Any]
) -> None:
    logger, records = logs
    first = Blocking(fail=True)
    reg, wf = registry(
        workflow.handle(A, first, max_attempts=3, backoff_schedule=[0]),
        workflow.handle(B, Counting()),
    )
    mgr = make_manager(reg, logger=logger)
    try:
        run = wf.start(mgr, Inp(1))
        assert first.started.wait(10)
        steal(db, run.id)
        before = snapshot(db, run.id)
    finally:
        first.release.set()
    records.wait_for("claim lost")
    mgr.close(timeout=10)
    assert snapshot(db, run.id) == before
    attempts, error, failed_at = db.execute(
        "SELECT attempts, error, failed_at FROM workflow_tasks WHERE run_id = %s AND seq = 1",
        (run.id,),
    ).fetchone()
    assert (attempts, error, failed_at) == (0, None, None)
    assert first.calls == [1], "no retry by the executor that lost the claim"


def test_invariant_1_permanent_failure_after_a_stolen_claim_does_not_park(
    make_manager: Any, logs: tuple[logging.Logger, Records], db: psycopg.Connection[Any]
) -> None:
    logger, records = logs
    started = threading.Event()
    release = threading.Event()

    def fn(run: workflow.TaskRun[Inp]) -> Out:
        started.set()
        assert release.wait(20)
        raise workflow.Permanent("too late to park", code="late")

    reg, wf = registry(workflow.handle(A, fn))
    mgr = make_manager(reg, logger=logger)
    try:
        run = wf.start(mgr, Inp(1))
        assert started.wait(10)
        steal(db, run.id)
        before = snapshot(db, run.id)
    finally:
        release.set()
    records.wait_for("claim lost")
    mgr.close(timeout=10)
    assert snapshot(db, run.id) == before
    assert run.status().status is Status.RUNNING
    assert [r for r in records.records if r.levelno >= workflow.ALERT] == []


def test_invariant_1_thief_finishes_the_run_and_the_loser_writes_nothing(
    make_manager: Any, logs: tuple[logging.Logger, Records], db: psycopg.Connection[Any]
) -> None:
    """A realistic steal: release the claim by SQL (as a sweep does), another manager claims it."""
    logger, records = logs
    release = threading.Event()
    started = threading.Event()
    outputs: list[str] = []
    lock = threading.Lock()

    def a(run: workflow.TaskRun[Inp]) -> Out:
        with lock:
            first_call = not outputs
            outputs.append("a")
        if first_call:
            started.set()
            assert release.wait(20)
            return Out("loser")
        return Out("winner")

    def b(run: workflow.TaskRun[Inp]) -> Out:
        with lock:
            outputs.append("b")
        return Out("b saw " + run.output(A).value)

    reg, wf = registry(workflow.handle(A, a), workflow.handle(B, b))
    loser = make_manager(reg, logger=logger)
    winner = make_manager(reg)
    try:
        run = wf.start(loser, Inp(1))
        assert started.wait(10)
        db.execute(
            "UPDATE workflow_runs SET claim_id = NULL, heartbeat_at = NULL WHERE id = %s",
            (run.id,),
        )
        assert winner.run(run.id).wait(timeout=30) is Status.SUCCEEDED
        before = snapshot(db, run.id)
    finally:
        release.set()
    records.wait_for("claim lost")
    loser.close(timeout=10)
    assert snapshot(db, run.id) == before
    rows = db.execute(
        "SELECT seq, output FROM workflow_tasks WHERE run_id = %s ORDER BY seq", (run.id,)
    ).fetchall()
    assert rows == [(1, {"value": "winner"}), (2, {"value": "b saw winner"})]
    assert outputs == ["a", "a", "b"]


def test_invariant_1_claim_stolen_during_an_in_process_backoff_stops_the_retry(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    calls: list[int] = []
    failed = threading.Event()

    def fn(run: workflow.TaskRun[Inp]) -> Out:
        calls.append(run.attempt)
        failed.set()
        raise RuntimeError("retry me")

    reg, wf = registry(workflow.handle(A, fn, max_attempts=5, backoff_schedule=[3]))
    # sweep_max_age 4 s: the heartbeat ticks every second, so the sleeping executor
    # learns of the loss (a heartbeat matching zero rows) before its retry.
    config = workflow.Config(sweep_max_age=4, max_in_process_backoff=3, default_task_timeout=0.5)
    mgr = make_manager(reg, config)
    run = wf.start(mgr, Inp(1))
    assert failed.wait(10)
    deadline = time.monotonic() + 10
    while (
        db.execute("SELECT attempts FROM workflow_tasks WHERE run_id = %s", (run.id,)).fetchone()[0]
        != 1
    ):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    thief = steal(db, run.id)
    before = snapshot(db, run.id)
    mgr.close(timeout=10)  # returns once the sleeping execution has stopped
    assert calls == [1]
    after = snapshot(db, run.id)
    assert after[0][0] == before[0][0]
    assert (
        db.execute("SELECT claim_id FROM workflow_runs WHERE id = %s", (run.id,)).fetchone()[0]
        == thief
    ), "the loser did not release the thief's claim"
    assert after[1] == before[1]


# --- a claim by id is taken once -----------------------------------------------------


@pytest.mark.parametrize("round_", range(3))
def test_two_managers_wait_kicks_claim_a_run_once(
    make_manager: Any, db: psycopg.Connection[Any], round_: int
) -> None:
    counts: dict[str, int] = {"a": 0, "b": 0, "c": 0}
    lock = threading.Lock()

    def counting(name: str) -> Any:
        def fn(run: workflow.TaskRun[Inp]) -> Out:
            with lock:
                counts[name] += 1
            return Out(name)

        return fn

    reg, wf = registry(
        workflow.handle(A, counting("a")),
        workflow.handle(B, counting("b")),
        workflow.handle(C, counting("c")),
    )
    one = make_manager(reg)
    two = make_manager(reg)
    runs = []
    with db.transaction():
        for i in range(5):
            runs.append(wf.start_tx(db, one, Inp(i)))
    barrier = threading.Barrier(4)
    results: list[Status] = []

    def waiter(mgr: workflow.Manager) -> None:
        barrier.wait(10)
        for run in runs:
            results.append(mgr.run(run.id).wait(timeout=30))

    threads = [threading.Thread(target=waiter, args=(mgr,)) for mgr in (one, two, one, two)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    assert results == [Status.SUCCEEDED] * 20
    assert counts == {"a": 5, "b": 5, "c": 5}, "each task of each run executed once"
    assert (
        db.execute(
            "SELECT count(*) FROM workflow_tasks WHERE attempts <> 0 OR output IS NULL"
        ).fetchone()[0]
        == 0
    )
