"""SPEC 12: operating runs with `workflow.Admin`: see, cancel, resume, fork, prune, stats.

Cancelling is a fenced revocation: the run becomes CANCELLED and loses its claim
in one statement, so a running execution's next write matches nothing; its
handler sees `cancelled` within about a second; what it returns afterwards is
discarded and not counted; the next task never starts. Resuming gives the
stopped task a fresh budget. Every change is in the run's history.
"""

from __future__ import annotations

import datetime
import threading
import time
import uuid
from typing import Any

import attrs
import psycopg
import pytest
from helpers import Inp, Out, poll, registry, wait_until

import workflow
from workflow import Status

A = workflow.Task("a", Out)
B = workflow.Task("b", Out)
C = workflow.Task("c", Out)


@pytest.fixture
def admin(pool: Any) -> Any:
    adm = workflow.Admin(pool)
    yield adm
    adm.close()


def rows(db: psycopg.Connection[Any], run_id: str) -> Any:
    return db.execute(
        "SELECT r.status, r.claim_id, r.finished_at IS NOT NULL, "
        "array_agg(t.attempts ORDER BY t.seq), array_agg(t.output IS NOT NULL ORDER BY t.seq) "
        "FROM workflow_runs r JOIN workflow_tasks t ON t.run_id = r.id WHERE r.id = %s "
        "GROUP BY r.id",
        (run_id,),
    ).fetchone()


def history(admin: workflow.Admin, run_id: str) -> list[str]:
    return [entry.kind for entry in admin.run(run_id).history]


class Calls:
    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def add(self, task: str, attempt: int) -> None:
        with self.lock:
            self.seen.append((task, attempt))


def recording(calls: Calls, task: str, fail_first: bool = False) -> Any:
    def fn(run: workflow.TaskRun[Inp]) -> Out:
        calls.add(task, run.attempt)
        if fail_first and run.attempt == 1:
            raise workflow.with_code("down", RuntimeError(f"{task} provider down"))
        return Out(task)

    return fn


# --- cancel ------------------------------------------------------------------------------


def test_cancel_a_pending_run_and_no_worker_ever_runs_it(
    make_manager: Any, admin: workflow.Admin, db: psycopg.Connection[Any]
) -> None:
    """Durable: a worker started after the cancel (it was down when it happened) honours it."""
    calls = Calls()
    reg, wf = registry(workflow.handle(A, recording(calls, "a")))
    mgr = make_manager(reg)
    with db.transaction():
        run = wf.start_tx(db, mgr, Inp(1))
    status = admin.cancel(run.id, reason="customer withdrew", actor="ops")
    assert status.status is Status.CANCELLED and status.finished_at is not None
    runnable = mgr.new_runnable(workflow.RunnerConfig(poll_interval=0.1, listen=False))
    runnable.start()
    try:
        assert run.wait(timeout=5) is Status.CANCELLED
        time.sleep(0.3)
    finally:
        runnable.stop(timeout=10)
    assert calls.seen == []
    (entry,) = admin.run(run.id).history
    assert (entry.kind, entry.actor, entry.reason) == ("cancelled", "ops", "customer withdrew")


def test_cancel_a_run_waiting_to_retry_and_a_parked_run(
    make_manager: Any, admin: workflow.Admin, db: psycopg.Connection[Any]
) -> None:
    calls = Calls()
    reg, wf = registry(
        workflow.handle(A, recording(calls, "a", fail_first=True), backoff_schedule=[3600])
    )
    mgr = make_manager(reg)
    waiting = wf.start(mgr, Inp(1))
    poll(db, "SELECT claim_id IS NULL AND next_retry_at > now() FROM workflow_runs WHERE id = %s",
         (waiting.id,))
    assert admin.cancel(waiting.id).status is Status.CANCELLED
    assert waiting.wait(timeout=5) is Status.CANCELLED

    reg2, wf2 = registry(
        workflow.handle(A, lambda run: (_ for _ in ()).throw(workflow.Permanent("no"))),
        name="Parks",
    )
    parked = wf2.start(make_manager(reg2), Inp(1))
    assert parked.wait(timeout=10) is Status.PARKED
    assert admin.cancel(parked.id).status is Status.CANCELLED
    assert history(admin, parked.id) == ["parked", "cancelled"]


