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
import pytest
from helpers import Inp, Out, poll, registry, wait_until

import workflow
from workflow import Status
from workflow.events import ExecutionEnded, RunFinished

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


def finish_together(store: Any, db_url: str, first: Any, threads: list[threading.Thread]) -> None:
    """Start `threads` (each executing a run, `first`'s first) so that they finish at once:
    the first one's step held in flight by a row lock on its run, the others queued
    behind it (their steps then share one statement); wait for all of them."""
    store.steps.flights = 1  # the steps after the first queue, none rides beside it
    with psycopg.connect(db_url) as blocker:
        blocker.execute("SELECT FROM workflow_runs WHERE id = %s FOR UPDATE", (first.id,))
        threads[0].start()
        wait_until(lambda: store.steps.in_flight == 1, "the first step in flight")
        for thread in threads[1:]:
            thread.start()
        wait_until(lambda: store.steps.queued == len(threads) - 1, "the other steps queued")
        blocker.rollback()
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive()


def test_runs_finishing_together_claim_their_threads_next_runs_in_the_same_commit(
    make_manager: Any, db: psycopg.Connection[Any], db_url: str
) -> None:
    """Three worker executions finish at once (the first one's step held in flight by a
    row lock, the other two queued behind it): the two whose finishing steps share a
    statement each come back with a run to go on with, the oldest waiting, claimed in
    that commit, heartbeated and counted; the one written alone comes back with none.
    Executed, the runs they got finish like any other."""
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)
    runs = start_each_in_its_own_transaction(db, wf, mgr, 6)
    store, executor = mgr._store, mgr._executor
    first, *others = store.claim_runs(["W"], 3)
    got: dict[Any, Any] = {}

    def execute(run: Any) -> None:
        executor.admit()
        got[run.id] = executor.execute(run, claim_next=("W",))

    threads = [threading.Thread(target=execute, args=(run,)) for run in (first, *others)]
    finish_together(store, db_url, first, threads)
    assert got[first.id] is None
    following = [got[run.id] for run in others]
    assert sorted(str(run.id) for run, _ in following) == sorted(str(r.id) for r in runs[3:5])
    held = {claim.claim_id for claim in executor.heartbeat.claims()}
    assert {claim.claim_id for _, claim in following} == held
    assert all(run.claim_id == claim.claim_id for run, claim in following)
    # The finishing steps and the claims: one commit.
    xmins = db.execute(
        "SELECT DISTINCT xmin::text FROM workflow_runs WHERE id = ANY(%s)",
        ([run.id for run in others] + [run.id for run, _ in following],),
    ).fetchall()
    assert len(xmins) == 1
    for run, claim in following:
        assert executor.execute(run, claim=claim) is None
    assert not executor.heartbeat.claims()
    all_succeed(db, runs[:5])
    assert db.execute("SELECT claim_id FROM workflow_runs WHERE id = %s",
                      (runs[5].id,)).fetchone() == (None,)


@pytest.mark.parametrize("raised_on", [RunFinished, ExecutionEnded])
def test_a_run_claimed_by_a_finish_is_let_go_of_when_an_interrupt_ends_the_execution(
    make_manager: Any, db: psycopg.Connection[Any], db_url: str, raised_on: type
) -> None:
    """A `SystemExit` raised after a finish claimed this thread's next run (here by an
    event subscriber, as the run finishes or as its execution ends) ends the execution
    and goes on up: the run the finish claimed, which nobody will execute now, is let
    go of at once (no heartbeat, not counted in flight, claimable, no attempt charged),
    not left held until the process exits and then swept; the execution that raised is
    uncounted too."""
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)
    runs = start_each_in_its_own_transaction(db, wf, mgr, 5)
    store, executor = mgr._store, mgr._executor
    first, *others = store.claim_runs(["W"], 3)
    interrupted = {run.id for run in others}

    def exit_on_finish(event: Any) -> None:
        if isinstance(event, raised_on) and event.run_id in interrupted:
            raise SystemExit(3)

    mgr.events.subscribe(exit_on_finish)
    raised: dict[Any, Any] = {}

    def execute(run: Any) -> None:
        executor.admit()
        try:
            raised[run.id] = executor.execute(run, claim_next=("W",))
        except SystemExit as e:
            raised[run.id] = e

    threads = [threading.Thread(target=execute, args=(run,)) for run in (first, *others)]
    finish_together(store, db_url, first, threads)
    assert raised[first.id] is None
    assert all(isinstance(raised[run.id], SystemExit) for run in others)
    assert not executor.heartbeat.claims()
    assert executor._in_flight == 0
    rows = db.execute(
        "SELECT r.claim_id, r.released_claim IS NOT NULL, t.attempts FROM workflow_runs r "
        "JOIN workflow_tasks t ON t.run_id = r.id WHERE r.id = ANY(%s)",
        ([run.id for run in runs[3:]],),
    ).fetchall()
    assert rows == [(None, True, 0), (None, True, 0)]
    assert sorted(str(r.id) for r in store.claim_runs(["W"], 5)) == sorted(
        str(r.id) for r in runs[3:]
    )
