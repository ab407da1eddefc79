"""Least privilege: the engine runs as a role that can only read and write rows.

The migrations run as the owner (the fixtures' migrated template). The test then
creates a role of its own (a unique name, dropped afterwards) with exactly these
grants, the ones the README shows:

    GRANT CONNECT ON DATABASE <db> TO <role>;
    GRANT USAGE ON SCHEMA public TO <role>;
    GRANT SELECT, INSERT, UPDATE, DELETE
        ON workflow_runs, workflow_tasks, workflow_events, workflow_schedules TO <role>;
    GRANT SELECT ON workflow_yoyo_migration TO <role>;
    REVOKE CREATE ON SCHEMA public FROM PUBLIC;

and proves that a Manager and a runnable connecting as that role start (fast path
and `start_tx`), execute, retry, park and sweep runs, that an `Admin` as that role
lists, cancels, resumes, forks and prunes them; and that the role cannot create,
alter, truncate or drop tables.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import ConnectionPool

import workflow

GRANTS = [
    "GRANT CONNECT ON DATABASE {db} TO {role}",
    "GRANT USAGE ON SCHEMA public TO {role}",
    "GRANT SELECT, INSERT, UPDATE, DELETE ON workflow_runs, workflow_tasks, workflow_events, "
    "workflow_schedules TO {role}",
    "GRANT SELECT ON workflow_yoyo_migration TO {role}",
    # PostgreSQL 14 and older grant CREATE on public to every role; 15 and later do not.
    "REVOKE CREATE ON SCHEMA public FROM PUBLIC",
]

LOGGER = "least_privilege.engine"

Order = workflow.Workflow("LeastPrivilege.Order", str)
reserve = workflow.Task("lp.reserve", str)
charge = workflow.Task("lp.charge", str)
ship = workflow.Task("lp.ship")

_attempts: dict[tuple[str, str], int] = {}
_lock = threading.Lock()


def _count(run: workflow.TaskRun[str], task: str) -> int:
    with _lock:
        _attempts[(run.run_id, task)] = _attempts.get((run.run_id, task), 0) + 1
        return _attempts[(run.run_id, task)]


def _reserve(run: workflow.TaskRun[str]) -> str:
    _count(run, "reserve")
    return f"hold-{run.input}"


def _charge(run: workflow.TaskRun[str]) -> str:
    _count(run, "charge")
    if run.input == "flaky" and run.attempt == 1:
        raise RuntimeError("card network timeout (transient)")
    if run.input == "reject":
        raise workflow.Permanent("card rejected", code="rejected")
    return f"charged-{run.output(reserve)}"


def _ship(run: workflow.TaskRun[str]) -> None:
    _count(run, "ship")
    assert run.output(charge).startswith("charged-hold-")


def registry() -> workflow.Registry:
    reg = workflow.Registry()
    reg.register(
        workflow.define(
            Order,
            workflow.handle(reserve, _reserve),
            workflow.handle(charge, _charge, backoff_schedule=[0.05]),
            workflow.handle(ship, _ship),
        )
    )
    return reg


CONFIG = workflow.Config(
    sweep_max_age=2,
    default_task_timeout=1,
    max_in_process_backoff=0.5,
    backoff_base=0.05,
    backoff_max=0.2,
)


@pytest.fixture
def role_url(db_url: str, db: psycopg.Connection[Any], pg_url: str) -> Iterator[str]:
    """A conninfo for `db_url`'s database as a fresh least-privilege role."""
    role = f"wf_least_{uuid.uuid4().hex[:10]}"
    params = conninfo_to_dict(db_url)
    dbname = params["dbname"]
    db.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    try:
        for grant in GRANTS:
            db.execute(sql.SQL(grant).format(db=sql.Identifier(dbname), role=sql.Identifier(role)))
        params["user"] = role
        params.pop("password", None)
        yield make_conninfo(**params)
    finally:
        # The role owns nothing; its grants go with DROP OWNED, its sessions with the kill.
        db.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,)
        )
        db.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        with psycopg.connect(pg_url, autocommit=True) as admin:
            deadline = time.monotonic() + 10
            while True:
                try:
                    admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))
                    break
                except psycopg.errors.DependentObjectsStillReferenced:
                    # Privileges in the template or another database: none expected.
                    raise
                except psycopg.errors.ObjectInUse:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)


