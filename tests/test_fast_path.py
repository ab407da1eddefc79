"""SPEC section 4 and the Engine issue: the fast path, against real PostgreSQL.

A started run executes right away on the manager's thread pool, inserted already
claimed; when `max_local_runs` executions are in flight it is left PENDING for a
poller; a 3-task run costs the documented 4 transactions; a double `wait()`
claims once; `wait(timeout)` gives up without stopping the run.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import attrs
import psycopg
import pytest
from helpers import FLUSH_STATS, committed_transactions, dbname_of, threads_fail_to_start
from pgbouncer import runner_config
from psycopg_pool import ConnectionPool

import workflow
import workflow.events
from workflow.store.rows import TaskRow

WF = workflow.Workflow("Fast.Path", str)
ONE = workflow.Task("fast.one", str)
TWO = workflow.Task("fast.two")
THREE = workflow.Task("fast.three", int)
BLOCK = "block"


class Handlers:
    """Three handlers that record their calls; inputs equal to BLOCK wait on `gate`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: Counter[tuple[str, str]] = Counter()
        self.threads: list[str] = []
        self.gate = threading.Event()
        self.entered = threading.Semaphore(0)

    def _record(self, task: str, run: workflow.TaskRun[str]) -> None:
        with self.lock:
            self.calls[(task, run.input)] += 1
            self.threads.append(threading.current_thread().name)

    def one(self, run: workflow.TaskRun[str]) -> str:
        self._record("fast.one", run)
        if run.input == BLOCK:
            self.entered.release()
            assert self.gate.wait(timeout=60), "the test never opened the gate"
        return run.input.upper()

    def two(self, run: workflow.TaskRun[str]) -> None:
        self._record("fast.two", run)

    def three(self, run: workflow.TaskRun[str]) -> int:
        self._record("fast.three", run)
        return len(run.output(ONE))

    def count(self, task: str, input: str) -> int:
        with self.lock:
            return self.calls[(task, input)]

    def wait_entered(self, n: int = 1) -> None:
        for _ in range(n):
            assert self.entered.acquire(timeout=30), "a blocking handler never started"


def three_tasks(h: Handlers) -> workflow.Registry:
    reg = workflow.Registry()
    reg.register(
        workflow.define(
            WF,
            workflow.handle(ONE, h.one),
            workflow.handle(TWO, h.two),
            workflow.handle(THREE, h.three),
        )
    )
    return reg


def status_of(db: psycopg.Connection[Any], run_id: str) -> str:
    row = db.execute("SELECT status FROM workflow_runs WHERE id = %s", (run_id,)).fetchone()
    assert row is not None
    return str(row[0])


def wait_for_status(
    db: psycopg.Connection[Any], run_id: str, status: str, timeout: float = 30.0
) -> None:
    """Poll the row (not `run.wait()`, which could kick the run) until it has `status`."""
    deadline = time.monotonic() + timeout
    while status_of(db, run_id) != status:
        if time.monotonic() > deadline:
            pytest.fail(f"run {run_id} never reached {status} (is {status_of(db, run_id)})")
        time.sleep(0.02)


@pytest.fixture
def h() -> Iterator[Handlers]:
    handlers = Handlers()
    yield handlers
    handlers.gate.set()  # never leave a handler blocked past the test


def test_started_run_executes_on_the_managers_thread_without_any_poller(
    make_manager: Any, h: Handlers, db: psycopg.Connection[Any]
) -> None:
    mgr = make_manager(three_tasks(h))
    run = WF.start(mgr, "abc")
    # No runnable, no wait(): only the fast path can execute it.
    wait_for_status(db, run.id, "succeeded")
    assert len(h.threads) == 3
    for name in h.threads:
        assert name.startswith("workflow-run"), name
    assert threading.current_thread().name not in h.threads
    assert [h.count(t, "abc") for t in ("fast.one", "fast.two", "fast.three")] == [1, 1, 1]
    assert run.status().status is workflow.Status.SUCCEEDED
    outputs = db.execute(
        "SELECT output FROM workflow_tasks WHERE run_id = %s ORDER BY seq", (run.id,)
    ).fetchall()
    assert outputs == [("ABC",), (None,), (3,)]


