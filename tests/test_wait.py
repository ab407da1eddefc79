"""SPEC section 4 (watching runs) and the `wait()` kick of section 11, against real PostgreSQL.

`wait()` wakes on a run finished in this process, sees one finished by another
manager, claims and executes a run that is claimable now and unclaimed, and only
waits otherwise. `status()` is a plain read with timezone-aware times.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers import FLUSH_STATS, committed_transactions, dbname_of, threads_fail_to_start
from psycopg_pool import ConnectionPool

import workflow

WF = workflow.Workflow("Wait.Rules", str)
FOREIGN = workflow.Workflow("Wait.Foreign", str)
ONE = workflow.Task("wait.one", str)
TWO = workflow.Task("wait.two")
BLOCK = "block"
PARK = "park"
RETRY_LATER = "retry-later"


class Handlers:
    """Handlers that count calls; BLOCK waits on `gate`, PARK parks, RETRY_LATER retries in 1 h."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: Counter[tuple[str, str]] = Counter()
        self.threads: list[str] = []
        self.gate = threading.Event()
        self.entered = threading.Semaphore(0)

    def one(self, run: workflow.TaskRun[str]) -> str:
        with self.lock:
            self.calls[("wait.one", run.input)] += 1
            self.threads.append(threading.current_thread().name)
        if run.input == BLOCK:
            self.entered.release()
            assert self.gate.wait(timeout=60), "the test never opened the gate"
        if run.input == PARK:
            raise workflow.Permanent("card declined", code="declined")
        if run.input == RETRY_LATER:
            raise RuntimeError("provider down")
        return run.input

    def two(self, run: workflow.TaskRun[str]) -> None:
        with self.lock:
            self.calls[("wait.two", run.input)] += 1

    def count(self, task: str, input: str) -> int:
        with self.lock:
            return self.calls[(task, input)]

    def wait_entered(self) -> None:
        assert self.entered.acquire(timeout=30), "the blocking handler never started"


def rules(h: Handlers) -> workflow.Registry:
    reg = workflow.Registry()
    reg.register(
        workflow.define(
            WF,
            workflow.handle(ONE, h.one, backoff_schedule=[3600]),
            workflow.handle(TWO, h.two),
        )
    )
    return reg


def foreign(h: Handlers) -> workflow.Registry:
    reg = workflow.Registry()
    reg.register(workflow.define(FOREIGN, workflow.handle(ONE, h.one)))
    return reg


def row_of(db: psycopg.Connection[Any], run_id: str) -> dict[str, Any]:
    cur = db.execute("SELECT * FROM workflow_runs WHERE id = %s", (run_id,))
    row = cur.fetchone()
    assert row is not None and cur.description is not None
    return {d.name: v for d, v in zip(cur.description, row, strict=True)}


def wait_for_status(
    db: psycopg.Connection[Any], run_id: str, status: str, timeout: float = 30.0
) -> None:
    deadline = time.monotonic() + timeout
    while row_of(db, run_id)["status"] != status:
        if time.monotonic() > deadline:
            pytest.fail(f"run {run_id} never reached {status}")
        time.sleep(0.02)


def committed_start_tx(
    db_url: str, wf: workflow.Workflow[str], mgr: workflow.Manager, input: str
) -> workflow.Run:
    with psycopg.connect(db_url) as conn:
        run = wf.start_tx(conn, mgr, input)
        conn.commit()
    return run


class Waiter:
    """`run.wait(timeout)` on a thread of its own."""

    def __init__(self, run: workflow.Run, timeout: float | None = 60) -> None:
        self.result: workflow.Status | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._go, args=(run, timeout), daemon=True)
        self._thread.start()

    def _go(self, run: workflow.Run, timeout: float | None) -> None:
        try:
            self.result = run.wait(timeout=timeout)
        except BaseException as e:
            self.error = e
        finally:
            self.done.set()

    def outcome(self) -> workflow.Status | None:
        assert self.done.wait(timeout=90), "wait() never returned"
        if self.error is not None:
            raise self.error
        return self.result


@pytest.fixture
def h() -> Iterator[Handlers]:
    handlers = Handlers()
    yield handlers
    handlers.gate.set()


# Waking waiters.


