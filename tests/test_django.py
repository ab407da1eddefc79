"""Django with the psycopg 3 backend, for real: the `workflow.contrib.django` app.

The example project (examples/django_transfer) runs as subprocesses with
`manage.py` on a fresh database of the test's: `migrate` and `workflow_migrate`
build the schema, `runserver` serves the view that creates a `Transfer` row and
starts its run with `start_on_commit` in one `atomic()` block, and
`workflow_worker` finishes a run nobody executed. No worker runs while the view
is exercised: a committed run completes on the fast path of the server process.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from adoption import require
from adoption.servers import (
    ServerProcess,
    child_env,
    free_port,
    http,
    wait_until_serving,
)
from helpers import ROOT

from workflow.store import SCHEMA_VERSION, schema_version

require("django")

pytestmark = pytest.mark.slow

PROJECT = ROOT / "examples" / "django_transfer"
DAILY_LIMIT_CENTS = 1_000_000  # transfers.views.DAILY_LIMIT_CENTS


def _env(db_url: str) -> dict[str, str]:
    return child_env(DATABASE_URL=db_url, DJANGO_DEBUG="0")


def manage(db_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`python manage.py ARGS` in the example project, on `db_url`; checked for exit code 0."""
    done = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=PROJECT,
        env=_env(db_url),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"manage.py {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture
def project_db(empty_db_url: str) -> str:
    """A fresh database with the example's tables and pgworkflow's, made by manage.py."""
    manage(empty_db_url, "migrate", "--no-input")
    manage(empty_db_url, "workflow_migrate")
    return empty_db_url


