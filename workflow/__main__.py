"""The command line: `python -m workflow COMMAND [options]`.

    python -m workflow migrate [--database-url URL]   apply the schema chain
    python -m workflow check   [--database-url URL]   compare the database's schema
                                                      version with this code's
    python -m workflow demo    [--database-url URL]   run a Transfer workflow end to end,
                                                      narrated (embedded PostgreSQL
                                                      when no URL is set)

The URL defaults to `$WORKFLOW_DATABASE_URL`. Exit codes: 0 success, 1 failure
(unreachable database, schema behind, a failed migration), 2 usage error. Every
failure is exactly one line on stderr, without a traceback.

Each subcommand is a function `_cmd_NAME(args) -> int` added to the parser in
`_parser()`; add another the same way.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import psycopg

from workflow.errors import WorkflowError
from workflow.store import SCHEMA_VERSION, SchemaOutdated, migrate, schema_version
from workflow.store.connection import connect_explained

PROG = "python -m workflow"
URL_ENV = "WORKFLOW_DATABASE_URL"


class _UsageError(Exception):
    """A bad command line: one line on stderr, exit code 2."""


class _Failure(Exception):
    """A failure the user can act on: one line on stderr, exit code 1."""


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors raised (and printed as one line) instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{self.prog}: {message} (see --help)")


def _one_line(text: object) -> str:
    """`text` with every run of whitespace (newlines included) made one space."""
    return " ".join(str(text).split())


def _database_url(args: argparse.Namespace) -> str:
    url: str | None = args.database_url or os.environ.get(URL_ENV)
    if not url:
        raise _UsageError(
            f"{PROG} {args.command}: no database URL: pass --database-url URL or set ${URL_ENV}"
        )
    return url


@contextmanager
def _connect(url: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection to `url`; `_Failure` when it cannot be opened."""
    try:
        conn = connect_explained(url)
    except WorkflowError as exc:
        raise _Failure(str(exc)) from None
    with conn:
        yield conn


def _cmd_migrate(args: argparse.Namespace) -> int:
    """Apply every migration of the chain not yet applied."""
    with _connect(_database_url(args)) as conn:
        try:
            applied = migrate(conn)
            version = schema_version(conn)
        except (psycopg.Error, WorkflowError) as exc:
            raise _Failure(f"workflow: migrate failed: {_one_line(exc)}") from None
    if not applied:
        print(f"workflow: the database schema is up to date (version {version})")
        return 0
    for migration_id in applied:
        print(f"workflow: applied {migration_id}")
    print(f"workflow: the database schema is now at version {version}")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    """Print both schema versions; exit 1 when the database is behind this code."""
    with _connect(_database_url(args)) as conn:
        try:
            found = schema_version(conn)
        except psycopg.Error as exc:
            raise _Failure(f"workflow: cannot read the schema version: {_one_line(exc)}") from None
    print(f"database schema version: {found}")
    print(f"code schema version: {SCHEMA_VERSION}")
    if found < SCHEMA_VERSION:
        print(str(SchemaOutdated(found, SCHEMA_VERSION)), file=sys.stderr)
        return 1
    if found > SCHEMA_VERSION:
        print("workflow: the database schema is newer than this code (a later release migrated it)")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    """Run the narrated demo (workflow/demo.py); without a URL, on an embedded server."""
    from workflow.demo import run_demo

    return run_demo(args.database_url)


def _parser() -> _Parser:
    parser = _Parser(
        prog=PROG,
        description="pgworkflow: durable, ordered task runs stored in PostgreSQL.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    database = _Parser(add_help=False)
    database.add_argument(
        "--database-url",
        metavar="URL",
        help=f"a postgresql:// URL (default: ${URL_ENV})",
    )

    migrate_cmd = commands.add_parser(
        "migrate",
        parents=[database],
        help="apply the schema migrations (idempotent, safe to run concurrently)",
        description="Apply every migration of pgworkflow's schema chain not yet applied.",
    )
    migrate_cmd.set_defaults(func=_cmd_migrate)

    check_cmd = commands.add_parser(
        "check",
        parents=[database],
        help="print the database's schema version and this code's; exit 1 when behind",
        description=(
            "Print the database's schema version and the version this code needs; "
            "exit 1 when the database is behind."
        ),
    )
    check_cmd.set_defaults(func=_cmd_check)

    demo_cmd = commands.add_parser(
        "demo",
        parents=[database],
        help="run a small Transfer workflow end to end and print each step",
        description=(
            "Run four Transfer runs (a success, a retry, a parked failure, a run resumed by "
            "a worker) and print each step as it happens. Uses a scratch database on the "
            "given server when allowed; without a URL, a private embedded PostgreSQL "
            "(pip install 'pgworkflow[embedded]')."
        ),
    )
    demo_cmd.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line with `argv` (default: `sys.argv[1:]`); the exit code."""
    try:
        args = _parser().parse_args(argv)
        code: int = args.func(args)
        return code
    except _UsageError as exc:
        print(_one_line(exc), file=sys.stderr)
        return 2
    except _Failure as exc:
        print(_one_line(exc), file=sys.stderr)
        return 1
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else 0
    except KeyboardInterrupt:
        print("workflow: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