def test_cancel_a_running_run_sets_cancelled_discards_its_result_and_starts_no_next_task(
    make_manager: Any, admin: workflow.Admin, db: psycopg.Connection[Any]
) -> None:
    entered = threading.Event()
    saw: dict[str, float] = {}
    b_calls = Calls()

    def long(run: workflow.TaskRun[Inp]) -> Out:
        entered.set()
        began = time.monotonic()
        if run.cancelled.wait(20):
            saw["after"] = time.monotonic() - began
        return Out("returned after the cancel")

    reg, wf = registry(
        workflow.handle(A, long, timeout=30), workflow.handle(B, recording(b_calls, "b"))
    )
    mgr = make_manager(reg)
    run = wf.start(mgr, Inp(1))
    assert entered.wait(10)
    cancelled_at = time.monotonic()
    assert admin.cancel(run.id, reason="stop it").status is Status.CANCELLED
    assert run.wait(timeout=10) is Status.CANCELLED
    wait_until(lambda: "after" in saw, "the handler to see cancelled")
    assert time.monotonic() - cancelled_at < 5
    time.sleep(0.3)
    status, claim, finished, attempts, outputs = rows(db, run.id)
    assert (status, claim, finished) == ("cancelled", None, True)
    assert attempts == [0, 0], "the cancelled attempt is not counted"
    assert outputs == [False, False], "what it returned afterwards is discarded"
    assert b_calls.seen == [], "the next task never starts"


def test_cancel_leaves_a_succeeded_or_cancelled_run_as_it_is(
    make_manager: Any, admin: workflow.Admin
) -> None:
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    run = wf.start(make_manager(reg), Inp(1))
    assert run.wait(timeout=10) is Status.SUCCEEDED
    assert admin.cancel(run.id).status is Status.SUCCEEDED
    assert history(admin, run.id) == []


def test_unknown_and_malformed_ids_are_run_not_found(admin: workflow.Admin) -> None:
    for bad in (str(uuid.uuid4()), "not-a-run", ""):
        for call in (admin.cancel, admin.resume, admin.run, admin.fork):
            with pytest.raises(workflow.RunNotFound):
                call(bad)


# --- resume ------------------------------------------------------------------------------


def test_resume_a_parked_run_with_a_fresh_budget_its_earlier_tasks_kept(
    make_manager: Any, admin: workflow.Admin, db: psycopg.Connection[Any]
) -> None:
    calls = Calls()
    fixed = threading.Event()

    def b(run: workflow.TaskRun[Inp]) -> Out:
        calls.add("b", run.attempt)
        if not fixed.is_set():
            raise workflow.with_code("rejected", RuntimeError("provider rejects"))
        return Out("b")

    reg, wf = registry(
        workflow.handle(A, recording(calls, "a")),
        workflow.handle(B, b, max_attempts=2, backoff_schedule=[0.01]),
    )
    mgr = make_manager(reg)
    run = wf.start(mgr, Inp(1))
    assert run.wait(timeout=10) is Status.PARKED
    assert calls.seen == [("a", 1), ("b", 1), ("b", 2)]
    detail = admin.run(run.id)
    assert [(t.name, t.state, t.attempts) for t in detail.tasks] == [
        ("a", "done", 0), ("b", "current", 2)
    ]
    assert detail.failure is not None and detail.failure.code == "rejected"
    fixed.set()
    status = admin.resume(run.id, reason="provider fixed", actor="ops")
    assert status.status is Status.RUNNING and status.failure is None
    # No longer terminal anywhere: the manager that parked it waits for its new end.
    runnable = mgr.new_runnable(workflow.RunnerConfig(poll_interval=0.1, listen=False))
    runnable.start()
    try:
        assert run.wait(timeout=20) is Status.SUCCEEDED
    finally:
        runnable.stop(timeout=10)
    assert calls.seen[3:] == [("b", 1)], "a fresh budget, and task a not run again"
    assert history(admin, run.id) == ["failed", "parked", "resumed"]
    resumed = admin.run(run.id).history[-1]
    assert (resumed.actor, resumed.reason, resumed.task) == ("ops", "provider fixed", "b")


