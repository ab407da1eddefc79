"""SPEC 9 invariant 4, and SPEC 2's limits: an attempt that ran is always counted.

Whatever goes wrong while the engine records an attempt (an error text PostgreSQL
cannot store, a value the schema cannot carry, a delay too long to compute, a
database that refuses the write), the attempt counts, or the run parks with an
ALERT saying why: the claim is never released uncounted, so a handler can never
be called more than its budget allows. Each test bounds the handler's calls by
`max_attempts`; the old engine looped on each of these thousands of times a second.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

import psycopg
import pytest
from helpers import Inp, Out, Records, registry, wait_until

import workflow
from workflow import Status

A = workflow.Task("a", Out)


class Calls:
    """Counts handler calls from any thread."""

    def __init__(self) -> None:
        self.attempts: list[int] = []
        self._lock = threading.Lock()

    def add(self, attempt: int) -> None:
        with self._lock:
            self.attempts.append(attempt)

    @property
    def count(self) -> int:
        with self._lock:
            return len(self.attempts)


def raising(calls: Calls, make: Any) -> Any:
    def fn(run: workflow.TaskRun[Inp]) -> Out:
        calls.add(run.attempt)
        raise make()

    return fn


def parked_within_budget(run: workflow.Run, calls: Calls, budget: int) -> workflow.Failure:
    status = run.wait(timeout=20)
    # Let a looping engine show itself: no call may follow the park.
    time.sleep(0.3)
    assert calls.count <= budget, f"handler called {calls.count} times for a budget of {budget}"
    assert status is Status.PARKED, f"{status} after {calls.count} handler calls"
    failure = run.status().failure
    assert failure is not None
    return failure


def stored_error(db: psycopg.Connection[Any], run_id: str) -> tuple[str, str | None, int]:
    row = db.execute(
        "SELECT error, error_code, attempts FROM workflow_tasks WHERE run_id = %s AND seq = 1",
        (run_id,),
    ).fetchone()
    assert row is not None
    return row[0], row[1], row[2]


# --- error texts PostgreSQL cannot store --------------------------------------------

UNSTORABLE = [
    pytest.param("card\x00declined", id="nul"),
    pytest.param(b"caf\xe9 refused".decode("utf-8", "surrogateescape"), id="lone-surrogate"),
]


@pytest.mark.parametrize("message", UNSTORABLE)
def test_an_unstorable_error_text_still_counts_every_attempt(
    make_manager: Any, db: psycopg.Connection[Any], message: str
) -> None:
    calls = Calls()
    reg, wf = registry(
        workflow.handle(
            A, raising(calls, lambda: RuntimeError(message)), max_attempts=3,
            backoff_schedule=[0.01],
        )
    )
    run = wf.start(make_manager(reg), Inp(1))
    failure = parked_within_budget(run, calls, 3)
    assert calls.attempts == [1, 2, 3]
    assert failure.attempts == 3
    assert "\x00" not in failure.error
    assert failure.error.encode("utf-8")  # valid UTF-8: no lone surrogate left
    assert "declined" in failure.error or "refused" in failure.error
    error, _, attempts = stored_error(db, run.id)
    assert attempts == 3 and error == failure.error


@pytest.mark.parametrize("code", UNSTORABLE)
def test_an_unstorable_failure_code_is_stored_readably(
    make_manager: Any, db: psycopg.Connection[Any], code: str
) -> None:
    calls = Calls()
    reg, wf = registry(
        workflow.handle(
            A, raising(calls, lambda: workflow.with_code(code, RuntimeError("no"))),
            max_attempts=2, backoff_schedule=[0.01],
        )
    )
    run = wf.start(make_manager(reg), Inp(1))
    failure = parked_within_budget(run, calls, 2)
    assert failure.code is not None
    assert "\x00" not in failure.code and failure.code.encode("utf-8")
    assert failure.code.replace("\ufffd", "?") in ("card?declined", "caf? refused")


def test_a_huge_error_text_is_stored_bounded(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    calls = Calls()
    reg, wf = registry(
        workflow.handle(A, raising(calls, lambda: RuntimeError("x" * 5_000_000)), max_attempts=1)
    )
    run = wf.start(make_manager(reg), Inp(1))
    failure = parked_within_budget(run, calls, 1)
    assert failure.error.startswith("xxx")
    assert len(failure.error) <= 4000
    assert failure.error.endswith("(truncated)")


# --- values the schema cannot carry ---------------------------------------------------


def test_the_registry_refuses_more_tasks_than_current_seq_can_count() -> None:
    tasks = [workflow.Task(f"t{i}") for i in range(32767)]
    wf = workflow.Workflow("Long", Inp)
    with pytest.raises(workflow.RegistrationError, match="32766"):
        workflow.Registry().register(
            workflow.define(wf, *(workflow.handle(t, lambda run: None) for t in tasks))
        )


def test_the_longest_workflow_the_registry_accepts_finishes(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    """32766 tasks: the run is forged onto its last task, which must complete."""
    tasks = [workflow.Task(f"t{i}") for i in range(32766)]
    wf = workflow.Workflow("Long", Inp)
    reg = workflow.Registry()
    reg.register(workflow.define(wf, *(workflow.handle(t, lambda run: None) for t in tasks)))
    mgr = make_manager(reg)
    with db.transaction():
        run = wf.start_tx(db, mgr, Inp(1))
    db.execute(
        "UPDATE workflow_tasks SET finished_at = now() WHERE run_id = %s AND seq < 32766",
        (run.id,),
    )
    db.execute("UPDATE workflow_runs SET current_seq = 32766 WHERE id = %s", (run.id,))
    assert run.wait(timeout=30) is Status.SUCCEEDED


# --- delays past what a power or an interval can carry --------------------------------


def test_a_task_retried_past_1024_attempts_waits_its_capped_delay(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    """`base * 2**(attempt-1)` overflows a float from attempt 1025: the cap must apply first."""
    calls = Calls()
    reg, wf = registry(
        workflow.handle(
            A, raising(calls, lambda: RuntimeError("still down")), max_attempts=1503,
            backoff=workflow.Backoff(base=0.001, max=0.01),
        )
    )
    mgr = make_manager(reg)
    with db.transaction():
        run = wf.start_tx(db, mgr, Inp(1))
    db.execute(
        "UPDATE workflow_tasks SET attempts = 1500, failed_at = now() WHERE run_id = %s",
        (run.id,),
    )
    db.execute("UPDATE workflow_runs SET status = 'running' WHERE id = %s", (run.id,))
    failure = parked_within_budget(run, calls, 3)
    assert calls.attempts == [1501, 1502, 1503]
    assert failure.attempts == 1503


@pytest.mark.parametrize(
    "step_options",
    [
        pytest.param({"backoff": workflow.Backoff(base=1, max=math.inf)}, id="infinite-max"),
        pytest.param({"backoff": workflow.Backoff(base=1, max=1e300)}, id="huge-max"),
        pytest.param({"backoff": workflow.Backoff(base=math.inf, max=math.inf)}, id="inf-base"),
        pytest.param({"backoff_schedule": [1, math.inf]}, id="infinite-entry"),
        pytest.param({"backoff_schedule": [1e300]}, id="huge-entry"),
        pytest.param({"timeout": math.inf}, id="infinite-timeout"),
        pytest.param({"timeout": 1e300}, id="huge-timeout"),
    ],
)
def test_the_registry_refuses_delays_and_timeouts_out_of_range(step_options: Any) -> None:
    reg = workflow.Registry()
    wf = workflow.Workflow("W", Inp)
    with pytest.raises(workflow.RegistrationError, match=r"292 years|infinite|beyond"):
        reg.register(workflow.define(wf, workflow.handle(A, lambda run: Out("x"), **step_options)))


def test_the_config_refuses_an_infinite_backoff_max() -> None:
    with pytest.raises(workflow.ConfigError):
        workflow.Config(backoff_max=math.inf)


# --- a database that refuses the write ------------------------------------------------

POISON_TRIGGER = """
CREATE FUNCTION test_poison() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.output::text LIKE '%poison%' THEN
        RAISE EXCEPTION 'refusing to store poison';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER test_poison BEFORE UPDATE ON workflow_tasks
    FOR EACH ROW EXECUTE FUNCTION test_poison();