def test_wait_on_a_run_finished_in_this_process_returns_when_it_finishes(
    make_manager: Any, h: Handlers
) -> None:
    mgr = make_manager(rules(h))
    run = WF.start(mgr, BLOCK)
    h.wait_entered()
    waiter = Waiter(run)
    assert not waiter.done.is_set()
    h.gate.set()
    assert waiter.outcome() is workflow.Status.SUCCEEDED
    # Already terminal: returns straight away, without executing anything again.
    assert run.wait() is workflow.Status.SUCCEEDED
    assert h.count("wait.one", BLOCK) == 1 and h.count("wait.two", BLOCK) == 1


@pytest.mark.direct(reason="counts the transactions of one server connection")
@pytest.mark.server(15, "pg_stat_force_next_flush()")
@pytest.mark.parametrize("outcome", ["ok", PARK])
def test_wait_on_a_run_finished_in_this_process_is_woken_without_a_database_poll(
    db_url: str, pg_url: str, h: Handlers, outcome: str
) -> None:
    """Event-based, proven without timing: `start()` then `wait()` commits no more
    transactions than the run itself (one insert, one per finished task, or one
    park), so `wait()` read nothing from the database, not even the final status.

    A park is the one exception allowed: a run parked here may be resumed by a
    person since (SPEC 12), so a `wait()` that arrives after its execution ended
    reads its status once (one more transaction at most); a waiter already waiting
    when it parked is woken without a read.

    Counted as in test_fast_path.py: one pooled connection without server-side
    prepares (a PREPARE counts as a transaction), stats force-flushed before the
    baseline and after the run (that flush is one transaction), the counter read
    from another database. An autovacuum worker could only add commits: the
    smallest of up to three measurements is kept.
    """
    expected = {"ok": 3, PARK: 2}[outcome]  # insert + 2 tasks / insert + park
    dbname = dbname_of(db_url)
    engine_pool: ConnectionPool[Any] = ConnectionPool(
        db_url,
        min_size=1,
        max_size=1,
        kwargs={"autocommit": True, "prepare_threshold": None},
        open=True,
    )
    with engine_pool, psycopg.connect(pg_url, autocommit=True) as admin:
        mgr = workflow.Manager(engine_pool, rules(h))
        try:
            costs = []
            statuses = []
            for _ in range(3):
                with engine_pool.connection() as conn:
                    conn.execute(FLUSH_STATS)
                before = committed_transactions(admin, dbname)
                statuses.append(WF.start(mgr, outcome).wait(timeout=60))
                with engine_pool.connection() as conn:
                    conn.execute(FLUSH_STATS)
                costs.append(committed_transactions(admin, dbname) - before - 1)
                if costs[-1] == expected:
                    break
        finally:
            mgr.close(timeout=10)
    terminal = workflow.Status.SUCCEEDED if outcome == "ok" else workflow.Status.PARKED
    assert set(statuses) == {terminal}
    allowed = {expected} if outcome == "ok" else {expected, expected + 1}
    assert min(costs) in allowed, f"transactions for start() + wait(), measured: {costs}"


def test_wait_on_a_run_parked_in_this_process_returns_parked(
    make_manager: Any, h: Handlers
) -> None:
    mgr = make_manager(rules(h))
    run = WF.start(mgr, PARK)
    assert run.wait(timeout=30) is workflow.Status.PARKED
    assert h.count("wait.two", PARK) == 0


def test_wait_sees_a_run_finished_by_another_manager(
    make_manager: Any, h: Handlers, db: psycopg.Connection[Any]
) -> None:
    watcher = make_manager(rules(h))
    executor = make_manager(rules(h))
    run = WF.start(executor, BLOCK)  # claimed by `executor` at insert
    h.wait_entered()
    waiter = Waiter(watcher.run(run.id))
    h.gate.set()
    assert waiter.outcome() is workflow.Status.SUCCEEDED
    assert h.count("wait.one", BLOCK) == 1 and h.count("wait.two", BLOCK) == 1
    assert row_of(db, run.id)["status"] == "succeeded"


def test_wait_sees_a_run_parked_by_another_manager(make_manager: Any, h: Handlers) -> None:
    watcher = make_manager(rules(h))
    executor = make_manager(rules(h))
    run = WF.start(executor, PARK)
    assert watcher.run(run.id).wait(timeout=30) is workflow.Status.PARKED
    assert h.count("wait.one", PARK) == 1


# Kicks.


def test_wait_kicks_a_claimable_unclaimed_run(
    make_manager: Any, h: Handlers, db_url: str, db: psycopg.Connection[Any]
) -> None:
    mgr = make_manager(rules(h))
    run = committed_start_tx(db_url, WF, mgr, "kick")
    assert row_of(db, run.id)["claim_id"] is None
    assert run.wait(timeout=30) is workflow.Status.SUCCEEDED
    assert h.count("wait.one", "kick") == 1 and h.count("wait.two", "kick") == 1
    assert h.threads and all(name.startswith("workflow-run") for name in h.threads)


