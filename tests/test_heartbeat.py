"""SPEC section 9, invariant 5: heartbeats, deadlines and lost claims.

The sweeper that releases what stops being heartbeated is in test_sweeper.py.

A small `sweep_max_age` makes the heartbeat interval (`sweep_max_age / 4`) short.
Heartbeat movement is read from `workflow_runs.heartbeat_at` (database clock);
staleness is judged with the database clock too (`now() - heartbeat_at`).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
from helpers import FirstAttempt, Inp, Out, Records, poll, registry, snapshot, wait_until
from pgbouncer import runner_config

import workflow
from workflow import Status
from workflow.events import AttemptEnded

# --- helpers -------------------------------------------------------------------------


A = workflow.Task("a", Out)
B = workflow.Task("b", Out)


RUN_SQL = """
SELECT r.claim_id, r.heartbeat_at, now() - r.heartbeat_at, r.status, t.attempts, t.output,
       r.current_seq
FROM workflow_runs r JOIN workflow_tasks t ON t.run_id = r.id AND t.seq = 1
WHERE r.id = %s
"""


# --- heartbeats inside the deadline --------------------------------------------------


def test_heartbeat_advances_while_a_long_handler_runs_inside_its_deadline(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    release = threading.Event()

    def blocking(run: workflow.TaskRun[Inp]) -> Out:
        assert release.wait(20)
        return Out("done")

    handler = FirstAttempt(blocking)
    # Heartbeat every 0.5 s; the attempt may take 1.9 s.
    config = workflow.Config(sweep_max_age=2, max_in_process_backoff=0)
    reg, wf = registry(workflow.handle(A, handler, timeout=1.9))
    mgr = make_manager(reg, config)
    sweeper = mgr.new_runnable(runner_config(listen=False)).sweeper
    assert sweeper is not None
    try:
        run = wf.start(mgr, Inp(1))
        assert handler.started.wait(10)
        claim, first_beat, *_ = db.execute(RUN_SQL, (run.id,)).fetchone()
        assert claim is not None and first_beat is not None
        row = poll(db, RUN_SQL, (run.id,), until=lambda r: r[1] > first_beat)
        (taskrun,) = handler.runs
        assert not taskrun.cancelled.is_set()
        assert taskrun.remaining() > 0, "the beat came inside the attempt's deadline"
        assert row[0] == claim
        second = poll(db, RUN_SQL, (run.id,), until=lambda r: r[1] > row[1])
        assert second[0] == claim
        assert sweeper.sweep() == 0, "a heartbeated claim is not stale"
    finally:
        release.set()
    assert run.wait(timeout=30) is Status.SUCCEEDED


def test_past_its_deadline_an_attempt_is_no_longer_heartbeated_and_cancelled_is_set(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    release = threading.Event()
    cancelled_at_deadline: list[tuple[bool, float]] = []
    seen = threading.Event()

    def hangs(run: workflow.TaskRun[Inp]) -> Out:
        cancelled_at_deadline.append((run.cancelled.wait(10), run.remaining()))
        seen.set()
        assert release.wait(20)
        return Out("late success")

    handler = FirstAttempt(hangs)
    config = workflow.Config(  # beat every 0.5 s
        sweep_max_age=2, max_in_process_backoff=0, default_task_timeout=1.5
    )
    reg, wf = registry(workflow.handle(A, handler, timeout=0.3), workflow.handle(B, handler))
    mgr = make_manager(reg, config)
    try:
        run = wf.start(mgr, Inp(1))
        assert seen.wait(15)
        assert cancelled_at_deadline == [(True, 0.0)], "cancelled is set at the deadline"
        claim = db.execute(RUN_SQL, (run.id,)).fetchone()[0]
        # Three heartbeat intervals without a beat (database clock): it stopped.
        row = poll(
            db,
            RUN_SQL,
            (run.id,),
            until=lambda r: r[2].total_seconds() > 1.5,
        )
        assert row[0] == claim, "the claim is still held, just no longer refreshed"
        assert row[4] == 0
    finally:
        release.set()
    # The claim was never lost, so the late success counts (SPEC 11).
    assert run.wait(timeout=30) is Status.SUCCEEDED
    assert db.execute(
        "SELECT output, attempts FROM workflow_tasks WHERE run_id = %s AND seq = 1", (run.id,)
    ).fetchone() == ({"value": "late success"}, 0)


# --- a heartbeat that matches zero rows ----------------------------------------------


@pytest.mark.parametrize("then", ["returns", "raises"])
def test_lost_heartbeat_sets_cancelled_and_ends_the_execution_without_writing(
    make_manager: Any,
    logs: tuple[logging.Logger, Records],
    db: psycopg.Connection[Any],
    then: str,
) -> None:
    logger, records = logs
    observed: list[tuple[bool, float]] = []
    next_task: list[int] = []

    def waits_for_cancel(run: workflow.TaskRun[Inp]) -> Out:
        observed.append((run.cancelled.wait(15), run.remaining()))
        if then == "raises":
            run.raise_if_cancelled()
        return Out("written by nobody")

    def b(run: workflow.TaskRun[Inp]) -> Out:
        next_task.append(run.attempt)
        return Out("b")

    handler = FirstAttempt(waits_for_cancel)
    config = workflow.Config(  # beat every 1 s
        sweep_max_age=4, max_in_process_backoff=0, default_task_timeout=3
    )
    reg, wf = registry(
        workflow.handle(A, handler, timeout=3.9, max_attempts=3, backoff_schedule=[0]),
        workflow.handle(B, b),
    )
    mgr = make_manager(reg, config, logger=logger)
    run = wf.start(mgr, Inp(1))
    assert handler.started.wait(10)
    thief = uuid.uuid4()
    db.execute(
        "UPDATE workflow_runs SET claim_id = %s, heartbeat_at = now() WHERE id = %s",
        (thief, run.id),
    )
    before = snapshot(db, run.id)
    lost = records.wait_for("claim lost")
    assert lost.run_id == run.id  # type: ignore[attr-defined]
    mgr.close(timeout=10)  # the execution has ended
    ((was_set, remaining),) = observed
    assert was_set
    assert remaining > 0, "cancelled by the lost heartbeat, not by the deadline"
    after = snapshot(db, run.id)
    # Only the thief's own heartbeat could differ; nothing else was written.
    assert after[1] == before[1]
    assert after[0][:11] + after[0][12:] == before[0][:11] + before[0][12:]
    claim, _, _, status, attempts, output, current_seq = db.execute(RUN_SQL, (run.id,)).fetchone()
    assert (claim, status, attempts, output, current_seq) == (thief, "running", 0, None, 1)
    assert next_task == []
    assert len(handler.runs) == 1


# --- the heartbeat thread's deadline wake-up -----------------------------------------


def test_deadline_begun_while_the_heartbeat_thread_beats_still_cancels_on_time(
    pool: Any, db: psycopg.Connection[Any]
) -> None:
    """An attempt that begins while the heartbeat thread is inside its beat query.

    White-box: `Heartbeat` is driven directly, its `_beat` instrumented to hold the
    thread inside the beat (where a real one spends a database round trip) while
    an attempt begins. The attempt's `cancelled` must be set by a wake-up of its
    own at its deadline, not left for the next beat (an interval later: up to 15 s
    with the default settings).
    """
    from workflow.heartbeat import DEADLINE, Claim, Heartbeat
    from workflow.logs import EngineLog
    from workflow.store import Store

    events: list[str] = []
    in_beat = threading.Event()
    go_on = threading.Event()

    class Instrumented(Heartbeat):
        beats = 0
        scanning = True

        def claims(self) -> list[Claim]:
            if self.scanning and threading.current_thread() is self._thread:
                events.append("scan")
            return super().claims()

        def _beat(self, now: float) -> None:
            self.scanning = False
            try:
                super()._beat(now)
            finally:
                self.scanning = True
            self.beats += 1
            events.append("beat")
            if self.beats == 1:
                in_beat.set()
                assert go_on.wait(10)

    class Recorded(Claim):
        def expire(self, now: float) -> bool:
            expired = super().expire(now)
            if expired and f"cancel:{self.reason}" not in events:
                events.append(f"cancel:{self.reason}")
            return expired

    run_id, claim_id = uuid.uuid4(), uuid.uuid4()
    db.execute(
        "INSERT INTO workflow_runs (id, workflow, status, input, task_count, current_seq, "
        "claim_id, heartbeat_at) VALUES (%s, 'W', 'running', '{}'::jsonb, 1, 1, %s, now())",
        (run_id, claim_id),
    )
    lease = Recorded(run_id, claim_id)
    heartbeat = Instrumented(
        Store(pool), 0.5, EngineLog(logging.getLogger("test.heartbeat.race"))
    )
    heartbeat.add(lease)
    heartbeat.start()
    try:
        assert in_beat.wait(10)
        # The executor begins an attempt while the thread is inside its first beat.
        deadline = time.monotonic() + 0.1
        cancelled = lease.begin_attempt(deadline)
        heartbeat.watch_deadline(deadline)
        go_on.set()
        assert cancelled.wait(10)
        poll(db, "SELECT 1", until=lambda _: heartbeat.beats >= 2)
    finally:
        go_on.set()
        heartbeat.stop(5)
    assert lease.reason == DEADLINE
    at = events.index(f"cancel:{DEADLINE}")
    assert events[at + 1] == "scan", (
        f"the deadline was only noticed on the next beat's wake-up, an interval late: {events}"
    )


# --- a claim let go by the execution's own last write ------------------------------------


@pytest.mark.parametrize("ending", ["finishes", "parks", "releases for a retry"])
def test_a_check_between_the_last_write_and_the_claims_removal_reports_nothing_lost(
    make_manager: Any, logs: tuple[logging.Logger, Records], ending: str
) -> None:
    """The run's last write lets go of the claim in the database a moment before the
    execution stops heartbeating it. A check in that moment sees the claim gone, and
    must not take it for a claim stolen by another executor (a false alarm, found by
    bench/prune.py)."""
    logger, records = logs

    def a(run: workflow.TaskRun[Inp]) -> Out:
        if ending == "finishes":
            return Out("a")
        raise workflow.Permanent("no") if ending == "parks" else RuntimeError("later")

    config = workflow.Config(max_in_process_backoff=0)
    reg, wf = registry(workflow.handle(A, a, max_attempts=2, backoff_schedule=[60]))
    mgr = make_manager(reg, config, logger=logger)
    heartbeat = mgr._heartbeat
    checked = threading.Event()
    check = heartbeat._check

    def spied(claims: Any) -> None:
        check(claims)
        checked.set()

    heartbeat._check = spied

    def on_event(event: Any) -> None:
        # Right after the attempt's write committed, on the executor's thread: the
        # claim is still registered with the heartbeat.
        if isinstance(event, AttemptEnded):
            heartbeat.check_soon()
            assert checked.wait(10)

    mgr.events.subscribe(on_event)
    run = wf.start(mgr, Inp(1))
    expected = {"finishes": Status.SUCCEEDED, "parks": Status.PARKED}.get(ending)
    if expected is not None:
        assert run.wait(timeout=10) is expected
    else:
        wait_until(checked.is_set, "the check")
    mgr.close(timeout=10)
    assert checked.is_set()
    assert not [m for m in records.messages() if "claim lost" in m]


# --- the claim's cancelled event -----------------------------------------------------


def test_a_claim_makes_no_condition_until_its_cancelled_event_is_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from workflow.heartbeat import Claim

    made: list[object] = []
    real = threading.Condition

    def counting(*args: Any) -> threading.Condition:
        condition = real(*args)
        made.append(condition)
        return condition

    monkeypatch.setattr(threading, "Condition", counting)
    claims = [Claim(uuid.uuid4(), uuid.uuid4()) for _ in range(3)]
    assert made == []  # an untouched claim costs no condition: most never need one
    claims[0].cancel("cancelled")
    assert len(made) == 1
    assert claims[0].cancelled.is_set() and not claims[1].cancelled.is_set()


def test_the_cancelled_event_wakes_a_waiter_set_from_another_thread() -> None:
    from workflow.heartbeat import CancelEvent

    event = CancelEvent()
    assert isinstance(event, threading.Event)
    assert not event.is_set()
    assert event.wait(0.01) is False
    woke: list[bool] = []
    waiting = threading.Thread(target=lambda: woke.append(event.wait(30)))
    waiting.start()
    threading.Timer(0.05, event.set).start()
    waiting.join(30)
    assert woke == [True]
    assert event.is_set() and event.wait(0) is True
    event.clear()
    assert not event.is_set() and event.wait(0) is False


def test_a_set_during_a_waiters_first_use_wakes_that_waiter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Making a condition is slowed down so that set() comes while the waiter is still
    # making its own: both make one, and both must end up on the same, or the set
    # notifies a condition nobody waits on. The sleeps only widen that window; any
    # order of the two threads must wake the waiter.
    from workflow.heartbeat import CancelEvent

    event = CancelEvent()
    woke: list[bool] = []
    waiting = threading.Thread(target=lambda: woke.append(event.wait(5)))
    made: list[object] = []
    real = threading.Condition

    def slow(*args: Any) -> threading.Condition:
        condition = real(*args)
        made.append(condition)
        time.sleep(0.05)
        return condition

    monkeypatch.setattr(threading, "Condition", slow)
    waiting.start()
    time.sleep(0.01)
    event.set()
    waiting.join(10)
    assert woke == [True]