"""


def test_a_success_the_database_refuses_to_record_counts_as_a_failed_attempt(
    make_manager: Any, db: psycopg.Connection[Any], logs: tuple[logging.Logger, Records]
) -> None:
    logger, records = logs
    db.execute(POISON_TRIGGER)
    calls = Calls()

    def poison(run: workflow.TaskRun[Inp]) -> Out:
        calls.add(run.attempt)
        return Out("poison")

    reg, wf = registry(workflow.handle(A, poison, max_attempts=3, backoff_schedule=[0.01]))
    run = wf.start(make_manager(reg, logger=logger), Inp(1))
    failure = parked_within_budget(run, calls, 3)
    assert calls.attempts == [1, 2, 3]
    assert failure.attempts == 3
    assert "could not be recorded" in failure.error and "poison" in failure.error
    (alert,) = records.alerts()
    assert alert.run_id == run.id  # type: ignore[attr-defined]


BLOCK_TRIGGER = """
CREATE TABLE test_block (on_ boolean NOT NULL);
INSERT INTO test_block VALUES (true);
CREATE FUNCTION test_block() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF (SELECT on_ FROM test_block) THEN
        RAISE EXCEPTION 'the database refuses every write of this task';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER test_block BEFORE UPDATE ON workflow_tasks
    FOR EACH ROW EXECUTE FUNCTION test_block();
