"""Workers as real processes: draining many runs, surviving `kill -9`, backoff, SIGTERM, LISTEN.

SPEC section 6 and invariant 8 ("no run is lost"). Every worker is a real
`python -m workflow.worker` subprocess; handlers (tests/worker_apps/) record each
execution in a `ledger` table of the test's own, stamped with the database clock.
Waits poll the database or the worker's stderr against a deadline; leftover
workers are killed at teardown.
"""

from __future__ import annotations

import datetime
import signal
import time
from collections.abc import Callable
from typing import Any

import pgbouncer
import psycopg
import pytest
from helpers import poll
from worker_apps import backoff, three_tasks
from worker_apps.harness import WorkerProcess
from worker_apps.ledger import CREATE_TABLE

import workflow

THREE = "tests.worker_apps.three_tasks:registry"
THREE_QUICK_SWEEP = "tests.worker_apps.three_tasks:quick_sweep_app"
THREE_POLL_ONLY = "tests.worker_apps.three_tasks:poll_only_app"
BACKOFF = "tests.worker_apps.backoff:registry"

Spawn = Callable[..., WorkerProcess]


@pytest.fixture
def ledger(db: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    """The test database's connection, with the `ledger` table created."""
    db.execute(CREATE_TABLE)
    return db


def start_runs(
    make_manager: Any,
    registry: workflow.Registry,
    wf: workflow.Workflow[Any],
    inputs: list[Any],
    pool: Any,
    per_transaction: int = 250,
) -> list[str]:
    """Start one run per input with `start_tx`, `per_transaction` per transaction; their ids.

    The test's own manager only inserts: it runs no worker and launches nothing.
    """
    mgr = make_manager(registry)
    ids: list[str] = []
    for i in range(0, len(inputs), per_transaction):
        with pool.connection() as conn, conn.transaction():
            for value in inputs[i : i + per_transaction]:
                ids.append(wf.start_tx(conn, mgr, value).id)
    return ids


def wait_status(db: psycopg.Connection[Any], run_id: str, status: str, timeout: float) -> None:
    poll(
        db,
        "SELECT status = %s FROM workflow_runs WHERE id = %s",
        (status, run_id),
        timeout=timeout,
        what=f"run {run_id} to be {status}",
    )


def wait_listening(db: psycopg.Connection[Any], count: int, timeout: float = 30.0) -> None:
    """Until `count` sessions on the test database have LISTENed for wake-ups."""
    poll(
        db,
        "SELECT count(*) >= %s FROM pg_stat_activity "
        "WHERE datname = current_database() AND query = 'LISTEN workflow_runs'",
        (count,),
        timeout=timeout,
        what=f"{count} LISTENing workers",
    )


def ledger_rows(db: psycopg.Connection[Any], run_id: str) -> list[tuple[Any, ...]]:
    """(seq, attempt, pid, event, cancelled, at) of one run, in order."""
    return db.execute(
        "SELECT seq, attempt, pid, event, cancelled, at FROM ledger WHERE run_id = %s "
        "ORDER BY at, seq, event DESC",
        (run_id,),
    ).fetchall()


def task_rows(db: psycopg.Connection[Any], run_id: str) -> list[tuple[Any, ...]]:
    """(seq, attempts, output, finished_at, failed_at, error) of one run's tasks."""
    return db.execute(
        "SELECT seq, attempts, output, finished_at, failed_at, error FROM workflow_tasks "
        "WHERE run_id = %s ORDER BY seq",
        (run_id,),
    ).fetchall()


def db_now(db: psycopg.Connection[Any]) -> datetime.datetime:
    row = db.execute("SELECT now()").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


# --- An App's runner without LISTEN, behind PgBouncer -----------------------------------


@pytest.mark.behind_pgbouncer
def test_an_apps_runner_without_listen_prepares_no_statements_behind_pgbouncer(
    ledger: psycopg.Connection[Any], engine_url: str, make_manager: Any, pool: Any
) -> None:
    """SPEC 6: behind a transaction-mode pooler the pool needs `prepare_threshold=None`
    (PgBouncer before 1.21 cannot carry server-side prepared statements). A runner that
    says `listen=False` is that setting, with no `--no-listen` flag given."""
    worker = WorkerProcess(THREE_POLL_ONLY, engine_url)  # no worker_args(): no flag
    try:
        assert "listen=off" in worker.wait_for_line("workflow: worker started")
        [run_id] = start_runs(
            make_manager, three_tasks.registry(), three_tasks.Three, [three_tasks.Plan()], pool
        )
        wait_status(ledger, run_id, "succeeded", timeout=30)
        assert "Traceback" not in worker.stderr, worker.stderr
    finally:
        worker.kill()


# --- (a) Many runs, three workers: exactly once ----------------------------------------


@pytest.mark.slow
def test_three_workers_drain_1000_start_tx_runs_each_task_exactly_once(
    ledger: psycopg.Connection[Any], spawn: Spawn, make_manager: Any, pool: Any
) -> None:
    workers = [
        spawn(THREE, "--concurrency", "4", "--batch-size", "10", "--poll-interval", "2")
        for _ in range(3)
    ]
    for worker in workers:
        worker.wait_started()
    if not pgbouncer.ENABLED:  # poll-only behind PgBouncer: nothing more to wait for
        wait_listening(ledger, 3)

    ids = start_runs(
        make_manager, three_tasks.registry(), three_tasks.Three, [three_tasks.Plan()] * 1000, pool
    )
    assert len(set(ids)) == 1000

    poll(
        ledger,
        "SELECT count(*) = 1000 FROM workflow_runs WHERE status = 'succeeded'",
        timeout=90,
        what="1000 runs to succeed",
    )
    statuses = dict(
        ledger.execute("SELECT status, count(*) FROM workflow_runs GROUP BY status").fetchall()
    )
    assert statuses == {"succeeded": 1000}
    # Every (run, seq) executed exactly once, on its first attempt.
    row = ledger.execute(
        "SELECT count(*), count(DISTINCT (run_id, seq)), max(attempt), "
        "count(DISTINCT run_id) FROM ledger"
    ).fetchone()
    assert row == (3000, 3000, 1, 1000)
    row = ledger.execute(
        "SELECT count(*), sum(attempts), count(*) FILTER (WHERE finished_at IS NULL) "
        "FROM workflow_tasks"
    ).fetchone()
    assert row == (3000, 0, 0)
    unclaimed = ledger.execute(
        "SELECT count(*) FROM workflow_runs WHERE claim_id IS NOT NULL"
    ).fetchone()
    assert unclaimed == (0,)
    pids = {pid for (pid,) in ledger.execute("SELECT DISTINCT pid FROM ledger").fetchall()}
    assert pids == {worker.pid for worker in workers}

    for worker in workers:
        worker.signal(signal.SIGTERM)
    for worker in workers:
        assert worker.wait() == 0, worker.stderr
        assert "Traceback" not in worker.stderr, worker.stderr


# --- (b) kill -9 inside a task: another worker finishes the run --------------------------


@pytest.mark.slow
def test_a_run_whose_worker_was_killed_mid_task_is_finished_by_another_after_sweep_max_age(
    ledger: psycopg.Connection[Any], spawn: Spawn, make_manager: Any, pool: Any
) -> None:
    sweep_max_age = 3.0
    assert three_tasks.QUICK_SWEEP.sweep_max_age == sweep_max_age
    fast = ("--sweep-interval", "0.5", "--poll-interval", "1")
    a = spawn(THREE_QUICK_SWEEP, *fast)
    a.wait_started()
    [run_id] = start_runs(
        make_manager,
        three_tasks.registry(),
        three_tasks.Three,
        [three_tasks.Plan(hold_seq=2, hold="hang")],
        pool,
    )

    # Wait until worker A is inside task 2, then kill it outright.
    poll(
        ledger,
        "SELECT pid FROM ledger WHERE run_id = %s AND seq = 2",
        (run_id,),
        timeout=20,
        what="task 2 to start",
    )
    a.kill()
    killed_at = db_now(ledger)
    claim = ledger.execute(
        "SELECT claim_id IS NOT NULL, status FROM workflow_runs WHERE id = %s", (run_id,)
    ).fetchone()
    assert claim == (True, "running")

    b = spawn(THREE_QUICK_SWEEP, *fast)
    b.wait_started()
    wait_status(ledger, run_id, "succeeded", timeout=30)

    rows = [(seq, attempt, pid) for seq, attempt, pid, *_ in ledger_rows(ledger, run_id)]
    assert rows == [(1, 1, a.pid), (2, 1, a.pid), (2, 2, b.pid), (3, 1, b.pid)]
    tasks = task_rows(ledger, run_id)
    assert [(seq, attempts, output) for seq, attempts, output, *_ in tasks] == [
        (1, 0, 1),
        (2, 1, 2),
        (3, 0, None),
    ]
    assert "abandoned" in tasks[1][5]
    # The claim went stale only after sweep_max_age without a heartbeat (A beat at most
    # a heartbeat interval, sweep_max_age / 4, before it died).
    [rerun_at] = [
        at for seq, attempt, _, _, _, at in ledger_rows(ledger, run_id) if (seq, attempt) == (2, 2)
    ]
    assert (rerun_at - killed_at).total_seconds() >= sweep_max_age * 3 / 4 - 0.1
    assert "released a stale claim" in b.stderr


# --- (c) A long backoff outlives its worker ---------------------------------------------


@pytest.mark.slow
def test_a_released_backoff_is_honoured_by_the_worker_that_resumes_it(
    ledger: psycopg.Connection[Any], spawn: Spawn, make_manager: Any, pool: Any
) -> None:
    a = spawn(BACKOFF, "--poll-interval", "0.5")
    a.wait_started()
    [run_id] = start_runs(make_manager, backoff.registry(), backoff.Flaky, ["x"], pool)

    # A's attempt fails; the 6 s delay is above max_in_process_backoff: the claim is released.
    row = poll(
        ledger,
        "SELECT r.claim_id IS NULL AND t.attempts = 1, t.failed_at, r.next_retry_at "
        "FROM workflow_runs r JOIN workflow_tasks t ON t.run_id = r.id AND t.seq = 1 "
        "WHERE r.id = %s",
        (run_id,),
        timeout=20,
        what="the failed attempt to release its claim",
    )
    failed_at: datetime.datetime = row[1]
    assert row[2] - failed_at == datetime.timedelta(seconds=backoff.DELAY)
    a.signal(signal.SIGTERM)
    assert a.wait() == 0, a.stderr

    b = spawn(BACKOFF, "--poll-interval", "0.5")
    b.wait_started()
    wait_status(ledger, run_id, "succeeded", timeout=30)

    rows = ledger_rows(ledger, run_id)
    assert [(seq, attempt, pid) for seq, attempt, pid, *_ in rows] == [
        (1, 1, a.pid),
        (1, 2, b.pid),
        (2, 1, b.pid),
    ]
    retried_at = rows[1][5]
    assert retried_at >= failed_at + datetime.timedelta(seconds=backoff.DELAY)
    tasks = task_rows(ledger, run_id)
    assert [(seq, attempts, output) for seq, attempts, output, *_ in tasks] == [
        (1, 1, "ok"),
        (2, 0, None),
    ]


# --- (d) SIGTERM drains -----------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_during_a_long_task_finishes_and_records_the_attempt_then_exits_0(
    ledger: psycopg.Connection[Any], spawn: Spawn, make_manager: Any, pool: Any
) -> None:
    hold = 2.0
    a = spawn(THREE)
    a.wait_started()
    [run_id] = start_runs(
        make_manager,
        three_tasks.registry(),
        three_tasks.Three,
        [three_tasks.Plan(hold_seq=2, hold="finish", seconds=hold)],
        pool,
    )
    poll(
        ledger,
        "SELECT pid FROM ledger WHERE run_id = %s AND seq = 2",
        (run_id,),
        timeout=20,
        what="task 2 to start",
    )
    a.signal(signal.SIGTERM)
    assert a.wait() == 0, a.stderr
    assert "worker draining on SIGTERM" in a.stderr
    assert "Traceback" not in a.stderr

    # The attempt finished (seeing `cancelled`), its output was recorded, task 3 was
    # not started, and the claim was released for immediate re-claim.
    rows = ledger_rows(ledger, run_id)
    assert [(seq, attempt, pid, event) for seq, attempt, pid, event, *_ in rows] == [
        (1, 1, a.pid, "start"),
        (2, 1, a.pid, "start"),
        (2, 1, a.pid, "end"),
    ]
    assert rows[2][4] is True
    tasks = task_rows(ledger, run_id)
    assert [
        (seq, attempts, output, finished is not None)
        for seq, attempts, output, finished, *_ in tasks
    ] == [(1, 0, 1, True), (2, 0, 2, True), (3, 0, None, False)]
    run = ledger.execute(
        "SELECT status, claim_id, current_seq, finished_at, next_retry_at <= now() "
        "FROM workflow_runs WHERE id = %s",
        (run_id,),
    ).fetchone()
    assert run == ("running", None, 3, None, True)

    # Another worker goes on from task 3.
    b = spawn(THREE)
    b.wait_started()
    wait_status(ledger, run_id, "succeeded", timeout=20)
    assert [
        (seq, pid) for seq, _, pid, event, *_ in ledger_rows(ledger, run_id) if event == "start"
    ] == [(1, a.pid), (2, a.pid), (3, b.pid)]


