"""Cron schedules (SPEC 14): each tick starts exactly one run, however many workers run.

The tick computation is tested on computed ticks, never by sleeping: daylight
saving in Europe/Berlin, and each catch-up policy. Against PostgreSQL, missed
ticks are made by moving a schedule's `next_tick` into the past (downtime), so
many ticks fall due at once: three worker processes racing for them start one
run per tick; a worker SIGKILLed inside a tick's transaction leaves the tick to
the next worker, which starts it once; a removed schedule is orphaned and stops;
a changed cron fires on the new expression; the CLI pauses, resumes, triggers.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import zoneinfo
from typing import Any

import psycopg
import pytest
from helpers import Inp, Out, registry, wait_until
from pgbouncer import worker_args
from worker_apps.harness import ROOT, WorkerProcess

import workflow
from workflow.schedules import MAX_CATCHUP, NONE_GRACE, Schedule, tick_key

pytest.importorskip("cronsim")

UTC = datetime.timezone.utc
BERLIN = "Europe/Berlin"
A = workflow.Task("a", Out)
APP = "tests.worker_apps.scheduled:registry"


def at(text: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(text)


def _wf() -> workflow.Workflow[Inp]:
    return workflow.Workflow("W", Inp)


# --- declaring ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cron": "61 * * * *"}, "bad cron expression"),
        ({"cron": "* * *"}, "bad cron expression"),
        ({"cron": "*/10 * * * * *"}, "five fields"),
        ({"cron": "0 0 * * * * *"}, "five fields"),
        ({"cron": 5}, "cron must be a str"),
        ({"timezone": "Mars/Olympus"}, "unknown time zone"),
        ({"timezone": "../etc/passwd"}, "unknown time zone"),
        ({"catchup": "some"}, "catchup must be one of latest, all, none"),
        ({"name": ""}, "non-empty str name"),
        ({"name": "x" * 300}, "255"),
        ({"workflow": "W"}, "must be a workflow.Workflow"),
    ],
)
def test_a_bad_schedule_is_a_registration_error(kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"name": "s", "workflow": _wf(), "cron": "0 * * * *"}
    args.update(kwargs)
    with pytest.raises(workflow.RegistrationError, match=match):
        Schedule(args.pop("name"), args.pop("workflow"), args.pop("cron"), input=Inp(1), **args)


def test_the_registry_refuses_a_schedule_of_an_unregistered_workflow_or_a_duplicate() -> None:
    reg, wf = registry(workflow.handle(A, lambda run: Out("a")))
    other = workflow.Workflow("Other", Inp)
    with pytest.raises(workflow.RegistrationError, match="not registered in this registry"):
        reg.schedule(Schedule("s", other, "0 * * * *", input=Inp(1)))
    reg.schedule(Schedule("s", wf, "0 * * * *", input=Inp(1)))
    with pytest.raises(workflow.RegistrationError, match="already registered"):
        reg.schedule(Schedule("s", wf, "30 * * * *", input=Inp(1)))
    reg.freeze()
    with pytest.raises(workflow.RegistrationError, match="frozen"):
        reg.schedule(Schedule("t", wf, "0 * * * *", input=Inp(1)))
    assert [s.name for s in reg.schedules()] == ["s"]


# --- computed ticks ----------------------------------------------------------------


def _ticks(schedule: Schedule[Any], start: str, count: int) -> list[str]:
    out, when = [], at(start)
    for _ in range(count):
        when = schedule.next_after(when)
        out.append(when.astimezone(datetime.timezone.utc).isoformat())
    return out


def test_a_daily_tick_in_the_hour_skipped_in_spring_fires_right_after_the_change() -> None:
    daily = Schedule("d", _wf(), "30 2 * * *", input=Inp(1), timezone=BERLIN)
    # 2026-03-29 02:00 CET jumps to 03:00 CEST: 02:30 does not exist that night.
    assert _ticks(daily, "2026-03-28T12:00:00+00:00", 3) == [
        "2026-03-29T01:00:00+00:00",  # 03:00 CEST, right after the change
        "2026-03-30T00:30:00+00:00",  # 02:30 CEST
        "2026-03-31T00:30:00+00:00",
    ]


def test_a_daily_tick_in_the_hour_repeated_in_autumn_fires_once() -> None:
    daily = Schedule("d", _wf(), "30 2 * * *", input=Inp(1), timezone=BERLIN)
    # 2026-10-25 03:00 CEST falls back to 02:00 CET: 02:30 happens twice.
    assert _ticks(daily, "2026-10-24T12:00:00+00:00", 2) == [
        "2026-10-25T00:30:00+00:00",  # 02:30 CEST, the first one only
        "2026-10-26T01:30:00+00:00",  # 02:30 CET
    ]


def test_an_hourly_tick_fires_in_both_of_the_repeated_hours_with_keys_of_their_own() -> None:
    hourly = Schedule("h", _wf(), "30 * * * *", input=Inp(1), timezone=BERLIN)
    ticks = _ticks(hourly, "2026-10-24T23:00:00+00:00", 3)
    assert ticks == [
        "2026-10-24T23:30:00+00:00",  # 01:30 CEST
        "2026-10-25T00:30:00+00:00",  # 02:30 CEST
        "2026-10-25T01:30:00+00:00",  # 02:30 CET
    ]
    keys = {tick_key("h", at(t)) for t in ticks}
    assert "schedule:h:2026-10-25T00:30:00Z" in keys and len(keys) == 3


def test_in_the_second_pass_of_the_repeated_hour_the_next_tick_is_tomorrows() -> None:
    daily = Schedule("d", _wf(), "30 2 * * *", input=Inp(1), timezone=BERLIN)
    # 02:10 CET, the second pass (01:10Z): cronsim, reading wall time, answers 02:30 of the
    # first pass (00:30Z), gone by an hour ago; a scheduler taking that kept firing nothing.
    assert daily.next_after(at("2026-10-25T01:10:00+00:00")) == at("2026-10-26T01:30:00+00:00")
    nxt = daily.next_after(at("2026-10-25T01:45:00+00:00"))
    assert nxt == at("2026-10-26T01:30:00+00:00")
    ticks, following = daily.due(at("2026-10-25T00:30:00+00:00"), at("2026-10-25T01:45:00+00:00"))
    assert [t.isoformat() for t in ticks] == ["2026-10-25T00:30:00+00:00"]
    assert following > at("2026-10-25T01:45:00+00:00"), "the next tick is never in the past"


def test_times_in_a_daylight_saving_zone_compare_as_instants() -> None:
    """A session whose TimeZone is Europe/Berlin hands back times in that zone: 02:50 CEST
    is earlier than 02:05 CET, though its wall clock is later."""
    zone = zoneinfo.ZoneInfo(BERLIN)
    first_pass = datetime.datetime(2026, 10, 25, 2, 50, tzinfo=zone, fold=0)  # 00:50Z
    second_pass = datetime.datetime(2026, 10, 25, 2, 5, tzinfo=zone, fold=1)  # 01:05Z
    hourly = Schedule("h", _wf(), "50 * * * *", input=Inp(1), timezone=BERLIN)
    ticks, following = hourly.due(first_pass, second_pass)
    assert [t.isoformat() for t in ticks] == ["2026-10-25T00:50:00+00:00"]
    assert following == at("2026-10-25T01:50:00+00:00")


@pytest.mark.parametrize("catchup", ["all", "latest", "none"])
@pytest.mark.parametrize("zone", ["UTC", BERLIN])
def test_a_tick_fires_when_the_worker_looks_milliseconds_after_it(catchup: str, zone: str) -> None:
    """A worker wakes for a tick and reads the database's now() a few milliseconds after
    it: the tick is due, whatever the catch-up policy. (cronsim 2.7, the newest on
    Python 3.10, iterates backwards from a time as if its microseconds were zero.)"""
    minutely = Schedule("m", _wf(), "* * * * *", input=Inp(1), timezone=zone, catchup=catchup)
    tick = at("2026-12-07T12:37:00+00:00")
    for late in (datetime.timedelta(microseconds=1), datetime.timedelta(milliseconds=11),
                 datetime.timedelta(seconds=59, microseconds=999_999)):
        ticks, following = minutely.due(tick, tick + late)
        assert ticks == [tick], late
        assert following == at("2026-12-07T12:38:00+00:00")
    ticks, _ = minutely.due(tick, tick)
    assert ticks == [tick]


def test_the_catchup_policies_after_downtime() -> None:
    def schedule(catchup: str) -> Schedule[Any]:
        return Schedule("m", _wf(), "* * * * *", input=Inp(1), catchup=catchup)

    missed_since = at("2026-06-01T10:00:00+00:00")
    now = at("2026-06-01T10:05:30+00:00")
    ticks, following = schedule("all").due(missed_since, now)
    assert [t.strftime("%H:%M") for t in ticks] == ["10:00", "10:01", "10:02", "10:03",
                                                    "10:04", "10:05"]
    assert following == at("2026-06-01T10:06:00+00:00")
    ticks, following = schedule("latest").due(missed_since, now)
    assert [t.strftime("%H:%M") for t in ticks] == ["10:05"]
    assert following == at("2026-06-01T10:06:00+00:00")
    # "none": the 10:05 tick is 30 s late, within the grace; after a longer outage, nothing.
    assert [t.strftime("%H:%M") for t in schedule("none").due(missed_since, now)[0]] == ["10:05"]
    hourly = Schedule("h", _wf(), "0 * * * *", input=Inp(1), catchup="none")
    ticks, following = hourly.due(missed_since, at("2026-06-01T12:30:00+00:00"))
    assert ticks == [] and following == at("2026-06-01T13:00:00+00:00"), "30 min late: skipped"
    # "all" fires the most recent MAX_CATCHUP ticks at most.
    ticks, _ = schedule("all").due(missed_since - datetime.timedelta(days=1), now)
    assert len(ticks) == MAX_CATCHUP and ticks[-1].strftime("%H:%M") == "10:05"
    # Not due yet: nothing, and the same next tick.
    assert schedule("all").due(now + datetime.timedelta(minutes=1), now) == (
        [], now + datetime.timedelta(minutes=1)
    )


def test_the_input_callable_gets_the_tick_in_the_schedules_time_zone() -> None:
    seen: list[datetime.datetime] = []

    def input_of(tick: datetime.datetime) -> Inp:
        seen.append(tick)
        return Inp(tick.hour)

    s = Schedule("d", _wf(), "0 9 * * *", input=input_of, timezone=BERLIN)
    tick = s.next_after(at("2026-07-01T00:00:00+00:00"))
    assert s.input_for(tick) == Inp(9)
    assert seen[0].utcoffset() == datetime.timedelta(hours=2)


# --- against PostgreSQL ------------------------------------------------------------


def _runs_of(db: psycopg.Connection[Any], name: str) -> list[tuple[str, str]]:
    rows = db.execute(
        "SELECT idempotency_key, input #>> '{}' FROM workflow_runs "
        "WHERE idempotency_key LIKE %s ORDER BY idempotency_key",
        (f"schedule:{name}:%",),
    ).fetchall()
    return [(r[0], r[1]) for r in rows]


def _backdate(db: psycopg.Connection[Any], name: str, days: int) -> datetime.datetime:
    """Make `name` look like its workers were down `days` days: next_tick = that midnight."""
    (midnight,) = db.execute(
        "UPDATE workflow_schedules SET next_tick = date_trunc('day', now() AT TIME ZONE 'UTC') "
        "AT TIME ZONE 'UTC' - make_interval(days => %s) WHERE name = %s RETURNING next_tick",
        (days, name),
    ).fetchone() or (None,)
    assert midnight is not None
    return midnight  # type: ignore[no-any-return]


def _scheduler(make_manager: Any, env: dict[str, str] | None = None) -> Any:
    from worker_apps import scheduled

    old = dict(os.environ)
    os.environ.update(env or {})
    try:
        mgr = make_manager(scheduled.registry())
    finally:
        os.environ.clear()
        os.environ.update(old)
    runnable = mgr.new_runnable(workflow.RunnerConfig(listen=False, poll_interval=0.2))
    return mgr, runnable.scheduler


@pytest.mark.parametrize(("catchup", "expected"), [("all", 6), ("latest", 1), ("none", 0)])
def test_downtime_over_several_ticks_by_catchup_policy(
    make_manager: Any, db: psycopg.Connection[Any], catchup: str, expected: int
) -> None:
    _, scheduler = _scheduler(make_manager, {"SCHED_CATCHUP": catchup})
    scheduler.register()
    assert _runs_of(db, "nightly") == []
    midnight = _backdate(db, "nightly", 5)
    today = midnight + datetime.timedelta(days=5)
    late_before = (datetime.datetime.now(UTC) - today).total_seconds()
    fired = scheduler.fire_due()
    late_after = (datetime.datetime.now(UTC) - today).total_seconds()
    if catchup == "none" and late_before <= NONE_GRACE:
        # Within a minute of midnight UTC: today's tick is on time and fires (unless
        # the grace ran out during the firing itself).
        expected = 1 if late_after <= NONE_GRACE else fired
    assert fired == expected
    runs = _runs_of(db, "nightly")
    assert len(runs) == expected
    if expected:
        assert runs[-1][0] == f"schedule:nightly:{today.strftime('%Y-%m-%dT00:00:00Z')}"
    assert scheduler.fire_due() == 0, "fired ticks are not fired again"
    (next_tick,) = db.execute(
        "SELECT next_tick FROM workflow_schedules WHERE name = 'nightly'"
    ).fetchone() or (None,)
    assert next_tick > datetime.datetime.now(UTC)


def test_three_workers_start_one_run_per_tick(
    make_manager: Any, db: psycopg.Connection[Any], engine_url: str
) -> None:
    _, scheduler = _scheduler(make_manager)
    scheduler.register()
    _backdate(db, "nightly", 49)  # 50 ticks due at once
    workers = [
        WorkerProcess(APP, engine_url, *worker_args("--poll-interval", "0.2")) for _ in range(3)
    ]
    try:
        for worker in workers:
            worker.wait_started()
        wait_until(lambda: len(_runs_of(db, "nightly")) >= 50, "the 50 ticks' runs", timeout=30)
        # Once more, while all three watch: the same schedule falls due again.
        _backdate(db, "nightly", 99)
        wait_until(lambda: len(_runs_of(db, "nightly")) >= 100, "100 ticks' runs", timeout=30)
        for worker in workers:
            worker.terminate()
        for worker in workers:
            assert worker.wait(timeout=30) == 0, worker.stderr
    finally:
        for worker in workers:
            worker.kill()
    keys = [key for key, _ in _runs_of(db, "nightly")]
    assert len(keys) == len(set(keys)) == 100
    fired_by = [w for w in workers if "schedule 'nightly' fired" in w.stderr]
    assert fired_by, "some worker fired the ticks"


def test_a_worker_killed_inside_a_ticks_transaction_leaves_the_tick_to_another_once(
    make_manager: Any, db: psycopg.Connection[Any], engine_url: str
) -> None:
    _, scheduler = _scheduler(make_manager, {"SCHED_CATCHUP": "latest"})
    scheduler.register()
    _backdate(db, "nightly", 3)
    env_worker = dict(os.environ, SCHED_HANG="1", SCHED_CATCHUP="latest")
    stuck = _worker_with_env(env_worker, engine_url)
    try:
        stuck.wait_for_line("hanging in the tick's transaction")
        (locked,) = db.execute(
            "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
            "WHERE c.relname = 'workflow_schedules' AND l.pid <> pg_backend_pid()"
        ).fetchone() or (0,)
        assert locked >= 1, "the stuck worker holds the schedule's row"
        assert _runs_of(db, "nightly") == [], "nothing is visible before its commit"
        rescuer = _worker_with_env(dict(os.environ, SCHED_CATCHUP="latest"), engine_url)
        try:
            rescuer.wait_started()
            os.kill(stuck.pid, signal.SIGKILL)
            stuck.wait(timeout=20)
            wait_until(lambda: len(_runs_of(db, "nightly")) == 1, "the tick's one run")
            rescuer.terminate()
            assert rescuer.wait(timeout=30) == 0, rescuer.stderr
        finally:
            rescuer.kill()
    finally:
        stuck.kill()
    (key, _), = _runs_of(db, "nightly")
    assert key.startswith("schedule:nightly:")


def _worker_with_env(env: dict[str, str], engine_url: str) -> WorkerProcess:
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        return WorkerProcess(APP, engine_url, *worker_args("--poll-interval", "0.2"))
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_a_removed_schedule_is_orphaned_and_a_changed_cron_fires_on_the_new_one(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    _, first = _scheduler(make_manager, {"SCHED_NAME": "old"})
    first.register()
    _backdate(db, "old", 2)
    # The next release renames it: "old" is no longer in the code.
    _, second = _scheduler(make_manager, {"SCHED_NAME": "new"})
    second.register()
    rows = dict(db.execute("SELECT name, orphaned FROM workflow_schedules").fetchall())
    assert rows == {"old": True, "new": False}
    assert second.fire_due() == 0
    assert first.fire_due() == 0, "an orphaned schedule does not fire, even for old code"
    # A changed expression takes its next tick from the new one, from now.
    db.execute("UPDATE workflow_schedules SET cron = '0 12 * * *' WHERE name = 'new'")
    _backdate(db, "new", 2)
    second.register()
    (cron, next_tick) = db.execute(
        "SELECT cron, next_tick FROM workflow_schedules WHERE name = 'new'"
    ).fetchone() or (None, None)
    assert cron == "0 0 * * *" and next_tick > datetime.datetime.now(UTC)
    assert next_tick.hour == 0 and next_tick.minute == 0
    assert second.fire_due() == 0


def test_a_row_holding_another_releases_cron_is_left_to_the_workers_of_that_release(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    _, scheduler = _scheduler(make_manager)
    scheduler.register()
    # A worker of another release wrote its own expression, and the schedule is due.
    db.execute("UPDATE workflow_schedules SET cron = '0 6 * * *' WHERE name = 'nightly'")
    _backdate(db, "nightly", 1)
    assert scheduler.fire_due() == 0, "not fired on an expression this worker does not hold"
    assert _runs_of(db, "nightly") == []
    # Its periodic re-assertion takes the row back (here: at once, as at a start).
    scheduler.register(orphan=False)
    (cron,) = db.execute(
        "SELECT cron FROM workflow_schedules WHERE name = 'nightly'"
    ).fetchone() or (None,)
    assert cron == "0 0 * * *"


def _cli(db_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "workflow", *args, "--database-url", db_url],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )


def test_the_cli_lists_pauses_resumes_and_triggers(
    make_manager: Any, db: psycopg.Connection[Any], db_url: str
) -> None:
    _, scheduler = _scheduler(make_manager, {"SCHED_CATCHUP": "latest"})
    scheduler.register()
    listed = _cli(db_url, "schedules", "list")
    assert listed.returncode == 0, listed.stderr
    assert "nightly" in listed.stdout and "0 0 * * *" in listed.stdout and "active" in listed.stdout
    assert _cli(db_url, "schedules", "pause", "nightly").returncode == 0
    _backdate(db, "nightly", 1)
    assert scheduler.fire_due() == 0, "a paused schedule does not fire"
    assert "paused" in _cli(db_url, "schedules", "list").stdout
    triggered = _cli(db_url, "schedules", "trigger", "nightly")
    assert triggered.returncode == 0 and "triggered" in triggered.stdout
    assert scheduler.fire_due() == 1, "a trigger fires even while paused"
    (key, _), = _runs_of(db, "nightly")
    assert key.startswith("schedule:nightly:trigger:")
    assert _cli(db_url, "schedules", "resume", "nightly").returncode == 0
    assert scheduler.fire_due() == 1, "resumed: the missed tick, by its policy (latest)"
    assert len(_runs_of(db, "nightly")) == 2
    as_json = _cli(db_url, "schedules", "list", "--json")
    assert '"name": "nightly"' in as_json.stdout and '"paused": false' in as_json.stdout
    missing = _cli(db_url, "schedules", "pause", "nope")
    assert missing.returncode == 1 and "no schedule is named 'nope'" in missing.stderr


def test_a_failing_input_callable_starts_nothing_and_is_retried(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    calls: list[datetime.datetime] = []

    def broken(tick: datetime.datetime) -> Inp:
        calls.append(tick)
        if len(calls) == 1:
            raise RuntimeError("the report service is down")
        return Inp(tick.day)

    reg, wf = registry(workflow.handle(A, lambda run: Out("a")))
    reg.schedule(Schedule("flaky", wf, "0 0 * * *", input=broken))
    mgr = make_manager(reg)
    scheduler = mgr.new_runnable(workflow.RunnerConfig(listen=False)).scheduler
    scheduler.register()
    _backdate(db, "flaky", 1)
    assert scheduler.fire_due() == 0
    assert _runs_of(db, "flaky") == []
    assert scheduler.fire_due() == 0, "not tried again before RETRY seconds"
    wait_until(lambda: scheduler.fire_due() == 1, "the retry after RETRY seconds", timeout=15)
    assert len(_runs_of(db, "flaky")) == 1 and len(calls) == 2
