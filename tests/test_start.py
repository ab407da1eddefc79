"""SPEC section 4 (starting runs) and invariant 7, against real PostgreSQL.

`start` and `start_tx`: the task snapshot, `skip_if` evaluated once, idempotency
keys, reading the stored input, `RunNotFound`, `EncodeError` before anything is
written, the caller's transaction, and the wake-up NOTIFY.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import attrs
import psycopg
import pytest
from pgbouncer import ENGINE_KWARGS
from psycopg import pq

import workflow


@attrs.frozen
class Order:
    customer: str
    amount: int
    express: bool = False


@attrs.frozen
class Reserved:
    id: str


WF = workflow.Workflow("Start.Order", Order)
OTHER = workflow.Workflow("Start.Other", Order)
RESERVE = workflow.Task("order.reserve", Reserved)
PACK = workflow.Task("order.pack", str)
SHIP = workflow.Task("order.ship")
RECEIPT = workflow.Task("order.receipt", str)
TASK_NAMES = ["order.reserve", "order.pack", "order.ship", "order.receipt"]


class Recorder:
    """Handlers and a skip predicate that count their calls (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[str, str, Order]] = []
        self.skip_calls: list[Order] = []
        self.pack_output_missing: list[bool] = []
        self.park_on_reserve = False

    def record(self, task: str, run: workflow.TaskRun[Order]) -> None:
        with self.lock:
            self.calls.append((task, run.run_id, run.input))

    def reserve(self, run: workflow.TaskRun[Order]) -> Reserved:
        self.record("order.reserve", run)
        if self.park_on_reserve:
            raise workflow.Permanent("out of stock", code="stock")
        return Reserved(id=f"r-{run.input.customer}")

    def pack(self, run: workflow.TaskRun[Order]) -> str:
        self.record("order.pack", run)
        return f"box for {run.output(RESERVE).id}"

    def ship(self, run: workflow.TaskRun[Order]) -> None:
        self.record("order.ship", run)

    def receipt(self, run: workflow.TaskRun[Order]) -> str:
        self.record("order.receipt", run)
        try:
            packed = run.output(PACK)
        except workflow.OutputMissing:
            with self.lock:
                self.pack_output_missing.append(True)
            return "not packed"
        with self.lock:
            self.pack_output_missing.append(False)
        return packed

    def skip_pack(self, order: Order) -> bool:
        with self.lock:
            self.skip_calls.append(order)
        return order.express

    def executed(self, task: str) -> int:
        with self.lock:
            return sum(1 for name, _, _ in self.calls if name == task)


def order_registry(rec: Recorder, *, all_skippable: bool = False) -> workflow.Registry:
    """`Start.Order` (reserve, pack skipped for express orders, ship, receipt) and `Start.Other`."""
    reg = workflow.Registry()
    skip: Callable[[Order], bool] = rec.skip_pack
    steps = [
        workflow.handle(RESERVE, rec.reserve),
        workflow.handle(PACK, rec.pack).skip_if(skip),
        workflow.handle(SHIP, rec.ship),
        workflow.handle(RECEIPT, rec.receipt),
    ]
    if all_skippable:
        steps = [s.skip_if(lambda o: o.express) if s.skip is None else s for s in steps]
    reg.register(workflow.define(WF, *steps))
    reg.register(workflow.define(OTHER, workflow.handle(RESERVE, rec.reserve)))
    return reg


def counts(db: psycopg.Connection[Any]) -> tuple[int, int]:
    runs = db.execute("SELECT count(*) FROM workflow_runs").fetchone()
    tasks = db.execute("SELECT count(*) FROM workflow_tasks").fetchone()
    assert runs is not None and tasks is not None
    return int(runs[0]), int(tasks[0])


def run_row(db: psycopg.Connection[Any], run_id: str) -> dict[str, Any]:
    cur = db.execute("SELECT * FROM workflow_runs WHERE id = %s", (run_id,))
    row = cur.fetchone()
    assert row is not None, f"no row for run {run_id}"
    assert cur.description is not None
    return {d.name: v for d, v in zip(cur.description, row, strict=True)}