def test_resume_a_cancelled_run_with_tasks_left(
    make_manager: Any, admin: workflow.Admin, db: psycopg.Connection[Any]
) -> None:
    calls = Calls()
    reg, wf = registry(workflow.handle(A, recording(calls, "a")))
    mgr = make_manager(reg)
    with db.transaction():
        run = wf.start_tx(db, mgr, Inp(1))
    admin.cancel(run.id)
    assert admin.resume(run.id).status is Status.RUNNING
    assert run.wait(timeout=10) is Status.SUCCEEDED  # the wait() kick runs it here
    assert calls.seen == [("a", 1)]


@pytest.mark.parametrize("state", ["pending", "succeeded"])
def test_resume_of_any_other_status_is_not_resumable(
    make_manager: Any, admin: workflow.Admin, db: psycopg.Connection[Any], state: str
) -> None:
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)
    if state == "pending":
        with db.transaction():
            run = wf.start_tx(db, mgr, Inp(1))
    else:
        run = wf.start(mgr, Inp(1))
        assert run.wait(timeout=10) is Status.SUCCEEDED
    with pytest.raises(workflow.NotResumable, match=state):
        admin.resume(run.id)


def test_two_resumes_at_once_one_wins(
    make_manager: Any, pool: Any, db: psycopg.Connection[Any]
) -> None:
    reg, wf = registry(
        workflow.handle(A, lambda run: (_ for _ in ()).throw(workflow.Permanent("no")))
    )
    run = wf.start(make_manager(reg), Inp(1))
    assert run.wait(timeout=10) is Status.PARKED
    admins = [workflow.Admin(pool) for _ in range(4)]
    barrier = threading.Barrier(len(admins))
    outcomes: list[str] = []

    def resume(adm: workflow.Admin) -> None:
        barrier.wait()
        try:
            adm.resume(run.id)
            outcomes.append("resumed")
        except workflow.NotResumable:
            outcomes.append("refused")

    threads = [threading.Thread(target=resume, args=(a,)) for a in admins]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert sorted(outcomes) == ["refused"] * 3 + ["resumed"]
    count = db.execute(
        "SELECT count(*) FROM workflow_events WHERE run_id = %s AND kind = 'resumed'", (run.id,)
    ).fetchone()
    assert count == (1,)


# --- fork --------------------------------------------------------------------------------


def test_fork_from_a_task_copies_the_earlier_outputs_and_records_where_it_came_from(
    make_manager: Any, admin: workflow.Admin, db: psycopg.Connection[Any]
) -> None:
    calls = Calls()

    def c(run: workflow.TaskRun[Inp]) -> Out:
        calls.add("c", run.attempt)
        return Out("c saw " + run.output(A).value + "+" + run.output(B).value)

    reg, wf = registry(
        workflow.handle(A, recording(calls, "a")),
        workflow.handle(B, recording(calls, "b")),
        workflow.handle(C, c),
    )
    mgr = make_manager(reg)
    original = wf.start(mgr, Inp(1))
    assert original.wait(timeout=10) is Status.SUCCEEDED
    before = rows(db, original.id)
    fork_id = admin.fork(original.id, from_task="c", reason="re-send", actor="ops")
    assert mgr.run(fork_id).wait(timeout=10) is Status.SUCCEEDED
    assert calls.seen == [("a", 1), ("b", 1), ("c", 1), ("c", 1)], "only c ran again"
    detail = admin.run(fork_id)
    assert detail.forked_from == original.id
    assert detail.input == {"n": 1}
    out = db.execute(
        "SELECT output FROM workflow_tasks WHERE run_id = %s AND seq = 3", (fork_id,)
    ).fetchone()
    assert out == ({"value": "c saw a+b"},)
    assert rows(db, original.id) == before, "the original is not changed"
    (event,) = admin.run(original.id).history
    assert (event.kind, event.other_run, event.actor) == ("forked", fork_id, "ops")
    with pytest.raises(ValueError, match="no task 'zz'"):
        admin.fork(original.id, from_task="zz")
    with pytest.raises(workflow.WorkflowError, match="from_task"):
        admin.fork(original.id)


