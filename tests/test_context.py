"""SPEC section 7: the calling context, captured at start and restored around handlers only.

The propagator is `context_apps.CallerPropagator`, over the `CALLER` ContextVar;
handlers report what they saw as their outputs (`context_apps.Seen`), so a run
resumed by another process is checked from the database.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

import psycopg
import pytest
from context_apps import (
    ANONYMOUS,
    CALLER,
    Audit,
    Caller,
    CallerPropagator,
    Order,
    Seen,
    first,
    second,
    seen,
)
from pgbouncer import engine_pool_kwargs, worker_args
from psycopg_pool import ConnectionPool

import workflow

TESTS = Path(__file__).resolve().parent
WAIT = 30


# --- helpers -------------------------------------------------------------------------


@contextlib.contextmanager
def calling_as(caller: Caller) -> Iterator[None]:
    token = CALLER.set(caller)
    try:
        yield
    finally:
        CALLER.reset(token)


def registry(
    first_fn: Callable[[workflow.TaskRun[Order]], Seen] = seen,
    second_fn: Callable[[workflow.TaskRun[Order]], Seen] = seen,
    **first_options: Any,
) -> workflow.Registry:
    reg = workflow.Registry()
    reg.register(
        workflow.define(
            Audit,
            workflow.handle(first, first_fn, **first_options),
            workflow.handle(second, second_fn),
        )
    )
    return reg


def config(propagator: CallerPropagator | None, **kwargs: Any) -> workflow.Config:
    context = workflow.propagate(propagator) if propagator is not None else None
    return workflow.Config(context=context, **kwargs)


def start_tx(db_url: str, mgr: workflow.Manager, item: str) -> workflow.Run:
    """Start a run with start_tx in a transaction of our own, committed; nothing runs it."""
    with psycopg.connect(db_url) as conn, conn.transaction():
        return Audit.start_tx(conn, mgr, Order(item))


def outputs(db: psycopg.Connection[Any], run_id: str) -> list[Seen]:
    rows = db.execute(
        "SELECT output FROM workflow_tasks WHERE run_id = %s ORDER BY seq", (run_id,)
    ).fetchall()
    return [Seen(**row[0]) for row in rows if row[0] is not None]


def stored_context(db: psycopg.Connection[Any], run_id: str) -> tuple[Any, Any]:
    row = db.execute(
        "SELECT context, context_sealed FROM workflow_runs WHERE id = %s", (run_id,)
    ).fetchone()
    assert row is not None
    return row[0], row[1]


def attempts(db: psycopg.Connection[Any], run_id: str) -> list[int]:
    rows = db.execute(
        "SELECT attempts FROM workflow_tasks WHERE run_id = %s ORDER BY seq", (run_id,)
    ).fetchall()
    return [row[0] for row in rows]


def alerts(caplog: pytest.LogCaptureFixture, run_id: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.levelno == workflow.ALERT and getattr(r, "run_id", None) == run_id
    ]


def assert_balanced(events: list[tuple[str, Caller, str]], calls: int) -> None:
    """restore() was entered once per handler call, and each enter closed before the next."""
    assert [kind for kind, _, _ in events] == ["enter", "exit"] * calls


# --- the fast path -------------------------------------------------------------------


def test_fast_path_handler_sees_the_value_set_before_start(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    propagator = CallerPropagator()
    mgr = make_manager(registry(), config(propagator))
    alice = Caller(actor="alice", request_id="req-1")

    with calling_as(alice):
        run = Audit.start(mgr, Order("book"))
    assert run.wait(WAIT) is workflow.Status.SUCCEEDED

    got = outputs(db, run.id)
    assert [(s.actor, s.request_id) for s in got] == [("alice", "req-1")] * 2
    assert {s.pid for s in got} == {os.getpid()}
    assert stored_context(db, run.id) == ({"actor": "alice", "request_id": "req-1"}, None)
    assert_balanced(propagator.events, 2)
    # The handler ran on the manager's pool, not the caller's thread.
    assert all(thread != threading.current_thread().name for _, _, thread in propagator.events)


def test_context_is_captured_when_the_run_starts_not_when_it_runs(
    make_manager: Any, db_url: str, db: psycopg.Connection[Any]
) -> None:
    propagator = CallerPropagator()
    mgr = make_manager(registry(), config(propagator))

    with calling_as(Caller(actor="carol", request_id="req-7")):
        run = start_tx(db_url, mgr, "lamp")
    with calling_as(Caller(actor="mallory", request_id="req-666")):
        assert mgr.run(run.id).wait(WAIT) is workflow.Status.SUCCEEDED

    assert [(s.actor, s.request_id) for s in outputs(db, run.id)] == [("carol", "req-7")] * 2


def test_an_unset_context_is_captured_as_what_capture_returns(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    mgr = make_manager(registry(), config(CallerPropagator()))
    assert CALLER.get() is None

    run = Audit.start(mgr, Order("pen"))
    assert run.wait(WAIT) is workflow.Status.SUCCEEDED

    assert [(s.actor, s.request_id) for s in outputs(db, run.id)] == [
        (ANONYMOUS.actor, ANONYMOUS.request_id)
    ] * 2


# --- only around handlers ------------------------------------------------------------


class RecordingPool(ConnectionPool):  # type: ignore[type-arg]
    """A pool that records, for each connection borrowed, the thread and CALLER's value."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.borrows: list[tuple[str, Caller | None]] = []
        self._borrows_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def getconn(self, timeout: float | None = None) -> Any:
        with self._borrows_lock:
            self.borrows.append((threading.current_thread().name, CALLER.get()))
        return super().getconn(timeout)


