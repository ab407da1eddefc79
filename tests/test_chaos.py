"""Chaos under load (SPEC 9, invariant 8), the short mode CI runs; and the checks' own teeth.

`test_chaos_short` runs `python -m tests.chaos --short` in-process: a private
PostgreSQL, three worker subprocesses SIGKILLed one at a time every few seconds
and replaced, a starter starting runs with `start_tx` and `start()`, one
PostgreSQL restart mid-load. It asserts the checks of `tests/chaos/checks.py`:
nothing lost, no output overwritten by a stale executor, no overlapping
executions with valid claims, attempts within budget.

The other tests prove that those checks can fail: they run a few chaos runs on a
scratch database of the shared server, then forge what a broken engine would
leave behind (a stale output written over a recorded one, a second execution under
the same claim, a run left unfinished) and expect the checks to report it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from chaos import app as chaos_app
from chaos import ledger
from chaos.checks import check
from chaos.runner import Plan, run_chaos
from chaos.schema import TABLES
from privatepg import available

import workflow


@pytest.mark.slow
def test_chaos_short() -> None:
    reason = available()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    result = run_chaos(Plan.short(), say=print)
    print(result.summary())
    details = "\n".join(result.problems + result.report.problems)
    report = result.report
    assert result.kills > 0 and result.restarts == 1, result.summary()
    assert result.lost_replies > 0 and result.cancels > 0 and result.resumes > 0
    assert report.runs > 100 and report.executions >= 3 * report.runs, result.summary()
    assert report.started_recorded > 0
    assert result.drained, details
    assert report.lost == 0, details
    assert report.overwritten == 0, details
    assert report.overlaps == 0, details
    assert report.attempts_over == 0, details
    assert report.stale_reads == 0, details
    assert report.unknown_claims == 0, details
    assert report.ticks_missed == 0, details
    assert report.keyed_runs > 0 and report.key_holds >= report.keyed_runs, result.summary()
    assert report.key_overlaps == 0 and report.unheld_claims == 0, details
    assert result.crashes == 0, details
    assert result.starter_exit == 0, details
    assert result.worker_exits == [0, 0, 0], details
    assert not result.problems, details
    assert result.ok, details


# --- The checks catch what they are for -----------------------------------------------


@pytest.fixture
def chaos_db(db_url: str, db: psycopg.Connection[Any]) -> Iterator[psycopg.Connection[Any]]:
    """The test database with the chaos tables; handlers in this process write its ledger."""
    db.execute(TABLES)
    saved = os.environ.get(ledger.URL_ENV)
    os.environ[ledger.URL_ENV] = db_url
    ledger._pool = None
    yield db
    if ledger._pool is not None:
        ledger._pool.close()
        ledger._pool = None
    if saved is None:
        os.environ.pop(ledger.URL_ENV, None)
    else:
        os.environ[ledger.URL_ENV] = saved


def _run_some(make_manager: Any, db: psycopg.Connection[Any], count: int = 4) -> list[str]:
    mgr = make_manager(chaos_app.registry(), chaos_app.CONFIG)
    runs = [
        chaos_app.Chaos.start(mgr, chaos_app.Job(n=i, fail_seq=2 if i == 0 else 0))
        for i in range(count)
    ]
    for run in runs:
        assert run.wait(timeout=30) is workflow.Status.SUCCEEDED
        db.execute("INSERT INTO chaos_started (run_id, via) VALUES (%s, 'start')", (run.id,))
    return [run.id for run in runs]


def test_checks_pass_on_honest_runs(chaos_db: psycopg.Connection[Any], make_manager: Any) -> None:
    _run_some(make_manager, chaos_db)
    report = check(chaos_db, chaos_app.MAX_ATTEMPTS, os.getpid())
    assert report.violations == 0, report.problems
    assert report.runs == 4
    assert report.executions == 13  # 4 runs x 3 tasks, and one injected retry
    assert report.re_executions == 1 and report.injected_failures == 1
    assert report.fast_path_executions == 13


def test_checks_catch_two_runs_of_one_key_holding_it_at_once(
    chaos_db: psycopg.Connection[Any], make_manager: Any
) -> None:
    ids = _run_some(make_manager, chaos_db, count=7)  # runs 0, 3 and 6 have accounts
    keyed = chaos_db.execute(
        "SELECT id FROM workflow_runs WHERE concurrency_key IS NOT NULL ORDER BY created_at"
    ).fetchall()
    assert len(keyed) == 3
    assert check(chaos_db, chaos_app.MAX_ATTEMPTS, os.getpid()).violations == 0
    # Runs 0 and 3 are different accounts; give run 3 run 0's key over run 0's hold.
    chaos_db.execute(
        "UPDATE workflow_runs SET concurrency_key = (SELECT concurrency_key FROM "
        "workflow_runs WHERE id = %s) WHERE id = %s", (keyed[0][0], keyed[1][0]),
    )
    chaos_db.execute(
        "INSERT INTO chaos_key_holds (run_id, key, old_slot, new_slot, at) "
        "SELECT %s, key, NULL, 0, at + interval '1 microsecond' FROM chaos_key_holds "
        "WHERE run_id = %s AND new_slot IS NOT NULL",
        (keyed[1][0], keyed[0][0]),
    )
    report = check(chaos_db, chaos_app.MAX_ATTEMPTS, os.getpid())
    assert report.key_overlaps >= 1, report.problems
    assert len(ids) == 7


def test_checks_catch_a_keyed_run_claimed_without_its_key(
    chaos_db: psycopg.Connection[Any], make_manager: Any
) -> None:
    _run_some(make_manager, chaos_db, count=1)
    chaos_db.execute("DELETE FROM chaos_key_holds")
    report = check(chaos_db, chaos_app.MAX_ATTEMPTS, os.getpid())
    assert report.unheld_claims == 1, report.problems


def test_checks_catch_a_stale_output_written_over_a_recorded_one(
    chaos_db: psycopg.Connection[Any], make_manager: Any
) -> None:
    ids = _run_some(make_manager, chaos_db)
    # A stale executor's execution of task 2 of the first run (its own claim, long
    # cleared), whose output then lands over the recorded one: what an unfenced
    # write would leave.
    row = chaos_db.execute(
        "SELECT claim_id FROM chaos_exec WHERE run_id = %s AND seq = 1", (ids[0],)
    ).fetchone()
    assert row is not None
    stale = uuid.uuid4()
    chaos_db.execute(
        "INSERT INTO chaos_exec (exec_id, run_id, seq, attempt, pid, claim_id, prev_output, "
        "ended_at, outcome) SELECT %s, run_id, 2, 1, 0, %s, prev_output, clock_timestamp(), "
        "'returned' FROM chaos_exec WHERE run_id = %s AND seq = 2 LIMIT 1",
        (stale, row[0], ids[0]),
    )
    chaos_db.execute(
        "UPDATE workflow_tasks SET output = to_jsonb(%s::text) WHERE run_id = %s AND seq = 2",
        (str(stale), ids[0]),
    )
    report = check(chaos_db, chaos_app.MAX_ATTEMPTS, os.getpid())
    assert report.overwritten >= 1, report.problems
    assert any("overwritten" in p for p in report.problems)
    # Task 3 read the output that was recorded before: now a stale read too.
    assert report.stale_reads >= 1


def test_checks_catch_an_output_written_under_another_claim(
    chaos_db: psycopg.Connection[Any], make_manager: Any
) -> None:
    ids = _run_some(make_manager, chaos_db)
    # The recorded output names an execution whose claim is not the one the run held
    # when the output was written (the only write of it, so no overwrite is seen).
    chaos_db.execute(
        "UPDATE chaos_exec SET claim_id = %s WHERE run_id = %s AND seq = 3",
        (uuid.uuid4(), ids[1]),
    )
    report = check(chaos_db, chaos_app.MAX_ATTEMPTS, os.getpid())
    assert report.overwritten == 1, report.problems
    assert report.unknown_claims == 1


def test_checks_catch_overlapping_executions_under_one_claim(
    chaos_db: psycopg.Connection[Any], make_manager: Any
) -> None:
    ids = _run_some(make_manager, chaos_db)
    # A second execution of task 1, under the same valid claim, at the same time.
    chaos_db.execute(
        "INSERT INTO chaos_exec (exec_id, run_id, seq, attempt, pid, claim_id, started_at, "
        "ended_at, outcome) SELECT %s, run_id, seq, attempt, pid, claim_id, started_at, "
        "ended_at, 'raised' FROM chaos_exec WHERE run_id = %s AND seq = 1",
        (uuid.uuid4(), ids[2]),
    )
    report = check(chaos_db, chaos_app.MAX_ATTEMPTS, os.getpid())
    assert report.overlaps == 1, report.problems


def test_checks_catch_a_lost_run_and_an_attempt_over_budget(
    chaos_db: psycopg.Connection[Any], make_manager: Any
) -> None:
    ids = _run_some(make_manager, chaos_db)
    chaos_db.execute(
        "INSERT INTO chaos_started (run_id, via) VALUES (%s, 'start_tx')", (uuid.uuid4(),)
    )
    chaos_db.execute(
        "UPDATE workflow_tasks SET attempts = %s WHERE run_id = %s AND seq = 1",
        (chaos_app.MAX_ATTEMPTS + 1, ids[3]),
    )
    report = check(chaos_db, chaos_app.MAX_ATTEMPTS, os.getpid())
    assert report.lost == 1, report.problems
    assert report.attempts_over >= 1, report.problems


def test_checks_catch_a_sweep_that_counted_an_attempt_no_one_ran(
    chaos_db: psycopg.Connection[Any], make_manager: Any
) -> None:
    """What a lost claim reply left on the old engine: a claim no executor knew of, swept."""
    from chaos.schema import SWEEP_ERROR_PREFIX

    ids = _run_some(make_manager, chaos_db)
    chaos_db.execute(
        "UPDATE workflow_runs SET claim_id = %s, heartbeat_at = now() WHERE id = %s",
        (uuid.uuid4(), ids[1]),
    )
    with chaos_db.transaction():
        chaos_db.execute(
            "UPDATE workflow_runs SET claim_id = NULL, heartbeat_at = NULL WHERE id = %s",
            (ids[1],),
        )
        chaos_db.execute(
            "UPDATE workflow_tasks SET attempts = attempts + 1, error = %s "
            "WHERE run_id = %s AND seq = 3",
            (f"{SWEEP_ERROR_PREFIX}: its executor stopped heartbeating", ids[1]),
        )
    report = check(chaos_db, chaos_app.MAX_ATTEMPTS, os.getpid())
    assert report.phantom_attempts == 1, report.problems
    assert report.miscounted == 1 and report.violations >= 1


def test_checks_catch_a_failure_counted_twice(
    chaos_db: psycopg.Connection[Any], make_manager: Any
) -> None:
    ids = _run_some(make_manager, chaos_db)
    chaos_db.execute(
        "UPDATE workflow_tasks SET attempts = attempts + 1 WHERE run_id = %s AND seq = 2",
        (ids[0],),
    )
    report = check(chaos_db, chaos_app.MAX_ATTEMPTS, os.getpid())
    assert report.phantom_attempts == 1, report.problems


def test_checks_catch_a_failure_that_ran_and_was_never_counted(
    chaos_db: psycopg.Connection[Any], make_manager: Any
) -> None:
    ids = _run_some(make_manager, chaos_db)
    chaos_db.execute(
        "INSERT INTO chaos_exec (exec_id, run_id, seq, attempt, pid, claim_id, started_at, "
        "ended_at, outcome) SELECT %s, run_id, seq, attempt, pid, claim_id, started_at, "
        "started_at, 'raised' FROM chaos_exec WHERE run_id = %s AND seq = 1",
        (uuid.uuid4(), ids[3]),
    )
    report = check(chaos_db, chaos_app.MAX_ATTEMPTS, os.getpid())
    assert report.uncounted == 1, report.problems


def test_checks_catch_one_write_counting_two_attempts(
    chaos_db: psycopg.Connection[Any], make_manager: Any
) -> None:
    ids = _run_some(make_manager, chaos_db)
    chaos_db.execute(
        "UPDATE workflow_tasks SET attempts = attempts + 2 WHERE run_id = %s AND seq = 1",
        (ids[2],),
    )
    report = check(chaos_db, chaos_app.MAX_ATTEMPTS, os.getpid())
    assert report.double_counted == 1, report.problems


def test_checks_catch_a_tick_that_started_no_run(
    chaos_db: psycopg.Connection[Any], make_manager: Any
) -> None:
    _run_some(make_manager, chaos_db, count=1)
    # The schedule was registered five minutes before the workers were stopped, and
    # only one of its ticks started a run: what a scheduler that lost ticks would leave.
    chaos_db.execute(
        "INSERT INTO workflow_schedules (name, workflow, cron, timezone, catchup, next_tick, "
        "created_at) VALUES (%s, 'Chaos.Three', '* * * * *', 'UTC', 'all', now(), "
        "now() - interval '5 minutes 30 seconds')",
        (chaos_app.SCHEDULE,),
    )
    chaos_db.execute("INSERT INTO chaos_faults (kind, app) VALUES ('stop', 'chaos-w1')")
    mgr = make_manager(chaos_app.registry(), chaos_app.CONFIG)
    tick = chaos_db.execute(
        "SELECT to_char(date_trunc('minute', now() - interval '2 minutes') AT TIME ZONE 'UTC', "
        "'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')"
    ).fetchone()
    assert tick is not None
    run = chaos_app.Chaos.start(
        mgr, chaos_app.Job(n=-1), idempotency_key=f"schedule:{chaos_app.SCHEDULE}:{tick[0]}"
    )
    assert run.wait(timeout=30) is workflow.Status.SUCCEEDED
    report = check(chaos_db, chaos_app.MAX_ATTEMPTS, os.getpid())
    assert report.ticks == 1
    assert report.ticks_missed >= 4, report.problems
    assert any("started no run" in p for p in report.problems)
