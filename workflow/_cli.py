"""What every command line of pgworkflow shares: one-line errors, exit codes, --database-url.

`python -m workflow ...`, `python -m workflow.worker` and the Django management
commands end the same way: exit 0 on success, 1 when refused or when something
the user can act on failed (`CommandFailed`), 2 for a usage error
(`UsageError`); every failure is exactly one line on stderr, no traceback.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
from collections.abc import Callable
from typing import NoReturn

from workflow.store.connections import normalize_url, one_line

URL_ENV = "WORKFLOW_DATABASE_URL"
"""The environment variable `--database-url` defaults to."""


class UsageError(Exception):
    """A bad command line: one line on stderr, exit code 2."""


class CommandFailed(Exception):
    """A failure the user can act on: one line on stderr, exit code 1."""


class Parser(argparse.ArgumentParser):
    """argparse, with usage errors raised (and printed as one line) instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see --help)")


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_SPAN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")


def is_span(text: str) -> bool:
    """Whether `text` is a duration as `parse_span` reads it."""
    return _SPAN.match(text) is not None


def parse_span(text: str) -> datetime.timedelta:
    """`90s`, `30m`, `24h`, `7d`, `2w` as a timedelta; `argparse.ArgumentTypeError` otherwise."""
    match = _SPAN.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration like 90s, 30m, 24h, 7d or 2w"
        )
    try:
        return datetime.timedelta(seconds=float(match[1]) * _UNITS[match[2]])
    except OverflowError:
        raise argparse.ArgumentTypeError(f"{text!r} is longer than a duration may be") from None


def add_database_url(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    """Add `--database-url URL` to `parser` (default: `$WORKFLOW_DATABASE_URL`)."""
    parser.add_argument(
        "--database-url",
        metavar="URL",
        help=help or f"a postgresql:// URL (default: ${URL_ENV})",
    )


def database_url(given: str | None, prog: str) -> str:
    """The URL given, else `$WORKFLOW_DATABASE_URL`, made plain; `UsageError` with neither."""
    url = given or os.environ.get(URL_ENV)
    if not url:
        raise UsageError(f"{prog}: no database URL: pass --database-url URL or set ${URL_ENV}")
    return normalize_url(url)


def run(command: Callable[[], int]) -> int:
    """Run `command`; its exit code, or 2 / 1 / 130 after one line on stderr."""
    try:
        return command()
    except UsageError as exc:
        print(one_line(exc), file=sys.stderr)
        return 2
    except CommandFailed as exc:
        print(one_line(exc), file=sys.stderr)
        return 1
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else 0
    except KeyboardInterrupt:
        print("workflow: interrupted", file=sys.stderr)
        return 130