def _wait_status(db: psycopg.Connection[Any], run_id: str, status: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        row = db.execute("SELECT status FROM workflow_runs WHERE id = %s", (run_id,)).fetchone()
        if row is not None and row[0] == status:
            return
        assert time.monotonic() < deadline, f"run {run_id} is {row}, not {status}"
        time.sleep(0.05)


def test_the_engine_runs_with_row_privileges_only(
    role_url: str, db: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    with psycopg.connect(role_url, autocommit=True) as conn:
        assert conn.execute("SELECT current_user").fetchone()[0] != "postgres"  # type: ignore[index]
        is_super = conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
        assert is_super.fetchone() == (False,)

    pool: ConnectionPool[Any] = ConnectionPool(role_url, min_size=1, max_size=6, open=True)
    mgr = workflow.Manager(pool, registry(), CONFIG, logger=logging.getLogger(LOGGER))
    runnable = mgr.new_runnable(
        workflow.RunnerConfig(poll_interval=0.2, batch_size=10, concurrency=4, sweep_interval=0.2)
    )
    runnable.start()
    try:
        # Start on the fast path, execute: every task once.
        ok = Order.start(mgr, "ok")
        assert ok.wait(timeout=15) is workflow.Status.SUCCEEDED
        # Retry: a transient failure, then success.
        flaky = Order.start(mgr, "flaky")
        assert flaky.wait(timeout=15) is workflow.Status.SUCCEEDED
        assert _attempts[(flaky.id, "charge")] == 2
        # Park: a permanent failure.
        rejected = Order.start(mgr, "reject")
        assert rejected.wait(timeout=15) is workflow.Status.PARKED
        failure = rejected.status().failure
        assert failure is not None and failure.code == "rejected" and failure.attempts == 1
        # start_tx in the role's own transaction, executed by the runnable's poller.
        with psycopg.connect(role_url) as conn, conn.transaction():
            queued = Order.start_tx(conn, mgr, "queued")
        _wait_status(db, queued.id, "succeeded", 15)
        # Idempotent start: the second returns the first, untouched.
        again = Order.start(mgr, "ok", idempotency_key="order-1")
        assert Order.start(mgr, "ok", idempotency_key="order-1") == again
        assert again.wait(timeout=15) is workflow.Status.SUCCEEDED
        assert Order.input(mgr, again.id) == "ok"
        # Sweep: a run claimed by an executor that died (its heartbeat is old) is
        # released by the role's sweeper, counted, and finished by its poller.
        with psycopg.connect(role_url) as conn, conn.transaction():
            orphan = Order.start_tx(conn, mgr, "orphan")
            conn.execute(
                "UPDATE workflow_runs SET claim_id = gen_random_uuid(), status = 'running', "
                "heartbeat_at = now() - interval '1 hour' WHERE id = %s",
                (orphan.id,),
            )
        _wait_status(db, orphan.id, "succeeded", 15)
        row = db.execute(
            "SELECT attempts, error FROM workflow_tasks WHERE run_id = %s AND seq = 1",
            (orphan.id,),
        ).fetchone()
        assert row is not None and row[0] == 1 and "abandoned" in row[1]
    finally:
        runnable.stop(timeout=10)
        mgr.close(timeout=10)
        pool.close()

    problems = [
        r.getMessage()
        for r in caplog.records
        if r.name == LOGGER and r.levelno >= logging.ERROR and r.levelno < workflow.ALERT
    ]
    assert problems == []
    statuses = dict(db.execute("SELECT status, count(*) FROM workflow_runs GROUP BY 1").fetchall())
    assert statuses == {"succeeded": 5, "parked": 1}


@pytest.mark.parametrize(
    "statement",
    [
        "CREATE TABLE intruder (id int)",
        "CREATE TABLE workflow_intruder (id int)",
        "ALTER TABLE workflow_runs ADD COLUMN intruder int",
        "TRUNCATE workflow_runs",
        "DROP TABLE workflow_tasks",
        "CREATE INDEX intruder ON workflow_runs (created_at)",
        "INSERT INTO workflow_yoyo_migration (migration_hash, migration_id) VALUES ('x', 'x')",
    ],
)
def test_the_role_cannot_change_the_schema(role_url: str, statement: str) -> None:
    with (
        psycopg.connect(role_url, autocommit=True) as conn,
        pytest.raises(psycopg.errors.InsufficientPrivilege),
    ):
        conn.execute(statement)


def test_the_same_role_suffices_for_admin(role_url: str) -> None:
    def rejects(run: workflow.TaskRun[str]) -> str:
        raise workflow.Permanent("no")

    reg = workflow.Registry()
    reg.register(workflow.define(Order, workflow.handle(reserve, rejects)))
    with workflow.Manager(role_url, reg) as mgr, workflow.Admin(role_url) as admin:
        run = Order.start(mgr, "o-1")
        assert run.wait(timeout=20) is workflow.Status.PARKED
        assert [item.id for item in admin.runs().items] == [run.id]
        assert admin.run(run.id).history[-1].kind == "parked"
        fork_id = admin.fork(run.id)
        assert admin.resume(run.id).status is workflow.Status.RUNNING
        assert admin.cancel(run.id).status is workflow.Status.CANCELLED
        assert admin.cancel(fork_id).status is workflow.Status.CANCELLED
        assert admin.prune(older_than=0) == 2
        assert admin.stats().workflows == ()


def test_the_same_role_fires_schedules(role_url: str) -> None:
    pytest.importorskip("cronsim")
    reg = workflow.Registry()
    reg.register(workflow.define(Order, workflow.handle(reserve, lambda run: run.input)))
    reg.schedule(workflow.Schedule("hourly", Order, "0 * * * *", input="o-tick"))
    with workflow.Manager(role_url, reg) as mgr, workflow.Admin(role_url) as admin:
        scheduler = mgr.new_runnable(workflow.RunnerConfig(listen=False)).scheduler
        assert scheduler is not None
        scheduler.register()
        with psycopg.connect(role_url, autocommit=True) as conn:
            conn.execute("UPDATE workflow_schedules SET next_tick = now() - interval '1 hour'")
        assert scheduler.fire_due() == 1
        admin.pause_schedule("hourly")
        admin.trigger_schedule("hourly")
        assert scheduler.fire_due() == 1
        (state,) = admin.schedules()
        assert state.paused and state.triggered_at is None