def test_a_fork_of_a_sealed_run_opens_with_the_cipher(
    make_manager: Any, admin: workflow.Admin, db: psycopg.Connection[Any]
) -> None:
    config = workflow.Config(cipher=workflow.AESGCMCipher([bytes(range(32))]))
    seen: list[int] = []
    reg, wf = registry(
        workflow.handle(A, lambda run: seen.append(run.input.n) or Out("a")),
        workflow.handle(B, lambda run: (_ for _ in ()).throw(workflow.Permanent("no"))),
    )
    mgr = make_manager(reg, config)
    run = wf.start(mgr, Inp(41))
    assert run.wait(timeout=10) is Status.PARKED
    assert admin.run(run.id).input == "sealed"
    fork_id = admin.fork(run.id, from_task="a")
    assert mgr.run(fork_id).wait(timeout=10) is Status.PARKED
    assert seen == [41, 41], "the fork's handler opened the input sealed for the original"
    assert wf.input(mgr, fork_id) == Inp(41)


# --- bulk --------------------------------------------------------------------------------


def test_bulk_cancel_and_resume_of_a_filter(
    make_manager: Any, admin: workflow.Admin, db: psycopg.Connection[Any]
) -> None:
    reg, wf = registry(
        workflow.handle(A, lambda run: (_ for _ in ()).throw(workflow.Permanent("no")))
    )
    mgr = make_manager(reg)
    runs = [wf.start(mgr, Inp(n)) for n in range(7)]
    assert {run.wait(timeout=10) for run in runs} == {Status.PARKED}
    assert admin.count(status="parked", workflow="W") == 7
    seen: list[int] = []
    assert admin.resume_matching(workflow="W", batch_size=3, progress=seen.append) == 7
    assert seen == [3, 6, 7]
    assert admin.count(status="running") == 7, "resumed: claimable, waiting for an executor"
    assert admin.cancel_matching(status=Status.RUNNING, workflow="W", batch_size=2) == 7
    assert admin.count(status="cancelled") == 7
    assert admin.cancel_matching(status="cancelled") == 0
    assert admin.resume_matching(status="cancelled", since=datetime.timedelta(hours=1)) == 7


# --- listing and paging --------------------------------------------------------------------


def test_runs_pages_newest_first_through_ties_in_created_at(
    make_manager: Any, admin: workflow.Admin, db: psycopg.Connection[Any]
) -> None:
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)
    with db.transaction():  # one transaction: one created_at for all
        ids = {wf.start_tx(db, mgr, Inp(n)).id for n in range(23)}
    seen: list[str] = []
    page = admin.runs(limit=5)
    while True:
        seen += [item.id for item in page.items]
        if page.next is None:
            break
        page = admin.runs(limit=5, after=page.next)
    assert len(seen) == 23 and set(seen) == ids, "every run once"
    assert admin.runs(status=["running", "succeeded"]).items == ()
    assert len(admin.runs(workflow="W", since=datetime.timedelta(hours=1)).items) == 23
    assert admin.runs(until=datetime.timedelta(hours=1)).items == ()
    with pytest.raises(ValueError, match="unknown status"):
        admin.runs(status="lost")
    with pytest.raises(ValueError, match="timezone"):
        admin.runs(since=datetime.datetime(2026, 1, 1))
    with pytest.raises(ValueError, match="page token"):
        admin.runs(after="garbage")