def task_rows(db: psycopg.Connection[Any], run_id: str) -> list[tuple[Any, ...]]:
    return db.execute(
        "SELECT seq, name, skipped, attempts, output, error, finished_at FROM workflow_tasks "
        "WHERE run_id = %s ORDER BY seq",
        (run_id,),
    ).fetchall()


@pytest.fixture
def rec() -> Recorder:
    return Recorder()


@pytest.fixture
def mgr(make_manager: Any, rec: Recorder) -> workflow.Manager:
    manager: workflow.Manager = make_manager(order_registry(rec))
    return manager


@pytest.fixture
def writer(engine_url: str) -> Any:
    """A plain (non-autocommit) connection for the caller's own transactions.

    Behind PgBouncer (`$WORKFLOW_TEST_PGBOUNCER`) the application's connection goes
    through it too.
    """
    with psycopg.connect(engine_url, **ENGINE_KWARGS) as conn:
        yield conn


# start


def test_start_returns_a_run_whose_id_is_a_str(mgr: workflow.Manager) -> None:
    run = WF.start(mgr, Order("ada", 10))
    assert isinstance(run, workflow.Run)
    assert isinstance(run.id, str) and run.id
    assert mgr.run(run.id) == run
    assert mgr.run(run.id).id == run.id
    assert run.wait(timeout=30) is workflow.Status.SUCCEEDED


def test_snapshot_has_one_row_per_task_in_order_with_seq_from_one(
    mgr: workflow.Manager, db: psycopg.Connection[Any]
) -> None:
    run = WF.start(mgr, Order("ada", 10))
    assert run.wait(timeout=30) is workflow.Status.SUCCEEDED
    rows = task_rows(db, run.id)
    assert [(seq, name, skipped) for seq, name, skipped, *_ in rows] == [
        (1, "order.reserve", False),
        (2, "order.pack", False),
        (3, "order.ship", False),
        (4, "order.receipt", False),
    ]
    assert run_row(db, run.id)["task_count"] == 4
    assert rows[0][4] == {"id": "r-ada"}
    assert rows[1][4] == "box for r-ada"
    assert rows[2][4] is None  # order.ship records nothing
    assert rows[3][4] == "box for r-ada"


def test_snapshot_of_start_tx_is_written_in_order_before_any_execution(
    mgr: workflow.Manager, writer: psycopg.Connection[Any], db: psycopg.Connection[Any]
) -> None:
    run = WF.start_tx(writer, mgr, Order("ada", 10))
    writer.commit()
    rows = task_rows(db, run.id)
    assert [
        (seq, name, skipped, attempts, output) for seq, name, skipped, attempts, output, *_ in rows
    ] == [(i + 1, name, False, 0, None) for i, name in enumerate(TASK_NAMES)]


def test_skip_if_is_evaluated_once_at_creation_against_the_input(
    mgr: workflow.Manager, rec: Recorder, db: psycopg.Connection[Any]
) -> None:
    order = Order("bob", 5, express=True)
    run = WF.start(mgr, order)
    assert run.wait(timeout=30) is workflow.Status.SUCCEEDED
    assert rec.skip_calls == [order]
    assert isinstance(rec.skip_calls[0], Order)


def test_skip_if_is_not_evaluated_again_when_a_claimed_run_executes(
    mgr: workflow.Manager, rec: Recorder, writer: psycopg.Connection[Any]
) -> None:
    # start_tx leaves the run for a claim by id (wait() kicks it): executing it
    # from its stored snapshot must not call the predicate again.
    run = WF.start_tx(writer, mgr, Order("bob", 5, express=True))
    writer.commit()
    assert len(rec.skip_calls) == 1
    assert run.wait(timeout=30) is workflow.Status.SUCCEEDED
    assert len(rec.skip_calls) == 1
    assert rec.executed("order.pack") == 0


def test_a_skipped_task_is_marked_skipped_and_never_executed(
    mgr: workflow.Manager, rec: Recorder, db: psycopg.Connection[Any]
) -> None:
    run = WF.start(mgr, Order("bob", 5, express=True))
    assert run.wait(timeout=30) is workflow.Status.SUCCEEDED
    rows = task_rows(db, run.id)
    assert [(name, skipped) for _, name, skipped, *_ in rows] == [
        ("order.reserve", False),
        ("order.pack", True),
        ("order.ship", False),
        ("order.receipt", False),
    ]
    assert rows[1][3] == 0 and rows[1][4] is None  # no attempt, no output
    assert rec.executed("order.pack") == 0
    assert rec.executed("order.reserve") == rec.executed("order.ship") == 1
    assert rec.executed("order.receipt") == 1


