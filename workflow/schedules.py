"""Cron schedules (SPEC 14): `Schedule(name, workflow, cron, input=..., timezone=..., catchup=...)`.

A schedule is declared in code and registered with `Registry.schedule(...)`;
every worker whose registry holds it may fire it, and each tick starts exactly
one run with the idempotency key `schedule:{name}:{tick in UTC, ISO 8601}`
(`workflow/scheduler.py` says how). Its state lives in the table
`workflow_schedules`, so nothing is kept in memory and no leader is elected.

The cron expression is parsed by cronsim (the `cron` extra), which follows
Debian's cron, daylight-saving transitions included: a tick that falls in the
hour skipped in spring fires right after the change; in the hour repeated in
autumn a daily tick fires once and an hourly one fires in both. The expression is
read in `timezone` (an IANA name, through the standard library's zoneinfo).

Missed ticks, after downtime or a pause: `catchup="latest"` (the default) fires
the most recent one once; `"all"` fires each of them, the most recent 100 at
most; `"none"` fires a tick only when it is at most `NONE_GRACE` seconds late.
"""

from __future__ import annotations

import datetime
import zoneinfo
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from workflow.errors import RegistrationError
from workflow.limits import MAX_NAME_BYTES, text_problem

try:
    import cronsim
except ImportError:  # the `cron` extra is not installed
    cronsim = None  # type: ignore[assignment]

__all__ = ["CATCHUP", "MAX_CATCHUP", "NONE_GRACE", "Schedule", "tick_key"]

In = TypeVar("In")

CATCHUP = ("latest", "all", "none")
MAX_CATCHUP = 100
"""The most missed ticks `catchup="all"` fires at once (the most recent ones)."""
NONE_GRACE = 60.0
"""How late (seconds) a tick may be and still fire with `catchup="none"`."""
_UTC = datetime.timezone.utc
_MINUTE = datetime.timedelta(minutes=1)
_MAX_STEPS = 1000


def tick_key(name: str, tick: datetime.datetime) -> str:
    """The idempotency key of `name`'s run for `tick`: `schedule:{name}:{tick in UTC}`."""
    return f"schedule:{name}:{tick.astimezone(_UTC).strftime('%Y-%m-%dT%H:%M:%SZ')}"


