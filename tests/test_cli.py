"""`python -m workflow migrate` and `python -m workflow check`, run as real processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from workflow.store import SCHEMA_VERSION, schema_version

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args: str, env_url: str | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m workflow ARGS` with `$WORKFLOW_DATABASE_URL` set to `env_url` (or unset)."""
    env = {k: v for k, v in os.environ.items() if k != "WORKFLOW_DATABASE_URL"}
    if env_url is not None:
        env["WORKFLOW_DATABASE_URL"] = env_url
    return subprocess.run(
        [sys.executable, "-m", "workflow", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def stderr_lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return proc.stderr.splitlines()


def test_check_on_an_empty_database_exits_1_and_prints_both_versions(empty_db_url: str) -> None:
    proc = run_cli("check", "--database-url", empty_db_url)
    assert proc.returncode == 1, proc
    assert "database schema version: 0" in proc.stdout
    assert f"code schema version: {SCHEMA_VERSION}" in proc.stdout
    [line] = stderr_lines(proc)
    assert "python -m workflow migrate" in line
    assert "Traceback" not in proc.stderr


def test_migrate_then_check_exits_0(empty_db_url: str) -> None:
    proc = run_cli("migrate", "--database-url", empty_db_url)
    assert proc.returncode == 0, proc
    assert "0001_runs_and_tasks" in proc.stdout
    assert f"version {SCHEMA_VERSION}" in proc.stdout
    assert proc.stderr == ""
    assert schema_version(empty_db_url) == SCHEMA_VERSION

    proc = run_cli("check", "--database-url", empty_db_url)
    assert proc.returncode == 0, proc
    assert f"database schema version: {SCHEMA_VERSION}" in proc.stdout
    assert f"code schema version: {SCHEMA_VERSION}" in proc.stdout
    assert proc.stderr == ""


def test_migrate_twice_says_up_to_date(empty_db_url: str) -> None:
    assert run_cli("migrate", "--database-url", empty_db_url).returncode == 0
    proc = run_cli("migrate", "--database-url", empty_db_url)
    assert proc.returncode == 0, proc
    assert "up to date" in proc.stdout
    assert "applied" not in proc.stdout


def test_url_defaults_to_the_environment(empty_db_url: str) -> None:
    proc = run_cli("migrate", env_url=empty_db_url)
    assert proc.returncode == 0, proc
    assert "0001_runs_and_tasks" in proc.stdout
    proc = run_cli("check", env_url=empty_db_url)
    assert proc.returncode == 0, proc


def test_option_wins_over_the_environment(empty_db_url: str) -> None:
    proc = run_cli(
        "check", "--database-url", empty_db_url, env_url="postgresql://postgres@127.0.0.1:1/x"
    )
    assert proc.returncode == 1, proc
    assert "database schema version: 0" in proc.stdout


def test_check_exits_0_when_the_database_is_ahead(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO workflow_yoyo_migration (migration_hash, migration_id, applied_at_utc)"
            " VALUES ('future', '9999_from_a_later_release', now())"
        )
    proc = run_cli("check", "--database-url", db_url)
    assert proc.returncode == 0, proc
    assert "database schema version: 9999" in proc.stdout
    assert f"code schema version: {SCHEMA_VERSION}" in proc.stdout
    assert proc.stderr == ""


@pytest.mark.parametrize("command", ["migrate", "check"])
def test_unreachable_database_is_one_line_and_exit_1(command: str) -> None:
    proc = run_cli(command, "--database-url", "postgresql://postgres@127.0.0.1:1/postgres")
    assert proc.returncode == 1, proc
    [line] = stderr_lines(proc)
    assert line.startswith("workflow: cannot connect to the database")
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("command", ["migrate", "check"])
def test_no_url_is_a_usage_error(command: str) -> None:
    proc = run_cli(command)
    assert proc.returncode == 2, proc
    [line] = stderr_lines(proc)
    assert "WORKFLOW_DATABASE_URL" in line
    assert "--database-url" in line
    assert proc.stdout == ""


@pytest.mark.parametrize(
    "args", [[], ["frobnicate"], ["check", "--bogus"], ["migrate", "--database-url"]]
)
def test_bad_command_lines_are_one_line_usage_errors(args: list[str]) -> None:
    proc = run_cli(*args)
    assert proc.returncode == 2, proc
    assert len(stderr_lines(proc)) == 1, proc.stderr


def test_help_exits_0() -> None:
    proc = run_cli("--help")
    assert proc.returncode == 0, proc
    assert "migrate" in proc.stdout
    assert "check" in proc.stdout


def test_main_returns_the_exit_code_in_process(
    empty_db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from workflow.__main__ import main

    monkeypatch.delenv("WORKFLOW_DATABASE_URL", raising=False)
    assert main(["check"]) == 2
    assert main(["check", "--database-url", empty_db_url]) == 1
    assert main(["migrate", "--database-url", empty_db_url]) == 0
    assert main(["check", "--database-url", empty_db_url]) == 0
    out = capsys.readouterr().out
    assert f"database schema version: {SCHEMA_VERSION}" in out