"""


def test_when_no_write_lands_the_claim_is_left_for_the_sweeper_to_count(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    """Neither the outcome nor the failure can be written: the claim is not released
    (that would re-run the handler at once, uncounted); it stops being heartbeated,
    so a sweeper reclaims it after `sweep_max_age` and counts the attempt."""
    db.execute(BLOCK_TRIGGER)
    calls = Calls()
    outcomes = iter(["fail", "ok"])

    def fn(run: workflow.TaskRun[Inp]) -> Out:
        calls.add(run.attempt)
        if next(outcomes) == "fail":
            raise RuntimeError("first attempt fails")
        return Out("done")

    reg, wf = registry(workflow.handle(A, fn, timeout=1, max_attempts=5))
    config = workflow.Config(sweep_max_age=2, max_in_process_backoff=0)
    mgr = make_manager(reg, config)
    run = wf.start(mgr, Inp(1))
    wait_until(lambda: calls.count == 1, "the first attempt")
    time.sleep(1.5)
    assert calls.count == 1, "the handler ran again before the attempt was counted"
    claim = db.execute(
        "SELECT claim_id IS NOT NULL FROM workflow_runs WHERE id = %s", (run.id,)
    ).fetchone()
    assert claim == (True,), "the claim was released uncounted"
    db.execute("UPDATE test_block SET on_ = false")
    runnable = mgr.new_runnable(
        workflow.RunnerConfig(poll_interval=0.2, sweep_interval=0.5, listen=False)
    )
    runnable.start()
    try:
        assert run.wait(timeout=20) is Status.SUCCEEDED
    finally:
        runnable.stop(timeout=10)
    assert calls.attempts == [1, 2], "the swept attempt counts: the next one is attempt 2"


# --- handlers that raise what is not an Exception -------------------------------------


@pytest.mark.parametrize("interrupt", [SystemExit, KeyboardInterrupt], ids=lambda e: e.__name__)
def test_a_handler_raising_an_interrupt_has_its_attempt_recorded(
    make_manager: Any, db: psycopg.Connection[Any], interrupt: type[BaseException]
) -> None:
    calls = Calls()

    def fn(run: workflow.TaskRun[Inp]) -> Out:
        calls.add(run.attempt)
        if run.attempt == 1:
            raise interrupt()
        return Out("second time")

    reg, wf = registry(workflow.handle(A, fn, max_attempts=3, backoff_schedule=[0.01]))
    mgr = make_manager(reg)
    run = wf.start(mgr, Inp(1))
    runnable = mgr.new_runnable(workflow.RunnerConfig(poll_interval=0.2, listen=False))
    runnable.start()
    try:
        assert run.wait(timeout=20) is Status.SUCCEEDED
    finally:
        runnable.stop(timeout=10)
    assert calls.attempts == [1, 2]
    error, _, attempts = stored_error(db, run.id)
    assert attempts == 1 and interrupt.__name__ in error