def test_run_detail_shows_the_timeline_the_input_and_the_history(
    make_manager: Any, admin: workflow.Admin
) -> None:
    calls = Calls()
    reg, wf = registry(
        workflow.handle(A, recording(calls, "a", fail_first=True), backoff_schedule=[0.01]),
        workflow.handle(B, lambda run: (_ for _ in ()).throw(
            workflow.Permanent("card declined", code="declined"))),
        workflow.handle(C, recording(calls, "c")),
    )
    run = wf.start(make_manager(reg), Inp(5))
    assert run.wait(timeout=10) is Status.PARKED
    detail = admin.run(run.id)
    assert detail.input == {"n": 5} and detail.task == "b" and detail.status is Status.PARKED
    assert [(t.name, t.state, t.attempts, t.code) for t in detail.tasks] == [
        ("a", "done", 1, "down"), ("b", "current", 1, "declined"), ("c", "waiting", 0, None)
    ]
    kinds = [(e.kind, e.task, e.attempt, e.code) for e in detail.history]
    assert kinds == [("failed", "a", 1, "down"), ("parked", "b", 1, "declined")]
    listed = admin.runs().items[0]
    assert attrs.asdict(listed) == {
        k: v for k, v in attrs.asdict(detail).items() if k in attrs.asdict(listed)
    }


# --- retention -----------------------------------------------------------------------------


def test_prune_deletes_old_finished_runs_in_batches_and_frees_their_keys(
    make_manager: Any, admin: workflow.Admin, db: psycopg.Connection[Any]
) -> None:
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)
    runs = [wf.start(mgr, Inp(n), idempotency_key=f"k{n}") for n in range(25)]
    assert {run.wait(timeout=10) for run in runs} == {Status.SUCCEEDED}
    assert admin.count_prunable(older_than=datetime.timedelta(days=1)) == 0
    db.execute("UPDATE workflow_runs SET finished_at = now() - interval '8 days'")
    assert admin.count_prunable(older_than=datetime.timedelta(days=7)) == 25
    seen: list[int] = []
    assert admin.prune(older_than=datetime.timedelta(days=7), batch_size=10,
                       progress=seen.append) == 25
    assert seen == [10, 20, 25]
    assert db.execute(
        "SELECT (SELECT count(*) FROM workflow_runs), (SELECT count(*) FROM workflow_tasks)"
    ).fetchone() == (0, 0)
    again = wf.start(mgr, Inp(0), idempotency_key="k0")
    assert again.id not in {run.id for run in runs}, "a pruned run frees its key"
    with pytest.raises(ValueError, match="finished"):
        admin.prune(older_than=0, statuses=["running"])