@pytest.mark.slow
def test_sigterm_while_a_handler_honours_cancelled_spends_no_attempt(
    ledger: psycopg.Connection[Any], spawn: Spawn, make_manager: Any, pool: Any
) -> None:
    a = spawn(THREE)
    a.wait_started()
    [run_id] = start_runs(
        make_manager,
        three_tasks.registry(),
        three_tasks.Three,
        [three_tasks.Plan(hold_seq=2, hold="cancellable", seconds=60)],
        pool,
    )
    poll(
        ledger,
        "SELECT pid FROM ledger WHERE run_id = %s AND seq = 2",
        (run_id,),
        timeout=20,
        what="task 2 to start",
    )
    sent = time.monotonic()
    a.signal(signal.SIGTERM)
    assert a.wait() == 0, a.stderr
    assert time.monotonic() - sent < 10
    tasks = task_rows(ledger, run_id)
    assert [(seq, attempts, output) for seq, attempts, output, *_ in tasks] == [
        (1, 0, 1),
        (2, 0, None),
        (3, 0, None),
    ]
    run = ledger.execute(
        "SELECT status, claim_id, current_seq FROM workflow_runs WHERE id = %s",
        (run_id,),
    ).fetchone()
    assert run == ("running", None, 2)


@pytest.mark.slow
def test_a_second_signal_exits_at_once_without_draining(
    ledger: psycopg.Connection[Any], spawn: Spawn, make_manager: Any, pool: Any
) -> None:
    a = spawn(THREE)
    a.wait_started()
    [run_id] = start_runs(
        make_manager,
        three_tasks.registry(),
        three_tasks.Three,
        [three_tasks.Plan(hold_seq=1, hold="finish", seconds=60)],
        pool,
    )
    poll(
        ledger,
        "SELECT pid FROM ledger WHERE run_id = %s AND seq = 1",
        (run_id,),
        timeout=20,
        what="task 1 to start",
    )
    a.signal(signal.SIGTERM)
    a.wait_for_line("worker draining")
    sent = time.monotonic()
    a.signal(signal.SIGTERM)
    assert a.wait() == 1
    assert time.monotonic() - sent < 5
    assert a.stderr.splitlines()[-1] == (
        "workflow: worker: second signal (SIGTERM): exiting at once"
    )
    # The claim is left to the sweeper: nothing was recorded for the abandoned attempt.
    run = ledger.execute(
        "SELECT claim_id IS NOT NULL FROM workflow_runs WHERE id = %s", (run_id,)
    ).fetchone()
    assert run == (True,)


