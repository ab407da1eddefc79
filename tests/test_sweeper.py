"""SPEC 6 and 9 (invariants 4, 5): the sweeper releases stale claims, counting the attempt.

A claim whose heartbeat is older than `sweep_max_age` is stale: its executor
crashed, or hangs past its timeout. The sweeper releases it and counts the
abandoned attempt on the run's current task, in one guarded statement, so many
replicas may sweep at once and each stale claim is swept exactly once. A hung
handler's late write is fenced out.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
from helpers import FirstAttempt, Inp, Out, poll, registry, snapshot
from pgbouncer import runner_config

import workflow
from workflow import Status

A = workflow.Task("a", Out)
B = workflow.Task("b", Out)

RUN_SQL = """
SELECT r.claim_id, r.heartbeat_at, now() - r.heartbeat_at, r.status, t.attempts, t.output,
       r.current_seq
FROM workflow_runs r JOIN workflow_tasks t ON t.run_id = r.id AND t.seq = 1
WHERE r.id = %s
"""




def hung_run(
    make_manager: Any, db: psycopg.Connection[Any], release: threading.Event
) -> tuple[workflow.Manager, FirstAttempt, workflow.Registry, workflow.Run, Any]:
    def hangs(run: workflow.TaskRun[Inp]) -> Out:
        assert release.wait(30)  # ignores `cancelled`
        return Out("hung attempt")

    handler = FirstAttempt(hangs)
    # Heartbeat every 0.25 s; a claim is stale after 1 s without one.
    config = workflow.Config(sweep_max_age=1, max_in_process_backoff=0, default_task_timeout=0.5)
    reg, wf = registry(
        workflow.handle(A, handler, timeout=0.3, max_attempts=3, backoff_schedule=[0]),
        workflow.handle(B, lambda run: Out("b saw " + run.output(A).value)),
    )
    mgr = make_manager(reg, config)
    run = wf.start(mgr, Inp(1))
    assert handler.started.wait(10)
    return mgr, handler, reg, run, config


def test_hung_handler_is_swept_after_sweep_max_age_with_its_attempt_counted(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    release = threading.Event()
    try:
        mgr, handler, reg, run, config = hung_run(make_manager, db, release)
        claim = db.execute(RUN_SQL, (run.id,)).fetchone()[0]
        sweeper = mgr.new_runnable(runner_config(listen=False)).sweeper
        assert sweeper is not None
        deadline = time.monotonic() + 20
        swept = 0
        while swept == 0:
            # The heartbeat read before the sweep, the clock read after it: a claim the
            # sweep took must have been a second old by the time the sweep ended (a
            # check of "stale now" before the sweep would race the claim's ageing).
            beat_before = db.execute(
                "SELECT heartbeat_at FROM workflow_runs WHERE id = %s", (run.id,)
            ).fetchone()[0]
            swept = sweeper.sweep()
            after = db.execute("SELECT clock_timestamp()").fetchone()[0]
            assert swept == 0 or (after - beat_before).total_seconds() > 1.0, (
                "only a claim older than sweep_max_age is swept"
            )
            assert time.monotonic() < deadline, "the hung claim was never swept"
            time.sleep(0.05)
        assert swept == 1
        row = db.execute(
            "SELECT r.claim_id, r.heartbeat_at, r.status, r.next_retry_at <= now(), "
            "t.attempts, t.error, t.failed_at IS NOT NULL, t.output "
            "FROM workflow_runs r JOIN workflow_tasks t ON t.run_id = r.id AND t.seq = 1 "
            "WHERE r.id = %s",
            (run.id,),
        ).fetchone()
        claim_after, beat, status, due, attempts, error, failed, output = row
        assert (claim_after, beat, status, due) == (None, None, "running", True)
        assert attempts == 1, "the abandoned attempt counts"
        assert failed and "abandoned" in error
        assert output is None
        assert sweeper.sweep() == 0, "sweeping again changes nothing"
        assert claim is not None

        other = make_manager(reg, config)
        assert other.run(run.id).wait(timeout=30) is Status.SUCCEEDED
        assert [r.attempt for r in handler.runs] == [1, 2]
        before = snapshot(db, run.id)
    finally:
        release.set()
    mgr.close(timeout=10)  # the hung execution ends; its late write is fenced out
    assert snapshot(db, run.id) == before
    assert db.execute(
        "SELECT seq, attempts, output FROM workflow_tasks WHERE run_id = %s ORDER BY seq",
        (run.id,),
    ).fetchall() == [(1, 1, {"value": "attempt 2"}), (2, 0, {"value": "b saw attempt 2"})]


def test_runnable_sweeps_a_hung_handler_and_its_poller_finishes_the_run(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    release = threading.Event()
    try:
        mgr, handler, _, run, _ = hung_run(make_manager, db, release)
        runnable = mgr.new_runnable(runner_config(sweep_interval=0.1, poll_interval=0.1))
        runnable.start()
        try:
            poll(
                db,
                "SELECT status FROM workflow_runs WHERE id = %s",
                (run.id,),
                until=lambda r: r[0] == "succeeded",
                timeout=30,
            )
        finally:
            release.set()
            runnable.stop(timeout=10)
    finally:
        release.set()
    assert [r.attempt for r in handler.runs] == [1, 2]
    assert db.execute(
        "SELECT attempts, output FROM workflow_tasks WHERE run_id = %s AND seq = 1", (run.id,)
    ).fetchone() == (1, {"value": "attempt 2"})


def test_wait_on_the_hung_runs_manager_sees_it_finished_elsewhere(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    """SPEC 4: a run finished elsewhere is seen by wait() within about a second.

    The run's first execution is still hung in this manager (its handler ignores
    `cancelled`); it was swept and another manager finished the run.
    """
    release = threading.Event()
    try:
        mgr, _, reg, run, config = hung_run(make_manager, db, release)
        sweeper = mgr.new_runnable(runner_config(listen=False)).sweeper
        assert sweeper is not None
        deadline = time.monotonic() + 20
        while sweeper.sweep() == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        other = make_manager(reg, config)
        assert other.run(run.id).wait(timeout=30) is Status.SUCCEEDED
        assert mgr.run(run.id).wait(timeout=5) is Status.SUCCEEDED
    finally:
        release.set()


def test_sweepers_in_many_replicas_sweep_each_stale_claim_once(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    managers = [make_manager(reg) for _ in range(3)]
    with db.transaction():
        runs = [wf.start_tx(db, managers[0], Inp(n)) for n in range(60)]
    db.execute(
        "UPDATE workflow_runs SET claim_id = gen_random_uuid(), status = 'running', "
        "heartbeat_at = now() - interval '1 hour'"
    )
    sweepers = [m.new_runnable(runner_config(listen=False)).sweeper for m in managers]
    barrier = threading.Barrier(len(sweepers))
    counts: list[int] = []

    def sweep(sweeper: Any) -> None:
        barrier.wait()
        counts.append(sweeper.sweep())

    threads = [threading.Thread(target=sweep, args=(s,)) for s in sweepers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sum(counts) == len(runs), counts
    rows = db.execute(
        "SELECT r.claim_id IS NULL, t.attempts FROM workflow_runs r "
        "JOIN workflow_tasks t ON t.run_id = r.id AND t.seq = 1"
    ).fetchall()
    assert set(rows) == {(True, 1)}, "each stale claim released once, its attempt counted once"
