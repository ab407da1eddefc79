"""SPEC 12's command line: `python -m workflow runs | prune | stats`.

Each command against a real database: its table for a person, its `--json`
lines for scripts, and its exit codes (0 done, 1 refused or not found, 2 a
usage error), every failure one line on stderr.
"""

from __future__ import annotations

import datetime
import json
import re
import subprocess
import sys
from typing import Any

import psycopg
import pytest
from helpers import ROOT, Inp, Out, registry

import workflow
from workflow import Status
from workflow.__main__ import main
from workflow.admin_cli import parse_when

A = workflow.Task("a", Out)
B = workflow.Task("b", Out)


def cli(capsys: pytest.CaptureFixture[str], db_url: str, *args: str) -> tuple[int, str, str]:
    code = main([*args, "--database-url", db_url])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def runs(make_manager: Any, db: psycopg.Connection[Any]) -> dict[str, str]:
    """A succeeded run, a parked one (coded failure) and a pending one."""

    def b(run: workflow.TaskRun[Inp]) -> Out:
        if run.input.n == 2:
            raise workflow.Permanent("the provider rejected it", code="rejected")
        return Out("b")

    reg, wf = registry(workflow.handle(A, lambda run: Out("a")), workflow.handle(B, b))
    mgr = make_manager(reg)
    done = wf.start(mgr, Inp(1), idempotency_key="order-1")
    parked = wf.start(mgr, Inp(2))
    assert done.wait(timeout=10) is Status.SUCCEEDED and parked.wait(timeout=10) is Status.PARKED
    with db.transaction():
        pending = wf.start_tx(db, mgr, Inp(3))
    return {"done": done.id, "parked": parked.id, "pending": pending.id}


def test_runs_list_is_a_table_and_json_lines(
    capsys: pytest.CaptureFixture[str], db_url: str, runs: dict[str, str]
) -> None:
    code, out, _ = cli(capsys, db_url, "runs", "list")
    assert code == 0
    header, *lines = out.strip().splitlines()
    assert header.split() == ["ID", "WORKFLOW", "STATUS", "TASK", "CREATED", "FAILURE"]
    assert len(lines) == 3 and all("s ago" in line for line in lines)
    parked_line = next(line for line in lines if runs["parked"] in line)
    assert "parked" in parked_line and "rejected: the provider rejected it" in parked_line
    code, out, _ = cli(capsys, db_url, "runs", "list", "--status", "parked", "--json")
    assert code == 0
    (item,) = [json.loads(line) for line in out.splitlines()]
    assert item["id"] == runs["parked"] and item["status"] == "parked" and item["task"] == "b"
    assert item["failure"]["code"] == "rejected"
    code, out, _ = cli(capsys, db_url, "runs", "list", "--since", "1h", "--status", "succeeded")
    assert code == 0 and runs["done"] in out and runs["parked"] not in out


def test_runs_show_prints_the_timeline_and_history(
    capsys: pytest.CaptureFixture[str], db_url: str, runs: dict[str, str]
) -> None:
    code, out, _ = cli(capsys, db_url, "runs", "show", runs["parked"])
    assert code == 0
    assert re.search(r"^status +parked on b$", out, flags=re.M)
    assert "rejected: the provider rejected it" in out
    assert "SEQ  TASK  STATE    ATTEMPTS" in out
    assert "parked" in out.split("WHEN", 1)[1]
    code, out, _ = cli(capsys, db_url, "runs", "show", runs["done"], "--json")
    detail = json.loads(out)
    assert [t["state"] for t in detail["tasks"]] == ["done", "done"]
    assert detail["input"] == {"n": 1} and detail["idempotency_key"] == "order-1"


