"""The public API is typed: `mypy --strict` accepts the SPEC's usage and rejects misuse.

`tests/typing/typed_example.py` uses the API as SPEC sections 2 and 5 do and must
check clean. `tests/typing/mistyped_example.py` marks each deliberate error with a
trailing `# E: <why>` comment; mypy must report an error on every marked line and
on no other line.

Imports of `workflow` are followed silently, as for an installed package: these
tests judge what a user of the API sees, while the library's own `mypy --strict`
run (CI) judges the library's internals.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = Path(__file__).resolve().parent / "typing"
TYPED = EXAMPLES / "typed_example.py"
MISTYPED = EXAMPLES / "mistyped_example.py"

ERROR_LINE = re.compile(r"^(?P<path>.+?):(?P<line>\d+): error: (?P<message>.*)$")
MARKER = re.compile(r"#\s*E:")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private cache, shared by this module's runs, so concurrent runs do not collide."""
    return tmp_path_factory.mktemp("mypy-cache")


def run_mypy(path: Path, cache: Path) -> tuple[int, str, dict[int, list[str]]]:
    """Run `mypy --strict` on `path`; return the exit code, the output, and errors by line."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--strict",
            "--follow-imports=silent",
            "--cache-dir",
            str(cache),
            "--no-color-output",
            "--no-error-summary",
            "--show-absolute-path",
            str(path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    output = result.stdout + result.stderr
    errors: dict[int, list[str]] = {}
    for line in output.splitlines():
        match = ERROR_LINE.match(line)
        if match is None:
            continue
        assert Path(match["path"]).resolve() == path.resolve(), f"error outside {path}: {line}"
        errors.setdefault(int(match["line"]), []).append(match["message"])
    return result.returncode, output, errors


def marked_lines(path: Path) -> set[int]:
    """The 1-based numbers of the lines carrying a `# E:` marker."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return {number for number, text in enumerate(lines, start=1) if MARKER.search(text)}


def test_typed_example_passes_mypy_strict(mypy_cache: Path) -> None:
    code, output, errors = run_mypy(TYPED, mypy_cache)
    assert errors == {}, output
    assert code == 0, output


def test_mistyped_example_marks_its_errors() -> None:
    assert len(marked_lines(MISTYPED)) >= 3


def test_mistyped_example_fails_on_each_marked_line(mypy_cache: Path) -> None:
    code, output, errors = run_mypy(MISTYPED, mypy_cache)
    assert code == 1, output
    expected = marked_lines(MISTYPED)
    missing = sorted(expected - errors.keys())
    unexpected = {line: errors[line] for line in sorted(errors.keys() - expected)}
    assert not missing, f"no mypy error on marked lines {missing}:\n{output}"
    assert not unexpected, f"mypy errors on unmarked lines {unexpected}:\n{output}"
