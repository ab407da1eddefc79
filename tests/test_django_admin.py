"""The runs in Django's admin (SPEC 16): a read-only list over the engine's tables with
filters by status and workflow, and cancel and resume actions that go through
`workflow.Admin` (their history names the Django user).

The example project (examples/django_transfer) installs the admin; a probe script
(tests/adoption/django_admin_probe.py) drives it with Django's test client in a
subprocess of its own, on a fresh database that `manage.py migrate` and
`workflow_migrate` built.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from typing import Any

import psycopg
import pytest
from adoption import require
from helpers import ROOT
from test_django import PROJECT, _env, manage

require("django")

pytestmark = pytest.mark.slow

PROBE = ROOT / "tests" / "adoption" / "django_admin_probe.py"


def _insert(db: psycopg.Connection[Any], workflow: str, status: str) -> str:
    run_id = str(uuid.uuid4())
    db.execute(
        "INSERT INTO workflow_runs (id, workflow, status, input, task_count, current_seq, "
        "finished_at) VALUES (%s, %s, %s, '{}', 1, %s, now())",
        (run_id, workflow, status, 1 if status == "parked" else 2),
    )
    db.execute(
        "INSERT INTO workflow_tasks (run_id, seq, name, attempts, error, error_code, failed_at)"
        " VALUES (%s, 1, 'probe.step', %s, %s, %s, now())",
        (run_id, 3 if status == "parked" else 0, "declined" if status == "parked" else None,
         "card.declined" if status == "parked" else None),
    )
    return run_id


def test_the_admin_lists_filters_and_steers_runs(empty_db_url: str) -> None:
    manage(empty_db_url, "migrate", "--no-input")
    manage(empty_db_url, "workflow_migrate")
    with psycopg.connect(empty_db_url, autocommit=True) as db:
        parked = [_insert(db, "Django.Probe", "parked") for _ in range(2)]
        succeeded = _insert(db, "Django.Probe.Other", "succeeded")
        done = subprocess.run(
            [sys.executable, str(PROBE), *parked, succeeded],
            cwd=PROJECT, env=_env(empty_db_url), capture_output=True, text=True, timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        [line] = [ln for ln in done.stdout.splitlines() if ln.startswith("PROBE ")]
        seen = json.loads(line[len("PROBE "):])
        statuses = dict(db.execute(
            "SELECT id::text, status FROM workflow_runs WHERE id = ANY(%s::uuid[])",
            ([*parked, succeeded],),
        ).fetchall())
        history = db.execute(
            "SELECT run_id::text, kind, actor FROM workflow_events WHERE actor LIKE 'django%%' "
            "ORDER BY at"
        ).fetchall()
    assert seen["anonymous"] == 302  # to the admin's login page
    assert seen["list_status"] == 200
    assert seen["listed"] == sorted([*parked, succeeded])
    assert seen["parked_only"] == sorted(parked)
    assert seen["by_workflow"] == [succeeded]
    assert seen["detail_status"] == 200 and seen["detail_can_save"] is False
    assert seen["add_status"] == 403
    assert seen["resume_message"] == ["Resumed 2 of 2 run(s)."]
    # The succeeded run is left as it is: only the resumed parked one is cancelled.
    assert seen["cancel_message"] == ["Cancelled 1 of 2 run(s)."]
    assert statuses == {parked[0]: "running", parked[1]: "cancelled", succeeded: "succeeded"}
    assert sorted((run, kind) for run, kind, _ in history) == sorted([
        (parked[0], "resumed"), (parked[1], "resumed"), (parked[1], "cancelled"),
    ])
    assert {actor for _, _, actor in history} == {"django:admin"}