def test_restore_is_entered_only_around_handler_calls(db_url: str, engine_url: str) -> None:
    """Every engine write (a pool borrow off the caller's thread) runs with CALLER unset.

    The first task fails once (an in-process retry), so each run makes three handler
    calls and three engine writes on its execution thread (fail, complete, complete).
    """
    propagator = CallerPropagator()
    calls: list[tuple[str, Caller | None]] = []
    failed: set[str] = set()
    lock = threading.Lock()

    def flaky(run: workflow.TaskRun[Order]) -> Seen:
        with lock:
            calls.append((run.run_id, CALLER.get()))
            if run.run_id not in failed:
                failed.add(run.run_id)
                raise RuntimeError("transient")
        return seen(run)

    def steady(run: workflow.TaskRun[Order]) -> Seen:
        with lock:
            calls.append((run.run_id, CALLER.get()))
        return seen(run)

    pool = RecordingPool(engine_url, min_size=1, max_size=8, open=True, **engine_pool_kwargs())
    try:
        mgr = workflow.Manager(
            pool,
            registry(flaky, steady, backoff_schedule=[0.05]),
            config(propagator),
        )
        try:
            dave = Caller(actor="dave", request_id="req-9")
            with calling_as(dave):
                fast = Audit.start(mgr, Order("fast"))
                kicked = start_tx(db_url, mgr, "kicked")
            assert fast.wait(WAIT) is workflow.Status.SUCCEEDED
            assert mgr.run(kicked.id).wait(WAIT) is workflow.Status.SUCCEEDED
        finally:
            mgr.close(timeout=10)
    finally:
        pool.close()

    assert len(calls) == 6
    assert all(value == dave for _, value in calls), calls
    assert_balanced(propagator.events, len(calls))
    assert {snapshot for _, snapshot, _ in propagator.events} == {dave}

    main = threading.current_thread().name
    engine_borrows = [(thread, value) for thread, value in pool.borrows if thread != main]
    # Two runs, each a failed attempt and two completions (the heartbeat may add more).
    assert len(engine_borrows) >= 6, pool.borrows
    assert all(value is None for _, value in engine_borrows), engine_borrows
    # And the handlers' own threads are the ones writing afterwards.
    handler_threads = {thread for _, _, thread in propagator.events}
    assert handler_threads <= {thread for thread, _ in engine_borrows}


# --- another process -----------------------------------------------------------------


def subprocess_env(db_url: str, keys: list[bytes] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(TESTS), env.get("PYTHONPATH", "")) if p
    )
    env["WORKFLOW_DATABASE_URL"] = db_url
    env.pop("CONTEXT_APPS_KEYS", None)
    if keys:
        env["CONTEXT_APPS_KEYS"] = ",".join(k.hex() for k in keys)
    return env


