"""SPEC sections 3, 5, 9 (invariants 2 and 3) and 11: retries, backoff, timeouts.

Every delay is checked through what the engine persisted (`next_retry_at` minus
`failed_at`, both written by one statement from the database clock), never by
measuring how long something took. To let a released retry proceed without
waiting for it, a test moves the task's `failed_at` and the run's
`next_retry_at` back in time by the same amount ("time travel"): the executor
recomputes the owed delay from the persisted `failed_at` (invariant 3), so
moving `next_retry_at` alone would not do.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from helpers import Inp, Out, poll, registry
from pgbouncer import runner_config

import workflow
from workflow import Status
from workflow.events import ExecutionEnded

# --- helpers -------------------------------------------------------------------------


A = workflow.Task("a", Out)
B = workflow.Task("b", Out)


class Flaky(Exception):
    pass


TASK_SQL = """
SELECT t.attempts, t.failed_at, r.next_retry_at, r.claim_id, r.status, t.error,
       r.next_retry_at > now() AS in_future
FROM workflow_runs r JOIN workflow_tasks t ON t.run_id = r.id AND t.seq = %s
WHERE r.id = %s
"""


def task_state(db: psycopg.Connection[Any], run_id: str, seq: int = 1) -> Any:
    return db.execute(TASK_SQL, (seq, run_id)).fetchone()


def wait_released_after(db: psycopg.Connection[Any], run_id: str, attempts: int) -> Any:
    """Wait until task 1 has `attempts` ended attempts and the claim is released."""
    return poll(
        db,
        TASK_SQL,
        (1, run_id),
        until=lambda r: r[0] == attempts and r[3] is None,
    )


def time_travel(db: psycopg.Connection[Any], run_id: str) -> None:
    """Move the retry bookkeeping an hour into the past: the retry is due now."""
    db.execute(
        "UPDATE workflow_tasks SET failed_at = failed_at - interval '1 hour' "
        "WHERE run_id = %s AND failed_at IS NOT NULL",
        (run_id,),
    )
    db.execute(
        "UPDATE workflow_runs SET next_retry_at = next_retry_at - interval '1 hour' WHERE id = %s",
        (run_id,),
    )


def start_tx(db: psycopg.Connection[Any], wf: Any, mgr: workflow.Manager) -> workflow.Run:
    with db.transaction():
        run: workflow.Run = wf.start_tx(db, mgr, Inp(1))
    return run


def seconds(delta: datetime.timedelta) -> float:
    return delta.total_seconds()


# --- the budget ----------------------------------------------------------------------


def test_any_exception_retries_until_the_budget_is_spent_then_parks(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    errors: list[BaseException] = [KeyError("k"), OSError("disk"), Flaky("boom 3")]
    seen: list[int] = []

    def fn(run: workflow.TaskRun[Inp]) -> Out:
        seen.append(run.attempt)
        raise errors[run.attempt - 1]

    reg, wf = registry(workflow.handle(A, fn, max_attempts=3, backoff_schedule=[0]))
    mgr = make_manager(reg)
    run = wf.start(mgr, Inp(1))
    assert run.wait(timeout=30) is Status.PARKED
    assert seen == [1, 2, 3]
    assert run.status().failure == workflow.Failure(task="a", error="boom 3", code=None, attempts=3)
    attempts, _, _, claim, status, error, _ = task_state(db, run.id)
    assert (attempts, claim, status, error) == (3, None, "parked", "boom 3")


def test_handler_sees_attempt_1_2_3_and_last_attempt_only_on_the_last(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    seen: list[tuple[int, bool]] = []

    def fn(run: workflow.TaskRun[Inp]) -> Out:
        seen.append((run.attempt, run.last_attempt))
        if run.attempt < 3:
            raise Flaky(f"attempt {run.attempt}")
        return Out("third time")

    reg, wf = registry(workflow.handle(A, fn, max_attempts=3, backoff_schedule=[0]))
    mgr = make_manager(reg)
    run = wf.start(mgr, Inp(1))
    assert run.wait(timeout=30) is Status.SUCCEEDED
    assert seen == [(1, False), (2, False), (3, True)]
    row = db.execute(
        "SELECT attempts, output FROM workflow_tasks WHERE run_id = %s", (run.id,)
    ).fetchone()
    assert row == (2, {"value": "third time"})


def test_failure_of_the_last_attempt_of_a_one_attempt_task_parks_at_once(
    make_manager: Any,
) -> None:
    seen: list[tuple[int, bool]] = []

    def fn(run: workflow.TaskRun[Inp]) -> Out:
        seen.append((run.attempt, run.last_attempt))
        raise Flaky("only chance")

    reg, wf = registry(workflow.handle(A, fn, max_attempts=1))
    mgr = make_manager(reg)
    run = wf.start(mgr, Inp(1))
    assert run.wait(timeout=30) is Status.PARKED
    assert seen == [(1, True)]
    assert run.status().failure == workflow.Failure(
        task="a", error="only chance", code=None, attempts=1
    )


# --- backoff, through the persisted next_retry_at ------------------------------------


def _persisted_delays(
    make_manager: Any,
    db: psycopg.Connection[Any],
    step: Callable[[Callable[[workflow.TaskRun[Inp]], Out]], workflow.Step[Inp]],
    max_attempts: int,
    config: workflow.Config | None = None,
) -> tuple[list[float], list[int], workflow.Run]:
    """Fail every attempt; the persisted delay after each failed, released attempt."""
    seen: list[int] = []

    def fn(run: workflow.TaskRun[Inp]) -> Out:
        seen.append(run.attempt)
        raise Flaky(f"attempt {run.attempt}")

    reg, wf = registry(step(fn))
    mgr = make_manager(reg, config)
    run = wf.start(mgr, Inp(1))
    delays: list[float] = []
    for attempts in range(1, max_attempts):
        _ended, failed_at, retry_at, _claim, status, error, in_future = wait_released_after(
            db, run.id, attempts
        )
        assert status == "running"
        assert error == f"attempt {attempts}"
        assert in_future, "a released retry is not claimable before next_retry_at"
        delays.append(seconds(retry_at - failed_at))
        time_travel(db, run.id)
        # One wait without time left kicks the due retry, though the failed attempt's
        # execution may still be ending here (its claim released first).
        kicked = run.wait(timeout=0)
        last = attempts == max_attempts - 1
        assert kicked is Status.RUNNING or (last and kicked is Status.PARKED), kicked
    assert run.wait(timeout=30) is Status.PARKED
    return delays, seen, run


def test_exponential_backoff_is_min_base_times_2_pow_attempt_minus_1_and_max(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    delays, seen, run = _persisted_delays(
        make_manager,
        db,
        lambda fn: workflow.handle(
            A, fn, max_attempts=5, backoff=workflow.Backoff(base=10, max=25)
        ),
        max_attempts=5,
    )
    assert delays == [10.0, 20.0, 25.0, 25.0]
    assert seen == [1, 2, 3, 4, 5]
    failure = run.status().failure
    assert failure is not None and failure.attempts == 5


def test_exponential_backoff_accepts_timedelta_durations(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    delays, _, _ = _persisted_delays(
        make_manager,
        db,
        lambda fn: workflow.handle(
            A,
            fn,
            max_attempts=3,
            backoff=workflow.Backoff(
                base=datetime.timedelta(seconds=7.5), max=datetime.timedelta(minutes=1)
            ),
        ),
        max_attempts=3,
    )
    assert delays == [7.5, 15.0]


def test_backoff_schedule_is_used_in_order_and_past_the_end_reuses_the_last_entry(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    delays, seen, _ = _persisted_delays(
        make_manager,
        db,
        lambda fn: workflow.handle(A, fn, max_attempts=5, backoff_schedule=[30, 10]),
        max_attempts=5,
    )
    assert delays == [30.0, 10.0, 10.0, 10.0]
    assert seen == [1, 2, 3, 4, 5]


def test_config_backoff_and_max_attempts_apply_when_the_task_sets_none(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    config = workflow.Config(default_max_attempts=4, backoff_base=10, backoff_max=30)
    delays, seen, run = _persisted_delays(
        make_manager, db, lambda fn: workflow.handle(A, fn), max_attempts=4, config=config
    )
    assert delays == [10.0, 20.0, 30.0]
    assert seen == [1, 2, 3, 4]
    failure = run.status().failure
    assert failure == workflow.Failure(task="a", error="attempt 4", code=None, attempts=4)


def test_task_settings_win_over_config_defaults(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    config = workflow.Config(default_max_attempts=8, backoff_base=100, backoff_max=200)
    delays, seen, _ = _persisted_delays(
        make_manager,
        db,
        lambda fn: workflow.handle(A, fn, max_attempts=3, backoff=workflow.Backoff(base=6, max=9)),
        max_attempts=3,
        config=config,
    )
    assert delays == [6.0, 9.0]
    assert seen == [1, 2, 3]


def test_default_backoff_base_is_1s(make_manager: Any, db: psycopg.Connection[Any]) -> None:
    def fn(run: workflow.TaskRun[Inp]) -> Out:
        if run.attempt == 1:
            raise Flaky("once")
        return Out("ok")

    reg, wf = registry(workflow.handle(A, fn))
    mgr = make_manager(reg)  # no Config: every default
    run = wf.start(mgr, Inp(1))
    assert run.wait(timeout=30) is Status.SUCCEEDED
    attempts, failed_at, retry_at, *_ = task_state(db, run.id)
    assert attempts == 1
    assert retry_at - failed_at == datetime.timedelta(seconds=1)


def _preset_attempts(
    db: psycopg.Connection[Any], run_id: str, attempts: int, *, ago: str = "1 hour"
) -> None:
    db.execute(
        "UPDATE workflow_tasks SET attempts = %s, failed_at = now() - %s::interval, "
        "error = 'earlier failure' WHERE run_id = %s AND seq = 1",
        (attempts, ago, run_id),
    )


def test_default_max_attempts_is_8(make_manager: Any, db: psycopg.Connection[Any]) -> None:
    seen: list[tuple[int, bool]] = []

    def fn(run: workflow.TaskRun[Inp]) -> Out:
        seen.append((run.attempt, run.last_attempt))
        raise Flaky("still failing")

    reg, wf = registry(workflow.handle(A, fn))
    mgr = make_manager(reg)
    run = start_tx(db, wf, mgr)
    _preset_attempts(db, run.id, 7)
    assert run.wait(timeout=30) is Status.PARKED
    assert seen == [(8, True)]
    assert run.status().failure == workflow.Failure(
        task="a", error="still failing", code=None, attempts=8
    )


def test_default_backoff_max_is_300s(make_manager: Any, db: psycopg.Connection[Any]) -> None:
    def fn(run: workflow.TaskRun[Inp]) -> Out:
        raise Flaky("still failing")

    reg, wf = registry(workflow.handle(A, fn, max_attempts=12))
    mgr = make_manager(reg)
    run = start_tx(db, wf, mgr)
    _preset_attempts(db, run.id, 9)  # attempt 10: 1 * 2**9 = 512 > 300
    assert run.wait(timeout=0) is Status.RUNNING
    _attempts, failed_at, retry_at, claim, status, _, in_future = wait_released_after(
        db, run.id, 10
    )
    assert retry_at - failed_at == datetime.timedelta(seconds=300)
    assert (claim, status, in_future) == (None, "running", True)


# --- in-process backoff or released claim --------------------------------------------


def test_delay_within_max_in_process_backoff_keeps_the_claim_and_retries_in_process(
    make_manager: Any, pool: Any, db: psycopg.Connection[Any]
) -> None:
    seen: list[tuple[int, Any, int, bool, int]] = []

    def fn(run: workflow.TaskRun[Inp]) -> Out:
        with pool.connection() as conn:
            claim, attempts, due = conn.execute(
                "SELECT r.claim_id, t.attempts, now() >= r.next_retry_at "
                "FROM workflow_runs r JOIN workflow_tasks t ON t.run_id = r.id AND t.seq = 1 "
                "WHERE r.id = %s",
                (run.run_id,),
            ).fetchone()
        seen.append((run.attempt, claim, attempts, due, threading.get_ident()))
        if run.attempt == 1:
            raise Flaky("once")
        return Out("ok")

    reg, wf = registry(workflow.handle(A, fn, max_attempts=3, backoff_schedule=[1]))
    mgr = make_manager(reg, workflow.Config(max_in_process_backoff=5))
    run = wf.start(mgr, Inp(1))
    assert run.wait(timeout=30) is Status.SUCCEEDED
    (a1, claim1, ended1, _, thread1), (a2, claim2, ended2, due2, thread2) = seen
    assert (a1, a2) == (1, 2)
    assert claim1 is not None
    assert claim2 == claim1, "the claim is kept across an in-process backoff"
    assert thread2 == thread1, "the retry runs in the same execution"
    assert (ended1, ended2) == (0, 1)
    assert due2, "the in-process retry did not run before next_retry_at (database clock)"
    attempts, failed_at, retry_at, *_ = task_state(db, run.id)
    assert attempts == 1
    assert retry_at - failed_at == datetime.timedelta(seconds=1)


def test_claim_stays_held_while_the_executor_sleeps_a_short_backoff(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    claims: list[Any] = []
    second = threading.Event()
    go_on = threading.Event()

    def fn(run: workflow.TaskRun[Inp]) -> Out:
        if run.attempt == 1:
            raise Flaky("once")
        second.set()
        go_on.wait(10)
        return Out("ok")

    reg, wf = registry(workflow.handle(A, fn, max_attempts=3, backoff_schedule=[2]))
    mgr = make_manager(reg, workflow.Config(max_in_process_backoff=5))
    try:
        run = wf.start(mgr, Inp(1))
        claims.append(
            db.execute("SELECT claim_id FROM workflow_runs WHERE id = %s", (run.id,)).fetchone()[0]
        )
        _attempts, _, _, claim, status, _, _ = poll(
            db, TASK_SQL, (1, run.id), until=lambda r: r[0] == 1
        )
        assert (claim, status) == (claims[0], "running")
        assert second.wait(10)
        assert task_state(db, run.id)[3] == claims[0]
    finally:
        go_on.set()
    assert run.wait(timeout=30) is Status.SUCCEEDED


def test_delay_above_max_in_process_backoff_releases_the_claim_until_next_retry_at(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    calls: list[int] = []

    def fn(run: workflow.TaskRun[Inp]) -> Out:
        calls.append(run.attempt)
        raise Flaky("not yet")

    reg, wf = registry(workflow.handle(A, fn, max_attempts=3, backoff_schedule=[60]))
    mgr = make_manager(reg, workflow.Config(max_in_process_backoff=5))
    other = make_manager(reg)
    run = wf.start(mgr, Inp(1))
    _attempts, failed_at, retry_at, claim, status, _, in_future = wait_released_after(db, run.id, 1)
    assert (claim, status, in_future) == (None, "running", True)
    assert retry_at - failed_at == datetime.timedelta(seconds=60)
    # Neither manager's wait() (a kick), nor a poller, runs it before next_retry_at.
    assert run.wait(timeout=0.5) is Status.RUNNING
    assert other.run(run.id).wait(timeout=1.5) is Status.RUNNING
    runnable = other.new_runnable(runner_config(poll_interval=0.1, sweep_enabled=False))
    runnable.start()
    try:
        assert other.run(run.id).wait(timeout=1) is Status.RUNNING
    finally:
        assert runnable.stop(timeout=10)
    assert calls == [1]
    assert task_state(db, run.id)[:5] == (1, failed_at, retry_at, None, "running")


def test_released_retry_runs_again_once_due(make_manager: Any, db: psycopg.Connection[Any]) -> None:
    calls: list[int] = []

    def fn(run: workflow.TaskRun[Inp]) -> Out:
        calls.append(run.attempt)
        if run.attempt == 1:
            raise Flaky("not yet")
        return Out("second")

    reg, wf = registry(workflow.handle(A, fn, max_attempts=3, backoff_schedule=[60]))
    mgr = make_manager(reg)
    run = wf.start(mgr, Inp(1))
    wait_released_after(db, run.id, 1)
    time_travel(db, run.id)
    assert run.wait(timeout=30) is Status.SUCCEEDED
    assert calls == [1, 2]


def test_wait_without_time_left_kicks_a_due_retry_whose_failed_attempt_is_still_ending_here(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    """SPEC 9: `wait()` claims a run that is claimable now, `timeout=0` included. The
    failed attempt's claim is released before its execution here has ended; a wait in
    that window must not take the run for one still executing here and kick nothing."""
    calls: list[int] = []
    hold = threading.Event()

    def fn(run: workflow.TaskRun[Inp]) -> Out:
        calls.append(run.attempt)
        if run.attempt == 1:
            raise Flaky("not yet")
        # Held too: a kicked retry that ended at once would let wait(timeout=0)
        # return its SUCCEEDED before the assertion below could see it running.
        assert hold.wait(30)
        return Out("second")

    def hold_first_end(event: object) -> None:
        # The execution's end is announced after its claim was released and before
        # this process records it ended: held here, the window stays open.
        if isinstance(event, ExecutionEnded) and calls == [1]:
            assert hold.wait(30)

    reg, wf = registry(workflow.handle(A, fn, max_attempts=3, backoff_schedule=[60]))
    mgr = make_manager(reg)  # no runnable: nothing but a kick claims the run
    mgr.events.subscribe(hold_first_end)
    run = wf.start(mgr, Inp(1))
    try:
        wait_released_after(db, run.id, 1)
        time_travel(db, run.id)
        assert run.wait(timeout=0) is Status.RUNNING
        state = task_state(db, run.id)
        assert state[3] is not None, "the due retry was not kicked"
    finally:
        hold.set()
    assert run.wait(timeout=30) is Status.SUCCEEDED
    assert calls == [1, 2]


# --- invariant 3: the delay comes from the persisted attempt count -------------------


def test_invariant_3_resumed_task_waits_the_delay_of_its_persisted_attempt_count(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    calls: list[int] = []

    def fn(run: workflow.TaskRun[Inp]) -> Out:
        calls.append(run.attempt)
        return Out("too early")

    reg, wf = registry(
        workflow.handle(A, fn, max_attempts=5, backoff=workflow.Backoff(base=100, max=1000))
    )
    first = make_manager(reg)
    run = start_tx(db, wf, first)
    # As if an executor failed attempt 2 just now and crashed before scheduling the
    # retry: the run is claimable (next_retry_at is its creation time).
    _preset_attempts(db, run.id, 2, ago="0 seconds")
    attempts, failed_at, retry_at, claim, *_ = task_state(db, run.id)
    assert retry_at <= failed_at and claim is None

    resumer = make_manager(reg)
    assert resumer.run(run.id).wait(timeout=0) is Status.RUNNING  # the kick claims it
    row = poll(db, TASK_SQL, (1, run.id), until=lambda r: r[3] is None and r[6])
    attempts, failed_at_after, retry_at, claim, status, _, _ = row
    assert calls == []
    assert (attempts, claim, status) == (2, None, "running")
    assert failed_at_after == failed_at
    assert retry_at == failed_at + datetime.timedelta(seconds=200)  # delay(2) = 100 * 2
    # A second kick before it is due does not run it either.
    assert resumer.run(run.id).wait(timeout=0.5) is Status.RUNNING
    assert calls == []


def test_invariant_3_resumed_task_sleeps_a_short_owed_delay_before_its_next_attempt(
    make_manager: Any, pool: Any, db: psycopg.Connection[Any]
) -> None:
    seen: list[tuple[int, bool]] = []

    def fn(run: workflow.TaskRun[Inp]) -> Out:
        with pool.connection() as conn:
            waited = conn.execute(
                "SELECT now() >= failed_at + interval '1 second' FROM workflow_tasks "
                "WHERE run_id = %s AND seq = 1",
                (run.run_id,),
            ).fetchone()[0]
        seen.append((run.attempt, waited))
        return Out("after the owed delay")

    reg, wf = registry(workflow.handle(A, fn, max_attempts=5, backoff_schedule=[1]))
    mgr = make_manager(reg, workflow.Config(max_in_process_backoff=5))
    run = start_tx(db, wf, mgr)
    _preset_attempts(db, run.id, 1, ago="0 seconds")
    assert run.wait(timeout=30) is Status.SUCCEEDED
    assert seen == [(2, True)]


# --- timeouts and late success -------------------------------------------------------


def test_handler_raising_after_its_deadline_is_a_timeout_failure(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    cancelled_seen: list[bool] = []

    def fn(run: workflow.TaskRun[Inp]) -> Out:
        if run.attempt == 1:
            cancelled_seen.append(run.cancelled.wait(10))
            raise Flaky("gave up")
        return Out("retried")

    reg, wf = registry(workflow.handle(A, fn, timeout=0.2, max_attempts=2, backoff_schedule=[0]))
    mgr = make_manager(reg)
    run = wf.start(mgr, Inp(1))
    assert run.wait(timeout=30) is Status.SUCCEEDED, "a timeout is retryable"
    assert cancelled_seen == [True]
    attempts, _, _, _, _, error, _ = task_state(db, run.id)
    assert attempts == 1
    assert "timed out" in error and "0.2" in error and "gave up" in error


def test_handler_raising_after_its_deadline_on_its_last_attempt_parks_as_a_timeout(
    make_manager: Any,
) -> None:
    def fn(run: workflow.TaskRun[Inp]) -> Out:
        run.cancelled.wait(10)
        run.raise_if_cancelled()
        return Out("unreachable")

    reg, wf = registry(workflow.handle(A, fn, timeout=0.2, max_attempts=1))
    mgr = make_manager(reg)
    run = wf.start(mgr, Inp(1))
    assert run.wait(timeout=30) is Status.PARKED
    failure = run.status().failure
    assert failure is not None
    assert (failure.task, failure.attempts) == ("a", 1)
    assert "timed out" in failure.error and "0.2" in failure.error


def test_late_success_with_a_valid_claim_is_recorded(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    cancelled_seen: list[bool] = []
    calls: list[int] = []

    def slow(run: workflow.TaskRun[Inp]) -> Out:
        calls.append(run.attempt)
        cancelled_seen.append(run.cancelled.wait(10))
        assert run.remaining() == 0.0
        return Out("late but fine")

    def after(run: workflow.TaskRun[Inp]) -> Out:
        return Out("saw " + run.output(A).value)

    reg, wf = registry(
        workflow.handle(A, slow, timeout=0.2, max_attempts=3), workflow.handle(B, after)
    )
    mgr = make_manager(reg)
    run = wf.start(mgr, Inp(1))
    assert run.wait(timeout=30) is Status.SUCCEEDED
    assert calls == [1]
    assert cancelled_seen == [True]
    rows = db.execute(
        "SELECT seq, attempts, output, error FROM workflow_tasks WHERE run_id = %s ORDER BY seq",
        (run.id,),
    ).fetchall()
    assert rows == [
        (1, 0, {"value": "late but fine"}, None),
        (2, 0, {"value": "saw late but fine"}, None),
    ]


@pytest.mark.parametrize("timeout", [0.2, datetime.timedelta(milliseconds=200)])
def test_deadline_and_remaining_follow_the_task_timeout(make_manager: Any, timeout: Any) -> None:
    seen: list[tuple[float, float]] = []

    def fn(run: workflow.TaskRun[Inp]) -> Out:
        seen.append((run.remaining(), run.deadline - time.monotonic()))
        return Out("ok")

    reg, wf = registry(workflow.handle(A, fn, timeout=timeout))
    mgr = make_manager(reg)
    run = wf.start(mgr, Inp(1))
    assert run.wait(timeout=30) is Status.SUCCEEDED
    ((remaining, left),) = seen
    assert 0.0 <= remaining <= 0.2
    assert left <= 0.2