def test_the_workers_pruner_keeps_parked_runs_by_default(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    reg, wf = registry(
        workflow.handle(A, lambda run: (_ for _ in ()).throw(workflow.Permanent("no")))
    )
    ok_reg, ok = registry(workflow.handle(A, lambda run: Out("x")), name="Ok")
    mgr, ok_mgr = make_manager(reg), make_manager(ok_reg)
    parked = wf.start(mgr, Inp(1))
    done = ok.start(ok_mgr, Inp(1))
    assert parked.wait(timeout=10) is Status.PARKED and done.wait(timeout=10) is Status.SUCCEEDED
    db.execute("UPDATE workflow_runs SET finished_at = now() - interval '400 days'")
    runnable = ok_mgr.new_runnable(workflow.RunnerConfig(listen=False, prune_interval=0.1))
    runnable.start()
    try:
        poll(db, "SELECT count(*) = 1 FROM workflow_runs", timeout=10)
    finally:
        runnable.stop(timeout=10)
    left = db.execute("SELECT id::text, status FROM workflow_runs").fetchall()
    assert left == [(parked.id, "parked")]


def test_retention_refuses_a_negative_age() -> None:
    with pytest.raises(workflow.ConfigError, match=r"Retention\.succeeded"):
        workflow.Retention(succeeded=-1)
    with pytest.raises(workflow.ConfigError, match="retention"):
        workflow.RunnerConfig(retention=7)  # type: ignore[arg-type]


# --- stats ---------------------------------------------------------------------------------


def test_stats_count_a_workflows_queue(
    make_manager: Any, admin: workflow.Admin, db: psycopg.Connection[Any]
) -> None:
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)
    with db.transaction():
        for n in range(3):
            wf.start_tx(db, mgr, Inp(n))
    db.execute(
        "UPDATE workflow_runs SET created_at = now() - interval '1 minute', "
        "next_retry_at = now() - interval '1 minute'"
    )
    stale = db.execute("SELECT id FROM workflow_runs LIMIT 1").fetchone()[0]
    db.execute(
        "UPDATE workflow_runs SET status = 'running', claim_id = gen_random_uuid(), "
        "heartbeat_at = now() - interval '1 hour' WHERE id = %s",
        (stale,),
    )
    (w,) = admin.stats().workflows
    assert (w.workflow, w.pending, w.running, w.claimable, w.stale_claims) == ("W", 2, 1, 2, 1)
    assert w.oldest_claimable_seconds is not None and 55 < w.oldest_claimable_seconds < 600


# --- a run cancelled in another process --------------------------------------------------

THREE = "tests.worker_apps.three_tasks:registry"


