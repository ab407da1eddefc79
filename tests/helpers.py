"""Helpers shared by the test modules: logs, polling with a deadline, subprocesses, workflows.

Imported as `helpers` (pytest puts `tests/` on `sys.path`, as for `pgbouncer`).
Fixtures live in `conftest.py`; this module holds plain functions and classes.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import psycopg
import pytest

import workflow
from workflow.runnable import Runnable

# --- logs ----------------------------------------------------------------------------


class Records(logging.Handler):
    """Collects every record of a logger (thread-safe).

    `wait_for(text)` blocks until a record contains `text`; `messages()` and
    `alerts()` are snapshots of what was collected so far.
    """

    def __init__(self, level: int = logging.NOTSET) -> None:
        super().__init__(level=level)
        self.records: list[logging.LogRecord] = []
        self._cond = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        with self._cond:
            self.records.append(record)
            self._cond.notify_all()

    def wait_for(self, text: str, timeout: float = 20.0) -> logging.LogRecord:
        """The first record whose message contains `text`; AssertionError after `timeout`."""
        with self._cond:
            found: list[logging.LogRecord] = []

            def seen() -> bool:
                found[:] = [r for r in self.records if text in r.getMessage()]
                return bool(found)

            assert self._cond.wait_for(seen, timeout), f"no log record with {text!r}"
            return found[0]

    def messages(self) -> list[str]:
        """Every message collected so far, in order."""
        with self._cond:
            return [r.getMessage() for r in self.records]

    def alerts(self) -> list[logging.LogRecord]:
        """The records at `workflow.ALERT` or above."""
        with self._cond:
            return [r for r in self.records if r.levelno >= workflow.ALERT]


# --- waiting against a deadline ------------------------------------------------------


def poll(
    db: psycopg.Connection[Any],
    sql: str,
    params: Any = None,
    *,
    until: Callable[[Any], bool] | None = None,
    timeout: float = 20.0,
    what: str | None = None,
    interval: float = 0.02,
) -> Any:
    """Re-run `sql` until `until(row)` holds; the row. AssertionError after `timeout`.

    Without `until`, until a row comes back with a truthy first column. The error
    names `what` when given, and always shows the last row read.
    """
    if until is None:
        until = first_column_true
    deadline = time.monotonic() + timeout
    while True:
        row = db.execute(sql, params).fetchone()
        if until(row):
            return row
        if time.monotonic() > deadline:
            if what is None:
                raise AssertionError(f"condition not reached; last row: {row!r}")
            raise AssertionError(
                f"timed out after {timeout}s waiting for {what}; last row: {row!r}"
            )
        time.sleep(interval)


def other_backends(db: psycopg.Connection[Any]) -> int:
    """Sessions connected to the test database, other than `db` itself."""
    row = db.execute(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() AND pid <> pg_backend_pid() "
        "AND backend_type = 'client backend'"
    ).fetchone()
    assert row is not None
    return int(row[0])


def first_column_true(row: Any) -> bool:
    """For `poll(until=...)`: a row was read and its first column is truthy."""
    return row is not None and bool(row[0])


def wait_until(
    predicate: Callable[[], bool], what: str, timeout: float = 15.0, interval: float = 0.02
) -> None:
    """Call `predicate` until it holds; `pytest.fail` naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(interval)


# --- subprocesses --------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