def test_fast_path_run_is_inserted_already_claimed(
    make_manager: Any, h: Handlers, db: psycopg.Connection[Any]
) -> None:
    mgr = make_manager(three_tasks(h))
    run = WF.start(mgr, BLOCK)
    h.wait_entered()
    row = db.execute(
        "SELECT status, claim_id, heartbeat_at, next_retry_at, xmin::text, "
        "       (SELECT array_agg(DISTINCT t.xmin::text) FROM workflow_tasks t "
        "        WHERE t.run_id = r.id) "
        "FROM workflow_runs r WHERE id = %s",
        (run.id,),
    ).fetchone()
    assert row is not None
    status, claim_id, heartbeat_at, due_at, run_xmin, task_xmins = row
    assert status == "running"
    assert claim_id is not None
    # Claimed in the inserting transaction: the same now() stamped both columns,
    # and the run row was not rewritten by a second (claiming) statement.
    assert heartbeat_at == due_at
    assert task_xmins == [run_xmin]
    assert run.status().status is workflow.Status.RUNNING
    h.gate.set()
    assert run.wait(timeout=30) is workflow.Status.SUCCEEDED
    assert db.execute("SELECT claim_id FROM workflow_runs WHERE id = %s", (run.id,)).fetchone() == (
        None,
    )


def test_start_with_max_local_runs_in_flight_leaves_the_run_pending_for_a_poller(
    make_manager: Any, h: Handlers, db: psycopg.Connection[Any], db_url: str
) -> None:
    mgr = make_manager(three_tasks(h), workflow.Config(max_local_runs=2))
    busy = [WF.start(mgr, BLOCK), WF.start(mgr, BLOCK)]
    h.wait_entered(2)
    with psycopg.connect(db_url, autocommit=True) as listener:
        listener.execute("LISTEN workflow_runs")
        late = WF.start(mgr, "late")
        row = db.execute(
            "SELECT status, claim_id, heartbeat_at FROM workflow_runs WHERE id = %s", (late.id,)
        ).fetchone()
        assert row == ("pending", None, None)
        # Left for a poller, so the insert woke the pollers.
        notes = list(listener.notifies(timeout=15, stop_after=1))
        assert [(n.channel, n.payload) for n in notes] == [("workflow_runs", WF.name)]
    assert late.status().status is workflow.Status.PENDING

    h.gate.set()
    for run in busy:
        assert run.wait(timeout=30) is workflow.Status.SUCCEEDED
    # Room is free again, but nobody claimed the late run: no poller, no wait().
    assert db.execute(
        "SELECT status, claim_id FROM workflow_runs WHERE id = %s", (late.id,)
    ).fetchone() == ("pending", None)
    assert h.count("fast.one", "late") == 0

    assert late.wait(timeout=30) is workflow.Status.SUCCEEDED
    assert [h.count(t, "late") for t in ("fast.one", "fast.two", "fast.three")] == [1, 1, 1]
    assert [h.count(t, BLOCK) for t in ("fast.one", "fast.two", "fast.three")] == [2, 2, 2]


def test_a_process_out_of_threads_goes_on_with_those_it_has(
    make_manager: Any,
    h: Handlers,
    db: psycopg.Connection[Any],
    monkeypatch: pytest.MonkeyPatch,
    logs: Any,
) -> None:
    # Room for four runs, but only one fast-path thread can start. The run that meets
    # the refusal waits for that thread; from then on the fast path counts on one slot,
    # so the next start is left pending for a poller without being claimed at all.
    # (Before: each start past the first was inserted claimed, found no thread, and was
    # released again, its waiter kicking it into the same refusal every second.)
    logger, records = logs
    mgr = make_manager(three_tasks(h), workflow.Config(max_local_runs=4), logger=logger)
    threads_fail_to_start(monkeypatch, lambda t: t.name.startswith("workflow-run_") and
                          t.name != "workflow-run_0")
    store = mgr._executor.store
    releases: list[Any] = []
    release_claim = store.release_claim

    def counted(*args: Any) -> Any:
        releases.append(args)
        return release_claim(*args)

    monkeypatch.setattr(store, "release_claim", counted)
    first = WF.start(mgr, BLOCK)
    h.wait_entered()
    second = WF.start(mgr, "second")  # waits for workflow-run_0
    third = WF.start(mgr, "third")
    row = db.execute(
        "SELECT status, claim_id FROM workflow_runs WHERE id = %s", (third.id,)
    ).fetchone()
    assert row == ("pending", None)  # left for a poller
    h.gate.set()
    assert first.wait(timeout=30) is workflow.Status.SUCCEEDED
    assert second.wait(timeout=30) is workflow.Status.SUCCEEDED
    assert releases == []  # no run claimed only to be given back
    assert set(h.threads) == {"workflow-run_0"}
    assert sum("can't start a new thread" in m for m in records.messages()) == 1