@pytest.mark.parametrize("bad", ["6b1d0c6e-0000-4000-8000-000000000000", "not-an-id"])
def test_an_unknown_or_malformed_id_is_one_line_and_exit_1(
    capsys: pytest.CaptureFixture[str], db_url: str, bad: str, runs: dict[str, str]
) -> None:
    for args in (["runs", "show", bad], ["runs", "cancel", bad], ["runs", "resume", bad],
                 ["runs", "fork", bad]):
        code, _, err = cli(capsys, db_url, *args)
        assert code == 1, args
        assert len(err.strip().splitlines()) == 1 and "no run has id" in err


def test_cancel_and_resume_by_id(
    capsys: pytest.CaptureFixture[str], db_url: str, runs: dict[str, str],
    db: psycopg.Connection[Any],
) -> None:
    code, out, _ = cli(capsys, db_url, "runs", "cancel", runs["pending"], "--reason", "dup")
    assert code == 0 and "cancelled (was pending)" in out
    code, out, _ = cli(capsys, db_url, "runs", "cancel", runs["pending"], runs["done"])
    assert code == 1 and "already cancelled" in out and "already succeeded" in out
    code, out, _ = cli(capsys, db_url, "runs", "resume", runs["parked"], "--reason", "fixed")
    assert code == 0 and "resumed" in out
    code, _, err = cli(capsys, db_url, "runs", "resume", runs["done"])
    assert code == 1 and "is succeeded" in err
    reasons = db.execute(
        "SELECT kind, reason FROM workflow_events WHERE kind IN ('cancelled', 'resumed') "
        "ORDER BY at"
    ).fetchall()
    assert reasons == [("cancelled", "dup"), ("resumed", "fixed")]


def test_fork_prints_the_new_run(
    capsys: pytest.CaptureFixture[str], db_url: str, runs: dict[str, str]
) -> None:
    code, out, _ = cli(capsys, db_url, "runs", "fork", runs["done"], "--from-task", "b")
    assert code == 0
    new_id = out.strip()
    code, out, _ = cli(capsys, db_url, "runs", "show", new_id, "--json")
    assert json.loads(out)["forked_from"] == runs["done"]
    code, _, err = cli(capsys, db_url, "runs", "fork", runs["done"], "--from-task", "zz")
    assert code == 1 and "no task 'zz'" in err


def test_bulk_actions_need_a_filter_and_yes_and_show_a_dry_run(
    capsys: pytest.CaptureFixture[str], db_url: str, runs: dict[str, str],
    db: psycopg.Connection[Any],
) -> None:
    code, _, err = cli(capsys, db_url, "runs", "cancel", "--all-matching")
    assert code == 2 and "at least one filter" in err
    code, out, _ = cli(capsys, db_url, "runs", "cancel", "--all-matching", "--workflow", "W",
                       "--dry-run")
    assert code == 0 and out.startswith("3 runs match;")
    code, _, err = cli(capsys, db_url, "runs", "cancel", "--all-matching", "--workflow", "W")
    assert code == 1 and "add --yes" in err
    assert db.execute("SELECT count(*) FROM workflow_runs WHERE status = 'cancelled'").fetchone() \
        == (0,)
    code, out, _ = cli(capsys, db_url, "runs", "cancel", "--all-matching", "--status", "parked",
                       "--status", "pending", "--yes", "--reason", "cleanup")
    assert code == 0 and "cancelled 2 of 2 runs matching" in out
    code, out, _ = cli(capsys, db_url, "runs", "resume", "--all-matching", "--status",
                       "cancelled", "--yes")
    assert code == 0 and "resumed 2 of 2 runs matching" in out
    code, _, err = cli(capsys, db_url, "runs", "cancel", runs["done"], "--workflow", "W")
    assert code == 2