def test_output_of_a_skipped_task_raises_output_missing_in_a_later_task(
    mgr: workflow.Manager, rec: Recorder, db: psycopg.Connection[Any]
) -> None:
    run = WF.start(mgr, Order("bob", 5, express=True))
    assert run.wait(timeout=30) is workflow.Status.SUCCEEDED
    assert rec.pack_output_missing == [True]
    assert task_rows(db, run.id)[3][4] == "not packed"


def test_a_task_whose_predicate_is_false_runs(mgr: workflow.Manager, rec: Recorder) -> None:
    run = WF.start(mgr, Order("cy", 5, express=False))
    assert run.wait(timeout=30) is workflow.Status.SUCCEEDED
    assert rec.executed("order.pack") == 1
    assert rec.pack_output_missing == [False]


def test_a_run_whose_tasks_are_all_skipped_is_succeeded(
    make_manager: Any, rec: Recorder, db: psycopg.Connection[Any]
) -> None:
    mgr = make_manager(order_registry(rec, all_skippable=True))
    run = WF.start(mgr, Order("dee", 1, express=True))
    status = run.status()
    assert status.status is workflow.Status.SUCCEEDED
    assert status.failure is None
    assert status.finished_at is not None
    assert run.wait(timeout=30) is workflow.Status.SUCCEEDED
    assert rec.calls == []
    assert [skipped for _, _, skipped, *_ in task_rows(db, run.id)] == [True] * 4
    row = run_row(db, run.id)
    assert row["claim_id"] is None and row["status"] == "succeeded"


def test_a_start_tx_run_whose_tasks_are_all_skipped_is_succeeded_on_commit(
    make_manager: Any, rec: Recorder, writer: psycopg.Connection[Any]
) -> None:
    mgr = make_manager(order_registry(rec, all_skippable=True))
    run = WF.start_tx(writer, mgr, Order("dee", 1, express=True))
    writer.commit()
    assert run.status().status is workflow.Status.SUCCEEDED
    assert run.wait(timeout=30) is workflow.Status.SUCCEEDED
    assert rec.calls == []


# Idempotency keys.


def test_second_start_with_the_same_key_returns_the_same_run_and_inserts_nothing(
    mgr: workflow.Manager, rec: Recorder, db: psycopg.Connection[Any]
) -> None:
    first = WF.start(mgr, Order("eve", 1, express=True), idempotency_key="order-1")
    assert first.wait(timeout=30) is workflow.Status.SUCCEEDED
    before = counts(db), run_row(db, first.id), task_rows(db, first.id)
    skip_calls = len(rec.skip_calls)
    calls = list(rec.calls)

    second = WF.start(mgr, Order("eve", 1, express=True), idempotency_key="order-1")

    assert second.id == first.id
    assert (counts(db), run_row(db, first.id), task_rows(db, first.id)) == before
    assert len(rec.skip_calls) == skip_calls, "a duplicate start evaluated skip_if"
    assert second.wait(timeout=30) is workflow.Status.SUCCEEDED
    assert rec.calls == calls, "a duplicate start executed tasks again"


def test_duplicate_start_leaves_a_parked_run_parked(
    mgr: workflow.Manager, rec: Recorder, db: psycopg.Connection[Any]
) -> None:
    rec.park_on_reserve = True
    first = WF.start(mgr, Order("fay", 2), idempotency_key="k")
    assert first.wait(timeout=30) is workflow.Status.PARKED
    parked = first.status()
    assert parked.failure is not None and parked.failure.code == "stock"
    before = counts(db), run_row(db, first.id), task_rows(db, first.id)
    rec.park_on_reserve = False
    calls = len(rec.calls)
    skip_calls = len(rec.skip_calls)

    again = WF.start(mgr, Order("fay", 2), idempotency_key="k")

    assert again.id == first.id
    assert again.wait(timeout=30) is workflow.Status.PARKED
    assert again.status() == parked
    assert (counts(db), run_row(db, first.id), task_rows(db, first.id)) == before
    assert len(rec.calls) == calls
    assert len(rec.skip_calls) == skip_calls