def test_start_with_the_pool_full_is_picked_up_by_a_poller(
    make_manager: Any, h: Handlers, db: psycopg.Connection[Any]
) -> None:
    mgr = make_manager(three_tasks(h), workflow.Config(max_local_runs=1))
    busy = WF.start(mgr, BLOCK)
    h.wait_entered()
    late = WF.start(mgr, "late")
    assert status_of(db, late.id) == "pending"
    runnable = mgr.new_runnable(
        runner_config(poll_interval=0.2, concurrency=2, sweep_enabled=False)
    )
    runnable.start()
    try:
        wait_for_status(db, late.id, "succeeded")
        assert h.count("fast.one", "late") == 1
        h.gate.set()
        wait_for_status(db, busy.id, "succeeded")
    finally:
        runnable.stop(timeout=10)
    assert any(name.startswith("workflow-worker") for name in h.threads)


# Transactions per run.


@pytest.mark.direct(reason="counts the transactions of one server connection")
@pytest.mark.server(15, "pg_stat_force_next_flush()")
def test_a_three_task_fast_path_run_costs_four_transactions(
    db_url: str, pg_url: str, h: Handlers
) -> None:
    """What a run costs alone: nothing else is in flight, so each of its task steps is
    written at once by itself (under load, steps of several runs share a commit: see
    test_group_commit.py, where six steps of six runs cost two).

    Counted with `pg_stat_database.xact_commit` of the test's private database.

    The counter is fed asynchronously: each backend accumulates its counts and
    flushes them at most once a second when idle. PostgreSQL 15's
    `pg_stat_force_next_flush()` makes the *calling* backend flush before it
    answers (the flush happens before ReadyForQuery), so the test:

    - gives the manager a pool of exactly one connection, so one backend does all
      of the engine's work and can be made to flush;
    - disables psycopg's server-side prepared statements on it
      (`prepare_threshold=None`): a PREPARE is a Parse+Sync that PostgreSQL counts
      as a committed transaction of its own, which would blur the count;
    - forces a flush of every backend on the database (the pool's and an
      inspector's) before reading the baseline, and of the pool's backend after
      the run (that flush statement is itself one committed transaction);
    - watches the run from the inspector inside one transaction that is rolled
      back, so the polling adds rollbacks, never commits;
    - reads the counter from a connection to another database.

    Nothing else connects to the test database. The heartbeat only beats while a
    claim is held at a 15 s tick, far longer than a run of trivial handlers. An
    autovacuum worker visiting the database could only add commits, so the test
    takes the smallest of up to three measurements.
    """
    dbname = dbname_of(db_url)
    engine_pool: ConnectionPool[Any] = ConnectionPool(
        db_url,
        min_size=1,
        max_size=1,
        kwargs={"autocommit": True, "prepare_threshold": None},
        open=True,
    )
    with (
        engine_pool,
        psycopg.connect(pg_url, autocommit=True) as admin,
        psycopg.connect(db_url, autocommit=True, prepare_threshold=None) as inspector,
    ):
        mgr = workflow.Manager(engine_pool, three_tasks(h))
        try:
            costs = []
            for attempt in range(3):
                with engine_pool.connection() as conn:
                    conn.execute(FLUSH_STATS)
                inspector.execute(FLUSH_STATS)
                before = committed_transactions(admin, dbname)

                run = WF.start(mgr, f"run-{attempt}")
                with inspector.transaction(force_rollback=True):
                    wait_for_status(inspector, run.id, "succeeded")

                with engine_pool.connection() as conn:
                    conn.execute(FLUSH_STATS)  # one committed transaction, flushed with the rest
                after = committed_transactions(admin, dbname)
                costs.append(after - before - 1)
                if costs[-1] == 4:
                    break
        finally:
            mgr.close(timeout=10)
    assert [h.count(t, "run-0") for t in ("fast.one", "fast.two", "fast.three")] == [1, 1, 1]
    assert min(costs) == 4, f"transactions per 3-task fast-path run, measured: {costs}"


