"""SPEC 6: the poller claims runs left for any process, longest due first, within its limits.

It claims only runs of workflows its manager registered (several services may
share the tables), in order of creation, at most `concurrency` in flight, and a
`wake()` (what the listener and the sweeper call) polls at once, whatever the
poll interval.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import psycopg
import pytest
from helpers import (
    Inp,
    Out,
    all_succeed,
    poll,
    registry,
    start_each_in_its_own_transaction,
    threads_fail_to_start,
    wait_until,
)

import workflow
from workflow import Status

A = workflow.Task("a", Out)


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


def test_a_runnable_whose_poller_cannot_start_stops_what_it_started_and_says_so_again(
    make_manager: Any, db: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Out of threads half-way through start(): the listener, sweeper, pruner and
    # scheduler were running, the poller not. They must not stay behind claiming
    # (the listener and scheduler do), and a second start() must not report success
    # while nothing polls. The manager itself is left whole: its fast path and a new
    # runnable still work.
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)
    runnable = mgr.new_runnable(workflow.RunnerConfig(poll_interval=0.1))
    started = threads_fail_to_start(monkeypatch, lambda t: t.name == "workflow-poller")
    with pytest.raises(RuntimeError, match="can't start new thread"):
        runnable.start()
    monkeypatch.undo()
    names = {thread.name for thread in started}
    assert {"workflow-listener", "workflow-sweeper", "workflow-scheduler"} <= names
    for thread in started:
        thread.join(timeout=10)
        assert not thread.is_alive(), thread.name
    with pytest.raises(workflow.WorkflowError, match="could not start"):
        runnable.start()
    with pytest.raises(workflow.WorkflowError, match="could not start"):
        runnable.run()
    assert wf.start(mgr, Inp(1)).wait(timeout=20) is Status.SUCCEEDED  # the fast path
    with db.transaction():
        queued = wf.start_tx(db, mgr, Inp(2))
    again = mgr.new_runnable(workflow.RunnerConfig(poll_interval=0.1))
    again.start()
    try:
        assert queued.wait(timeout=20) is Status.SUCCEEDED
    finally:
        again.stop(timeout=10)
    assert runnable.stop(timeout=10) is True


CLAIMS_SEEN = """
CREATE TABLE claims_seen (at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE FUNCTION claims_seen() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN INSERT INTO claims_seen DEFAULT VALUES; RETURN NULL; END $$;
CREATE TRIGGER claims_seen AFTER UPDATE ON workflow_runs FOR EACH ROW
WHEN (OLD.claim_id IS NULL AND NEW.claim_id IS NOT NULL) EXECUTE FUNCTION claims_seen();
"""


def test_a_run_no_thread_can_take_is_released_and_the_poller_backs_off(
    make_manager: Any, db: psycopg.Connection[Any], monkeypatch: Any, logs: Any
) -> None:
    # A process out of threads: the poller claims a run, no thread can take it, so it
    # releases it, and it waits before claiming again (0.5 s, doubling, up to the poll
    # interval) rather than claiming the same run four times a second, woken each time
    # by the release's own notification. Once a thread can start, the run is done.
    logger, records = logs
    db.execute(CLAIMS_SEEN)
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg, logger=logger)
    [run] = start_each_in_its_own_transaction(db, wf, mgr, 1)
    runnable = mgr.new_runnable(workflow.RunnerConfig(poll_interval=5, concurrency=2))
    threads_fail_to_start(monkeypatch, lambda t: t.name.startswith("workflow-worker"))
    runnable.start()
    try:
        records.wait_for("no thread could take")
        time.sleep(4)  # a window to count claims in (0 s, 0.5 s, 1.5 s, 3.5 s: four)
        [(claims,)] = db.execute("SELECT count(*) FROM claims_seen").fetchall()
        assert 1 <= claims <= 5, claims
        assert run.status().status is Status.RUNNING  # released, not finished
        monkeypatch.undo()
        all_succeed(db, [run])  # not run.wait(): it would run it on the fast path
    finally:
        runnable.stop(timeout=10)


def test_a_worker_with_fewer_threads_than_its_concurrency_claims_each_run_once(
    make_manager: Any, db: psycopg.Connection[Any], monkeypatch: Any, logs: Any
) -> None:
    # Concurrency 4, but the process can start only two of the poller's threads. The run
    # a third thread would have taken waits for one of the two, and from then on the
    # poller claims no more runs than its threads can take: no run is claimed, released
    # and claimed again (before: each thread coming back led to a claim of up to four
    # runs, two of them released at once, then a pause).
    logger, records = logs
    db.execute(CLAIMS_SEEN)

    def short(run: workflow.TaskRun[Inp]) -> Out:
        time.sleep(0.05)
        return Out(threading.current_thread().name)

    reg, wf = registry(workflow.handle(A, short))
    mgr = make_manager(reg, logger=logger)
    runs = start_each_in_its_own_transaction(db, wf, mgr, 24)
    runnable = mgr.new_runnable(
        workflow.RunnerConfig(poll_interval=0.5, batch_size=4, concurrency=4, listen=False)
    )
    threads_fail_to_start(
        monkeypatch,
        lambda t: t.name.startswith("workflow-worker") and t.name[-1] not in "01",
    )
    runnable.start()
    try:
        all_succeed(db, runs)
    finally:
        assert runnable.stop(timeout=10)
    [(claims,)] = db.execute("SELECT count(*) FROM claims_seen").fetchall()
    assert claims == len(runs)  # each run claimed once: none released for want of a thread
    names = {name for (name,) in db.execute("SELECT output->>'value' FROM workflow_tasks")}
    assert names == {"workflow-worker_0", "workflow-worker_1"}
    said = records.messages()
    assert sum("can't start a new thread" in m for m in said) == 1  # once, not per claim
    assert not [m for m in said if "no thread could take" in m]


def test_a_poller_starts_its_threads_with_it_not_one_per_run_as_a_backlog_comes(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    # Started on demand, each thread was started by the thread handing over a run,
    # under the lock every run thread takes when it comes back: in a busy process that
    # held the first half second of a drain back.
    reg, wf = registry(workflow.handle(A, lambda run: Out(threading.current_thread().name)))
    mgr = make_manager(reg)
    runnable = mgr.new_runnable(workflow.RunnerConfig(poll_interval=0.2, concurrency=3))
    before = set(threading.enumerate())  # an earlier test's threads may still be ending
    runnable.start()
    try:
        names = sorted(t.name for t in set(threading.enumerate()) - before
                       if t.name.startswith("workflow-worker_"))
        assert names == ["workflow-worker_0", "workflow-worker_1", "workflow-worker_2"]
        runs = start_each_in_its_own_transaction(db, wf, mgr, 6)
        all_succeed(db, runs)
    finally:
        assert runnable.stop(timeout=10)


def test_run_from_inside_a_handler_is_refused(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    # It would wait for a stop() that waits for this very handler.
    holder: list[workflow.Runnable] = []

    def calls_run(run: workflow.TaskRun[Inp]) -> Out:
        try:
            holder[0].run()
        except workflow.WorkflowError as exc:
            return Out(str(exc))
        return Out("run() returned")

    reg, wf = registry(workflow.handle(A, calls_run))
    mgr = make_manager(reg)
    runnable = mgr.new_runnable(workflow.RunnerConfig(poll_interval=0.2, listen=False))
    holder.append(runnable)
    [run] = start_each_in_its_own_transaction(db, wf, mgr, 1)
    runnable.start()
    try:
        assert run.wait(timeout=10) is Status.SUCCEEDED
    finally:
        runnable.stop(timeout=5)
    [(text,)] = db.execute(
        "SELECT output->>'value' FROM workflow_tasks WHERE run_id = %s", (run.id,)
    ).fetchall()
    assert "run() was called from inside a handler" in text


def test_a_batch_no_thread_can_take_sets_one_pause_and_the_next_waits_it_out(
    make_manager: Any, db: psycopg.Connection[Any], monkeypatch: Any, logs: Any
) -> None:
    # Four runs claimed together, none taken by a thread: one pause (0.5 s) and one
    # warning for the batch, not four warnings and a pause doubled to 4 s; each later
    # pause comes at least the previous one after it.
    logger, records = logs
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg, logger=logger)
    start_each_in_its_own_transaction(db, wf, mgr, 4)
    runnable = mgr.new_runnable(
        workflow.RunnerConfig(poll_interval=30, batch_size=4, concurrency=4)
    )
    threads_fail_to_start(monkeypatch, lambda t: t.name.startswith("workflow-worker"))
    runnable.start()
    try:
        wait_until(lambda: len(warned(records)) >= 3, "three pauses", timeout=30)
    finally:
        runnable.stop(timeout=10)
    pauses = warned(records)[:3]
    assert [pause for _, pause in pauses] == [0.5, 1.0, 2.0]
    for (at, pause), (later, _) in itertools.pairwise(pauses):
        assert later - at >= 0.8 * pause, pauses


def warned(records: Any) -> list[tuple[float, float]]:
    """(when, pause) of each "no thread could take" warning."""
    found = []
    for record in list(records.records):
        text = record.getMessage()
        if "no thread could take" in text:
            found.append((record.created, float(text.split("claims again in ")[1].split("s")[0])))
    return found


def test_stop_called_on_the_thread_inside_start_returns(
    make_manager: Any, monkeypatch: Any
) -> None:
    # What a signal handler calling stop() does when the signal lands while the main
    # thread is inside start(), holding the runnable's lock and a service's: stop()
    # runs on that same thread. It must not wait for itself.
    import workflow.service

    reg, _ = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)
    runnable = mgr.new_runnable(workflow.RunnerConfig(poll_interval=0.2, listen=False))
    real_start_thread = workflow.service.start_thread
    stopped: list[bool] = []

    def start_thread(thread: threading.Thread) -> None:
        if thread.name == "workflow-sweeper" and not stopped:
            stopped.append(runnable.stop(timeout=5))
        real_start_thread(thread)

    monkeypatch.setattr(workflow.service, "start_thread", start_thread)
    starter = threading.Thread(target=runnable.start, daemon=True)
    starter.start()
    starter.join(15)
    assert not starter.is_alive(), "start() waits for the stop() it is running"
    assert stopped == [True]
    runnable.run()  # returns at once: stopped


def test_a_claim_takes_the_oldest_runs_of_all_its_workflows_and_none_of_others(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    """A claim reads each of its workflows apart (migration 0010) and takes the runs due first
    among them all, across workflows (a new run is due from its creation; one released for a
    retry from the end of its backoff); a workflow named twice is read once; the runs of a
    workflow it does not serve, the first two created, are left alone. Both the poller's
    claim and the one that rides with a worker's finishing writes."""
    managers = {}
    flows = {}
    for name in ("Red", "Blue", "Foreign"):
        reg, flows[name] = registry(workflow.handle(A, lambda run: Out("x")), name=name)
        managers[name] = make_manager(reg)
    order = ["Foreign", "Foreign", "Red", "Blue", "Blue", "Red", "Foreign", "Blue", "Red", "Red"]
    ids: dict[str, list[str]] = {"Red": [], "Blue": [], "Foreign": []}
    created = []
    for name in order:
        with db.transaction():
            run = flows[name].start_tx(db, managers[name], Inp(len(created)))
        ids[name].append(run.id)
        created.append((name, run.id))
    ours = [run_id for name, run_id in created if name != "Foreign"]
    # The first of ours falls due after every other was created: it is claimed last.
    with db.transaction():
        db.execute("UPDATE workflow_runs SET next_retry_at = clock_timestamp() WHERE id = %s",
                   (ours[0],))
    ours = ours[1:] + ours[:1]
    store = managers["Red"]._store

    first = store.claim_runs(["Red", "Blue", "Red"], 3)  # (returned in creation order)
    assert {str(run.id) for run in first} == set(ours[:3])
    assert len({run.claim_id for run in first}) == 3

    steps = [store.step_params(run.id, run.claim_id, 1, None, 2) for run in first]
    answers, then = store.finish_runs(steps, ["Blue", "Red", "Blue"], 4)
    assert answers == [True, True, True]
    assert {str(run.id) for run in then} == set(ours[3:7])

    assert store.claim_runs(["Red", "Blue"], 10) == []
    rows = db.execute(
        "SELECT id::text, claim_id FROM workflow_runs WHERE workflow = 'Foreign'"
    ).fetchall()
    assert sorted(rows) == sorted((run_id, None) for run_id in ids["Foreign"])