def test_duplicate_start_tx_returns_the_existing_run_and_inserts_nothing(
    mgr: workflow.Manager,
    rec: Recorder,
    writer: psycopg.Connection[Any],
    db: psycopg.Connection[Any],
) -> None:
    first = WF.start(mgr, Order("gus", 3), idempotency_key="tx-key")
    assert first.wait(timeout=30) is workflow.Status.SUCCEEDED
    before = counts(db), run_row(db, first.id)
    skip_calls = len(rec.skip_calls)
    second = WF.start_tx(writer, mgr, Order("gus", 4), idempotency_key="tx-key")
    writer.commit()
    assert second.id == first.id
    assert (counts(db), run_row(db, first.id)) == before
    assert len(rec.skip_calls) == skip_calls


def test_idempotency_keys_are_per_workflow(
    mgr: workflow.Manager, db: psycopg.Connection[Any]
) -> None:
    a = WF.start(mgr, Order("hal", 1), idempotency_key="shared")
    b = OTHER.start(mgr, Order("hal", 1), idempotency_key="shared")
    assert a.id != b.id
    assert a.wait(timeout=30) is workflow.Status.SUCCEEDED
    assert b.wait(timeout=30) is workflow.Status.SUCCEEDED
    rows = db.execute(
        "SELECT workflow FROM workflow_runs WHERE idempotency_key = 'shared' ORDER BY workflow"
    ).fetchall()
    assert rows == [("Start.Order",), ("Start.Other",)]


def test_without_a_key_every_start_inserts_a_new_run(
    mgr: workflow.Manager, db: psycopg.Connection[Any]
) -> None:
    runs = [WF.start(mgr, Order("ida", 1)) for _ in range(3)]
    assert len({r.id for r in runs}) == 3
    for r in runs:
        assert r.wait(timeout=30) is workflow.Status.SUCCEEDED
    assert counts(db) == (3, 12)


def test_concurrent_starts_with_the_same_key_make_one_run(
    mgr: workflow.Manager, rec: Recorder, db: psycopg.Connection[Any]
) -> None:
    barrier = threading.Barrier(4)
    ids: list[str] = []
    errors: list[BaseException] = []

    def go() -> None:
        try:
            barrier.wait(timeout=10)
            ids.append(WF.start(mgr, Order("joe", 1), idempotency_key="race").id)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=go) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert errors == []
    assert len(set(ids)) == 1
    assert workflow.Run(mgr, ids[0]).wait(timeout=30) is workflow.Status.SUCCEEDED
    assert counts(db) == (1, 4)
    assert rec.executed("order.reserve") == 1


# Reading the stored input; unknown runs.


def test_input_reads_the_stored_input(mgr: workflow.Manager) -> None:
    order = Order("kim", 42, express=True)
    run = WF.start(mgr, order)
    assert WF.input(mgr, run.id) == order
    assert run.wait(timeout=30) is workflow.Status.SUCCEEDED
    assert WF.input(mgr, run.id) == order


def test_input_after_a_duplicate_start_returns_the_first_input(mgr: workflow.Manager) -> None:
    first = WF.start(mgr, Order("lee", 1), idempotency_key="dup")
    second = WF.start(mgr, Order("lee", 999, express=True), idempotency_key="dup")
    assert second.id == first.id
    assert WF.input(mgr, second.id) == Order("lee", 1)


def test_run_raises_run_not_found_for_unknown_and_malformed_ids(mgr: workflow.Manager) -> None:
    for bad in (str(uuid.uuid4()), "nope", "", "123", str(uuid.uuid4()) + "x"):
        with pytest.raises(workflow.RunNotFound):
            mgr.run(bad)
    assert issubclass(workflow.RunNotFound, workflow.WorkflowError)


def test_input_raises_run_not_found_for_a_run_of_another_workflow(
    mgr: workflow.Manager,
) -> None:
    other = OTHER.start(mgr, Order("max", 1))
    assert OTHER.input(mgr, other.id) == Order("max", 1)
    with pytest.raises(workflow.RunNotFound):
        WF.input(mgr, other.id)
    for bad in (str(uuid.uuid4()), "not-an-id"):
        with pytest.raises(workflow.RunNotFound):
            WF.input(mgr, bad)