@pytest.fixture
def ledger(db: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    from worker_apps.ledger import CREATE_TABLE

    db.execute(CREATE_TABLE)
    return db


@pytest.fixture
def spawn(engine_url: str) -> Any:
    from pgbouncer import worker_args
    from worker_apps.harness import WorkerProcess

    started: list[WorkerProcess] = []

    def start(*args: str) -> WorkerProcess:
        worker = WorkerProcess(THREE, engine_url, *worker_args(*args))
        started.append(worker)
        worker.wait_started()
        return worker

    yield start
    for worker in started:
        worker.kill()


def ledger_events(db: psycopg.Connection[Any], run_id: str) -> list[tuple[Any, ...]]:
    return db.execute(
        "SELECT seq, event, cancelled FROM ledger WHERE run_id = %s ORDER BY at, event DESC",
        (run_id,),
    ).fetchall()


@pytest.mark.slow
@pytest.mark.parametrize("listen", [True, False], ids=["listening", "poll-only"])
def test_cancel_a_run_executing_in_a_worker_process(
    make_manager: Any, admin: workflow.Admin, ledger: psycopg.Connection[Any], spawn: Any,
    listen: bool,
) -> None:
    from worker_apps.three_tasks import Plan, Three
    from worker_apps.three_tasks import registry as three

    mgr = make_manager(three())
    worker = spawn("--poll-interval", "0.2", *(() if listen else ("--no-listen",)))
    with ledger.transaction():
        run = Three.start_tx(ledger, mgr, Plan(hold_seq=2, hold="cancellable", seconds=30))
    poll(ledger, "SELECT count(*) = 2 FROM ledger WHERE run_id = %s", (run.id,),
         what="task 2 to begin in the worker")
    began = time.monotonic()
    admin.cancel(run.id, reason="customer withdrew")
    poll(ledger, "SELECT count(*) = 3 FROM ledger WHERE run_id = %s", (run.id,), timeout=10,
         what="the handler to see cancelled")
    assert time.monotonic() - began < 5
    assert ledger_events(ledger, run.id) == [(1, "start", False), (2, "start", False),
                                             (2, "end", True)]
    assert run.wait(timeout=5) is Status.CANCELLED
    time.sleep(0.5)
    status, claim, finished, attempts, outputs = rows(ledger, run.id)
    assert (status, claim, finished) == ("cancelled", None, True)
    assert attempts == [0, 0, 0] and outputs == [True, False, False]
    assert len(ledger_events(ledger, run.id)) == 3, "task 3 never started"
    assert "the run was cancelled" in worker.stderr


@pytest.mark.slow
def test_a_worker_stopped_when_its_run_was_cancelled_honours_it_when_it_comes_back(
    make_manager: Any, admin: workflow.Admin, ledger: psycopg.Connection[Any], spawn: Any,
) -> None:
    import os
    import signal

    from worker_apps.three_tasks import Plan, Three
    from worker_apps.three_tasks import registry as three

    mgr = make_manager(three())
    worker = spawn("--poll-interval", "0.2")
    with ledger.transaction():
        run = Three.start_tx(ledger, mgr, Plan(hold_seq=1, hold="finish", seconds=1.5))
    poll(ledger, "SELECT count(*) = 1 FROM ledger WHERE run_id = %s", (run.id,),
         what="task 1 to begin")
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        admin.cancel(run.id)
        time.sleep(2)  # the handler's work ends meanwhile, frozen with its process
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    poll(ledger, "SELECT count(*) = 2 FROM ledger WHERE run_id = %s", (run.id,),
         what="task 1 to end in the resumed worker")
    time.sleep(1)
    status, _, _, attempts, outputs = rows(ledger, run.id)
    assert status == "cancelled" and attempts == [0, 0, 0]
    assert outputs == [False, False, False], "the late success is fenced out"
    assert len(ledger_events(ledger, run.id)) == 2, "task 2 never started"


# --- races, made deterministic: the contenders queue on the run's row lock ------------------


class RowLock:
    """Holds a run's row lock from a transaction of the test's own, so that two
    contenders queue behind it in the order they arrive, then lets them go."""

    def __init__(self, db_url: str, run_id: str, table: str = "workflow_runs") -> None:
        column = "id" if table == "workflow_runs" else "run_id"
        self.conn = psycopg.connect(db_url)
        self.conn.execute(f"SELECT 1 FROM {table} WHERE {column} = %s FOR UPDATE", (run_id,))
        self.watcher = psycopg.connect(db_url, autocommit=True)

    def waiting(self, count: int) -> None:
        wait_until(
            lambda: self.watcher.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock'"
            ).fetchone()[0] >= count,
            f"{count} statements waiting on the run's row",
        )

    def release(self) -> None:
        self.conn.rollback()
        self.conn.close()
        self.watcher.close()


