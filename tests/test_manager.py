"""SPEC section 3 (the manager) and the logging rules of section 8, against real PostgreSQL.

Schema check on construction, registry freeze, the timeout rule, a pool borrowed
or owned, `close()` and the context manager, fork detection, and the logger.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import threading
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from helpers import Records, other_backends, threads_fail_to_start, wait_until
from psycopg_pool import ConnectionPool

import workflow
from workflow.store import SCHEMA_VERSION, SchemaOutdated

WF = workflow.Workflow("Manager.Rules", int)
STEP_ONE = workflow.Task("manager.one", int)
STEP_TWO = workflow.Task("manager.two")


def double(run: workflow.TaskRun[int]) -> int:
    return run.input * 2


def noop(run: workflow.TaskRun[int]) -> None:
    del run


def registry(*steps: workflow.Step[int], wf: workflow.Workflow[int] = WF) -> workflow.Registry:
    """A registry holding `wf` with `steps` (two trivial tasks by default)."""
    reg = workflow.Registry()
    if not steps:
        steps = (workflow.handle(STEP_ONE, double), workflow.handle(STEP_TWO, noop))
    reg.register(workflow.define(wf, *steps))
    return reg


def count_rows(db: psycopg.Connection[Any]) -> tuple[int, int]:
    runs = db.execute("SELECT count(*) FROM workflow_runs").fetchone()
    tasks = db.execute("SELECT count(*) FROM workflow_tasks").fetchone()
    assert runs is not None and tasks is not None
    return int(runs[0]), int(tasks[0])


# Schema version check.


def test_schema_outdated_on_unmigrated_database_names_found_needed_and_command(
    empty_db_url: str,
) -> None:
    with pytest.raises(SchemaOutdated) as info:
        workflow.Manager(empty_db_url, registry())
    error = info.value
    assert isinstance(error, workflow.WorkflowError)
    assert error.found == 0
    assert error.needed == SCHEMA_VERSION
    message = str(error)
    assert "version 0" in message
    assert f"needs {SCHEMA_VERSION}" in message
    assert "python -m workflow migrate" in message


def test_schema_outdated_with_a_borrowed_pool_leaves_the_pool_open(empty_db_url: str) -> None:
    with ConnectionPool(empty_db_url, min_size=1, max_size=2, open=True) as pool:
        with pytest.raises(workflow.SchemaOutdated):
            workflow.Manager(pool, registry())
        assert not pool.closed
        with pool.connection() as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)


def test_schema_outdated_with_a_connection_string_closes_the_pool_it_built(
    empty_db_url: str,
) -> None:
    with pytest.raises(workflow.SchemaOutdated):
        workflow.Manager(empty_db_url, registry())
    with psycopg.connect(empty_db_url, autocommit=True) as db:
        wait_until(lambda: other_backends(db) == 0, "the owned pool's connections to close")


def test_schema_outdated_when_bookkeeping_records_an_older_version(
    db_url: str, db: psycopg.Connection[Any]
) -> None:
    # Deleting the newest migration's bookkeeping row makes the database look one
    # version behind.
    deleted = db.execute(
        "DELETE FROM workflow_yoyo_migration WHERE migration_id LIKE %s RETURNING migration_id",
        (f"{SCHEMA_VERSION:04d}_%",),
    ).fetchall()
    assert deleted
    with pytest.raises(SchemaOutdated) as info:
        workflow.Manager(db_url, registry())
    assert info.value.found == SCHEMA_VERSION - 1
    assert info.value.needed == SCHEMA_VERSION
    assert f"version {SCHEMA_VERSION - 1}" in str(info.value)
    assert "python -m workflow migrate" in str(info.value)


def test_a_migrated_database_passes_the_schema_check(make_manager: Any) -> None:
    mgr = make_manager(registry())
    assert WF.start(mgr, 21).wait(timeout=30) is workflow.Status.SUCCEEDED


# The registry is frozen.


def test_manager_freezes_the_registry(make_manager: Any) -> None:
    reg = registry()
    before = reg.frozen
    make_manager(reg)
    assert (before, reg.frozen) == (False, True)
    other = workflow.Workflow("Manager.Late", int)
    with pytest.raises(workflow.RegistrationError, match="frozen"):
        reg.register(workflow.define(other, workflow.handle(workflow.Task("late.one"), noop)))
    assert reg.definition("Manager.Late") is None


# The timeout rule: task timeout + max_in_process_backoff < sweep_max_age, strictly.


def test_config_error_when_default_timeout_plus_backoff_equals_sweep_max_age(
    make_manager: Any,
) -> None:
    # Defaults: 60 s timeout + 5 s in-process backoff = 65 s; equal is a failure.
    with pytest.raises(workflow.ConfigError) as info:
        make_manager(registry(), workflow.Config(sweep_max_age=65))
    message = str(info.value)
    assert "Manager.Rules" in message
    assert "manager.one" in message
    assert "sweep_max_age" in message


def test_config_error_when_default_timeout_plus_backoff_exceeds_sweep_max_age(
    make_manager: Any,
) -> None:
    with pytest.raises(workflow.ConfigError):
        make_manager(
            registry(),
            workflow.Config(default_task_timeout=50, max_in_process_backoff=20, sweep_max_age=60),
        )


def test_config_with_defaults_strictly_under_sweep_max_age_passes(make_manager: Any) -> None:
    mgr = make_manager(registry(), workflow.Config(sweep_max_age=65.5))
    assert WF.start(mgr, 1).wait(timeout=30) is workflow.Status.SUCCEEDED


def test_config_error_when_per_task_timeout_plus_backoff_equals_sweep_max_age(
    make_manager: Any,
) -> None:
    # Default sweep_max_age 600 s, max_in_process_backoff 5 s: a 595 s task is too long.
    reg = registry(
        workflow.handle(STEP_ONE, double),
        workflow.handle(STEP_TWO, noop, timeout=datetime.timedelta(seconds=595)),
    )
    with pytest.raises(workflow.ConfigError) as info:
        make_manager(reg)
    assert "manager.two" in str(info.value)


def test_per_task_timeout_strictly_under_sweep_max_age_passes(make_manager: Any) -> None:
    reg = registry(
        workflow.handle(STEP_ONE, double, timeout=594.5),
        workflow.handle(STEP_TWO, noop),
    )
    mgr = make_manager(reg)
    assert WF.start(mgr, 1).wait(timeout=30) is workflow.Status.SUCCEEDED


def test_per_task_timeout_overrides_a_default_that_would_break_the_rule(
    make_manager: Any,
) -> None:
    # The rule is checked per registered task with its effective timeout: every
    # task sets its own, so the (too long) default never applies.
    reg = registry(
        workflow.handle(STEP_ONE, double, timeout=10),
        workflow.handle(STEP_TWO, noop, timeout=10),
    )
    make_manager(reg, workflow.Config(default_task_timeout=1000, sweep_max_age=100))
    with pytest.raises(workflow.ConfigError):
        make_manager(
            registry(
                workflow.handle(STEP_ONE, double, timeout=10), workflow.handle(STEP_TWO, noop)
            ),
            workflow.Config(default_task_timeout=1000, sweep_max_age=100),
        )


def test_config_error_with_a_timeout_rule_uses_config_max_in_process_backoff(
    make_manager: Any,
) -> None:
    reg = registry(workflow.handle(STEP_ONE, double, timeout=30), workflow.handle(STEP_TWO, noop))
    config = workflow.Config(default_task_timeout=30, max_in_process_backoff=0, sweep_max_age=30)
    with pytest.raises(workflow.ConfigError):
        make_manager(reg, config)
    make_manager(
        registry(workflow.handle(STEP_ONE, double, timeout=30), workflow.handle(STEP_TWO, noop)),
        workflow.Config(default_task_timeout=30, max_in_process_backoff=0, sweep_max_age=30.5),
    )


# A pool given is borrowed; a connection string builds a pool the manager owns.


def test_manager_with_connection_string_owns_its_pool_and_close_closes_it(
    db_url: str, db: psycopg.Connection[Any]
) -> None:
    mgr = workflow.Manager(db_url, registry())
    try:
        assert other_backends(db) >= 1
        assert WF.start(mgr, 4).wait(timeout=30) is workflow.Status.SUCCEEDED
    finally:
        mgr.close(timeout=10)
    wait_until(lambda: other_backends(db) == 0, "the owned pool's connections to close")
    mgr.close()  # idempotent


@pytest.mark.direct(reason="counts the pool's own backends in pg_stat_activity")
def test_a_manager_whose_heartbeat_cannot_start_closes_the_pool_it_built(
    db_url: str, db: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Out of threads while the manager is being built: the error is raised, and the
    # pool it opened (its connection and its threads) does not stay behind; an
    # application that retries builds one pool at a time, not one more per try.
    threads_fail_to_start(monkeypatch, lambda thread: thread.name == "workflow-heartbeat")
    before = {thread.ident for thread in threading.enumerate()}
    with pytest.raises(RuntimeError, match="can't start new thread"):
        workflow.Manager(db_url, registry())
    monkeypatch.undo()
    wait_until(lambda: other_backends(db) == 0, "the pool's connections to close")
    wait_until(
        lambda: {thread.ident for thread in threading.enumerate()} <= before,
        "the pool's threads to end",
    )
    with workflow.Manager(db_url, registry()) as mgr:  # nothing was left half-made
        assert WF.start(mgr, 4).wait(timeout=30) is workflow.Status.SUCCEEDED


@pytest.mark.direct(reason="counts the pool's own backends in pg_stat_activity")
def test_manager_with_a_pool_borrows_it_and_close_leaves_it_usable(
    pool: ConnectionPool[Any], db: psycopg.Connection[Any]
) -> None:
    mgr = workflow.Manager(pool, registry())
    run = WF.start(mgr, 4)
    assert run.wait(timeout=30) is workflow.Status.SUCCEEDED
    mgr.close(timeout=10)
    assert not pool.closed
    with pool.connection() as conn:
        assert conn.execute("SELECT count(*) FROM workflow_runs").fetchone() == (1,)
    assert other_backends(db) >= 1


def test_manager_is_a_context_manager_that_closes(db_url: str, db: psycopg.Connection[Any]) -> None:
    with workflow.Manager(db_url, registry()) as mgr:
        assert isinstance(mgr, workflow.Manager)
        assert WF.start(mgr, 5).wait(timeout=30) is workflow.Status.SUCCEEDED
    wait_until(lambda: other_backends(db) == 0, "the owned pool's connections to close")


def test_closed_manager_launches_nothing_but_start_still_inserts_for_a_poller(
    pool: ConnectionPool[Any], db: psycopg.Connection[Any]
) -> None:
    calls: list[int] = []

    def record(run: workflow.TaskRun[int]) -> int:
        calls.append(run.input)
        return run.input

    reg = registry(workflow.handle(STEP_ONE, record), workflow.handle(STEP_TWO, noop))
    with workflow.Manager(pool, reg) as mgr:
        pass
    run = WF.start(mgr, 6)
    row = db.execute(
        "SELECT status, claim_id FROM workflow_runs WHERE id = %s", (run.id,)
    ).fetchone()
    assert row == ("pending", None)
    assert calls == []


# A manager must not cross a fork().


@pytest.fixture
def forked_child_results() -> Iterator[Callable[[dict[str, Callable[[], Any]]], dict[str, Any]]]:
    """Run each call in a forked child; return {name: error message or a marker}."""

    def run_in_child(calls: dict[str, Callable[[], Any]]) -> dict[str, Any]:
        read_fd, write_fd = os.pipe()
        with warnings.catch_warnings():
            # Python 3.12+ warns about fork() in a multi-threaded process; the child
            # only raises (or reports) and leaves with os._exit.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 0
            try:
                signal.alarm(60)  # a child that hangs dies instead of blocking the parent
                os.close(read_fd)
                results: dict[str, Any] = {}
                for name, call in calls.items():
                    try:
                        call()
                        results[name] = {"raised": None}
                    except workflow.WorkflowError as e:
                        results[name] = {"raised": type(e).__name__, "message": str(e)}
                    except BaseException as e:
                        results[name] = {"raised": type(e).__name__, "message": str(e)}
                data = json.dumps(results).encode()
                while data:
                    data = data[os.write(write_fd, data) :]
            except BaseException:
                code = 3
            finally:
                os._exit(code)
        os.close(write_fd)
        chunks = []
        with os.fdopen(read_fd, "rb") as pipe:
            while chunk := pipe.read():
                chunks.append(chunk)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        return dict(json.loads(b"".join(chunks)))

    yield run_in_child


def test_manager_used_in_a_forked_child_raises_workflow_error_saying_build_after_fork(
    make_manager: Any,
    forked_child_results: Callable[[dict[str, Callable[[], Any]]], dict[str, Any]],
) -> None:
    mgr = make_manager(registry())
    run = WF.start(mgr, 7)
    assert run.wait(timeout=30) is workflow.Status.SUCCEEDED
    results = forked_child_results(
        {
            "start": lambda: WF.start(mgr, 8),
            "run": lambda: mgr.run(run.id),
            "wait": lambda: run.wait(timeout=1),
            "status": run.status,
            "input": lambda: WF.input(mgr, run.id),
            "new_runnable": mgr.new_runnable,
        }
    )
    for name, result in results.items():
        assert result["raised"] == "WorkflowError", (name, result)
        message = result["message"].lower()
        assert "fork" in message, (name, result)
        assert "after the fork" in message, (name, result)
    # The parent's manager is unaffected, and the child wrote nothing.
    assert mgr.run(run.id).status().status is workflow.Status.SUCCEEDED
    assert WF.start(mgr, 9).wait(timeout=30) is workflow.Status.SUCCEEDED


def test_close_in_a_forked_child_leaves_the_parents_warm_connections_alone(
    db_url: str,
    forked_child_results: Callable[[dict[str, Callable[[], Any]]], dict[str, Any]],
) -> None:
    # A manager built from a URL keeps connections warm; in a child they are the
    # parent's (same sockets): close() there must not hand them to the pool,
    # which may close them and so end the parent's sessions.
    mgr = workflow.Manager(db_url, registry())
    try:
        assert WF.start(mgr, 1).wait(timeout=30) is workflow.Status.SUCCEEDED
        warm = mgr._store.connections.warm
        assert warm

        def close_in_child() -> None:
            before = mgr._pool.get_stats().get("pool_available", 0)
            mgr.close(timeout=1)
            after = mgr._pool.get_stats().get("pool_available", 0)
            if after != before:
                raise AssertionError(f"the child gave {after - before} connections to its pool")
            if mgr._store.connections.warm:
                raise AssertionError("the child still holds warm connections")

        results = forked_child_results({"close": close_in_child})
        assert results["close"]["raised"] is None, results
        # The parent's warm connections are untouched and still work.
        assert mgr._store.connections.warm == warm
        assert WF.start(mgr, 2).wait(timeout=30) is workflow.Status.SUCCEEDED
    finally:
        mgr.close(timeout=10)


def test_a_manager_built_in_the_forked_child_works(
    make_manager: Any,
    db_url: str,
    forked_child_results: Callable[[dict[str, Callable[[], Any]]], dict[str, Any]],
    db: psycopg.Connection[Any],
) -> None:
    make_manager(registry())

    def build_and_run() -> None:
        with workflow.Manager(db_url, registry()) as child:
            status = WF.start(child, 10).wait(timeout=30)
            if status is not workflow.Status.SUCCEEDED:
                raise AssertionError(f"child run ended {status}")

    results = forked_child_results({"build_and_run": build_and_run})
    assert results == {"build_and_run": {"raised": None}}
    row = db.execute("SELECT status FROM workflow_runs WHERE input = '10'::jsonb").fetchone()
    assert row == ("succeeded",)


# Logging: the given logger (default "workflow"), every message prefixed.


@pytest.fixture
def handler_on() -> Iterator[Callable[[logging.Logger], Records]]:
    attached: list[tuple[logging.Logger, Records, int]] = []

    def attach(logger: logging.Logger) -> Records:
        handler = Records(logging.DEBUG)
        attached.append((logger, handler, logger.level))
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        return handler

    yield attach
    for logger, handler, level in attached:
        logger.removeHandler(handler)
        logger.setLevel(level)


def failing_registry(attempts: list[int]) -> workflow.Registry:
    """A workflow whose second task fails on every attempt (2 of them), then parks."""

    def flaky(run: workflow.TaskRun[int]) -> None:
        attempts.append(run.attempt)
        raise ValueError(f"boom on attempt {run.attempt}")

    return registry(
        workflow.handle(STEP_ONE, double),
        workflow.handle(STEP_TWO, flaky, max_attempts=2, backoff_schedule=[0]),
    )


def test_default_logger_is_the_workflow_logger(
    make_manager: Any, handler_on: Callable[[logging.Logger], Records]
) -> None:
    default = logging.getLogger("workflow")
    handler = handler_on(default)
    attempts: list[int] = []
    mgr = make_manager(failing_registry(attempts))
    assert mgr.logger is default
    run = WF.start(mgr, 1)
    assert run.wait(timeout=30) is workflow.Status.PARKED
    assert attempts == [1, 2]
    assert handler.records, "the engine logged nothing for a retry and a park"
    assert {r.name for r in handler.records} == {"workflow"}
    assert any(r.levelno == workflow.ALERT for r in handler.records)


def test_given_logger_receives_every_message_prefixed_with_workflow(
    make_manager: Any, handler_on: Callable[[logging.Logger], Records]
) -> None:
    mine = logging.getLogger(f"tests.manager.{uuid.uuid4().hex}")
    handler = handler_on(mine)
    default_handler = handler_on(logging.getLogger("workflow"))
    attempts: list[int] = []
    mgr = make_manager(failing_registry(attempts), logger=mine)
    assert mgr.logger is mine
    run = WF.start(mgr, 1)
    assert run.wait(timeout=30) is workflow.Status.PARKED
    mgr.close(timeout=10)
    assert attempts == [1, 2]
    records = handler.records
    assert len(records) >= 2  # the retry, and the park at ALERT
    for record in records:
        assert record.getMessage().startswith("workflow: "), record.getMessage()
    alerts = [r for r in records if r.levelno == workflow.ALERT]
    assert len(alerts) == 1
    assert alerts[0].levelname == "ALERT"
    assert getattr(alerts[0], "run_id", None) == run.id
    assert "manager.two" in alerts[0].getMessage()
    retries = [r for r in records if r.levelno < logging.WARNING]
    assert retries and getattr(retries[0], "run_id", None) == run.id
    assert default_handler.records == []


def test_manager_rejects_a_non_registry_and_a_non_pool(db_url: str) -> None:
    with pytest.raises(TypeError):
        workflow.Manager(db_url, object())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        workflow.Manager(object(), registry())  # type: ignore[arg-type]


def test_run_of_unknown_and_malformed_ids_raises_run_not_found(make_manager: Any) -> None:
    mgr = make_manager(registry())
    for bad in (str(uuid.uuid4()), "not-a-uuid", ""):
        with pytest.raises(workflow.RunNotFound):
            mgr.run(bad)


# close(): drains in-flight local executions.


def test_close_cancels_and_waits_for_in_flight_executions(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    saw_cancel = threading.Event()
    finish = threading.Event()
    second_calls: list[int] = []
    entered = threading.Event()

    def slow(run: workflow.TaskRun[int]) -> int:
        entered.set()
        assert run.cancelled.wait(timeout=60), "close() never set cancelled"
        saw_cancel.set()
        assert finish.wait(timeout=60)
        return run.input

    def second(run: workflow.TaskRun[int]) -> None:
        second_calls.append(run.input)

    reg = registry(workflow.handle(STEP_ONE, slow), workflow.handle(STEP_TWO, second))
    mgr = make_manager(reg)
    run = WF.start(mgr, 11)
    # Close once the handler runs: a run no thread has picked up yet when the
    # drain begins is released without running, which is not what this tests.
    assert entered.wait(timeout=30)
    closed = threading.Event()

    def close() -> None:
        mgr.close()
        closed.set()

    closer = threading.Thread(target=close, daemon=True)
    closer.start()
    assert saw_cancel.wait(timeout=30)
    # The handler is still inside its attempt: close() cannot have returned.
    assert not closed.is_set()
    finish.set()
    assert closed.wait(timeout=30), "close() never returned"
    closer.join(timeout=10)
    # The success was recorded, the next task was not started, the claim is free.
    row = db.execute(
        "SELECT status, claim_id, current_seq FROM workflow_runs WHERE id = %s", (run.id,)
    ).fetchone()
    assert row == ("running", None, 2)
    outputs = db.execute(
        "SELECT seq, output, attempts FROM workflow_tasks WHERE run_id = %s ORDER BY seq",
        (run.id,),
    ).fetchall()
    assert outputs == [(1, 11, 0), (2, None, 0)]
    assert second_calls == []


def test_close_with_a_timeout_returns_while_the_heartbeat_waits_on_a_lock(
    make_manager: Any, db_url: str
) -> None:
    # A migration's lock during a deploy: the heartbeat's claim check waits on it. The
    # timeout bounds the whole close(), the heartbeat's stop included.
    entered = threading.Event()
    gate = threading.Event()

    def held(run: workflow.TaskRun[int]) -> int:
        entered.set()
        gate.wait(timeout=60)
        return run.input

    mgr = make_manager(registry(workflow.handle(STEP_ONE, held), workflow.handle(STEP_TWO, noop)))
    WF.start(mgr, 1)
    assert entered.wait(timeout=30)
    with psycopg.connect(db_url, autocommit=True) as locker:
        locker.execute("BEGIN")
        locker.execute("LOCK TABLE workflow_runs IN ACCESS EXCLUSIVE MODE")
        try:
            wait_until(
                lambda: locker.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock'"
                ).fetchone() != (0,),
                "the heartbeat to wait on the lock",
            )
            closing = threading.Thread(target=mgr.close, kwargs={"timeout": 1.0})
            closing.start()
            closing.join(timeout=30)
            assert not closing.is_alive(), "close(timeout=1) returned while the lock is held"
        finally:
            gate.set()
            locker.execute("ROLLBACK")
    closing.join(timeout=30)


def test_close_with_a_timeout_returns_and_logs_when_a_handler_ignores_cancellation(
    make_manager: Any,
    db: psycopg.Connection[Any],
    handler_on: Callable[[logging.Logger], Records],
) -> None:
    logger = logging.getLogger(f"tests.manager.{uuid.uuid4().hex}")
    handler = handler_on(logger)
    entered = threading.Event()
    gate = threading.Event()

    def stubborn(run: workflow.TaskRun[int]) -> int:
        entered.set()
        assert gate.wait(timeout=60)
        return run.input

    mgr = make_manager(
        registry(workflow.handle(STEP_ONE, stubborn), workflow.handle(STEP_TWO, noop)),
        logger=logger,
    )
    run = WF.start(mgr, 12)
    assert entered.wait(timeout=30)
    try:
        mgr.close(timeout=0.3)
        warnings_logged = [r for r in handler.records if r.levelno == logging.WARNING]
        assert any("close() timed out" in r.getMessage() for r in warnings_logged)
        assert all(r.getMessage().startswith("workflow: ") for r in handler.records)
    finally:
        gate.set()
    # The late success is still recorded and the claim released.
    wait_until(
        lambda: (
            db.execute(
                "SELECT claim_id IS NULL AND current_seq = 2 FROM workflow_runs WHERE id = %s",
                (run.id,),
            ).fetchone()
            == (True,)
        ),
        "the in-flight execution to record its success and release the claim",
    )