# EncodeError: nothing written.


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(Order("nan", float("nan")), id="nan-field"),  # type: ignore[arg-type]
        pytest.param(Order("obj", object()), id="object-field"),  # type: ignore[arg-type]
        pytest.param({"customer": "dict", "amount": 1}, id="not-an-Order"),
    ],
)
def test_start_with_an_unencodable_input_raises_encode_error_and_writes_nothing(
    mgr: workflow.Manager, rec: Recorder, db: psycopg.Connection[Any], bad: Any
) -> None:
    with pytest.raises(workflow.EncodeError):
        WF.start(mgr, bad)
    assert counts(db) == (0, 0)
    assert rec.skip_calls == []
    assert rec.calls == []


def test_unencodable_input_with_an_idempotency_key_writes_nothing(
    mgr: workflow.Manager, db: psycopg.Connection[Any]
) -> None:
    with pytest.raises(workflow.EncodeError):
        WF.start(mgr, Order("nan", float("nan")), idempotency_key="bad")  # type: ignore[arg-type]
    assert counts(db) == (0, 0)
    run = WF.start(mgr, Order("ok", 1), idempotency_key="bad")
    assert run.wait(timeout=30) is workflow.Status.SUCCEEDED
    assert counts(db) == (1, 4)


# start_tx: the caller's transaction.


def test_start_tx_in_a_rolled_back_transaction_leaves_nothing(
    mgr: workflow.Manager,
    rec: Recorder,
    writer: psycopg.Connection[Any],
    db: psycopg.Connection[Any],
) -> None:
    run = WF.start_tx(writer, mgr, Order("ned", 1))
    assert writer.info.transaction_status == pq.TransactionStatus.INTRANS
    writer.rollback()
    assert counts(db) == (0, 0)
    with pytest.raises(workflow.RunNotFound):
        mgr.run(run.id)
    assert rec.calls == []


def test_start_tx_rolled_back_by_an_exception_in_a_transaction_block_leaves_nothing(
    mgr: workflow.Manager, db_url: str, db: psycopg.Connection[Any]
) -> None:
    with (
        psycopg.connect(db_url, autocommit=True) as conn,
        pytest.raises(RuntimeError),
        conn.transaction(),
    ):
        WF.start_tx(conn, mgr, Order("ned", 1))
        raise RuntimeError("the caller's own work failed")
    assert counts(db) == (0, 0)


def test_start_tx_is_inserted_in_the_callers_transaction_and_exists_as_pending_on_commit(
    mgr: workflow.Manager,
    rec: Recorder,
    writer: psycopg.Connection[Any],
    db: psycopg.Connection[Any],
) -> None:
    run = WF.start_tx(writer, mgr, Order("oli", 1))
    # Not visible to anyone else before the caller commits.
    assert counts(db) == (0, 0)
    assert writer.execute("SELECT count(*) FROM workflow_runs").fetchone() == (1,)
    writer.commit()
    row = run_row(db, run.id)
    assert row["status"] == "pending"
    assert row["claim_id"] is None and row["heartbeat_at"] is None
    assert run.status().status is workflow.Status.PENDING
    assert rec.calls == [], "start_tx launched the run"
    assert run.wait(timeout=30) is workflow.Status.SUCCEEDED
    assert rec.executed("order.reserve") == 1
    assert rec.executed("order.receipt") == 1


def test_start_tx_with_an_encode_error_leaves_the_callers_transaction_usable(
    mgr: workflow.Manager, writer: psycopg.Connection[Any], db: psycopg.Connection[Any]
) -> None:
    db.execute("CREATE TABLE app_orders (id int PRIMARY KEY)")
    writer.execute("INSERT INTO app_orders VALUES (1)")
    with pytest.raises(workflow.EncodeError):
        WF.start_tx(writer, mgr, Order("nan", float("nan")))  # type: ignore[arg-type]
    assert writer.info.transaction_status == pq.TransactionStatus.INTRANS
    writer.execute("INSERT INTO app_orders VALUES (2)")
    writer.commit()
    assert db.execute("SELECT id FROM app_orders ORDER BY id").fetchall() == [(1,), (2,)]
    assert counts(db) == (0, 0)


