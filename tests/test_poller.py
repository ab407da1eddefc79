"""SPEC 6: the poller claims runs left for any process, longest due first, within its limits.

It claims only runs of workflows its manager registered (several services may
share the tables), in order of creation, at most `concurrency` in flight, and a
`wake()` (what the listener and the sweeper call) polls at once, whatever the
poll interval.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
from helpers import Inp, Out, poll, registry

import workflow
from workflow import Status

A = workflow.Task("a", Out)


def start_each_in_its_own_transaction(
    db: psycopg.Connection[Any], wf: Any, mgr: workflow.Manager, count: int
) -> list[workflow.Run]:
    runs = []
    for n in range(count):
        with db.transaction():  # one transaction each: distinct created_at
            runs.append(wf.start_tx(db, mgr, Inp(n)))
    return runs


def all_succeed(db: psycopg.Connection[Any], runs: list[workflow.Run]) -> None:
    """Poll the database until every run succeeded (`run.wait()` would claim runs itself)."""
    poll(
        db,
        "SELECT count(*) = %s FROM workflow_runs WHERE id = ANY(%s) AND status = 'succeeded'",
        (len(runs), [run.id for run in runs]),
        timeout=30,
        what="every run to succeed",
    )


def test_the_poller_claims_oldest_first(make_manager: Any, db: psycopg.Connection[Any]) -> None:
    order: list[int] = []
    reg, wf = registry(workflow.handle(A, lambda run: order.append(run.input.n) or Out("x")))
    mgr = make_manager(reg)
    runs = start_each_in_its_own_transaction(db, wf, mgr, 8)
    runnable = mgr.new_runnable(
        workflow.RunnerConfig(poll_interval=0.2, batch_size=1, concurrency=1, listen=False)
    )
    runnable.start()
    try:
        all_succeed(db, runs)
    finally:
        runnable.stop(timeout=10)
    assert order == list(range(8))


def test_the_poller_never_runs_more_than_its_concurrency(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    lock = threading.Lock()
    now = [0]
    most = [0]

    def counts(run: workflow.TaskRun[Inp]) -> Out:
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        time.sleep(0.05)
        with lock:
            now[0] -= 1
        return Out("x")

    reg, wf = registry(workflow.handle(A, counts))
    mgr = make_manager(reg, workflow.Config(max_local_runs=1))
    runs = start_each_in_its_own_transaction(db, wf, mgr, 12)
    runnable = mgr.new_runnable(
        workflow.RunnerConfig(poll_interval=0.1, batch_size=10, concurrency=3, listen=False)
    )
    runnable.start()
    try:
        all_succeed(db, runs)
    finally:
        runnable.stop(timeout=10)
    assert most[0] == 3


def test_the_poller_leaves_other_services_runs_alone(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    ours_reg, ours = registry(workflow.handle(A, lambda run: Out("ours")), name="Ours")
    theirs_reg, theirs = registry(workflow.handle(A, lambda run: Out("theirs")), name="Theirs")
    ours_mgr, theirs_mgr = make_manager(ours_reg), make_manager(theirs_reg)
    with db.transaction():
        mine = ours.start_tx(db, ours_mgr, Inp(1))
        other = theirs.start_tx(db, theirs_mgr, Inp(2))
    runnable = ours_mgr.new_runnable(workflow.RunnerConfig(poll_interval=0.1, listen=False))
    runnable.start()
    try:
        assert mine.wait(timeout=20) is Status.SUCCEEDED
        time.sleep(0.3)  # several polls
    finally:
        runnable.stop(timeout=10)
    row = db.execute(
        "SELECT status, claim_id FROM workflow_runs WHERE id = %s", (other.id,)
    ).fetchone()
    assert row == ("pending", None)


def test_a_wake_polls_at_once_whatever_the_poll_interval(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)
    runnable = mgr.new_runnable(workflow.RunnerConfig(poll_interval=60, listen=False))
    runnable.start()
    try:
        # The first poll happens as the thread starts and finds nothing; the next
        # would be a minute away. (No wait(): it would claim the run itself.)
        time.sleep(0.5)
        with db.transaction():
            run = wf.start_tx(db, mgr, Inp(1))
        runnable._poller.wake()
        poll(
            db,
            "SELECT status FROM workflow_runs WHERE id = %s",
            (run.id,),
            until=lambda row: row[0] == "succeeded",
            timeout=10,
            what="the run, claimed by the woken poller",
        )
    finally:
        runnable.stop(timeout=10)



B = workflow.Task("b", Out)
C = workflow.Task("c", Out)
BLOCK = 1.2
"""Seconds each of a blocking run's three tasks takes: together past sweep_max_age."""