KEY = bytes(range(32))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["kick", "runnable"])
@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "sealed"])
def test_start_tx_run_resumed_by_another_process_sees_the_context(
    make_manager: Any, db_url: str, db: psycopg.Connection[Any], mode: str, sealed: bool
) -> None:
    cipher = workflow.AESGCMCipher([KEY]) if sealed else None
    mgr = make_manager(registry(), config(CallerPropagator(), cipher=cipher))

    with calling_as(Caller(actor="bob", request_id="req-42")):
        run = start_tx(db_url, mgr, "chair")
    if sealed:
        assert stored_context(db, run.id)[0] is None

    done = subprocess.run(
        [sys.executable, "-m", "context_apps.resume", db_url, run.id, mode],
        env=subprocess_env(db_url, [KEY] if sealed else None),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["status"] == "succeeded", done.stderr

    got = outputs(db, run.id)
    assert [(s.actor, s.request_id, s.item) for s in got] == [("bob", "req-42", "chair")] * 2
    assert {s.pid for s in got} == {report["pid"]}
    assert report["pid"] != os.getpid()


@pytest.mark.slow
def test_worker_cli_resumes_a_start_tx_run_with_its_context(
    make_manager: Any, db_url: str, engine_url: str, db: psycopg.Connection[Any]
) -> None:
    if importlib.util.find_spec("workflow.worker") is None:
        pytest.skip("workflow.worker (the worker CLI) is not written yet")
    mgr = make_manager(registry(), config(CallerPropagator(), cipher=workflow.AESGCMCipher([KEY])))
    with calling_as(Caller(actor="erin", request_id="req-5")):
        run = start_tx(db_url, mgr, "desk")

    worker = subprocess.Popen(
        [
            sys.executable, "-m", "workflow.worker",
            "--app", "context_apps:app",
            "--database-url", engine_url,
            *worker_args("--poll-interval", "0.2"),
        ],
        env=subprocess_env(db_url, [KEY]),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        status = run.status().status
        while not status.terminal and time.monotonic() < deadline and worker.poll() is None:
            time.sleep(0.1)
            status = run.status().status
    finally:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
        _, err = worker.communicate(timeout=30)
    assert status is workflow.Status.SUCCEEDED, err
    assert worker.returncode == 0, err

    got = outputs(db, run.id)
    assert [(s.actor, s.request_id) for s in got] == [("erin", "req-5")] * 2
    assert {s.pid for s in got} == {worker.pid}


class OptionalCallerPropagator(CallerPropagator):
    """A propagator whose snapshot may legitimately be None (nobody is signed in)."""

    snapshot_type = Optional[Caller]  # type: ignore[assignment]  # noqa: UP045

    def capture(self) -> Caller | None:  # type: ignore[override]
        return CALLER.get()

    @contextlib.contextmanager
    def restore(self, snapshot: Caller | None) -> Iterator[None]:  # type: ignore[override]
        with self._lock:
            self.events.append(("enter", snapshot or ANONYMOUS, threading.current_thread().name))
        token = CALLER.set(snapshot)
        try:
            yield
        finally:
            CALLER.reset(token)
            with self._lock:
                self.events.append(("exit", snapshot or ANONYMOUS, threading.current_thread().name))


@pytest.mark.parametrize("path", ["fast", "kick"])
def test_a_none_snapshot_is_still_restored_around_each_handler_call(
    make_manager: Any, db_url: str, db: psycopg.Connection[Any], path: str
) -> None:
    """A snapshot type may be Optional: capture() returning None is a snapshot like any other.

    It is stored (as JSON null) and restore(None) runs around each handler call: the
    engine must not mistake it for "no snapshot stored".
    """
    propagator = OptionalCallerPropagator()
    mgr = make_manager(registry(), config(propagator))
    assert CALLER.get() is None

    if path == "fast":
        run = Audit.start(mgr, Order("hat"))
        assert run.wait(WAIT) is workflow.Status.SUCCEEDED
    else:
        run = start_tx(db_url, mgr, "hat")
        assert mgr.run(run.id).wait(WAIT) is workflow.Status.SUCCEEDED

    assert db.execute(
        "SELECT context IS NOT NULL, context::text FROM workflow_runs WHERE id = %s", (run.id,)
    ).fetchone() == (True, "null")
    assert_balanced(propagator.events, 2)


# --- a snapshot that no longer decodes -----------------------------------------------


@pytest.mark.parametrize(
    "corrupt", ['{"unexpected": true}', '{"actor": "x"}', '"a string"', "[1, 2]"]
)
def test_a_snapshot_that_no_longer_decodes_parks_without_spending_an_attempt(
    make_manager: Any,
    db_url: str,
    db: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
    corrupt: str,
) -> None:
    propagator = CallerPropagator()
    called: list[str] = []

    def handler(run: workflow.TaskRun[Order]) -> Seen:
        called.append(run.run_id)
        return seen(run)

    mgr = make_manager(registry(handler, handler), config(propagator))
    with calling_as(Caller(actor="frank", request_id="req-3")):
        run = start_tx(db_url, mgr, "bed")
    db.execute("UPDATE workflow_runs SET context = %s::jsonb WHERE id = %s", (corrupt, run.id))

    assert mgr.run(run.id).wait(WAIT) is workflow.Status.PARKED

    status = run.status()
    assert status.failure is not None
    assert status.failure.task == first.name
    assert status.failure.attempts == 0
    assert status.finished_at is not None
    assert attempts(db, run.id) == [0, 0]
    assert called == []
    assert propagator.events == []
    records = alerts(caplog, run.id)
    assert len(records) == 1, [r.getMessage() for r in caplog.records]
    assert records[0].getMessage().startswith("workflow: ")
    assert records[0].levelname == "ALERT"


# --- no propagator -------------------------------------------------------------------


@pytest.mark.parametrize("corrupt", [False, True], ids=["snapshot", "undecodable-snapshot"])
def test_a_manager_without_a_propagator_runs_a_run_with_a_snapshot_without_it(
    make_manager: Any,
    db_url: str,
    db: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
    corrupt: bool,
) -> None:
    starter = make_manager(registry(), config(CallerPropagator()))
    with calling_as(Caller(actor="grace", request_id="req-8")):
        run = start_tx(db_url, starter, "rug")
    assert stored_context(db, run.id)[0] == {"actor": "grace", "request_id": "req-8"}
    if corrupt:
        db.execute(
            "UPDATE workflow_runs SET context = '{\"unexpected\": 1}'::jsonb WHERE id = %s",
            (run.id,),
        )

    plain = make_manager(registry(), config(None))
    assert plain.run(run.id).wait(WAIT) is workflow.Status.SUCCEEDED

    assert [(s.actor, s.request_id) for s in outputs(db, run.id)] == [(None, None)] * 2
    assert alerts(caplog, run.id) == []


def test_with_no_propagator_nothing_is_stored_and_handlers_see_no_context(
    make_manager: Any, db_url: str, db: psycopg.Connection[Any]
) -> None:
    mgr = make_manager(registry(), config(None))
    with calling_as(Caller(actor="heidi", request_id="req-2")):
        fast = Audit.start(mgr, Order("cup"))
        later = start_tx(db_url, mgr, "mug")

    assert fast.wait(WAIT) is workflow.Status.SUCCEEDED
    assert mgr.run(later.id).wait(WAIT) is workflow.Status.SUCCEEDED
    for run in (fast, later):
        assert stored_context(db, run.id) == (None, None)
        assert [(s.actor, s.request_id) for s in outputs(db, run.id)] == [(None, None)] * 2


# --- wiring --------------------------------------------------------------------------


def test_propagate_refuses_an_object_that_is_not_a_propagator() -> None:
    class NoRestore:
        snapshot_type = Caller

        def capture(self) -> Caller:
            return ANONYMOUS

    class NoSnapshotType:
        def capture(self) -> Caller:
            return ANONYMOUS

        def restore(self, snapshot: Caller) -> contextlib.AbstractContextManager[None]:
            return contextlib.nullcontext()

    with pytest.raises(TypeError):
        workflow.propagate(NoRestore())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        workflow.propagate(NoSnapshotType())  # type: ignore[arg-type]


def test_config_context_takes_a_propagation_not_a_bare_propagator() -> None:
    with pytest.raises(workflow.ConfigError):
        workflow.Config(context=CallerPropagator())  # type: ignore[arg-type]
    assert isinstance(workflow.propagate(CallerPropagator()), workflow.Propagation)