def test_start_tx_refuses_an_autocommit_connection_outside_a_transaction(
    mgr: workflow.Manager, db_url: str, db: psycopg.Connection[Any]
) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        with pytest.raises(workflow.WorkflowError, match="transaction"):
            WF.start_tx(conn, mgr, Order("pat", 1))
        assert counts(db) == (0, 0)
        # Inside an explicit transaction block the same connection is accepted.
        with conn.transaction():
            run = WF.start_tx(conn, mgr, Order("pat", 1))
    assert run.status().status is workflow.Status.PENDING


def test_start_tx_refuses_a_connection_in_a_failed_transaction(
    mgr: workflow.Manager, writer: psycopg.Connection[Any], db: psycopg.Connection[Any]
) -> None:
    with pytest.raises(psycopg.errors.DivisionByZero):
        writer.execute("SELECT 1 / 0")
    assert writer.info.transaction_status == pq.TransactionStatus.INERROR
    with pytest.raises(workflow.WorkflowError, match="failed"):
        WF.start_tx(writer, mgr, Order("quin", 1))
    writer.rollback()
    assert counts(db) == (0, 0)


def test_start_tx_rejects_something_that_is_not_a_connection(mgr: workflow.Manager) -> None:
    with pytest.raises(TypeError):
        WF.start_tx(object(), mgr, Order("r", 1))  # type: ignore[arg-type]


@pytest.fixture
def listener(db_url: str) -> Any:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("LISTEN workflow_runs")
        yield conn


def next_notify(conn: psycopg.Connection[Any]) -> psycopg.Notify:
    notes = list(conn.notifies(timeout=15, stop_after=1))
    assert notes, "no notification arrived"
    return notes[0]


def test_start_tx_notifies_workflow_runs_only_on_commit(
    mgr: workflow.Manager,
    writer: psycopg.Connection[Any],
    db: psycopg.Connection[Any],
    listener: psycopg.Connection[Any],
) -> None:
    WF.start_tx(writer, mgr, Order("sam", 1))
    # Notifications are delivered in commit order: a marker committed while the
    # run's transaction is still open must arrive first, alone.
    db.execute("NOTIFY workflow_runs, 'marker-before-commit'")
    assert next_notify(listener).payload == "marker-before-commit"
    writer.commit()
    note = next_notify(listener)
    assert note.channel == "workflow_runs"
    assert note.payload == WF.name


def test_start_tx_rolled_back_sends_no_notify(
    mgr: workflow.Manager,
    writer: psycopg.Connection[Any],
    db: psycopg.Connection[Any],
    listener: psycopg.Connection[Any],
) -> None:
    WF.start_tx(writer, mgr, Order("tom", 1))
    writer.rollback()
    db.execute("NOTIFY workflow_runs, 'marker-after-rollback'")
    assert next_notify(listener).payload == "marker-after-rollback"


@pytest.mark.direct(reason="a LISTEN wake-up needs a session of its own")
def test_start_tx_run_is_picked_up_by_a_listening_poller(
    make_manager: Any, rec: Recorder, writer: psycopg.Connection[Any]
) -> None:
    # The wake-up reaches a runnable LISTENing with a poll interval far longer
    # than this test may take.
    mgr = make_manager(order_registry(rec))
    runnable = mgr.new_runnable(workflow.RunnerConfig(poll_interval=3600, sweep_enabled=False))
    thread = threading.Thread(target=runnable.run, daemon=True)
    thread.start()
    try:
        run = WF.start_tx(writer, mgr, Order("uma", 1))
        writer.commit()
        deadline = time.monotonic() + 30
        while run.status().status is not workflow.Status.SUCCEEDED:
            assert time.monotonic() < deadline, "the listening poller never ran the run"
            time.sleep(0.05)
    finally:
        runnable.stop(timeout=10)
        thread.join(timeout=10)
    assert rec.executed("order.reserve") == 1