def in_thread(call: Any) -> tuple[threading.Thread, dict[str, Any]]:
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = call()
        except Exception as e:
            outcome["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


@pytest.mark.parametrize("first", ["complete", "cancel"])
def test_cancel_racing_a_task_completing_leaves_one_consistent_outcome(
    make_manager: Any, admin: workflow.Admin, db: psycopg.Connection[Any], db_url: str,
    first: str,
) -> None:
    returns = threading.Event()

    def a(run: workflow.TaskRun[Inp]) -> Out:
        returns.wait(20)
        return Out("a")

    reg, wf = registry(workflow.handle(A, a))
    run = wf.start(make_manager(reg), Inp(1))
    poll(db, "SELECT claim_id IS NOT NULL FROM workflow_runs WHERE id = %s", (run.id,))
    lock = RowLock(db_url, run.id)
    try:
        if first == "complete":
            returns.set()
            lock.waiting(1)
            thread, outcome = in_thread(lambda: admin.cancel(run.id))
            lock.waiting(2)
        else:
            thread, outcome = in_thread(lambda: admin.cancel(run.id))
            lock.waiting(1)
            returns.set()
            lock.waiting(2)
    finally:
        lock.release()
    thread.join(20)
    final = run.wait(timeout=20)
    status, claim, _, attempts, outputs = rows(db, run.id)
    if first == "complete":
        assert final is Status.SUCCEEDED and outcome["value"].status is Status.SUCCEEDED
        assert outputs == [True] and history(admin, run.id) == []
        assert status == "succeeded"
    else:
        assert final is Status.CANCELLED and outcome["value"].status is Status.CANCELLED
        assert outputs == [False], "the completion was fenced out"
        assert status == "cancelled"
    assert claim is None and attempts == [0]


@pytest.mark.parametrize("first", ["sweep", "cancel"])
def test_cancel_racing_the_sweeper_ends_cancelled(
    make_manager: Any, admin: workflow.Admin, db: psycopg.Connection[Any], db_url: str,
    first: str,
) -> None:
    reg, wf = registry(workflow.handle(A, lambda run: Out("a")))
    mgr = make_manager(reg)
    with db.transaction():
        run = wf.start_tx(db, mgr, Inp(1))
    db.execute(
        "UPDATE workflow_runs SET status = 'running', claim_id = gen_random_uuid(), "
        "heartbeat_at = now() - interval '1 hour' WHERE id = %s",
        (run.id,),
    )
    sweeper = mgr.new_runnable(workflow.RunnerConfig(listen=False)).sweeper
    # The sweep skips a locked run row, so to catch it mid-statement the test
    # locks the task row instead: the sweep then holds the run row while it
    # waits to count the abandoned attempt, and the cancel queues behind it.
    lock = RowLock(db_url, run.id, "workflow_tasks" if first == "sweep" else "workflow_runs")
    sweep = lambda: sweeper.sweep()  # noqa: E731
    cancel = lambda: admin.cancel(run.id)  # noqa: E731
    try:
        one, _ = in_thread(sweep if first == "sweep" else cancel)
        lock.waiting(1)
        two, _ = in_thread(cancel if first == "sweep" else sweep)
        if first == "sweep":
            lock.waiting(2)
        else:
            time.sleep(0.3)  # the sweep skips a locked row instead of waiting
    finally:
        lock.release()
    one.join(20)
    two.join(20)
    status, claim, finished, attempts, _ = rows(db, run.id)
    assert (status, claim, finished) == ("cancelled", None, True)
    assert attempts == ([1] if first == "sweep" else [0])
    assert run.wait(timeout=5) is Status.CANCELLED


@pytest.mark.parametrize("first", ["prune", "resume"])
def test_resume_racing_a_prune_either_resumes_or_finds_nothing(
    make_manager: Any, admin: workflow.Admin, db: psycopg.Connection[Any], db_url: str,
    first: str,
) -> None:
    reg, wf = registry(workflow.handle(A, lambda run: Out("a")))
    with db.transaction():
        run = wf.start_tx(db, make_manager(reg), Inp(1))
    admin.cancel(run.id)
    db.execute("UPDATE workflow_runs SET finished_at = now() - interval '60 days'")
    lock = RowLock(db_url, run.id)
    prune = lambda: admin.prune(older_than=datetime.timedelta(days=30))  # noqa: E731
    resume = lambda: admin.resume(run.id)  # noqa: E731
    try:
        one, first_outcome = in_thread(prune if first == "prune" else resume)
        if first == "prune":
            time.sleep(0.3)  # the prune skips the locked row; the resume then waits
            two, second_outcome = in_thread(resume)
            lock.waiting(1)
        else:
            lock.waiting(1)
            two, second_outcome = in_thread(prune)
            time.sleep(0.3)
    finally:
        lock.release()
    one.join(20)
    two.join(20)
    left = db.execute("SELECT status FROM workflow_runs WHERE id = %s", (run.id,)).fetchone()
    if first == "prune":
        # The prune skipped the row the test held (it never blocks); the resume won.
        assert first_outcome["value"] == 0 and left == ("running",)
    else:
        assert first_outcome["value"].status is Status.RUNNING and left == ("running",)
        assert second_outcome["value"] == 0, "a resumed run is no longer finished"
    assert admin.prune(older_than=datetime.timedelta(days=30)) == 0