def test_prune_and_its_dry_run(
    capsys: pytest.CaptureFixture[str], db_url: str, runs: dict[str, str],
    db: psycopg.Connection[Any],
) -> None:
    db.execute("UPDATE workflow_runs SET finished_at = now() - interval '10 days' "
               "WHERE finished_at IS NOT NULL")
    code, out, _ = cli(capsys, db_url, "prune", "--dry-run")
    assert code == 0 and out.startswith("1 run would be pruned")
    code, out, _ = cli(capsys, db_url, "prune", "--older-than", "8d")
    assert code == 0 and out.startswith("pruned 1 run (succeeded, cancelled)")
    code, out, _ = cli(capsys, db_url, "prune", "--status", "parked", "--older-than", "8d")
    assert code == 0 and out.startswith("pruned 1 run (parked)")
    code, _, err = cli(capsys, db_url, "prune", "--status", "running")
    assert code == 2 and "only finished runs" in err


def test_stats_is_a_table_and_json(
    capsys: pytest.CaptureFixture[str], db_url: str, runs: dict[str, str]
) -> None:
    code, out, _ = cli(capsys, db_url, "stats")
    assert code == 0
    header, line = out.strip().splitlines()
    assert header.split()[:4] == ["WORKFLOW", "PENDING", "RUNNING", "CLAIMABLE"]
    assert line.split()[:4] == ["W", "1", "0", "1"]
    code, out, _ = cli(capsys, db_url, "stats", "--json")
    stats = json.loads(out)
    assert (stats["parked"], stats["succeeded_last_day"]) == (1, 1)


@pytest.mark.parametrize(
    ("text", "when"),
    [
        ("2026-12-07T10:00:00Z", datetime.datetime(2026, 12, 7, 10, tzinfo=datetime.timezone.utc)),
        ("2026-12-07T10:00z", datetime.datetime(2026, 12, 7, 10, tzinfo=datetime.timezone.utc)),
        (" 2026-12-07 10:00 ", datetime.datetime(2026, 12, 7, 10, tzinfo=datetime.timezone.utc)),
        (
            "2026-12-07T11:00:00+01:00",
            datetime.datetime(2026, 12, 7, 10, tzinfo=datetime.timezone.utc),
        ),
    ],
)
def test_since_and_until_read_iso_times_on_every_supported_python(
    text: str, when: datetime.datetime
) -> None:
    """`Z` too: Python 3.10's fromisoformat refuses it, 3.11's reads it."""
    parsed = parse_when(text)
    assert parsed == when and isinstance(parsed, datetime.datetime) and parsed.tzinfo is not None


def test_runs_list_until_an_iso_time_in_utc(
    capsys: pytest.CaptureFixture[str], db_url: str, runs: dict[str, str]
) -> None:
    later = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)
    code, out, err = cli(
        capsys, db_url, "runs", "list", "--until", later.strftime("%Y-%m-%dT%H:%M:%SZ"), "--json"
    )
    assert code == 0, err
    assert {json.loads(line)["id"] for line in out.splitlines()} == set(runs.values())
    code, out, err = cli(capsys, db_url, "runs", "list", "--until", "2000-01-01T00:00:00Z")
    assert code == 0 and not any(run_id in out for run_id in runs.values())


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["runs", "list", "--status", "lost"], "unknown status 'lost'"),
        (["runs", "list", "--since", "yesterday"], "neither a duration"),
        (["runs", "list", "--until", "todayZ"], "'todayZ' is neither a duration"),
        (["prune", "--older-than", "7 days"], "not a duration"),
        (["prune", "--older-than", "99999999999d"], "longer than a duration may be"),
        (["runs", "list", "--limit", "0"], "--limit"),
        (["runs", "list", "--workflow"], "expected one argument"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], db_url: str, args: list[str], words: str
) -> None:
    code, _, err = cli(capsys, db_url, *args)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and words in err
    assert main(["runs"]) == 2
    assert "required" in capsys.readouterr().err


def test_the_commands_run_as_a_module(db_url: str, runs: dict[str, str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "workflow", "runs", "list", "--json", "--database-url", db_url],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 3
    created = json.loads(done.stdout.splitlines()[0])["created_at"]
    assert datetime.datetime.fromisoformat(created).tzinfo is not None