# --- (e) Wake-ups ----------------------------------------------------------------------


@pytest.mark.direct(reason="a LISTEN wake-up needs a session of its own")
def test_with_listen_an_idle_worker_picks_up_a_start_tx_run_long_before_its_poll_interval(
    ledger: psycopg.Connection[Any], spawn: Spawn, make_manager: Any, pool: Any
) -> None:
    a = spawn(THREE, "--poll-interval", "30")
    a.wait_started()
    wait_listening(ledger, 1)
    committed = time.monotonic()
    [run_id] = start_runs(
        make_manager, three_tasks.registry(), three_tasks.Three, [three_tasks.Plan()], pool
    )
    wait_status(ledger, run_id, "succeeded", timeout=10)
    assert time.monotonic() - committed < 10
    assert {pid for _, _, pid, *_ in ledger_rows(ledger, run_id)} == {a.pid}


def test_without_listen_the_poll_interval_still_picks_up_a_start_tx_run(
    ledger: psycopg.Connection[Any], spawn: Spawn, make_manager: Any, pool: Any
) -> None:
    a = spawn(THREE, "--no-listen", "--poll-interval", "1")
    a.wait_started()
    [run_id] = start_runs(
        make_manager, three_tasks.registry(), three_tasks.Three, [three_tasks.Plan()], pool
    )
    wait_status(ledger, run_id, "succeeded", timeout=10)
    assert {pid for _, _, pid, *_ in ledger_rows(ledger, run_id)} == {a.pid}
    listening = ledger.execute(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() AND query = 'LISTEN workflow_runs'"
    ).fetchone()
    assert listening == (0,)