def _run_row(db: psycopg.Connection[Any], run: workflow.Run) -> tuple[Any, ...]:
    row = db.execute(
        "SELECT r.status, r.claim_id, r.released_claim, max(t.attempts) FROM workflow_runs r"
        " JOIN workflow_tasks t ON t.run_id = r.id WHERE r.id = %s"
        " GROUP BY r.status, r.claim_id, r.released_claim",
        (run.id,),
    ).fetchone()
    assert row is not None
    return tuple(row)


class _Blocking:
    """Each task of a run with input n >= 1000 takes BLOCK seconds (less when cancelled);
    other runs' tasks take `pause`."""

    def __init__(self, pause: float) -> None:
        self.entered = threading.Event()
        self.pause = pause

    def __call__(self, run: workflow.TaskRun[Inp]) -> Out:
        if run.input.n >= 1000:
            self.entered.set()
            run.cancelled.wait(BLOCK)
        else:
            time.sleep(self.pause)
        return Out("x")


def _claimed_ahead_setup(
    make_manager: Any, db: psycopg.Connection[Any], pause: float
) -> tuple[workflow.Runnable, workflow.Run, workflow.Run]:
    """One thread, a batch of 2, sweep_max_age 3 s: runs whose tasks take `pause` end
    first, then a run whose three tasks take BLOCK seconds each holds the only thread,
    and another run is started behind it."""
    handler = _Blocking(pause)
    reg, wf = registry(workflow.handle(A, handler), workflow.handle(B, handler),
                       workflow.handle(C, handler))
    mgr = make_manager(
        reg, workflow.Config(sweep_max_age=3, default_task_timeout=2, max_in_process_backoff=0.1)
    )
    runnable = mgr.new_runnable(
        workflow.RunnerConfig(poll_interval=0.2, batch_size=2, concurrency=1, sweep_interval=0.5)
    )
    runnable.start()
    all_succeed(db, start_each_in_its_own_transaction(db, wf, mgr, 4))
    with db.transaction():
        blocker = wf.start_tx(db, mgr, Inp(1000))
    assert handler.entered.wait(10)
    with db.transaction():
        waiting = wf.start_tx(db, mgr, Inp(1))
    return runnable, blocker, waiting


def _claimed_ahead(db: psycopg.Connection[Any], run: workflow.Run) -> Any:
    """The claim the run was claimed ahead under (its tasks not yet attempted)."""
    poll(db, "SELECT claim_id IS NOT NULL FROM workflow_runs WHERE id = %s", (run.id,),
         timeout=10, what="the run to be claimed ahead")
    status, claim, _, attempts = _run_row(db, run)
    assert (status, attempts) == ("running", 0)
    return claim


def test_a_run_claimed_ahead_keeps_its_claim_while_it_waits_for_a_thread(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    # Executions are quick, so the poller claims a run more than it has threads for.
    # That run waits 3.6 s for the only thread, past sweep_max_age, with a sweep every
    # 0.5 s: its claim is heartbeated from the claim on, so it is never swept, and it
    # runs once, under the claim it was claimed ahead with.
    runnable, blocker, waiting = _claimed_ahead_setup(make_manager, db, 0.0)
    try:
        claim = _claimed_ahead(db, waiting)
        all_succeed(db, [blocker, waiting])
    finally:
        runnable.stop(timeout=10)
    # Attempts count failed and swept attempts: a sweep would have made it 1.
    assert _run_row(db, waiting) == ("succeeded", None, claim, 0)


def test_a_drain_releases_a_run_claimed_ahead_without_attempting_it(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    runnable, _blocker, waiting = _claimed_ahead_setup(make_manager, db, 0.0)
    try:
        claim = _claimed_ahead(db, waiting)
        assert runnable.stop(timeout=10)
        # Let go of by its own claim (not swept: no attempt counted), never attempted.
        assert _run_row(db, waiting)[1:] == (None, claim, 0)
    finally:
        runnable.stop(timeout=10)


def test_nothing_is_claimed_ahead_while_executions_are_slow(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    # Executions of 0.3 s (three tasks of 0.1 s: past AHEAD_HORIZON): a run started
    # behind the busy thread stays unclaimed, for any other worker to take.
    runnable, blocker, waiting = _claimed_ahead_setup(make_manager, db, 0.1)
    try:
        time.sleep(1.0)
        assert _run_row(db, waiting)[1] is None
        all_succeed(db, [blocker, waiting])
    finally:
        runnable.stop(timeout=10)
