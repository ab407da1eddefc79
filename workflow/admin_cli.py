"""`python -m workflow runs | prune | schedules | stats`: `workflow.Admin` on the command line.

    runs list [--status S]... [--workflow W] [--since 24h|ISO] [--until ...] [--limit N] [--json]
    runs show ID [--json]
    runs cancel ID... [--reason TEXT]          runs resume ID... [--reason TEXT]
    runs cancel|resume --all-matching [filters] [--dry-run] [--yes]
    runs fork ID [--from-task NAME]
    prune [--older-than 7d] [--status S]... [--dry-run]
    schedules list [--json]                     schedules pause|resume|trigger NAME
    stats [--json]

A table for a person; `--json` prints one JSON object per line for scripts. Exit
0 on success, 1 when refused or not found (a run left as it was, not resumable,
unknown), 2 on a usage error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import attrs
from attrs import AttrsInstance

from workflow._cli import CommandFailed, Parser, UsageError, database_url, is_span, parse_span
from workflow.admin import Admin, RunDetail, RunSummary
from workflow.errors import NotResumable, RunNotFound, ScheduleNotFound, WorkflowError
from workflow.run import Status

PROG = "python -m workflow"


def parse_when(text: str) -> datetime.datetime | datetime.timedelta:
    """A span (that long ago) or an ISO 8601 time (UTC when it names no offset, or `Z`)."""
    if is_span(text):
        return parse_span(text)
    iso = text.strip()
    if iso.endswith(("Z", "z")):  # Python 3.10's fromisoformat does not read Z
        iso = iso[:-1] + "+00:00"
    try:
        when = datetime.datetime.fromisoformat(iso)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a duration (24h, 7d) nor an ISO 8601 time"
        ) from None
    return when if when.tzinfo else when.replace(tzinfo=datetime.timezone.utc)


def parse_status(text: str) -> Status:
    try:
        return Status(text.strip().lower())
    except ValueError:
        known = ", ".join(s.value for s in Status)
        raise argparse.ArgumentTypeError(f"unknown status {text!r} (one of {known})") from None


def add_commands(commands: Any, database: argparse.ArgumentParser) -> None:
    """Add `runs`, `prune`, `schedules` and `stats` to the subcommands of `python -m workflow`."""
    runs = commands.add_parser(
        "runs", help="list, show, cancel, resume or fork runs",
        description="See and steer runs: list, show, cancel, resume, fork.",
    )
    actions = runs.add_subparsers(dest="action", required=True, metavar="ACTION")

    filters = Parser(add_help=False)
    filters.add_argument("--status", action="append", type=parse_status, metavar="S",
                         help="only runs of this status (repeatable)")
    filters.add_argument("--workflow", metavar="W", help="only runs of this workflow")
    filters.add_argument("--since", type=parse_when, metavar="24h|ISO",
                         help="only runs created since then")
    filters.add_argument("--until", type=parse_when, metavar="24h|ISO",
                         help="only runs created before then")
    as_json = Parser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="one JSON object per line")

    listing = actions.add_parser("list", parents=[database, filters, as_json],
                                 help="runs, newest first")
    listing.add_argument("--limit", type=int, default=50, metavar="N", help="at most N (50)")
    listing.set_defaults(func=_cmd_list)

    show = actions.add_parser("show", parents=[database, as_json],
                              help="one run: its tasks, input and history")
    show.add_argument("run_id", metavar="ID")
    show.set_defaults(func=_cmd_show)

    for name, verb in (("cancel", "cancel"), ("resume", "resume")):
        act = actions.add_parser(name, parents=[database, filters],
                                 help=f"{verb} runs by id, or all matching a filter")
        act.add_argument("run_ids", nargs="*", metavar="ID")
        act.add_argument("--reason", metavar="TEXT", help="recorded in the history")
        act.add_argument("--all-matching", action="store_true",
                         help="every run matching the filters (at least one filter)")
        act.add_argument("--dry-run", action="store_true", help="only say how many match")
        act.add_argument("--yes", action="store_true", help="do it (with --all-matching)")
        act.set_defaults(func=_cmd_cancel if name == "cancel" else _cmd_resume)

    fork = actions.add_parser("fork", parents=[database],
                              help="a new run with the same input, from a task")
    fork.add_argument("run_id", metavar="ID")
    fork.add_argument("--from-task", metavar="NAME",
                      help="the task to start from (default: the task the run is on)")
    fork.add_argument("--reason", metavar="TEXT", help="recorded in the history")
    fork.set_defaults(func=_cmd_fork)

    prune = commands.add_parser(
        "prune", parents=[database], help="delete old finished runs",
        description="Delete finished runs older than --older-than, with their tasks and "
        "history, in committed batches (parked runs only when named with --status).",
    )
    prune.add_argument("--older-than", type=parse_span, default=datetime.timedelta(days=7),
                       metavar="7d", help="finished longer ago than this (7d)")
    prune.add_argument("--status", action="append", type=parse_status, metavar="S",
                       help="succeeded and cancelled by default (repeatable)")
    prune.add_argument("--dry-run", action="store_true", help="only say how many")
    prune.set_defaults(func=_cmd_prune)

    schedules = commands.add_parser(
        "schedules", help="list, pause, resume or trigger cron schedules",
        description="See and steer the cron schedules the workers have registered.",
    )
    verbs = schedules.add_subparsers(dest="action", required=True, metavar="ACTION")
    listed = verbs.add_parser("list", parents=[database, as_json],
                              help="every schedule, its next and last tick")
    listed.set_defaults(func=_cmd_schedules)
    for name, help_text in (
        ("pause", "stop a schedule from firing"),
        ("resume", "let a paused schedule fire again (missed ticks: its catch-up policy)"),
        ("trigger", "start one run of a schedule now (a worker holding it starts it)"),
    ):
        verb = verbs.add_parser(name, parents=[database], help=help_text)
        verb.add_argument("name", metavar="NAME")
        verb.set_defaults(func=_cmd_schedule_action)

    stats = commands.add_parser("stats", parents=[database, as_json],
                                help="each workflow's queue")
    stats.add_argument("--stale-after", type=parse_span, default=datetime.timedelta(minutes=10),
                       metavar="10m", help="a claim without heartbeat this long is stale (10m)")
    stats.set_defaults(func=_cmd_stats)


# The commands.


@contextmanager
def _admin(args: argparse.Namespace, **options: Any) -> Iterator[Admin]:
    url = database_url(args.database_url, f"{PROG} {args.command}")
    try:
        admin = Admin(url, **options)
    except WorkflowError as exc:
        raise CommandFailed(str(exc)) from None
    try:
        yield admin
    except WorkflowError as exc:
        if isinstance(exc, (RunNotFound, NotResumable, ScheduleNotFound)):
            raise
        raise CommandFailed(str(exc)) from None
    finally:
        admin.close()


def _filters(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "status": args.status,
        "workflow": args.workflow,
        "since": args.since,
        "until": args.until,
    }


def _cmd_list(args: argparse.Namespace) -> int:
    if not 1 <= args.limit <= 10_000:
        raise UsageError(f"{PROG} runs list: --limit must be from 1 to 10000")
    with _admin(args) as admin:
        page = admin.runs(**_filters(args), limit=args.limit)
    if args.json:
        for item in page.items:
            _print_json(item)
        return 0
    now = datetime.datetime.now(datetime.timezone.utc)
    _print_table(
        ["ID", "WORKFLOW", "STATUS", "TASK", "CREATED", "FAILURE"],
        [
            [item.id, item.workflow, item.status.value, item.task or "-",
             _ago(item.created_at, now), _failure_text(item)]
            for item in page.items
        ],
    )
    if page.next is not None:
        print(f"(more: narrow the filters or raise --limit; {len(page.items)} shown)")
    elif not page.items:
        print("no runs match")
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        detail = _or_not_found(lambda: admin.run(args.run_id))
    if args.json:
        _print_json(detail)
        return 0
    _print_detail(detail)
    return 0


def _cmd_cancel(args: argparse.Namespace) -> int:
    return _act(args, "cancel")


def _cmd_resume(args: argparse.Namespace) -> int:
    return _act(args, "resume")


def _act(args: argparse.Namespace, verb: str) -> int:
    prog = f"{PROG} runs {verb}"
    filters = _filters(args)
    any_filter = any(value is not None for value in filters.values())
    if args.all_matching:
        if args.run_ids:
            raise UsageError(f"{prog}: give run ids or --all-matching, not both")
        if not any_filter:
            raise UsageError(
                f"{prog}: --all-matching needs at least one filter (--status, --workflow, "
                "--since, --until)"
            )
        with _admin(args) as admin:
            if verb == "resume" and filters["status"] is None:
                filters["status"] = [Status.PARKED]
            count = admin.count(**filters)
            if args.dry_run:
                print(f"{_runs(count)} {'matches' if count == 1 else 'match'}; {verb} would "
                      "act on each of them")
                return 0
            if not args.yes:
                print(f"{_runs(count)} {'matches' if count == 1 else 'match'}; add --yes to "
                      f"{verb} them", file=sys.stderr)
                return 1
            act = admin.cancel_matching if verb == "cancel" else admin.resume_matching
            changed = act(**filters, reason=args.reason, progress=_progress(verb))
        _end_progress()
        print(f"{verb}{'led' if verb == 'cancel' else 'd'} {changed} of {_runs(count)} "
              "matching")
        return 0
    if any_filter or args.dry_run or args.yes:
        raise UsageError(f"{prog}: filters, --dry-run and --yes go with --all-matching")
    if not args.run_ids:
        raise UsageError(f"{prog}: give the ids of the runs to {verb}, or --all-matching")
    refused = False
    with _admin(args) as admin:
        for run_id in args.run_ids:
            try:
                if verb == "cancel":
                    before = admin.run(run_id).status
                    status = admin.cancel(run_id, reason=args.reason)
                    if before in (Status.SUCCEEDED, Status.CANCELLED):
                        print(f"{run_id}: already {before.value}; left as it is")
                        refused = True
                    else:
                        print(f"{run_id}: cancelled (was {before.value})")
                else:
                    status = admin.resume(run_id, reason=args.reason)
                    print(f"{run_id}: resumed ({status.status.value}, claimable now)")
            except (RunNotFound, NotResumable) as exc:
                print(f"{run_id}: {exc}", file=sys.stderr)
                refused = True
    return 1 if refused else 0


def _cmd_fork(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        try:
            new_id = admin.fork(args.run_id, from_task=args.from_task, reason=args.reason)
        except ValueError as exc:
            raise CommandFailed(f"{PROG} runs fork: {exc}") from None
        except RunNotFound as exc:
            print(str(exc), file=sys.stderr)
            return 1
    print(new_id)
    return 0


def _cmd_prune(args: argparse.Namespace) -> int:
    statuses = args.status or [Status.SUCCEEDED, Status.CANCELLED]
    unfinished = [s.value for s in statuses if not s.terminal]
    if unfinished:
        raise UsageError(f"{PROG} prune: only finished runs are pruned, not {unfinished}")
    with _admin(args) as admin:
        if args.dry_run:
            count = admin.count_prunable(older_than=args.older_than, statuses=statuses)
            print(f"{_runs(count)} would be pruned")
            return 0
        deleted = admin.prune(
            older_than=args.older_than, statuses=statuses, progress=_progress("prune")
        )
    _end_progress()
    names = ", ".join(s.value for s in statuses)
    print(f"pruned {_runs(deleted)} ({names}) finished more than {_span(args.older_than)} ago")
    return 0


def _cmd_stats(args: argparse.Namespace) -> int:
    with _admin(args, stale_after=args.stale_after) as admin:
        stats = admin.stats()
    if args.json:
        for item in stats.workflows:
            _print_json(item)
        return 0
    _print_table(
        ["WORKFLOW", "PENDING", "RUNNING", "CLAIMABLE", "OLDEST", "STALE", "PARKED",
         "DONE 24H", "CANCELLED 24H"],
        [
            [w.workflow, str(w.pending), str(w.running), str(w.claimable),
             "-" if w.oldest_claimable_seconds is None else _span(w.oldest_claimable_seconds),
             str(w.stale_claims), str(w.parked), str(w.succeeded_last_day),
             str(w.cancelled_last_day)]
            for w in stats.workflows
        ],
    )
    if not stats.workflows:
        print("no unfinished, parked or recent runs")
    return 0


def _cmd_schedules(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        schedules = admin.schedules()
    if args.json:
        for item in schedules:
            _print_json(item)
        return 0
    _print_table(
        ["NAME", "WORKFLOW", "CRON", "TIMEZONE", "CATCHUP", "NEXT TICK", "LAST TICK", "STATE"],
        [
            [s.name, s.workflow, s.cron, s.timezone, s.catchup, _utc(s.next_tick),
             "-" if s.last_tick is None else _utc(s.last_tick),
             "orphaned" if s.orphaned else "paused" if s.paused else
             "triggered" if s.triggered_at is not None else "active"]
            for s in schedules
        ],
    )
    if not schedules:
        print("no schedules (a worker whose registry has schedules records them at start)")
    return 0


def _cmd_schedule_action(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        act = {
            "pause": admin.pause_schedule,
            "resume": admin.resume_schedule,
            "trigger": admin.trigger_schedule,
        }[args.action]
        try:
            act(args.name)
        except ScheduleNotFound as exc:
            print(str(exc), file=sys.stderr)
            return 1
    said = {
        "pause": f"schedule {args.name!r} paused",
        "resume": f"schedule {args.name!r} resumed",
        "trigger": f"schedule {args.name!r} triggered: a worker holding it starts one run "
                   "within about a second",
    }
    print(said[args.action])
    return 0


def _utc(when: datetime.datetime) -> str:
    return when.astimezone(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


# Printing.


def _or_not_found(call: Callable[[], RunDetail]) -> RunDetail:
    try:
        return call()
    except RunNotFound as exc:
        raise CommandFailed(str(exc)) from None


def _print_detail(detail: RunDetail) -> None:
    now = datetime.datetime.now(datetime.timezone.utc)
    lines = [
        ("run", detail.id),
        ("workflow", detail.workflow),
        ("status", detail.status.value + (f" on {detail.task}" if detail.task else "")),
        ("created", f"{detail.created_at.isoformat()} ({_ago(detail.created_at, now)})"),
        ("finished", "-" if detail.finished_at is None
         else f"{detail.finished_at.isoformat()} ({_ago(detail.finished_at, now)})"),
        ("key", detail.idempotency_key or "-"),
        ("forked from", detail.forked_from or "-"),
        ("concurrency key", "-" if detail.concurrency_key is None
         else f"{detail.concurrency_key[:16]}… ({detail.key_state or 'finished'})"),
        ("input", detail.input if isinstance(detail.input, str)
         else json.dumps(detail.input, ensure_ascii=False)),
    ]
    if detail.failure is not None:
        lines.append(("failure", _failure_text(detail)))
    width = max(len(label) for label, _ in lines)
    for label, value in lines:
        print(f"{label:<{width}}  {value}")
    print()
    _print_table(
        ["SEQ", "TASK", "STATE", "ATTEMPTS", "FINISHED", "LAST ERROR"],
        [
            [str(t.seq), t.name, t.state, str(t.attempts),
             "-" if t.finished_at is None else _ago(t.finished_at, now),
             _error_text(t.code, t.error)]
            for t in detail.tasks
        ],
    )
    print()
    if not detail.history:
        print("history: none (nothing failed, nobody acted on it)")
        return
    _print_table(
        ["WHEN", "WHAT", "TASK", "ATTEMPT", "WHO", "DETAIL"],
        [
            [_ago(e.at, now), e.kind, e.task or "-", "-" if e.attempt is None else str(e.attempt),
             e.actor or "engine",
             e.reason or _error_text(e.code, e.error) or (f"-> {e.other_run}" if e.other_run
                                                          else "")]
            for e in detail.history
        ],
    )


def _failure_text(item: RunSummary) -> str:
    if item.failure is None:
        return ""
    return _error_text(item.failure.code, item.failure.error)


def _error_text(code: str | None, error: str | None) -> str:
    if not error and not code:
        return ""
    text = " ".join((error or "").split())
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{code}: {text}" if code else text


def _print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    print("  ".join(h.ljust(widths[i]) for i, h in enumerate(headers)).rstrip())
    for row in rows:
        print("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())


def _print_json(item: AttrsInstance) -> None:
    print(json.dumps(attrs.asdict(item, value_serializer=_plain), ensure_ascii=False))


def _plain(instance: object, field: object, value: Any) -> Any:
    if isinstance(value, datetime.datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, Status):
        return value.value
    return value


def _runs(count: int) -> str:
    return f"{count} run" if count == 1 else f"{count} runs"


def _ago(when: datetime.datetime, now: datetime.datetime) -> str:
    return _span((now - when).total_seconds()) + " ago"


def _span(seconds: float | datetime.timedelta) -> str:
    if isinstance(seconds, datetime.timedelta):
        seconds = seconds.total_seconds()
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}" if seconds >= 10 * size else (
                f"{seconds / size:.1f}".rstrip("0").rstrip(".") + unit)
    return f"{seconds:.0f}s"


def _progress(verb: str) -> Callable[[int], None] | None:
    if not sys.stderr.isatty():
        return None

    def show(count: int) -> None:
        print(f"\r{verb}: {_runs(count)} so far...", end="", file=sys.stderr, flush=True)

    return show


def _end_progress() -> None:
    if sys.stderr.isatty():
        print("\r\x1b[K", end="", file=sys.stderr, flush=True)