# Waiting on the fast path.


def test_double_wait_from_two_threads_on_a_start_tx_run_executes_each_task_once(
    make_manager: Any, h: Handlers, db_url: str
) -> None:
    mgr = make_manager(three_tasks(h))
    with psycopg.connect(db_url) as conn:
        run = WF.start_tx(conn, mgr, "twice")
        conn.commit()
    barrier = threading.Barrier(2)
    results: list[workflow.Status] = []
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            barrier.wait(timeout=10)
            results.append(run.wait(timeout=30))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=waiter) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert results == [workflow.Status.SUCCEEDED] * 2
    assert [h.count(t, "twice") for t in ("fast.one", "fast.two", "fast.three")] == [1, 1, 1]


def test_double_wait_from_two_managers_on_a_start_tx_run_executes_each_task_once(
    make_manager: Any, h: Handlers, db_url: str
) -> None:
    first = make_manager(three_tasks(h))
    second = make_manager(three_tasks(h))
    with psycopg.connect(db_url) as conn:
        run = WF.start_tx(conn, first, "twice")
        conn.commit()
    barrier = threading.Barrier(4)
    results: list[workflow.Status] = []
    errors: list[BaseException] = []

    def waiter(mgr: workflow.Manager) -> None:
        try:
            handle = mgr.run(run.id)
            barrier.wait(timeout=10)
            results.append(handle.wait(timeout=30))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=waiter, args=(m,)) for m in (first, second) * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert results == [workflow.Status.SUCCEEDED] * 4
    assert [h.count(t, "twice") for t in ("fast.one", "fast.two", "fast.three")] == [1, 1, 1]


@pytest.mark.parametrize(
    "timeout", [0.2, datetime.timedelta(milliseconds=200)], ids=["seconds", "timedelta"]
)
def test_wait_with_a_timeout_returns_running_and_the_run_goes_on(
    make_manager: Any, h: Handlers, db: psycopg.Connection[Any], timeout: Any
) -> None:
    mgr = make_manager(three_tasks(h))
    run = WF.start(mgr, BLOCK)
    h.wait_entered()
    assert run.wait(timeout=timeout) is workflow.Status.RUNNING
    assert run.wait(timeout=0) is workflow.Status.RUNNING
    assert status_of(db, run.id) == "running"
    h.gate.set()
    assert run.wait() is workflow.Status.SUCCEEDED
    assert [h.count(t, BLOCK) for t in ("fast.one", "fast.two", "fast.three")] == [1, 1, 1]


