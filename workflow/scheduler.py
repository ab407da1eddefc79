"""The scheduler: fires the registry's cron schedules, each tick exactly once across workers.

At start it upserts each registered schedule into `workflow_schedules` (a new
one, or one whose cron or time zone changed, waits for its next tick from now)
and marks orphaned the schedules of its workflows that the code no longer
declares; every `REASSERT` seconds it upserts them again (un-orphaning them, and
taking a row back from a worker of another release). It fires only rows that
hold its own definition (name, cron, time zone). Until stopped, it fires what is
due:

- one transaction per schedule: lock a due (or triggered) row with
  `FOR UPDATE SKIP LOCKED`, start the tick's runs with `start_tx` on the same
  connection under the idempotency key `schedule:{name}:{tick}`, advance
  `next_tick`, commit. A second worker skips the locked row; a worker killed
  mid-tick leaves a rolled-back transaction, and the next worker fires the tick;
  a retry that finds the run already there (a commit whose reply was lost) starts
  nothing new. So a tick starts one run, whatever happens.
- the ticks to fire follow the schedule's catch-up policy (`Schedule.due`), by
  the database clock;
- a schedule whose firing fails (its input callable raised, say) is rolled back,
  logged, and tried again `RETRY` seconds later; the others go on;
- each schedule fires at most once per round, so nothing can spin; the runs it
  started wake this process's poller.

Between rounds it sleeps until the earliest of its schedules is due, at most a
second, so a trigger or a resume from the CLI is seen within about a second.
"""

from __future__ import annotations

import datetime
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg

from workflow.definition import Workflow
from workflow.executor import Executor
from workflow.schedules import Schedule, tick_key
from workflow.service import Service

REASSERT = 60.0
"""Seconds between re-assertions of this worker's schedule definitions (un-orphaning
them, and taking the row back after a worker of another release changed it)."""
LOOK_AGAIN = 1.0
"""The longest sleep between rounds (seconds): how soon a trigger or resume is seen."""
OVERDUE = 0.25
"""Seconds before looking again at a due schedule this round did not fire."""
RETRY = 5.0
"""Seconds before a schedule whose firing failed is tried again."""

StartTx = Callable[..., Any]


