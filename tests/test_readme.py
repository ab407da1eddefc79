"""The README's quick start runs as printed, against a real database."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def _quick_start() -> str:
    text = README.read_text("utf-8")
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the quick start has exactly one python block"
    return blocks[0]


def test_quick_start_runs_and_succeeds(db_url: str) -> None:
    env = {**os.environ, "WORKFLOW_DATABASE_URL": db_url}
    done = subprocess.run(
        [sys.executable, "-c", _quick_start()],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "sending 1250 against hold-acct-1 key " in done.stdout
    assert "SUCCEEDED" in done.stdout


def test_quick_start_is_short() -> None:
    lines = [line for line in _quick_start().splitlines() if line.strip()]
    assert len(lines) <= 35


def test_ci_runs_the_readmes_test_command_exactly() -> None:
    """`.ci/run` runs the README's test command verbatim, in a fresh venv, with no
    database configured: the path a newcomer takes is the path CI proves."""
    text = README.read_text("utf-8")
    section = text.split("## Tests", 1)[1].split("\n## ", 1)[0]
    (command,) = re.findall(r"```sh\n(.*?)\n```", section, flags=re.S)
    ci = (README.parent / ".ci" / "run").read_text("utf-8")
    match = re.search(r'^README_TEST_COMMAND="(.*)"$', ci, flags=re.M)
    assert match is not None, ".ci/run defines no README_TEST_COMMAND"
    assert match.group(1) == command.strip()
    assert 'bash -c "$README_TEST_COMMAND"' in ci
