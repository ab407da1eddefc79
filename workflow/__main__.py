"""The command line: `python -m workflow COMMAND [options]`.

    python -m workflow migrate [--database-url URL]   apply the schema chain
    python -m workflow check   [--database-url URL]   compare the database's schema
                                                      version with this code's
    python -m workflow demo    [--database-url URL]   run a Transfer workflow end to end,
                                                      narrated (embedded PostgreSQL
                                                      when no URL is set)
    python -m workflow runs list|show|cancel|resume|fork ...
    python -m workflow prune [--older-than 7d] ...    see and steer runs (admin_cli.py)
    python -m workflow schedules list|pause|resume|trigger ...
    python -m workflow stats [--json]
    python -m workflow dashboard [--host H] [--port 8420] [--read-only] [--password-file F]

The URL defaults to `$WORKFLOW_DATABASE_URL`. Exit codes: 0 success, 1 failure
(unreachable database, schema behind, a failed migration), 2 usage error. Every
failure is exactly one line on stderr, without a traceback.

Each subcommand is a function `_cmd_NAME(args) -> int` added to the parser in
`_parser()`; add another the same way.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg

from workflow._cli import CommandFailed, Parser, add_database_url, database_url, run
from workflow.admin_cli import add_commands
from workflow.errors import WorkflowError
from workflow.store import SCHEMA_VERSION, SchemaOutdated, migrate, schema_version
from workflow.store.connections import connect_explained, one_line

PROG = "python -m workflow"


@contextmanager
def _connect(args: argparse.Namespace) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection to the command's database; `CommandFailed` when it cannot open."""
    url = database_url(args.database_url, f"{PROG} {args.command}")
    try:
        conn = connect_explained(url)
    except WorkflowError as exc:
        raise CommandFailed(str(exc)) from None
    with conn:
        yield conn


def _cmd_migrate(args: argparse.Namespace) -> int:
    """Apply every migration of the chain not yet applied."""
    with _connect(args) as conn:
        try:
            applied = migrate(conn)
            version = schema_version(conn)
        except (psycopg.Error, WorkflowError) as exc:
            raise CommandFailed(f"workflow: migrate failed: {one_line(exc)}") from None
    if not applied:
        print(f"workflow: the database schema is up to date (version {version})")
        return 0
    for migration_id in applied:
        print(f"workflow: applied {migration_id}")
    print(f"workflow: the database schema is now at version {version}")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    """Print both schema versions; exit 1 when the database is behind this code."""
    with _connect(args) as conn:
        try:
            found = schema_version(conn)
        except psycopg.Error as exc:
            raise CommandFailed(
                f"workflow: cannot read the schema version: {one_line(exc)}"
            ) from None
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


def _cmd_dashboard(args: argparse.Namespace) -> int:
    """Serve the dashboard (workflow/contrib/dashboard) until interrupted."""
    try:
        from workflow.contrib.dashboard import make_app, password_authorizer
        from workflow.contrib.dashboard.serve import check_bind, read_password, serve
    except ImportError as exc:
        raise CommandFailed(
            f"workflow: the dashboard needs pip install 'pgworkflow[dashboard]' ({exc})"
        ) from None
    try:
        password = read_password(args.password_file)
        check_bind(args.host, guarded=password is not None)
    except WorkflowError as exc:
        raise CommandFailed(str(exc)) from None
    url = database_url(args.database_url, f"{PROG} dashboard")
    authorize = None if password is None else password_authorizer(password)
    try:
        app = make_app(url, authorize=authorize, read_only=args.read_only)
        app.admin  # noqa: B018 - connect now: a bad URL or schema fails here, not per page
    except WorkflowError as exc:
        raise CommandFailed(str(exc)) from None
    shown = f"[{args.host}]" if ":" in args.host else args.host
    print(f"workflow: dashboard on http://{shown}:{args.port}/"
          + (" (read-only)" if args.read_only else ""), file=sys.stderr, flush=True)
    try:
        serve(app, args.host, args.port)
    except OSError as exc:
        raise CommandFailed(f"workflow: the dashboard cannot listen on {shown}:{args.port}: "
                            f"{exc}") from None
    finally:
        app.close()
    return 0


def _parser() -> Parser:
    parser = Parser(
        prog=PROG,
        description="pgworkflow: durable, ordered task runs stored in PostgreSQL.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    database = Parser(add_help=False)
    add_database_url(database)

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
            "Run five Transfer runs (a success, a retry, a parked failure a person resumes, "
            "a cancellation, a run a worker finishes) and print each step as it happens. "
            "Uses a scratch database on the "
            "given server when allowed; without a URL, a private embedded PostgreSQL "
            "(pip install 'pgworkflow[embedded]')."
        ),
    )
    demo_cmd.set_defaults(func=_cmd_demo)

    dashboard_cmd = commands.add_parser(
        "dashboard",
        parents=[database],
        help="serve the web dashboard (pip install 'pgworkflow[dashboard]')",
        description=(
            "Serve the dashboard: runs, one run's timeline, the parked inbox, schedules and "
            "queue health, with cancel and resume. It listens on 127.0.0.1 unless given a "
            "host, and refuses a host other machines reach without a password (from "
            "--password-file, or $WORKFLOW_DASHBOARD_PASSWORD; user 'admin')."
        ),
    )
    dashboard_cmd.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    dashboard_cmd.add_argument("--port", type=int, default=8420, help="the port (8420)")
    dashboard_cmd.add_argument("--read-only", action="store_true",
                               help="show no action; refuse every POST")
    dashboard_cmd.add_argument("--password-file", metavar="FILE",
                               help="a file whose first line is the password (HTTP Basic)")
    dashboard_cmd.set_defaults(func=_cmd_dashboard)
    add_commands(commands, database)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line with `argv` (default: `sys.argv[1:]`); the exit code."""

    def command() -> int:
        args = _parser().parse_args(argv)
        code: int = args.func(args)
        return code

    return run(command)


if __name__ == "__main__":
    sys.exit(main())
