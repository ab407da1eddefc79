"""Connection faults (SPEC 9): killed backends and a PostgreSQL restart lose nothing.

On a private PostgreSQL (`tests/privatepg.py`; the shared server is never
restarted), a manager and its runnable execute a stream of 3-task runs, started
with `start()` (the fast path) and with `start_tx` (left for the runnable's
poller), while the test
- terminates the manager's connections (`pg_terminate_backend`, idle or busy, its
  pool's and its listener's) again and again, or
- restarts the server (`pg_ctl restart -m fast`).

Then every run succeeds, every task ran to the end, the runnable's threads are
alive and a run started afterwards is executed by the poller, and the logs say
what happened (WARNING/ERROR records starting with "workflow: " that mention the
lost connection); no execution failed unexpectedly.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from privatepg import PrivatePostgres, available
from psycopg_pool import ConnectionPool

import workflow
from workflow.store import migrate

pytestmark = pytest.mark.slow

APP_NAME = "faults-manager"
LOGGER = "faults.engine"

Faults = workflow.Workflow("Faults.Three", int)
TASKS = [workflow.Task(f"faults.t{i}", int) for i in (1, 2, 3)]
CONFIG = workflow.Config(
    sweep_max_age=6,
    default_task_timeout=3,
    max_in_process_backoff=1,
    backoff_base=0.1,
    backoff_max=1,
)
RUNNER = workflow.RunnerConfig(poll_interval=0.5, batch_size=10, concurrency=8, sweep_interval=1)

_executions: dict[tuple[int, int], int] = {}
_lock = threading.Lock()


def _handler(seq: int) -> Any:
    def run_task(run: workflow.TaskRun[int]) -> int:
        if seq > 1:
            assert run.output(TASKS[seq - 2]) == run.input * 10 + seq - 1
        with _lock:
            _executions[(run.input, seq)] = _executions.get((run.input, seq), 0) + 1
        run.cancelled.wait(0.01)
        return run.input * 10 + seq

    return run_task


def registry() -> workflow.Registry:
    reg = workflow.Registry()
    reg.register(
        workflow.define(Faults, *(workflow.handle(t, _handler(i + 1)) for i, t in enumerate(TASKS)))
    )
    return reg


@pytest.fixture(scope="module")
def server() -> Iterator[PrivatePostgres]:
    reason = available()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    with PrivatePostgres() as pg:
        yield pg


@pytest.fixture
def url(server: PrivatePostgres) -> Iterator[str]:
    name = f"faults_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(server.url(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    migrate(server.url(name))
    yield server.url(name)
    server.wait_ready()
    with psycopg.connect(server.url(), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class Engine:
    """A manager over its own pool (named APP_NAME in pg_stat_activity) and a runnable."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.pool: ConnectionPool[Any] = ConnectionPool(
            url,
            min_size=2,
            max_size=8,
            kwargs={"application_name": APP_NAME},
            open=True,
            name="faults",
        )
        self.mgr = workflow.Manager(self.pool, registry(), CONFIG, logger=logging.getLogger(LOGGER))
        self.runnable = self.mgr.new_runnable(RUNNER)
        self.runnable.start()
        self.admin = psycopg.connect(url, autocommit=True)
        self.started: list[str] = []
        self.n = 0

    def start_some(self, seconds: float, fault: Any = None) -> None:
        """Start runs for `seconds` (fast path and start_tx alternately), calling `fault()`."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.n += 1
            if self.n % 2:
                self.started.append(Faults.start(self.mgr, self.n).id)
            else:
                self._start_tx(self.n)
            if fault is not None:
                fault()

    def _start_tx(self, n: int) -> None:
        # The caller's own connection may be cut too: that start did not happen
        # (its transaction rolled back); start it again, as a caller would.
        deadline = time.monotonic() + 30
        while True:
            try:
                with psycopg.connect(self.url) as conn, conn.transaction():
                    run = Faults.start_tx(conn, self.mgr, n)
                # Only a committed transaction started a run: the commit itself may
                # be what the restart cut.
                self.started.append(run.id)
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def wait_all(self, timeout: float = 40) -> None:
        deadline = time.monotonic() + timeout
        conn = self._admin()
        while True:
            row = conn.execute(
                "SELECT count(*) FILTER (WHERE status = 'succeeded'), count(*) "
                "FROM workflow_runs WHERE id = ANY(%s)",
                ([uuid.UUID(i) for i in self.started],),
            ).fetchone()
            assert row is not None
            if row[0] == len(self.started):
                return
            assert time.monotonic() < deadline, (
                f"{len(self.started) - row[0]} of {len(self.started)} runs unfinished "
                f"(found {row[1]})"
            )
            time.sleep(0.1)

    def _admin(self) -> psycopg.Connection[Any]:
        if self.admin.closed or self.admin.broken:
            self.admin = psycopg.connect(self.url, autocommit=True)
        try:
            self.admin.execute("SELECT 1")
        except psycopg.OperationalError:
            self.admin = psycopg.connect(self.url, autocommit=True)
        return self.admin

    def kill_backends(self) -> int:
        """Terminate every backend of the manager (pool and listener); how many."""
        row = (
            self._admin()
            .execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = %s AND datname = current_database()",
                (APP_NAME,),
            )
            .fetchone()
        )
        return int(row[0]) if row else 0

    def threads_alive(self) -> set[str]:
        return {t.name for t in threading.enumerate() if t.name.startswith("workflow-")}

    def close(self) -> None:
        self.runnable.stop(timeout=15)
        self.mgr.close(timeout=15)
        self.pool.close()
        self.admin.close()


@pytest.fixture
def engine(url: str) -> Iterator[Engine]:
    _executions.clear()
    e = Engine(url)
    yield e
    e.close()


def _engine_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER]


def _assert_survived(engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    engine.wait_all()
    # Each task of each run ran to the end at least once (at-least-once), in order.
    runs = {
        int(r)
        for (r,) in engine._admin()
        .execute(
            "SELECT input FROM workflow_runs WHERE id = ANY(%s)",
            ([uuid.UUID(i) for i in engine.started],),
        )
        .fetchall()
    }
    for n in runs:
        for seq in (1, 2, 3):
            assert _executions.get((n, seq), 0) >= 1, (n, seq)
    outputs = (
        engine._admin()
        .execute(
            "SELECT count(*) FROM workflow_tasks t JOIN workflow_runs r ON r.id = t.run_id "
            "WHERE t.output = to_jsonb((r.input::int) * 10 + t.seq)"
        )
        .fetchone()
    )
    assert outputs == (3 * len(runs),)
    # The runnable is alive: its threads run, and a run started now (left for the
    # poller: start_tx launches nothing) is executed without anyone waiting on it.
    assert {
        "workflow-poller",
        "workflow-sweeper",
        "workflow-listener",
        "workflow-heartbeat",
    } <= engine.threads_alive()
    before = len(engine.started)
    engine._start_tx(10_000)
    assert len(engine.started) == before + 1
    engine.wait_all(timeout=30)
    # What happened is in the logs, in the engine's voice.
    records = _engine_records(caplog)
    for r in records:
        if r.levelno >= logging.WARNING:
            assert r.getMessage().startswith("workflow: "), r.getMessage()
    lost = [
        r for r in records if r.levelno >= logging.WARNING and "connection lost" in r.getMessage()
    ]
    assert lost, "no WARNING/ERROR record says a connection was lost"
    crashed = [r.getMessage() for r in records if "failed unexpectedly" in r.getMessage()]
    assert crashed == []


def test_killed_backends_lose_no_run_and_crash_nothing(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    killed = 0
    last = [0.0]

    def kill_now_and_then() -> None:
        nonlocal killed
        if time.monotonic() - last[0] > 0.3:
            killed += engine.kill_backends()
            last[0] = time.monotonic()

    engine.start_some(6, kill_now_and_then)
    assert killed >= 10, f"only {killed} backends were terminated"
    _assert_survived(engine, caplog)
    # The listener saw its connection go, and came back.
    messages = [r.getMessage() for r in _engine_records(caplog)]
    assert any(m.startswith("workflow: listener: LISTEN connection lost") for m in messages)
    assert any(m.startswith("workflow: listener: LISTEN re-established") for m in messages)


def test_a_postgres_restart_loses_no_run_and_crashes_nothing(
    engine: Engine, server: PrivatePostgres, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    engine.start_some(2)
    restarted = threading.Thread(target=server.restart, name="restart")
    restarted.start()
    engine.start_some(3)  # start() rides out the restart; start_tx is retried by its caller
    restarted.join(60)
    assert not restarted.is_alive()
    engine.start_some(1)
    _assert_survived(engine, caplog)