def test_fast_path_run_that_retries_stays_on_the_managers_thread(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    threads: list[str] = []
    attempts: list[int] = []

    def flaky(run: workflow.TaskRun[str]) -> str:
        threads.append(threading.current_thread().name)
        attempts.append(run.attempt)
        if run.attempt < 3:
            raise RuntimeError("transient")
        return "ok"

    reg = workflow.Registry()
    reg.register(workflow.define(WF, workflow.handle(ONE, flaky, backoff_schedule=[0])))
    mgr = make_manager(reg)
    run = WF.start(mgr, "x")
    wait_for_status(db, run.id, "succeeded")
    assert attempts == [1, 2, 3]
    assert all(name.startswith("workflow-run") for name in threads), threads
    assert db.execute(
        "SELECT attempts FROM workflow_tasks WHERE run_id = %s", (run.id,)
    ).fetchone() == (2,)


def test_fast_path_handler_sees_the_stored_input_not_the_callers_object(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    # Every task sees the workflow input as stored (what a retry or a resume on
    # another process decodes), never an alias of the object the caller still holds.
    Cart = workflow.Workflow("Fast.Cart", dict[str, list[int]])
    seen: list[dict[str, list[int]]] = []
    gate = threading.Event()
    entered = threading.Event()

    def read_input(run: workflow.TaskRun[dict[str, list[int]]]) -> None:
        entered.set()
        assert gate.wait(timeout=60)
        seen.append(run.input)

    reg = workflow.Registry()
    reg.register(workflow.define(Cart, workflow.handle(workflow.Task("cart.read"), read_input)))
    mgr = make_manager(reg)
    cart = {"items": [1, 2]}
    run = Cart.start(mgr, cart)
    assert entered.wait(timeout=30)
    cart["items"].append(3)  # the caller reuses its object after start()
    gate.set()
    assert run.wait(timeout=30) is workflow.Status.SUCCEEDED
    assert Cart.input(mgr, run.id) == {"items": [1, 2]}
    assert seen == [{"items": [1, 2]}]
    assert seen[0] is not cart


# An interrupt (Ctrl-C, or the SystemExit of a server telling its worker to quit) that
# lands in `start()` after the insert committed, before the run reached a thread. The run
# was inserted claimed by this process: its slot must come back, and the run must not
# sit claimed by nobody until a sweeper takes the claim (`sweep_max_age`, 600 s).


def _interrupt_once(mgr: workflow.Manager, kind: type[workflow.events.Event]) -> list[str]:
    """Raise KeyboardInterrupt from a subscriber at the first event of `kind`; the ids of
    the runs it interrupted."""
    hit: list[str] = []

    def subscriber(event: workflow.events.Event) -> None:
        if isinstance(event, kind) and not hit:
            hit.append(str(event.run_id))
            raise KeyboardInterrupt

    mgr.events.subscribe(subscriber)
    return hit


def fast_path_free_again(mgr: workflow.Manager, db: psycopg.Connection[Any]) -> None:
    """The fast path's only slot comes back (a waiter is woken as its run ends, a moment
    before the run's thread gives the slot back), and a new start runs on it: no poller,
    no wait()."""
    deadline = time.monotonic() + 30
    while mgr._fastpath._in_flight:
        assert time.monotonic() < deadline, "a fast-path slot was never given back"
        time.sleep(0.01)
    later = WF.start(mgr, "later")
    wait_for_status(db, later.id, "succeeded")


def interrupt_after(
    mgr: workflow.Manager, monkeypatch: pytest.MonkeyPatch, statement: str
) -> None:
    """Raise KeyboardInterrupt as the reply of `statement` (a name of queries.sql) comes
    back, once it has run and committed, until `monkeypatch.undo()`."""
    connections = mgr._store.connections
    real_once = connections._once
    sql = workflow.store._Q[statement]

    def once(text: str, params: dict[str, Any]) -> Any:
        rows = real_once(text, params)
        if text == sql:
            raise KeyboardInterrupt
        return rows

    monkeypatch.setattr(connections, "_once", once)


def test_a_start_interrupted_after_its_insert_gives_back_its_slot_and_its_claim(
    make_manager: Any, h: Handlers, db: psycopg.Connection[Any]
) -> None:
    mgr = make_manager(three_tasks(h), workflow.Config(max_local_runs=1))
    hit = _interrupt_once(mgr, workflow.events.RunStarted)
    with pytest.raises(KeyboardInterrupt):
        WF.start(mgr, "interrupted")
    (run_id,) = hit
    # Its claim was released: a wait() kicks it onto the fast path at once. Before,
    # it stayed claimed by no execution (and the only slot stayed taken).
    assert mgr.run(run_id).wait(timeout=20) is workflow.Status.SUCCEEDED
    fast_path_free_again(mgr, db)
    assert [h.count(t, "interrupted") for t in ("fast.one", "fast.two", "fast.three")] == [
        1, 1, 1,
    ]


def test_a_launch_interrupted_before_its_thread_took_the_run_leaves_nothing_admitted(
    make_manager: Any, h: Handlers, db: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    mgr = make_manager(three_tasks(h), workflow.Config(max_local_runs=1))
    real_start = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        if thread.name.startswith("workflow-run_"):
            raise KeyboardInterrupt  # in the wait for the run's first thread to start
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(KeyboardInterrupt):
        WF.start(mgr, "interrupted")
    monkeypatch.undo()
    rows = db.execute("SELECT id FROM workflow_runs WHERE input = %s", ('"interrupted"',))
    (run_id,) = [str(r[0]) for r in rows]
    assert mgr.run(run_id).wait(timeout=20) is workflow.Status.SUCCEEDED
    fast_path_free_again(mgr, db)
    # Nothing is left counted in flight (before: the interrupted run, for ever).
    assert mgr._executor.drain(timeout=10) is True


def test_a_launch_interrupted_after_its_thread_took_the_run_leaves_the_run_to_it(
    make_manager: Any, h: Handlers, db: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    mgr = make_manager(three_tasks(h), workflow.Config(max_local_runs=1))
    fastpath = mgr._fastpath
    threads = fastpath._threads
    real_submit = threads.submit

    def submit(fn: Any, job: Any) -> None:
        real_submit(fn, job)
        h.wait_entered()  # the run's thread is inside its first handler
        raise KeyboardInterrupt

    monkeypatch.setattr(threads, "submit", submit)
    with pytest.raises(KeyboardInterrupt):
        WF.start(mgr, BLOCK)
    monkeypatch.undo()
    rows = db.execute("SELECT id, claim_id FROM workflow_runs WHERE input = %s", (f'"{BLOCK}"',))
    ((run_id, claim_id),) = rows.fetchall()
    assert claim_id is not None  # still its thread's
    h.gate.set()
    assert mgr.run(str(run_id)).wait(timeout=20) is workflow.Status.SUCCEEDED
    assert [h.count(t, BLOCK) for t in ("fast.one", "fast.two", "fast.three")] == [1, 1, 1]
    assert mgr._executor.drain(timeout=10) is True


def test_a_start_interrupted_as_its_inserts_reply_came_releases_the_claim(
    make_manager: Any, h: Handlers, db: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ctrl-C pressed while the insert is on its way: the statement commits, and the
    # interrupt is raised as its reply comes back (libpq's wait cannot be interrupted).
    mgr = make_manager(three_tasks(h), workflow.Config(max_local_runs=1))
    interrupt_after(mgr, monkeypatch, "insert_run")
    with pytest.raises(KeyboardInterrupt):
        WF.start(mgr, "interrupted")
    monkeypatch.undo()
    rows = db.execute(
        "SELECT id, claim_id FROM workflow_runs WHERE input = %s", ('"interrupted"',)
    ).fetchall()
    ((run_id, claim_id),) = rows
    assert claim_id is None  # released: before, claimed by no execution for sweep_max_age
    assert mgr.run(str(run_id)).wait(timeout=20) is workflow.Status.SUCCEEDED
    fast_path_free_again(mgr, db)


def test_a_task_rows_recorded_output_is_the_row_evolved() -> None:
    failed_at = datetime.datetime(2026, 1, 2, tzinfo=datetime.timezone.utc)
    row = TaskRow(seq=2, name="fast.two", skipped=False, attempts=3, has_output=False,
                  output=None, failed_at=failed_at)
    assert row.with_output({"a": [1]}) == attrs.evolve(row, has_output=True, output={"a": [1]})
    assert [f.name for f in attrs.fields(TaskRow)] == [
        "seq", "name", "skipped", "attempts", "has_output", "output", "failed_at",
    ]  # with_output names each: a field added here must be added there


def test_a_kick_interrupted_as_its_claims_reply_came_releases_the_claim(
    make_manager: Any, h: Handlers, db: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ctrl-C in a wait() that kicks a start_tx run: the claim by id commits, and the
    # interrupt is raised as its reply comes back.
    mgr = make_manager(three_tasks(h), workflow.Config(max_local_runs=1))
    with mgr.pool.connection() as conn, conn.transaction():
        run = WF.start_tx(conn, mgr, "kicked")
    interrupt_after(mgr, monkeypatch, "claim_run")
    with pytest.raises(KeyboardInterrupt):
        mgr.kick(run.id)
    monkeypatch.undo()
    row = db.execute("SELECT claim_id FROM workflow_runs WHERE id = %s", (run.id,)).fetchone()
    assert row == (None,)  # released: before, claimed by no execution for sweep_max_age
    assert run.wait(timeout=20) is workflow.Status.SUCCEEDED
    fast_path_free_again(mgr, db)
