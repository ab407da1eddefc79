"""Delayed starts (SPEC 14): `start(..., delay=...)` and `start(..., run_at=...)`.

A delayed run is PENDING, is never executed on the fast path, becomes claimable
at its due time by the database clock, and an idle worker picks it up within
about a second of that time whatever its poll interval (the poller sleeps until
the earliest due run; the insert's wake-up tells it about a new one). Bad
arguments are refused before any SQL; a `run_at` in the past is due at once.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import psycopg
import pytest
from helpers import Inp, Out, registry, wait_until
from worker_apps.harness import WorkerProcess

import workflow
from workflow import Status

A = workflow.Task("a", Out)


def _due(db: psycopg.Connection[Any], run_id: str) -> tuple[str, float]:
    """(status, seconds from now until due, by the database clock)."""
    row = db.execute(
        "SELECT status, extract(epoch FROM next_retry_at - now())::float8 "
        "FROM workflow_runs WHERE id = %s",
        (run_id,),
    ).fetchone()
    assert row is not None
    return row[0], row[1]


def test_a_delayed_start_is_pending_and_not_executed_on_the_fast_path(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    ran = threading.Event()

    def a(run: workflow.TaskRun[Inp]) -> Out:
        ran.set()
        return Out("a")

    reg, wf = registry(workflow.handle(A, a))
    mgr = make_manager(reg)
    run = wf.start(mgr, Inp(1), delay=datetime.timedelta(hours=1))
    status, due_in = _due(db, run.id)
    assert status == "pending"
    assert 3590 < due_in <= 3600
    assert run.status().status is Status.PENDING
    # A wait() kicks only a claimable run: this one is not due.
    assert run.wait(timeout=1.5) is Status.RUNNING
    assert not ran.is_set()


def test_run_at_is_the_due_time_and_one_in_the_past_is_due_at_once(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    reg, wf = registry(workflow.handle(A, lambda run: Out("a")))
    mgr = make_manager(reg)
    berlin = datetime.timezone(datetime.timedelta(hours=1))
    at = datetime.datetime.now(berlin) + datetime.timedelta(minutes=10)
    with db.transaction():
        later = wf.start_tx(db, mgr, Inp(1), run_at=at)
    row = db.execute(
        "SELECT next_retry_at FROM workflow_runs WHERE id = %s", (later.id,)
    ).fetchone()
    assert row is not None and row[0] == at
    past = wf.start(mgr, Inp(2), run_at=datetime.datetime.now(datetime.timezone.utc)
                    - datetime.timedelta(days=1))
    # Due at once, but still not on the fast path: a poller or a wait() kick runs it.
    assert past.wait(timeout=20) is Status.SUCCEEDED


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"run_at": datetime.datetime(2030, 1, 1)}, ValueError, "naive"),
        ({"delay": 5, "run_at": datetime.datetime(2030, 1, 1, tzinfo=datetime.timezone.utc)},
         TypeError, "not both"),
        ({"delay": -1}, ValueError, "delay"),
        ({"delay": float("nan")}, ValueError, "delay"),
        ({"delay": float("inf")}, ValueError, "delay"),
        ({"delay": "soon"}, TypeError, "delay"),
        ({"run_at": "2030-01-01T00:00:00Z"}, TypeError, "run_at"),
    ],
    ids=["naive", "both", "negative", "nan", "inf", "text delay", "text run_at"],
)
def test_bad_delays_are_refused_before_any_sql(
    make_manager: Any, db: psycopg.Connection[Any], kwargs: dict[str, Any],
    error: type[Exception], match: str,
) -> None:
    reg, wf = registry(workflow.handle(A, lambda run: Out("a")))
    mgr = make_manager(reg)
    with pytest.raises(error, match=match):
        wf.start(mgr, Inp(1), **kwargs)
    with pytest.raises(error, match=match), db.transaction():
        wf.start_tx(db, mgr, Inp(1), **kwargs)
    assert db.execute("SELECT count(*) FROM workflow_runs").fetchone() == (0,)


def _status(db: psycopg.Connection[Any], run_id: str) -> str | None:
    row = db.execute("SELECT status FROM workflow_runs WHERE id = %s", (run_id,)).fetchone()
    return None if row is None else str(row[0])


@pytest.mark.direct("a LISTENing worker learns of the new due time from the insert's wake-up")
def test_a_worker_polling_every_30s_picks_a_delayed_run_up_about_when_it_is_due(
    make_manager: Any, db: psycopg.Connection[Any], engine_url: str
) -> None:
    from worker_apps import traced

    mgr = make_manager(traced.registry())
    worker = WorkerProcess("tests.worker_apps.traced:registry", engine_url,
                           "--poll-interval", "30")
    try:
        worker.wait_started()
        time.sleep(0.5)  # its first poll found nothing: it sleeps for up to 30 s
        with db.transaction():
            run = traced.Traced.start_tx(db, mgr, traced.Order(1), delay=3.0)
        (due,) = db.execute(
            "SELECT next_retry_at FROM workflow_runs WHERE id = %s", (run.id,)
        ).fetchone() or (None,)
        # Not run.wait(): a wait kicks a due run and executes it here.
        wait_until(lambda: _status(db, run.id) == "succeeded", "the worker to run it", timeout=20)
        (first_done,) = db.execute(
            "SELECT min(finished_at) FROM workflow_tasks WHERE run_id = %s", (run.id,)
        ).fetchone() or (None,)
        late = (first_done - due).total_seconds()
        assert 0 <= late < 2.0, f"its first task finished {late:.2f}s after its due time"
        worker.terminate()
        assert worker.wait(timeout=20) == 0, worker.stderr
    finally:
        worker.kill()


def test_a_poller_sleeps_until_the_earliest_due_run_not_its_poll_interval(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    reg, wf = registry(workflow.handle(A, lambda run: Out("a")))
    mgr = make_manager(reg)
    run = wf.start(mgr, Inp(1), delay=1.5)
    # No LISTEN and a 60 s poll interval: only the due time it reads can wake it.
    runnable = mgr.new_runnable(workflow.RunnerConfig(listen=False, poll_interval=60))
    runnable.start()
    try:
        wait_until(lambda: _status(db, run.id) == "succeeded", "the poller to run it", timeout=15)
    finally:
        runnable.stop()


def test_a_retry_this_worker_released_for_later_is_picked_up_about_when_due(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    """Its own executions' releases wake nothing from outside: the poller reads the due
    time again within a second of an execution ending, not after its poll interval."""
    def flaky(run: workflow.TaskRun[Inp]) -> Out:
        if run.attempt == 1:
            raise RuntimeError("once")
        return Out("a")

    # 6 s is above max_in_process_backoff (5 s): the claim is released until then.
    reg, wf = registry(workflow.handle(A, flaky, backoff_schedule=[6]))
    mgr = make_manager(reg)
    with db.transaction():
        run = wf.start_tx(db, mgr, Inp(1))
    runnable = mgr.new_runnable(workflow.RunnerConfig(listen=False, poll_interval=60))
    runnable.start()
    try:
        wait_until(lambda: _status(db, run.id) == "succeeded", "the retry", timeout=20)
    finally:
        runnable.stop()
    (failed_at, done_at) = db.execute(
        "SELECT failed_at, finished_at FROM workflow_tasks WHERE run_id = %s", (run.id,)
    ).fetchone() or (None, None)
    late = (done_at - failed_at).total_seconds() - 6
    assert -0.1 < late < 2.5, f"retried {late:.2f}s after it was due"