def test_a_kick_whose_thread_cannot_start_leaves_the_run_claimable_and_wait_to_its_polls(
    make_manager: Any,
    h: Handlers,
    db_url: str,
    db: psycopg.Connection[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Out of threads: the kick claims the run, cannot launch it, releases it. wait()
    # must then wait its poll interval before trying again, not claim and release
    # the run in a loop for as long as it waits.
    mgr = make_manager(rules(h))
    run = committed_start_tx(db_url, WF, mgr, "no-thread")
    claims = []
    store = mgr._executor.store
    claim_run = store.claim_run

    def counted(*args: Any) -> Any:
        claims.append(args)
        return claim_run(*args)

    monkeypatch.setattr(store, "claim_run", counted)
    threads_fail_to_start(monkeypatch, lambda t: t.name.startswith("workflow-run"))
    assert run.wait(timeout=2.5) is workflow.Status.RUNNING  # what a wait that times out says
    monkeypatch.undo()
    assert 1 <= len(claims) <= 4, f"{len(claims)} claims in one wait of 2.5 s (polls every 1 s)"
    assert row_of(db, run.id)["claim_id"] is None  # released: claimable by anyone
    assert run.wait(timeout=30) is workflow.Status.SUCCEEDED  # threads again: it runs


def test_wait_kicks_a_released_run_that_is_due(
    make_manager: Any, h: Handlers, db_url: str, db: psycopg.Connection[Any]
) -> None:
    mgr = make_manager(rules(h))
    run = committed_start_tx(db_url, WF, mgr, "released")
    # As a run looks after a release: claimed once, now unclaimed and due.
    db.execute(
        "UPDATE workflow_runs SET status = 'running', next_retry_at = now() - interval '1 s' "
        "WHERE id = %s",
        (run.id,),
    )
    assert run.wait(timeout=30) is workflow.Status.SUCCEEDED
    assert h.count("wait.one", "released") == 1


def test_wait_does_not_kick_a_run_claimed_by_someone_else(
    make_manager: Any, h: Handlers, db_url: str, db: psycopg.Connection[Any]
) -> None:
    mgr = make_manager(rules(h))
    run = committed_start_tx(db_url, WF, mgr, "theirs")
    claim = db.execute(
        "UPDATE workflow_runs SET claim_id = gen_random_uuid(), heartbeat_at = now(), "
        "status = 'running' WHERE id = %s RETURNING claim_id",
        (run.id,),
    ).fetchone()
    assert claim is not None
    assert run.wait(timeout=1.5) is workflow.Status.RUNNING
    assert h.count("wait.one", "theirs") == 0
    row = row_of(db, run.id)
    assert row["claim_id"] == claim[0]
    assert row["status"] == "running"


def test_wait_does_not_kick_a_released_run_before_its_retry_is_due(
    make_manager: Any, h: Handlers, db: psycopg.Connection[Any]
) -> None:
    mgr = make_manager(rules(h))
    # The first attempt fails; its 1 h backoff is past max_in_process_backoff, so
    # the executor releases the claim with next_retry_at an hour away.
    run = WF.start(mgr, RETRY_LATER)
    deadline = time.monotonic() + 30
    while row_of(db, run.id)["claim_id"] is not None or h.count("wait.one", RETRY_LATER) == 0:
        assert time.monotonic() < deadline, "the failed attempt never released its claim"
        time.sleep(0.02)
    assert run.wait(timeout=1.5) is workflow.Status.RUNNING
    assert h.count("wait.one", RETRY_LATER) == 1
    row = row_of(db, run.id)
    assert row["claim_id"] is None and row["status"] == "running"
    status = run.status()
    assert status.status is workflow.Status.RUNNING
    assert status.failure is None, "a run waiting to retry is not parked"
    assert status.finished_at is None


def test_wait_from_a_manager_without_the_workflow_does_not_execute_it(
    make_manager: Any, h: Handlers, db_url: str, db: psycopg.Connection[Any]
) -> None:
    owner = make_manager(foreign(h))
    stranger = make_manager(rules(h))
    run = committed_start_tx(db_url, FOREIGN, owner, "not-yours")
    assert stranger.run(run.id).wait(timeout=1.5) in (
        workflow.Status.PENDING,
        workflow.Status.RUNNING,
    )
    assert h.count("wait.one", "not-yours") == 0
    row = row_of(db, run.id)
    assert row["claim_id"] is None, "the stranger kept a claim on a run it cannot execute"
    assert run.wait(timeout=30) is workflow.Status.SUCCEEDED
    assert h.count("wait.one", "not-yours") == 1


def test_wait_from_a_manager_without_the_workflow_leaves_the_run_pending(
    make_manager: Any, h: Handlers, db_url: str, db: psycopg.Connection[Any]
) -> None:
    # Several services may share the tables: a manager that cannot run a
    # workflow must not touch its runs, so a never-executed run stays PENDING.
    owner = make_manager(foreign(h))
    stranger = make_manager(rules(h))
    run = committed_start_tx(db_url, FOREIGN, owner, "not-yours")
    before = row_of(db, run.id)
    # On timeout wait() answers RUNNING whatever the row says (SPEC section 4).
    assert stranger.run(run.id).wait(timeout=1.5) is workflow.Status.RUNNING
    assert run.status().status is workflow.Status.PENDING
    assert row_of(db, run.id) == before


def test_wait_on_unknown_or_malformed_id_raises_run_not_found(
    make_manager: Any, h: Handlers
) -> None:
    mgr = make_manager(rules(h))
    for bad in ("nope", "00000000-0000-0000-0000-000000000000"):
        with pytest.raises(workflow.RunNotFound):
            workflow.Run(mgr, bad).wait(timeout=1)
        with pytest.raises(workflow.RunNotFound):
            workflow.Run(mgr, bad).status()


# status()


def assert_aware(value: datetime.datetime | None) -> datetime.datetime:
    assert isinstance(value, datetime.datetime)
    assert value.tzinfo is not None and value.utcoffset() is not None
    return value


def test_status_of_a_pending_run(
    make_manager: Any, h: Handlers, db_url: str, db: psycopg.Connection[Any]
) -> None:
    mgr = make_manager(rules(h))
    run = committed_start_tx(db_url, WF, mgr, "pending")
    status = run.status()
    assert isinstance(status, workflow.RunStatus)
    assert status.status is workflow.Status.PENDING
    assert status.failure is None
    assert status.finished_at is None
    assert assert_aware(status.created_at) == row_of(db, run.id)["created_at"]


def test_status_of_a_running_run(make_manager: Any, h: Handlers) -> None:
    mgr = make_manager(rules(h))
    run = WF.start(mgr, BLOCK)
    h.wait_entered()
    status = run.status()
    assert status.status is workflow.Status.RUNNING
    assert status.failure is None
    assert status.finished_at is None
    assert_aware(status.created_at)


def test_status_of_a_succeeded_run_has_aware_times_and_no_failure(
    make_manager: Any, h: Handlers, db: psycopg.Connection[Any]
) -> None:
    mgr = make_manager(rules(h))
    run = WF.start(mgr, "ok")
    assert run.wait(timeout=30) is workflow.Status.SUCCEEDED
    status = run.status()
    assert status.status is workflow.Status.SUCCEEDED
    assert status.failure is None
    created = assert_aware(status.created_at)
    finished = assert_aware(status.finished_at)
    assert finished >= created
    row = row_of(db, run.id)
    assert (row["created_at"], row["finished_at"]) == (created, finished)


def test_status_of_a_parked_run_has_finished_at_and_a_failure(
    make_manager: Any, h: Handlers, db: psycopg.Connection[Any]
) -> None:
    mgr = make_manager(rules(h))
    run = WF.start(mgr, PARK)
    assert run.wait(timeout=30) is workflow.Status.PARKED
    status = run.status()
    assert status.status is workflow.Status.PARKED
    created = assert_aware(status.created_at)
    finished = assert_aware(status.finished_at)
    assert finished >= created
    assert status.failure == workflow.Failure(
        task="wait.one", error="card declined", code="declined", attempts=1
    )
    assert row_of(db, run.id)["finished_at"] == finished


def test_status_is_a_plain_read_that_does_not_kick(
    make_manager: Any, h: Handlers, db_url: str, db: psycopg.Connection[Any]
) -> None:
    mgr = make_manager(rules(h))
    run = committed_start_tx(db_url, WF, mgr, "read-only")
    before = row_of(db, run.id)
    for _ in range(3):
        assert run.status().status is workflow.Status.PENDING
    assert mgr.run(run.id).status().status is workflow.Status.PENDING
    assert row_of(db, run.id) == before
    assert h.count("wait.one", "read-only") == 0