class Scheduler(Service):
    """Fires `schedules` through `start_tx(conn, workflow, input, idempotency_key=...)`."""

    name = "workflow-scheduler"

    def __init__(
        self,
        executor: Executor,
        schedules: list[Schedule[Any]],
        start_tx: StartTx,
        wake: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self._executor = executor
        self._schedules = {s.name: s for s in schedules}
        self._mine = [(s.name, s.cron, s.timezone) for s in schedules]
        self._start_tx = start_tx
        self._wake_poller = wake
        self._failed: dict[str, float] = {}  # name -> monotonic time it may be tried again
        self._registered_at: float | None = None

    def register(self, *, orphan: bool = True) -> None:
        """Upsert every schedule (un-orphaning it), and mark orphaned the schedules of this
        registry's workflows that it no longer declares (at start; the re-assertions every
        `REASSERT` seconds only upsert, so that a worker of a newer release, which
        declares a new schedule, wins over an older one that restarted)."""
        store = self._executor.store
        now = store.db_now()
        for schedule in self._schedules.values():
            store.upsert_schedule(
                name=schedule.name, workflow=schedule.workflow.name, cron=schedule.cron,
                timezone=schedule.timezone, catchup=schedule.catchup,
                next_tick=schedule.next_after(now),
            )
        if orphan:
            names = self._executor.registry.names()
            for name in store.orphan_schedules(names, list(self._schedules)):
                self._executor.log.warning(
                    "schedule %r is no longer in the code: marked orphaned, it does not fire "
                    "(its row stays for its history)", name,
                )
        self._registered_at = time.monotonic()

    def fire_due(self) -> int:
        """Fire every due or triggered schedule now (each at most once); how many runs
        were started."""
        if self._registered_at is None:
            self.register()
        elif time.monotonic() - self._registered_at >= REASSERT:
            self.register(orphan=False)
        started = 0
        skip = self._failing()
        while not self._stopping.is_set():
            try:
                fired = self._fire_one(skip)
            except _Failed as failed:
                skip.append(failed.name)
                self._failed[failed.name] = time.monotonic() + RETRY
                continue
            if fired is None:
                break
            name, count = fired
            skip.append(name)  # once per round: a firing that moved nothing cannot spin
            started += count
        if started and self._wake_poller is not None:
            self._wake_poller()  # the runs it started, for this process's poller too
        return started

    def _failing(self) -> list[str]:
        now = time.monotonic()
        return [name for name, at in self._failed.items() if at > now]

    def _fire_one(self, skip: list[str]) -> tuple[str, int] | None:
        """Fire one due schedule in a transaction: its name and the runs started, or None
        when none is due."""
        store = self._executor.store
        name = None
        try:
            with store.transaction() as conn:
                claimed = store.claim_schedule(conn, self._mine, skip)
                if claimed is None:
                    return None
                name, next_tick, triggered_at, paused, now = claimed
                schedule = self._schedules[name]
                # Paused and triggered: only the trigger's run; the ticks wait.
                ticks, following = ([], next_tick) if paused else schedule.due(next_tick, now)
                last_run = None
                for tick in ticks:
                    last_run = self._start(conn, schedule, tick, tick_key(name, tick))
                if triggered_at is not None:
                    stamp = triggered_at.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
                    key = f"schedule:{name}:trigger:{stamp}"
                    last_run = self._start(conn, schedule, triggered_at, key)
                store.advance_schedule(
                    conn, name, next_tick=following,
                    last_tick=ticks[-1] if ticks else None, last_run=last_run,
                    triggered=triggered_at is not None,
                )
        except Exception as e:
            if name is None:
                raise
            self._executor.log.exception(
                "schedule %r: firing failed and was rolled back (unless only the reply to "
                "its commit was lost: a retry then finds its runs by their keys); trying "
                "again in %gs", name, RETRY,
            )
            raise _Failed(name) from e
        self._failed.pop(name, None)
        fired = len(ticks) + (triggered_at is not None)
        if ticks:
            self._executor.log.info(
                "schedule %r fired %s", name, ", ".join(t.isoformat() for t in ticks)
            )
        elif next_tick <= now and not paused:
            self._executor.log.warning(
                "schedule %r: the tick of %s was skipped (catchup=%r: too late)",
                name, next_tick.isoformat(), schedule.catchup,
            )
        return name, fired

    def _start(
        self, conn: psycopg.Connection[Any], schedule: Schedule[Any], tick: datetime.datetime,
        key: str,
    ) -> Any:
        workflow: Workflow[Any] = schedule.workflow
        run = self._start_tx(conn, workflow, schedule.input_for(tick), idempotency_key=key)
        return uuid.UUID(run.id)

    def _until_due(self) -> float:
        failing = set(self._failing())
        mine = [m for m in self._mine if m[0] not in failing]
        try:
            due = self._executor.store.next_schedule_due(mine) if mine else None
        except Exception:
            self._executor.log.exception("scheduler: reading the next due time failed")
            return LOOK_AGAIN
        if due is None:
            return LOOK_AGAIN
        if due <= 0:
            # Due yet not fired this round: another worker holds it (firing it right
            # now). Look again soon.
            return OVERDUE
        return min(LOOK_AGAIN, due + 0.005)

    def _loop(self) -> None:
        if not self._schedules:  # nothing to fire: only orphan what the code removed
            while not self._stopping.is_set():
                try:
                    self.register()
                    return
                except Exception:
                    self._executor.log.exception("scheduler: recording the schedules failed")
                    self._sleep(RETRY)
            return
        while not self._stopping.is_set():
            try:
                self.fire_due()
            except Exception:
                self._executor.log.exception("scheduler: firing schedules failed")
                self._sleep(RETRY)
                continue
            self._sleep(self._until_due())


class _Failed(Exception):
    """A schedule could not be fired this round."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name