def test_start_of_a_workflow_not_registered_with_the_manager_raises_and_writes_nothing(
    mgr: workflow.Manager, db: psycopg.Connection[Any], writer: psycopg.Connection[Any]
) -> None:
    unknown = workflow.Workflow("Start.Unknown", Order)
    with pytest.raises(workflow.WorkflowError, match="not registered"):
        unknown.start(mgr, Order("x", 1))
    with pytest.raises(workflow.WorkflowError, match="not registered"):
        unknown.start_tx(writer, mgr, Order("x", 1))
    writer.commit()
    assert counts(db) == (0, 0)


class _Used(dict[str, str]):
    """The engine's statements, remembering which ones were looked up."""

    def __init__(self, queries: dict[str, str]) -> None:
        super().__init__(queries)
        self.names: list[str] = []

    def __getitem__(self, name: str) -> str:
        self.names.append(name)
        return super().__getitem__(name)

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        self.names.append(name)
        return super().get(name, default)


INSERTS = ("insert_run", "insert_runs", "insert_idempotent_run", "insert_keyed_run")


def test_a_start_with_no_key_of_either_kind_is_no_speculative_insertion(
    make_manager: Any, rec: Recorder, writer: psycopg.Connection[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An INSERT ... ON CONFLICT is a speculative insertion, which writes a confirmation
    # record to the WAL (48 bytes a run) even when the run has no key to conflict with.
    used = _Used(workflow.store._Q)
    monkeypatch.setattr(workflow.store, "_Q", used)
    mgr = make_manager(order_registry(rec))

    def inserts(start: Callable[[], object]) -> list[str]:
        used.names.clear()
        start()
        return [used[name] for name in list(used.names) if name in INSERTS]

    def in_tx(**kwargs: Any) -> None:
        WF.start_tx(writer, mgr, Order("tx", 1), **kwargs)
        writer.commit()

    keyless = inserts(lambda: WF.start(mgr, Order("a", 1))) + inserts(in_tx)
    keyed = inserts(lambda: WF.start(mgr, Order("b", 1), idempotency_key="b")) + inserts(
        lambda: in_tx(idempotency_key="tx")
    )
    assert len(keyless) == 2 and len(keyed) == 2
    assert not any("ON CONFLICT" in sql for sql in keyless)
    assert all("ON CONFLICT" in sql for sql in keyed)


def test_the_insert_without_an_idempotency_key_is_the_other_less_its_key() -> None:
    # Two copies of one statement: whatever changes in one must change in the other.
    plain, idempotent = (" ".join(workflow.store._Q[name].split())
                         for name in ("insert_run", "insert_idempotent_run"))
    key = (
        "CASE WHEN %(key_wait)s::text IS NULL THEN %(idempotency_key)s ELSE %(idempotency_key)s "
        "|| left(set_config('lock_timeout', %(key_wait)s, true), 0) END, "
    )
    conflict = (
        "ON CONFLICT (workflow, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING "
    )
    for part in (key, conflict, "idempotency_key, "):
        assert idempotent.count(part) == 1, part
        idempotent = idempotent.replace(part, "")
    assert plain == idempotent


def test_a_retried_insert_that_finds_its_key_taken_by_its_own_earlier_try_returns_its_run(
    pool: Any,
) -> None:
    # A start whose connection was lost while the server still ran its insert tries
    # again; the earlier try commits meanwhile, so the retry's ON CONFLICT inserts
    # nothing. The run is this start's (claimed for it): it must not be taken for
    # another start's, which would leave it claimed by nobody until a sweep.
    store = workflow.store.Store(pool)

    def insert(run_id: uuid.UUID, claim_id: uuid.UUID) -> Any:
        return store.insert_run(
            None, run_id=run_id, workflow="Start.Order", status="running",
            idempotency_key="once", input='{"customer": "a", "amount": 1}',
            input_sealed=None, context=None, context_sealed=None, task_count=1,
            current_seq=1, claim_id=claim_id,
            names=workflow.store.array_literal(["order.reserve"]),
            skipped=workflow.store.array_literal([False]), wake=False,
        )

    run_id, claim_id = uuid.uuid4(), uuid.uuid4()
    assert insert(run_id, claim_id) == (run_id, True)  # the earlier try, committed
    assert insert(run_id, claim_id) == (run_id, True)  # the retry
    assert insert(uuid.uuid4(), uuid.uuid4()) is None  # another start of the same key