@pytest.fixture
def runserver(project_db: str) -> Iterator[tuple[ServerProcess, str]]:
    """`manage.py runserver` (no autoreloader: one process) on a free port; (process, URL)."""
    port = free_port()
    server = ServerProcess(
        [sys.executable, "manage.py", "runserver", "--noreload", f"127.0.0.1:{port}"],
        env=_env(project_db),
        cwd=PROJECT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(f"{base}/transfers/0", server)
        yield server, base
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def _wait_for_status(db: psycopg.Connection[Any], run_id: str, status: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        row = db.execute("SELECT status FROM workflow_runs WHERE id = %s", (run_id,)).fetchone()
        if row == (status,):
            return
        assert time.monotonic() < deadline, f"run {run_id} is {row}, not {status}"
        time.sleep(0.05)


def test_workflow_migrate_applies_the_chain_once(empty_db_url: str) -> None:
    first = manage(empty_db_url, "workflow_migrate").stdout
    assert "workflow: applied 0001_runs_and_tasks" in first
    assert f"now at version {SCHEMA_VERSION}" in first
    again = manage(empty_db_url, "workflow_migrate").stdout
    assert f"workflow: the database schema is up to date (version {SCHEMA_VERSION})" in again
    with psycopg.connect(empty_db_url) as conn:
        assert schema_version(conn) == SCHEMA_VERSION


def test_the_row_and_the_run_commit_or_roll_back_together(
    runserver: tuple[ServerProcess, str], project_db: str
) -> None:
    server, base = runserver
    with psycopg.connect(project_db, autocommit=True) as db:
        transfer = {"account": "acct-1", "amount_cents": 1250}
        status, body = http("POST", f"{base}/transfers", transfer)
        assert status == 201, (body, server.output)
        run_id = body["run_id"]
        _wait_for_status(db, run_id, "succeeded")
        status, shown = http("GET", f"{base}/transfers/{body['id']}")
        assert (status, shown["status"], shown["run_id"]) == (200, "succeeded", run_id)
        assert db.execute(
            "SELECT account, amount_cents, run_id FROM transfers_transfer"
        ).fetchall() == [("acct-1", 1250, run_id)]
        # Executed on commit by the server process itself: no worker is running.
        (executed_by,) = db.execute(
            "SELECT (output->>'pid')::int FROM workflow_tasks WHERE run_id = %s AND seq = 1",
            (run_id,),
        ).fetchone() or (None,)
        assert executed_by == server.pid
        # The example mounts the dashboard at /ops/workflow (pgworkflow[dashboard]).
        with urllib.request.urlopen(f"{base}/ops/workflow/runs/{run_id}", timeout=10) as page:
            assert page.status == 200 and "succeeded" in page.read().decode()

        over = {"account": "acct-2", "amount_cents": DAILY_LIMIT_CENTS + 1}
        status, body = http("POST", f"{base}/transfers", over)
        assert status == 422, (body, server.output)
        rolled_back = body["rolled_back_run_id"]
        assert db.execute(
            "SELECT count(*) FROM transfers_transfer WHERE account = 'acct-2'"
        ).fetchone() == (0,)
        assert db.execute(
            "SELECT count(*) FROM workflow_runs WHERE id = %s", (rolled_back,)
        ).fetchone() == (0,)
        assert db.execute("SELECT count(*) FROM workflow_runs").fetchone() == (1,)
    # WORKFLOW["ON_MANAGER"] instrumented the server's manager: its /metrics counts the
    # run it finished, and both starts (the rolled-back one at its insert).
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        page = response.read().decode()
    assert 'pgworkflow_runs_finished_total{status="succeeded",workflow="Transfer.Send"} 1.0' in (
        page
    ), page
    assert 'pgworkflow_runs_started_total{workflow="Transfer.Send"} 2.0' in page, page
    assert "Traceback" not in server.output, server.output


START_WITHOUT_KICK = """
from django.db import connection, transaction
from transfers.workflows import SendTransfer, TransferInput
from workflow.contrib.django import get_manager

with transaction.atomic():
    connection.ensure_connection()
    transfer = TransferInput(7, "acct-7", 700)
    run = SendTransfer.start_tx(connection.connection, get_manager(), transfer)
print("RUN", run.id)
"""


def test_workflow_worker_finishes_a_run_left_in_the_tables(project_db: str) -> None:
    started = manage(project_db, "shell", "-c", START_WITHOUT_KICK).stdout
    match = re.search(r"^RUN (\S+)$", started, re.M)
    assert match, started
    run_id = match[1]
    with psycopg.connect(project_db, autocommit=True) as db:
        assert db.execute(
            "SELECT status FROM workflow_runs WHERE id = %s", (run_id,)
        ).fetchone() == ("pending",)
        worker = ServerProcess(
            [sys.executable, "manage.py", "workflow_worker", "--poll-interval", "1"],
            env=_env(project_db),
            cwd=PROJECT,
        )
        try:
            worker.wait_for_lines("workflow: worker started")
            _wait_for_status(db, run_id, "succeeded")
            worker.proc.send_signal(signal.SIGTERM)
            assert worker.wait(30) == 0, worker.output
        finally:
            worker.kill()
    assert "workflow: worker stopped" in worker.output
    assert "sent transfer 7 against hold-7" in worker.output


def test_the_worker_app_keeps_the_registrys_runner_when_the_setting_names_a_config() -> None:
    """`WORKFLOW["CONFIG"]` with a REGISTRY that is a `workflow.App` with a `runner`:
    `manage.py workflow_worker`'s default app keeps that runner (concurrency 5, its
    retention) beside the setting's Config."""
    code = (
        "import django, workflow\n"
        "from django.conf import settings\n"
        "settings.configure(WORKFLOW={'REGISTRY': 'tests.worker_apps.objects:KEEPING',\n"
        "                             'CONFIG': workflow.Config(sweep_max_age=120)})\n"
        "django.setup()\n"
        "from workflow.contrib.django import conf\n"
        "app = conf.app()\n"
        "print(app.runner.concurrency, app.runner.retention.succeeded, app.config.sweep_max_age)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["5", "None", "120"]