class Schedule(Generic[In]):
    """A cron schedule of runs of `workflow`: a tick starts one run whose input is
    `input` (a value, or a callable taking the tick as an aware datetime in
    `timezone`). Raises `RegistrationError` for a bad name, cron expression, time
    zone or catch-up policy, and when cronsim is not installed."""

    def __init__(
        self,
        name: str,
        workflow: Any,
        cron: str,
        *,
        input: In | Callable[[datetime.datetime], In],
        timezone: str = "UTC",
        catchup: str = "latest",
    ) -> None:
        from workflow.definition import Workflow

        if not isinstance(name, str) or not name:
            raise RegistrationError(f"a schedule needs a non-empty str name, got {name!r}")
        problem = text_problem(name, MAX_NAME_BYTES)
        if problem is not None:
            raise RegistrationError(f"schedule name {name[:60]!r} {problem}")
        if not isinstance(workflow, Workflow):
            raise RegistrationError(
                f"schedule {name!r}: workflow must be a workflow.Workflow, "
                f"not {type(workflow).__name__}"
            )
        if catchup not in CATCHUP:
            raise RegistrationError(
                f"schedule {name!r}: catchup must be one of {', '.join(CATCHUP)}, got {catchup!r}"
            )
        if cronsim is None:
            raise RegistrationError(
                f"schedule {name!r}: schedules need cronsim: pip install 'pgworkflow[cron]'"
            )
        if not isinstance(timezone, str):
            raise RegistrationError(
                f"schedule {name!r}: timezone must be an IANA name such as 'Europe/Berlin'"
            )
        try:
            self._zone = zoneinfo.ZoneInfo(timezone)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError) as e:
            raise RegistrationError(
                f"schedule {name!r}: unknown time zone {timezone!r} ({e}); give an IANA name "
                "such as 'Europe/Berlin' or 'UTC'"
            ) from None
        if not isinstance(cron, str):
            raise RegistrationError(f"schedule {name!r}: cron must be a str, got {cron!r}")
        if len(cron.split()) != 5:  # cronsim 2.7 and later also read six fields (seconds)
            raise RegistrationError(
                f"schedule {name!r}: bad cron expression {cron!r}: it needs five fields "
                "(minute, hour, day of month, month, day of week; schedules have no seconds)"
            )
        try:
            next(cronsim.CronSim(cron, datetime.datetime.now(self._zone)))
        except cronsim.CronSimError as e:
            raise RegistrationError(
                f"schedule {name!r}: bad cron expression {cron!r}: {e}"
            ) from None
        except StopIteration:
            raise RegistrationError(
                f"schedule {name!r}: cron expression {cron!r} never fires (no tick in 50 years)"
            ) from None
        self.name = name
        self.workflow = workflow
        self.cron = cron
        self.input = input
        self.timezone = timezone
        self.catchup = catchup

    def __repr__(self) -> str:
        return (
            f"Schedule({self.name!r}, {self.workflow.name!r}, {self.cron!r}, "
            f"timezone={self.timezone!r}, catchup={self.catchup!r})"
        )

    def input_for(self, tick: datetime.datetime) -> In:
        """The input of the run for `tick` (the callable's result, or the value)."""
        if callable(self.input):
            return self.input(tick.astimezone(self._zone))
        return self.input

    def next_after(self, when: datetime.datetime) -> datetime.datetime:
        """The first tick strictly after `when` (aware), in UTC; `datetime.max` (UTC) when
        none comes within 50 years."""
        when = when.astimezone(_UTC)
        start = when
        # cronsim reads local wall time: in the hour repeated in autumn it may answer
        # with the first pass of a time already gone by. Step on until strictly after.
        for _ in range(_MAX_STEPS):
            try:
                found = next(cronsim.CronSim(self.cron, start.astimezone(self._zone)))
            except StopIteration:
                return datetime.datetime.max.replace(tzinfo=_UTC)
            found = found.astimezone(_UTC)
            if found > when:
                return found
            start = max(start, found) + datetime.timedelta(minutes=1)
        return when + datetime.timedelta(minutes=1)

    def ticks_back(self, now: datetime.datetime, since: datetime.datetime, most: int
                   ) -> list[datetime.datetime]:
        """Up to `most` ticks in [`since`, `now`], the most recent ones, oldest first, in UTC."""
        now, since = now.astimezone(_UTC), since.astimezone(_UTC)
        found: list[datetime.datetime] = []
        # cronsim iterates backwards from strictly before its start, and some releases
        # read the start as if its seconds (2.6) or microseconds (2.7) were zero; ticks
        # fall on whole minutes, so start from the whole minute after `now`, which
        # every release reads alike.
        start = now.replace(second=0, microsecond=0) + _MINUTE
        backwards = cronsim.CronSim(self.cron, start.astimezone(self._zone), reverse=True)
        for step, local in enumerate(backwards):
            tick = local.astimezone(_UTC)
            if tick < since or len(found) == most or step > 2 * most + _MAX_STEPS:
                break
            if tick <= now and (not found or tick < found[-1]):
                found.append(tick)
        found.reverse()
        return found

    def due(
        self, next_tick: datetime.datetime, now: datetime.datetime
    ) -> tuple[list[datetime.datetime], datetime.datetime]:
        """(the ticks to fire now, the next tick after them), given the stored next tick
        and the database's now, by the catch-up policy."""
        next_tick, now = next_tick.astimezone(_UTC), now.astimezone(_UTC)
        if next_tick > now:
            return [], next_tick
        following = self.next_after(now)
        if self.catchup == "all":
            return self.ticks_back(now, next_tick, MAX_CATCHUP), following
        latest = self.ticks_back(now, next_tick, 1)
        if self.catchup == "none":
            latest = [t for t in latest if (now - t).total_seconds() <= NONE_GRACE]
        return latest, following
