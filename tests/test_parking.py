"""SPEC sections 4, 5, 8 and 9 (invariant 4): parking, failure codes, and the ALERT events.

A parked run is stopped for a person: `RunStatus.failure` says which task, the
last error text, its code and the persisted attempt count. Each of the four
events that park a run logs at `workflow.ALERT` (60, "ALERT") with a
`workflow: ` message and the run id.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import attrs
import psycopg
import pytest
from helpers import Records
from pgbouncer import runner_config

import workflow
from workflow import Status

# --- helpers -------------------------------------------------------------------------


@attrs.frozen
class Inp:
    account: str


@attrs.frozen
class Out:
    value: str


A = workflow.Task("a", Out)
B = workflow.Task("b", Out)


class ProviderRejected(Exception):
    pass


def registry(*steps: workflow.Step[Inp], name: str = "W") -> tuple[workflow.Registry, Any]:
    wf = workflow.Workflow(name, Inp)
    reg = workflow.Registry()
    reg.register(workflow.define(wf, *steps))
    return reg, wf


def start_tx(db: psycopg.Connection[Any], wf: Any, mgr: workflow.Manager) -> workflow.Run:
    with db.transaction():
        run: workflow.Run = wf.start_tx(db, mgr, Inp("acct-1"))
    return run


def assert_one_alert(records: Records, run_id: str, *words: str) -> logging.LogRecord:
    (record,) = records.alerts()
    assert record.levelno == workflow.ALERT == 60
    assert record.levelname == "ALERT"
    message = record.getMessage()
    assert message.startswith("workflow: ")
    assert record.run_id == run_id  # type: ignore[attr-defined]
    for word in words:
        assert word in message
    return record


def run_row(db: psycopg.Connection[Any], run_id: str) -> Any:
    return db.execute(
        "SELECT status, claim_id, finished_at, current_seq FROM workflow_runs WHERE id = %s",
        (run_id,),
    ).fetchone()


def tasks_rows(db: psycopg.Connection[Any], run_id: str) -> list[Any]:
    return db.execute(
        "SELECT seq, name, attempts, output, error, error_code, failed_at, finished_at "
        "FROM workflow_tasks WHERE run_id = %s ORDER BY seq",
        (run_id,),
    ).fetchall()


def failing(exc: Callable[[], BaseException | None], calls: list[int]) -> Any:
    def fn(run: workflow.TaskRun[Inp]) -> Out:
        calls.append(run.attempt)
        raised = exc()
        assert raised is not None
        raise raised

    return fn


def parks_after_one_attempt(
    make_manager: Any, logs: tuple[logging.Logger, Records], exc: Callable[[], Any]
) -> tuple[workflow.Run, workflow.Failure]:
    logger, records = logs
    calls: list[int] = []
    reg, wf = registry(workflow.handle(A, failing(exc, calls), max_attempts=5))
    mgr = make_manager(reg, logger=logger)
    run = wf.start(mgr, Inp("acct-1"))
    assert run.wait(timeout=30) is Status.PARKED
    assert calls == [1], "a permanent failure is not retried"
    failure = run.status().failure
    assert failure is not None
    assert_one_alert(records, run.id, "failed permanently")
    return run, failure


# --- permanent() and with_code() -----------------------------------------------------


def test_permanent_parks_at_once_with_budget_left(
    make_manager: Any, logs: tuple[logging.Logger, Records], db: psycopg.Connection[Any]
) -> None:
    run, failure = parks_after_one_attempt(
        make_manager, logs, lambda: workflow.permanent(ProviderRejected("card declined"))
    )
    assert failure == workflow.Failure(task="a", error="card declined", code=None, attempts=1)
    status, claim, finished_at, _ = run_row(db, run.id)
    assert (status, claim) == ("parked", None)
    assert finished_at is not None


def test_with_code_inside_permanent_sets_failure_code(
    make_manager: Any, logs: tuple[logging.Logger, Records]
) -> None:
    _, failure = parks_after_one_attempt(
        make_manager,
        logs,
        lambda: workflow.permanent(workflow.with_code("rejected", ProviderRejected("no"))),
    )
    assert failure == workflow.Failure(task="a", error="no", code="rejected", attempts=1)


def test_permanent_inside_with_code_sets_failure_code(
    make_manager: Any, logs: tuple[logging.Logger, Records]
) -> None:
    _, failure = parks_after_one_attempt(
        make_manager,
        logs,
        lambda: workflow.with_code("rejected", workflow.permanent(ProviderRejected("no"))),
    )
    assert failure == workflow.Failure(task="a", error="no", code="rejected", attempts=1)


def test_permanent_raised_directly_with_a_code(
    make_manager: Any, logs: tuple[logging.Logger, Records]
) -> None:
    _, failure = parks_after_one_attempt(
        make_manager, logs, lambda: workflow.Permanent("insufficient funds", code="nsf")
    )
    assert failure == workflow.Failure(task="a", error="insufficient funds", code="nsf", attempts=1)


def test_with_code_alone_retries_and_the_last_code_reaches_failure(
    make_manager: Any, logs: tuple[logging.Logger, Records], db: psycopg.Connection[Any]
) -> None:
    logger, records = logs
    calls: list[int] = []

    def fn(run: workflow.TaskRun[Inp]) -> Out:
        calls.append(run.attempt)
        raise workflow.with_code(f"busy-{run.attempt}", ProviderRejected("try later"))  # type: ignore[misc]

    reg, wf = registry(workflow.handle(A, fn, max_attempts=2, backoff_schedule=[0]))
    mgr = make_manager(reg, logger=logger)
    run = wf.start(mgr, Inp("acct-1"))
    assert run.wait(timeout=30) is Status.PARKED
    assert calls == [1, 2], "a coded failure is still retryable"
    assert run.status().failure == workflow.Failure(
        task="a", error="try later", code="busy-2", attempts=2
    )
    assert_one_alert(records, run.id, "last attempt")


def test_failure_names_the_task_the_run_was_on(
    make_manager: Any, logs: tuple[logging.Logger, Records], db: psycopg.Connection[Any]
) -> None:
    logger, _ = logs

    def ok(run: workflow.TaskRun[Inp]) -> Out:
        return Out("done")

    def bad(run: workflow.TaskRun[Inp]) -> Out:
        raise workflow.Permanent("second task refuses")

    reg, wf = registry(workflow.handle(A, ok), workflow.handle(B, bad))
    mgr = make_manager(reg, logger=logger)
    run = wf.start(mgr, Inp("acct-1"))
    assert run.wait(timeout=30) is Status.PARKED
    assert run.status().failure == workflow.Failure(
        task="b", error="second task refuses", code=None, attempts=1
    )
    rows = tasks_rows(db, run.id)
    assert rows[0][3] == {"value": "done"}, "the first task's output stays recorded"
    assert run_row(db, run.id)[3] == 2


# --- the four ALERT events -----------------------------------------------------------


def test_alert_level_is_60_named_alert() -> None:
    assert workflow.ALERT == 60
    assert logging.getLevelName(60) == "ALERT"
    assert logging.getLevelName("ALERT") == 60


def test_alert_1_input_that_no_longer_opens_parks_without_spending_an_attempt(
    make_manager: Any, logs: tuple[logging.Logger, Records], db: psycopg.Connection[Any]
) -> None:
    logger, records = logs
    calls: list[int] = []
    reg, wf = registry(workflow.handle(A, failing(lambda: ProviderRejected("never"), calls)))
    mgr = make_manager(reg, logger=logger)
    run = start_tx(db, wf, mgr)
    db.execute("UPDATE workflow_runs SET input = '{\"acct\": 42}'::jsonb WHERE id = %s", (run.id,))
    assert run.wait(timeout=30) is Status.PARKED
    assert calls == [], "the handler is never called"
    failure = run.status().failure
    assert failure is not None
    assert (failure.task, failure.attempts, failure.code) == ("a", 0, None)
    assert "input" in failure.error
    assert_one_alert(records, run.id, "input")
    status, claim, finished_at, _ = run_row(db, run.id)
    assert (status, claim) == ("parked", None) and finished_at is not None
    assert tasks_rows(db, run.id)[0][2] == 0


def test_alert_2_task_with_no_registered_handler_parks_version_skew(
    make_manager: Any, logs: tuple[logging.Logger, Records], db: psycopg.Connection[Any]
) -> None:
    logger, records = logs
    old_calls: list[int] = []
    new_calls: list[int] = []
    old_reg, old_wf = registry(
        workflow.handle(A, failing(lambda: ProviderRejected("old"), old_calls))
    )
    new_reg, _ = registry(workflow.handle(B, failing(lambda: ProviderRejected("new"), new_calls)))
    old = make_manager(old_reg)
    run = start_tx(db, old_wf, old)  # snapshot: task "a"
    new = make_manager(new_reg, logger=logger)  # 'W' now has only task "b"
    assert new.run(run.id).wait(timeout=30) is Status.PARKED
    assert old_calls == [] and new_calls == []
    failure = new.run(run.id).status().failure
    assert failure is not None
    assert (failure.task, failure.attempts) == ("a", 0)
    assert "a" in failure.error
    assert_one_alert(records, run.id, "'a'")
    status, claim, finished_at, _ = run_row(db, run.id)
    assert (status, claim) == ("parked", None) and finished_at is not None


def test_alert_2_version_skew_on_a_later_task_keeps_earlier_outputs(
    make_manager: Any, logs: tuple[logging.Logger, Records], db: psycopg.Connection[Any]
) -> None:
    logger, records = logs

    def ok(run: workflow.TaskRun[Inp]) -> Out:
        return Out("first")

    old_reg, old_wf = registry(workflow.handle(A, ok), workflow.handle(B, ok))
    new_reg, _ = registry(workflow.handle(A, ok))  # task "b" was removed by a deploy
    old = make_manager(old_reg)
    run = start_tx(db, old_wf, old)
    new = make_manager(new_reg, logger=logger)
    assert new.run(run.id).wait(timeout=30) is Status.PARKED
    failure = new.run(run.id).status().failure
    assert failure is not None and (failure.task, failure.attempts) == ("b", 0)
    assert_one_alert(records, run.id, "'b'")
    assert tasks_rows(db, run.id)[0][3] == {"value": "first"}


def test_alert_3_invariant_4_spent_budget_parks_without_calling_the_handler(
    make_manager: Any, logs: tuple[logging.Logger, Records], db: psycopg.Connection[Any]
) -> None:
    logger, records = logs
    calls: list[int] = []
    reg, wf = registry(
        workflow.handle(A, failing(lambda: ProviderRejected("x"), calls), max_attempts=3)
    )
    mgr = make_manager(reg, logger=logger)
    run = start_tx(db, wf, mgr)
    # As if three executors in a row died mid-attempt and a sweeper counted each.
    db.execute(
        "UPDATE workflow_tasks SET attempts = 3, failed_at = now() - interval '1 hour', "
        "error = 'the attempt was abandoned' WHERE run_id = %s",
        (run.id,),
    )
    assert run.wait(timeout=30) is Status.PARKED
    assert calls == []
    failure = run.status().failure
    assert failure is not None
    assert (failure.task, failure.attempts) == ("a", 3)
    assert_one_alert(records, run.id, "3 attempts")
    status, claim, finished_at, _ = run_row(db, run.id)
    assert (status, claim) == ("parked", None) and finished_at is not None


def test_alert_3_budget_spent_beyond_max_also_parks(
    make_manager: Any, logs: tuple[logging.Logger, Records], db: psycopg.Connection[Any]
) -> None:
    logger, records = logs
    calls: list[int] = []
    reg, wf = registry(
        workflow.handle(A, failing(lambda: ProviderRejected("x"), calls), max_attempts=2)
    )
    mgr = make_manager(reg, logger=logger)
    run = start_tx(db, wf, mgr)
    db.execute("UPDATE workflow_tasks SET attempts = 7 WHERE run_id = %s", (run.id,))
    assert run.wait(timeout=30) is Status.PARKED
    assert calls == []
    failure = run.status().failure
    assert failure is not None and failure.attempts == 7
    assert_one_alert(records, run.id)


def test_alert_4_failed_permanently(
    make_manager: Any, logs: tuple[logging.Logger, Records]
) -> None:
    parks_after_one_attempt(make_manager, logs, lambda: workflow.permanent(ValueError("bad")))


def test_alert_4_failed_on_its_last_attempt(
    make_manager: Any, logs: tuple[logging.Logger, Records], db: psycopg.Connection[Any]
) -> None:
    logger, records = logs
    calls: list[int] = []
    reg, wf = registry(
        workflow.handle(
            A,
            failing(lambda: ProviderRejected(f"no {len(calls)}"), calls),
            max_attempts=2,
            backoff_schedule=[0],
        )
    )
    mgr = make_manager(reg, logger=logger)
    run = wf.start(mgr, Inp("acct-1"))
    assert run.wait(timeout=30) is Status.PARKED
    assert calls == [1, 2]
    assert run.status().failure == workflow.Failure(task="a", error="no 2", code=None, attempts=2)
    assert_one_alert(records, run.id, "last attempt")
    retry_logs = [r for r in records.records if r.levelno < workflow.ALERT]
    assert retry_logs, "the retried failure is logged below ALERT"
    assert all(r.getMessage().startswith("workflow: ") for r in records.records)


def test_retried_failure_does_not_alert(
    make_manager: Any, logs: tuple[logging.Logger, Records]
) -> None:
    logger, records = logs

    def fn(run: workflow.TaskRun[Inp]) -> Out:
        if run.attempt == 1:
            raise ProviderRejected("blip")
        return Out("ok")

    reg, wf = registry(workflow.handle(A, fn, max_attempts=2, backoff_schedule=[0]))
    mgr = make_manager(reg, logger=logger)
    run = wf.start(mgr, Inp("acct-1"))
    assert run.wait(timeout=30) is Status.SUCCEEDED
    assert records.alerts() == []


def test_default_logger_is_named_workflow(
    make_manager: Any, caplog: pytest.LogCaptureFixture
) -> None:
    reg, wf = registry(workflow.handle(A, failing(lambda: workflow.Permanent("stop"), [])))
    mgr = make_manager(reg)
    with caplog.at_level(logging.DEBUG, logger="workflow"):
        run = wf.start(mgr, Inp("acct-1"))
        assert run.wait(timeout=30) is Status.PARKED
    alerts = [r for r in caplog.records if r.levelno == workflow.ALERT]
    assert [r.name for r in alerts] == ["workflow"]
    assert alerts[0].run_id == run.id  # type: ignore[attr-defined]


# --- parked runs ---------------------------------------------------------------------


def test_finished_at_is_set_on_parked(make_manager: Any, db: psycopg.Connection[Any]) -> None:
    reg, wf = registry(workflow.handle(A, failing(lambda: workflow.Permanent("x"), [])))
    mgr = make_manager(reg)
    run = wf.start(mgr, Inp("acct-1"))
    assert run.wait(timeout=30) is Status.PARKED
    status = run.status()
    assert status.finished_at is not None
    assert status.finished_at.tzinfo is not None
    assert status.finished_at >= status.created_at
    db_finished = db.execute(
        "SELECT finished_at FROM workflow_runs WHERE id = %s", (run.id,)
    ).fetchone()[0]
    assert db_finished == status.finished_at


def test_parked_run_stays_parked_after_a_duplicate_start_with_the_same_key(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    calls: list[int] = []
    reg, wf = registry(workflow.handle(A, failing(lambda: workflow.Permanent("declined"), calls)))
    mgr = make_manager(reg)
    run = wf.start(mgr, Inp("acct-1"), idempotency_key="order-7")
    assert run.wait(timeout=30) is Status.PARKED
    before = (
        db.execute("SELECT * FROM workflow_runs WHERE id = %s", (run.id,)).fetchone(),
        tasks_rows(db, run.id),
    )
    again = wf.start(mgr, Inp("acct-2"), idempotency_key="order-7")
    assert again.id == run.id
    assert again.wait(timeout=2) is Status.PARKED
    assert mgr.run(run.id).wait(timeout=0) is Status.PARKED
    assert calls == [1]
    after = (
        db.execute("SELECT * FROM workflow_runs WHERE id = %s", (run.id,)).fetchone(),
        tasks_rows(db, run.id),
    )
    assert after == before
    assert db.execute("SELECT count(*) FROM workflow_runs WHERE workflow = 'W'").fetchone()[0] == 1
    assert wf.input(mgr, run.id) == Inp("acct-1")


def test_parked_run_is_not_claimed_by_a_poller(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    calls: list[int] = []
    reg, wf = registry(workflow.handle(A, failing(lambda: workflow.Permanent("declined"), calls)))
    mgr = make_manager(reg)
    run = wf.start(mgr, Inp("acct-1"))
    assert run.wait(timeout=30) is Status.PARKED
    other = make_manager(reg)
    runnable = other.new_runnable(runner_config(poll_interval=0.05, sweep_interval=0.05))
    runnable.start()
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # a window for the poller to misbehave in
            assert run_row(db, run.id)[:2] == ("parked", None)
            time.sleep(0.05)
    finally:
        assert runnable.stop(timeout=10)
    assert calls == [1]