class OutputProcess:
    """A subprocess whose output is collected line by line on a thread.

    `stdout` and `stderr` are passed to `subprocess.Popen`; the one that is
    `subprocess.PIPE` is the stream collected (stdout when both are, so pass
    `stderr=subprocess.STDOUT` to merge them).
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: dict[str, str],
        cwd: Path = ROOT,
        stdout: int = subprocess.PIPE,
        stderr: int = subprocess.STDOUT,
    ) -> None:
        self.argv = list(argv)
        self.proc = subprocess.Popen(
            self.argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            text=True,
        )
        stream = self.proc.stdout if self.proc.stdout is not None else self.proc.stderr
        assert stream is not None, "neither stdout nor stderr is a pipe"
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._eof = False
        self._reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self, stream: Any) -> None:
        for line in stream:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._eof = True
            self._changed.notify_all()

    @property
    def output(self) -> str:
        """The lines collected so far."""
        with self._changed:
            return "\n".join(self.lines)

    def wait_for_lines(self, text: str, count: int = 1, timeout: float = 30.0) -> list[str]:
        """The first `count` output lines containing `text`; AssertionError on timeout or exit."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = [line for line in self.lines if text in line]
                if len(found) >= count:
                    return found[:count]
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    raise AssertionError(self._missing(text, count, len(found)))
                self._changed.wait(left)

    def _missing(self, text: str, count: int, found: int) -> str:
        """The message of `wait_for_lines` when `found` of `count` lines were printed."""
        return (
            f"{self.argv[:4]} printed {found} of {count} lines with {text!r} "
            f"(exit code {self.proc.poll()}); output:\n{self.output}"
        )

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 60.0) -> int:
        """The exit code, once the output has been read to its end."""
        code = self.proc.wait(timeout)
        self._reader.join(10)
        return code

    def kill(self) -> None:
        """SIGKILL this process (not its children), and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


# --- reading the store ---------------------------------------------------------------


def snapshot(db: psycopg.Connection[Any], run_id: str) -> tuple[Any, list[Any]]:
    """Every column of the run and of its tasks."""
    run = db.execute("SELECT * FROM workflow_runs WHERE id = %s", (run_id,)).fetchone()
    tasks = db.execute(
        "SELECT * FROM workflow_tasks WHERE run_id = %s ORDER BY seq", (run_id,)
    ).fetchall()
    return run, tasks


# --- transaction counting ------------------------------------------------------------


def dbname_of(url: str) -> str:
    """The database a libpq URL names (socket URLs such as `...@/db?host=/tmp` included)."""
    from psycopg.conninfo import conninfo_to_dict

    name = conninfo_to_dict(url).get("dbname")
    assert isinstance(name, str) and name, f"no database in {url!r}"
    return name


FLUSH_STATS = "SELECT pg_stat_force_next_flush(), (SELECT count(*) FROM workflow_runs)"


def committed_transactions(admin: psycopg.Connection[Any], dbname: str) -> int:
    """`pg_stat_database.xact_commit` of `dbname`, read afresh (no cached snapshot)."""
    admin.execute("SELECT pg_stat_clear_snapshot()")
    row = admin.execute(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = %s", (dbname,)
    ).fetchone()
    assert row is not None
    return int(row[0])


def insert_claimed_run(
    db: psycopg.Connection[Any],
    *,
    tasks: int = 3,
    workflow_name: str = "W",
    key: bytes | None = None,
    slot: int | None = 0,
) -> tuple[uuid.UUID, uuid.UUID]:
    """(run id, claim id) of a run inserted claimed with its task rows, as the fast path
    inserts one; its heartbeat a minute old (so a transaction's now() moves it). With
    `key`, a keyed run holding `slot` of it."""
    run_id, claim_id = uuid.uuid4(), uuid.uuid4()
    db.execute(
        "INSERT INTO workflow_runs (id, workflow, status, input, task_count, current_seq, "
        "claim_id, heartbeat_at, concurrency_key, key_slot) VALUES (%s, %s, 'running', "
        "'{\"n\": 1}'::jsonb, %s, 1, %s, now() - interval '1 minute', %s, %s)",
        (run_id, workflow_name, tasks, claim_id, key, slot if key is not None else None),
    )
    db.execute(
        "INSERT INTO workflow_tasks (run_id, seq, name) "
        "SELECT %s, s, 't' || s FROM generate_series(1, %s) AS s",
        (run_id, tasks),
    )
    return run_id, claim_id


# --- a tiny workflow -----------------------------------------------------------------


@attrs.frozen
class Inp:
    """The input of the tiny workflows built by `registry`."""

    n: int


@attrs.frozen
class Out:
    """A task output."""

    value: str


def registry(*steps: workflow.Step[Inp], name: str = "W") -> tuple[workflow.Registry, Any]:
    """(registry, workflow): one workflow `name`, input `Inp`, made of `steps`."""
    wf = workflow.Workflow(name, Inp)
    reg = workflow.Registry()
    reg.register(workflow.define(wf, *steps))
    return reg, wf


def start_each_in_its_own_transaction(
    db: psycopg.Connection[Any], wf: Any, mgr: workflow.Manager, count: int
) -> list[workflow.Run]:
    """`count` runs of `wf` (inputs `Inp(0)`...) started with `start_tx`, one transaction
    each (so their `created_at` differ): left for a poller."""
    runs = []
    for n in range(count):
        with db.transaction():
            runs.append(wf.start_tx(db, mgr, Inp(n)))
    return runs


def all_succeed(db: psycopg.Connection[Any], runs: list[workflow.Run]) -> None:
    """Poll the database until every run succeeded (`run.wait()` would claim runs itself)."""
    poll(
        db,
        "SELECT count(*) = %s FROM workflow_runs WHERE id = ANY(%s) AND status = 'succeeded'",
        (len(runs), [run.id for run in runs]),
        timeout=30,
        what="every run to succeed",
    )


def drain(db: psycopg.Connection[Any], mgr: workflow.Manager, runs: list[workflow.Run],
          **config: Any) -> Runnable:
    """Run a worker (`RunnerConfig(**config)`, no LISTEN) until every one of `runs` has
    succeeded, then stop it (it must drain); the runnable."""
    runnable = mgr.new_runnable(workflow.RunnerConfig(listen=False, **config))
    runnable.start()
    try:
        all_succeed(db, runs)
    finally:
        assert runnable.stop(timeout=10)
    return runnable


def threads_fail_to_start(
    monkeypatch: pytest.MonkeyPatch, refuse: Callable[[threading.Thread], bool]
) -> list[threading.Thread]:
    """From now until `monkeypatch.undo()`, a thread for which `refuse` is true fails to
    start as in a process out of threads; the list of those that did start."""
    started: list[threading.Thread] = []
    real_start = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        if refuse(thread):
            raise RuntimeError("can't start new thread")
        real_start(thread)
        started.append(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    return started


class FirstAttempt:
    """A handler recording each attempt's TaskRun: attempt 1 calls `first`, later ones
    return `Out("attempt N")`; `started` is set when attempt 1 begins."""

    def __init__(self, first: Callable[[workflow.TaskRun[Inp]], Out]) -> None:
        self.first = first
        self.runs: list[workflow.TaskRun[Inp]] = []
        self.started = threading.Event()

    def __call__(self, run: workflow.TaskRun[Inp]) -> Out:
        self.runs.append(run)
        if run.attempt == 1:
            self.started.set()
            return self.first(run)
        return Out(f"attempt {run.attempt}")
