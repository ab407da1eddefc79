"""The checks run at the end of a chaos run, over the engine's tables and the test's own.

Everything is read once into memory and checked in Python; see `schema.py` for
what each table holds. Times are the database clock throughout (`clock_timestamp()`
in the ledger and in the triggers), so no host clock is compared with another.

Why the fencing check is sound
------------------------------
A claim id is a fresh random UUID, set once on one run and cleared once. The
`chaos_claims` trigger gives, per claim C, the moment it was set (`set(C)`) and the
moment it was cleared or replaced (`clear(C)`); between the two, C is the run's
claim and nothing else is. Row locks serialise every change of a run row, so on
one run these trigger times are in the order the changes happened.

A task's output is the id of the execution E that produced it. The
`chaos_task_events` trigger sees the write W that stored it (its time and its
transaction). The claim that W happened under is
- the claim cleared in W's own transaction, when W finished the run (the run update
  and the task update are one statement), else
- the run's claim at W's time: the newest claim set before W (nothing cleared it
  before W, or W's fenced statement would have matched no row).
We require that this writer claim is E's own claim (read by the handler from its
executor's frame, independently of the database), that E began after its claim was
set and ended before W. Since claim ids are never reused, E's claim was then valid
from before E began until W: E ended while its claim was valid, and the output it
returned is the one recorded. An executor whose claim was swept (a hung handler
coming back late, or one whose heartbeats stopped while the server restarted) has
a different claim from the run's current one, so an output it wrote would fail the
check; and any second write of an output (`old_output` not NULL) is counted as an
overwrite outright.

Overlaps: each execution held a valid claim during [max(begin, set(C)),
min(end, clear(C))] (a killed execution has no end: until its claim was cleared).
Two executions of one task, or of one run under one claim, must not have
intersecting intervals. The ledger's begin is written just after the handler
starts and its end just before it returns, so these intervals are slightly
narrower than the real ones: an overlap found is real; an overlap of less than a
couple of database round trips could go unseen.

Attempts: a handler sees attempt = persisted count + 1. For each execution whose
claim was valid when it began, its attempt - 1 must equal the attempt-count bumps
(failures and sweeps) committed before it began; no execution may see an attempt
above `max_attempts` (the engine parks first); and no task's persisted count may
exceed `max_attempts` + the sweeps that bumped it.

Miscounts: every attempt counted ran, and every attempt that ran and failed is
counted, once.
- A write bumps an attempt count by one at most (`double_counted`): a failure
  retried after its reply was lost must not count twice.
- A failure's bump needs an execution of that task under the writing claim that
  raised, with that attempt number, each execution matched once
  (`phantom_attempts`).
- A sweep's bump (an abandoned attempt) needs a reason under the swept claim: an
  execution of that task under it (killed, hung, or cut off), or the process that
  set the claim killed after setting it, or the server restart between the claim
  and the sweep. A claim no executor knew of (the lost reply of a claim) has none
  (`phantom_attempts`).
- An execution that raised needs a bump under its claim: its failure (that
  attempt), or a sweep of its claim, or a release by a process told to drain
  (a failure during shutdown spends no attempt, by design), or an operator's
  cancel (a cancelled run's attempt is discarded, by design) (`uncounted`).
- An operator's resume resets the count to 0 (a fresh budget): not a bump.
Beyond that an attempt may run again only after its execution was interrupted:
the attempt check above flags any execution that saw a count its predecessors
did not leave.

Keys (SPEC 15): one run in three has an account, one run per account at once. The
`chaos_key_holds` trigger gives each run's holds of its key's slot; two runs of one
key must never hold it at overlapping times (`key_overlaps`), through kills,
sweeps, backoffs, cancels and resumes, and a keyed run is claimed only while it
holds its key (`unheld_claims`).
"""

from __future__ import annotations

import datetime
import uuid
from collections import defaultdict
from typing import Any

import attrs
import psycopg

from .schema import SWEEP_ERROR_PREFIX

INF = datetime.datetime.max.replace(tzinfo=datetime.timezone.utc)


@attrs.define
class Report:
    runs: int = 0
    started_recorded: int = 0
    executions: int = 0
    re_executions: int = 0
    injected_failures: int = 0
    killed_executions: int = 0
    stale_executions: int = 0
    sweeps: int = 0
    fast_path_executions: int = 0
    lost: int = 0
    overwritten: int = 0
    overlaps: int = 0
    attempts_over: int = 0
    stale_reads: int = 0
    unknown_claims: int = 0
    uncounted: int = 0
    phantom_attempts: int = 0
    double_counted: int = 0
    cancelled: int = 0
    ticks: int = 0
    ticks_missed: int = 0
    keyed_runs: int = 0
    key_holds: int = 0
    key_overlaps: int = 0
    unheld_claims: int = 0
    problems: list[str] = attrs.field(factory=list)

    @property
    def miscounted(self) -> int:
        return self.uncounted + self.phantom_attempts + self.double_counted

    @property
    def violations(self) -> int:
        return (
            self.lost
            + self.overwritten
            + self.overlaps
            + self.attempts_over
            + self.stale_reads
            + self.unknown_claims
            + self.miscounted
            + self.ticks_missed
            + self.key_overlaps
            + self.unheld_claims
        )

    def problem(self, text: str) -> None:
        if len(self.problems) < 30:
            self.problems.append(text)


@attrs.frozen
class _Exec:
    exec_id: uuid.UUID
    run_id: uuid.UUID
    seq: int
    attempt: int
    pid: int
    claim: uuid.UUID | None
    prev_output: str | None
    started_at: datetime.datetime
    ended_at: datetime.datetime | None
    outcome: str | None


def check(
    conn: psycopg.Connection[Any],
    max_attempts: int,
    starter_pid: int | None,
    sweep_max_age: float = 3.0,
) -> Report:
    """Run every check on the chaos database; the report (violations and counts)."""
    r = Report()
    runs = dict(conn.execute("SELECT id, status FROM workflow_runs").fetchall())
    started = {row[0] for row in conn.execute("SELECT run_id FROM chaos_started").fetchall()}
    tasks: dict[tuple[uuid.UUID, int], tuple[Any, int]] = {
        (run_id, seq): (output, attempts)
        for run_id, seq, output, attempts in conn.execute(
            "SELECT run_id, seq, output, attempts FROM workflow_tasks"
        ).fetchall()
    }
    execs = [
        _Exec(*row)
        for row in conn.execute(
            "SELECT exec_id, run_id, seq, attempt, pid, coalesce(claim_id, claim_at_start), "
            "prev_output, started_at, ended_at, outcome FROM chaos_exec ORDER BY started_at"
        ).fetchall()
    ]
    claim_rows = conn.execute(
        "SELECT run_id, old_claim, new_claim, at, xid, app FROM chaos_claims "
        "ORDER BY run_id, at, id"
    ).fetchall()
    faults = conn.execute("SELECT kind, app, at, until_ FROM chaos_faults").fetchall()
    event_rows = conn.execute(
        "SELECT run_id, seq, old_output, new_output, old_attempts, new_attempts, error, at, xid "
        "FROM chaos_task_events ORDER BY run_id, seq, at, id"
    ).fetchall()

    claim_set: dict[uuid.UUID, datetime.datetime] = {}
    claim_clear: dict[uuid.UUID, datetime.datetime] = {}
    claim_app: dict[uuid.UUID, str] = {}
    cleared_by: dict[uuid.UUID, tuple[str, int, datetime.datetime]] = {}
    claims_of_run: dict[uuid.UUID, list[tuple[Any, ...]]] = defaultdict(list)
    for run_id, old, new, at, xid, app in claim_rows:
        claims_of_run[run_id].append((old, new, at, xid))
        if new is not None:
            claim_set[new] = at
            claim_app[new] = app
        if old is not None:
            claim_clear[old] = at
            cleared_by[old] = (app, xid, at)
    events: dict[tuple[uuid.UUID, int], list[tuple[Any, ...]]] = defaultdict(list)
    for run_id, seq, *rest in event_rows:
        events[(run_id, seq)].append(tuple(rest))
    execs_of_task: dict[tuple[uuid.UUID, int], list[_Exec]] = defaultdict(list)
    by_id = {e.exec_id: e for e in execs}
    for e in execs:
        execs_of_task[(e.run_id, e.seq)].append(e)

    r.runs = len(runs)
    r.started_recorded = len(started)
    r.executions = len(execs)

    cancelled_by_operator = {
        row[0]
        for row in conn.execute(
            "SELECT run_id FROM workflow_events WHERE kind = 'cancelled' AND actor = 'chaos'"
        ).fetchall()
    }

    # 1. Lost: every recorded start exists, and every run of the table succeeded (or an
    # operator cancelled it, last).
    for run_id in started - runs.keys():
        r.lost += 1
        r.problem(f"lost: run {run_id} was started (committed) but is not in workflow_runs")
    for run_id, status in runs.items():
        if status == "cancelled" and run_id in cancelled_by_operator:
            r.cancelled += 1
            continue
        if status != "succeeded":
            r.lost += 1
            r.problem(f"lost: run {run_id} ended {status}, not succeeded")

    # 2. Overwritten: one output write per task, by the execution the writer claim ran.
    final_output: dict[tuple[uuid.UUID, int], str | None] = {}
    for key, (output, _) in tasks.items():
        final_output[key] = output
        writes = [ev for ev in events.get(key, []) if ev[0] != ev[1]]
        for old, new, *_ in writes:
            if old is not None:
                r.overwritten += 1
                r.problem(f"overwritten: task {key}: output {old} replaced by {new}")
        if output is None:
            continue
        if not writes:
            r.overwritten += 1
            r.problem(f"fencing: task {key}: output {output} was written unobserved")
            continue
        _, _, _, _, _, w_at, w_xid = writes[-1]
        try:
            e = by_id.get(uuid.UUID(output))
        except (TypeError, ValueError):
            e = None
        if e is None or (e.run_id, e.seq) != key or e.outcome != "returned":
            r.overwritten += 1
            r.problem(f"fencing: task {key}: output {output!r} is no returned execution of it")
            continue
        writer = _writer_claim(claims_of_run.get(key[0], []), w_at, w_xid)
        if e.claim is None or e.claim != writer:
            r.overwritten += 1
            r.problem(
                f"fencing: task {key}: output of execution {e.exec_id} (claim {e.claim}) was "
                f"written under claim {writer}"
            )
        elif not (
            claim_set.get(e.claim, INF) <= e.started_at
            and e.ended_at is not None
            and e.ended_at <= w_at
        ):
            r.overwritten += 1
            r.problem(
                f"fencing: task {key}: execution {e.exec_id} did not run inside its claim "
                f"(set {claim_set.get(e.claim)}, began {e.started_at}, ended {e.ended_at}, "
                f"written {w_at})"
            )

    # 3. Overlaps, among executions of one task and of one run under one claim.
    intervals: dict[uuid.UUID, tuple[datetime.datetime, datetime.datetime]] = {}
    for e in execs:
        if e.claim is None or e.claim not in claim_set:
            r.unknown_claims += 1
            r.problem(f"claim: execution {e.exec_id} ran under claim {e.claim}, never set")
            continue
        lo = max(e.started_at, claim_set[e.claim])
        hi = min(e.ended_at or INF, claim_clear.get(e.claim, INF))
        if lo < hi:
            intervals[e.exec_id] = (lo, hi)
        if e.ended_at is None:
            r.killed_executions += 1
        elif e.ended_at > claim_clear.get(e.claim, INF) or e.started_at >= claim_clear.get(
            e.claim, INF
        ):
            r.stale_executions += 1
    groups: dict[Any, list[_Exec]] = defaultdict(list)
    for e in execs:
        groups[("task", e.run_id, e.seq)].append(e)
        groups[("claim", e.run_id, e.claim)].append(e)
    seen_pairs: set[tuple[uuid.UUID, uuid.UUID]] = set()
    for group in groups.values():
        for i, a in enumerate(group):
            for b in group[i + 1 :]:
                ia, ib = intervals.get(a.exec_id), intervals.get(b.exec_id)
                if ia is None or ib is None or not (ia[0] < ib[1] and ib[0] < ia[1]):
                    continue
                pair = (min(a.exec_id, b.exec_id), max(a.exec_id, b.exec_id))
                if pair in seen_pairs:
                    continue
                seen_pairs.add(pair)
                r.overlaps += 1
                r.problem(
                    f"overlap: executions {a.exec_id} (seq {a.seq}, claim {a.claim}) and "
                    f"{b.exec_id} (seq {b.seq}, claim {b.claim}) of run {a.run_id} both held "
                    f"a valid claim during {max(ia[0], ib[0])} .. {min(ia[1], ib[1])}"
                )

    _check_keys(r, conn, claim_rows)

    # 4. Attempts.
    for key, (_, attempts) in tasks.items():
        bumps = [ev for ev in events.get(key, []) if ev[3] != ev[2]]
        sweeps = sum(ev[3] - ev[2] for ev in bumps if (ev[4] or "").startswith(SWEEP_ERROR_PREFIX))
        r.sweeps += sweeps
        if attempts > max_attempts + sweeps:
            r.attempts_over += 1
            r.problem(f"attempts: task {key}: {attempts} > {max_attempts} + {sweeps} sweeps")
        for e in execs_of_task.get(key, []):
            if e.attempt > max_attempts:
                r.attempts_over += 1
                r.problem(f"attempts: execution {e.exec_id} saw attempt {e.attempt}")
            valid_at_start = e.claim is not None and claim_set.get(
                e.claim, INF
            ) <= e.started_at < claim_clear.get(e.claim, INF)
            if not valid_at_start:
                continue
            before = sum(ev[3] - ev[2] for ev in bumps if ev[5] < e.started_at)
            if e.attempt - 1 != before:
                r.attempts_over += 1
                r.problem(
                    f"attempts: execution {e.exec_id} of task {key} saw attempt {e.attempt}, "
                    f"but {before} attempts had ended before it began"
                )

    # 5. Miscounts (see the module doc).
    _check_counts(
        r, execs_of_task, events, claims_of_run, claim_set, claim_app, cleared_by, faults
    )

    # 6. Every execution of a later task read the one recorded output of the task before.
    for e in execs:
        if e.seq > 1:
            recorded = final_output.get((e.run_id, e.seq - 1))
            if e.prev_output != recorded:
                r.stale_reads += 1
                r.problem(
                    f"read: execution {e.exec_id} (seq {e.seq}) read {e.prev_output!r}, "
                    f"recorded {recorded!r}"
                )

    # 7. The schedule: one run for each minute's tick between its registration and the
    # workers' stop (catch-up "all": a tick missed while every worker was down still fires).
    _check_ticks(r, conn)

    # Counts.
    r.re_executions = sum(len(group) - 1 for group in execs_of_task.values() if group)
    r.injected_failures = sum(1 for e in execs if e.outcome == "raised")
    if starter_pid is not None:
        r.fast_path_executions = sum(1 for e in execs if e.pid == starter_pid)
    return r


def _check_counts(
    r: Report,
    execs_of_task: dict[tuple[uuid.UUID, int], list[_Exec]],
    events: dict[tuple[uuid.UUID, int], list[tuple[Any, ...]]],
    claims_of_run: dict[uuid.UUID, list[tuple[Any, ...]]],
    claim_set: dict[uuid.UUID, datetime.datetime],
    claim_app: dict[uuid.UUID, str],
    cleared_by: dict[uuid.UUID, tuple[str, int, datetime.datetime]],
    faults: list[tuple[Any, ...]],
) -> None:
    kills = [(app, at) for kind, app, at, _ in faults if kind == "kill"]
    stops = {app: at for kind, app, at, _ in faults if kind == "stop"}
    restarts = [(at, until or INF) for kind, _, at, until in faults if kind == "restart"]
    bump_xids: set[int] = set()
    for key in set(execs_of_task) | set(events):
        run_id = key[0]
        history = claims_of_run.get(run_id, [])
        runs_under = defaultdict(list)
        for e in execs_of_task.get(key, []):
            runs_under[e.claim].append(e)
        failures_of: dict[uuid.UUID | None, int] = defaultdict(int)
        swept: set[uuid.UUID | None] = set()
        matched: set[uuid.UUID] = set()
        for _, _, old, new, error, at, xid in events.get(key, []):
            if new <= old:
                continue  # unchanged, or reset to a fresh budget by a resume
            bump_xids.add(xid)
            if new - old > 1:
                r.double_counted += 1
                r.problem(f"count: task {key}: one write counted {new - old} attempts")
            claim = _writer_claim(history, at, xid)
            if (error or "").startswith(SWEEP_ERROR_PREFIX):
                swept.add(claim)
                set_at = claim_set.get(claim, INF) if claim is not None else INF
                reason = (
                    bool(runs_under.get(claim))
                    or any(app == claim_app.get(claim) and set_at <= k_at <= at
                           for app, k_at in kills)
                    or any(r_at <= at and set_at <= r_until for r_at, r_until in restarts)
                )
                if not reason:
                    r.phantom_attempts += 1
                    r.problem(
                        f"count: task {key}: a sweep counted an attempt under claim {claim} "
                        f"(set by {claim_app.get(claim)!r} at {set_at}), which no execution "
                        "ran, no kill and no restart explains"
                    )
                continue
            candidates = [
                e for e in runs_under.get(claim, [])
                if e.outcome == "raised" and e.attempt == new and e.exec_id not in matched
            ]
            if not candidates:
                r.phantom_attempts += 1
                r.problem(
                    f"count: task {key}: attempt {new} counted as failed under claim {claim} "
                    "with no execution that raised it"
                )
                continue
            matched.add(candidates[0].exec_id)
            failures_of[claim] += 1
        for e in execs_of_task.get(key, []):
            if e.outcome != "raised" or e.exec_id in matched or e.claim in swept:
                continue
            releaser = cleared_by.get(e.claim) if e.claim is not None else None
            if releaser is not None and releaser[1] not in bump_xids:
                app, _, released_at = releaser
                if app in stops and stops[app] <= released_at:
                    continue  # released in a drain: a failure caused by shutdown spends none
                if app == "chaos-operator":
                    continue  # cancelled: what the attempt did is discarded, not counted
            r.uncounted += 1
            r.problem(
                f"count: task {key}: execution {e.exec_id} raised on attempt {e.attempt} "
                f"under claim {e.claim}, and no bump counted it"
            )


def _check_keys(r: Report, conn: psycopg.Connection[Any], claim_rows: list[Any]) -> None:
    """Per-key limits (SPEC 15, one run per key at once): no two runs of one key hold
    its slot at overlapping times, and a keyed run is claimed only while it holds it.

    Sound for the same reason as the claims: a run takes a slot only in a statement
    that saw the slot's last holder let go committed, so its trigger's clock is later
    than the holder's; and the hold trigger fires before the claim trigger of the
    same row change."""
    keyed = dict(
        conn.execute(
            "SELECT id, concurrency_key FROM workflow_runs WHERE concurrency_key IS NOT NULL"
        ).fetchall()
    )
    r.keyed_runs = len(keyed)
    holds: dict[uuid.UUID, list[list[Any]]] = defaultdict(list)  # run -> [start, end]
    for run_id, old, new, at in conn.execute(
        "SELECT run_id, old_slot, new_slot, at FROM chaos_key_holds ORDER BY run_id, at, id"
    ).fetchall():
        if old is None and new is not None:
            holds[run_id].append([at, INF])
        elif old is not None and new is None and holds[run_id]:
            holds[run_id][-1][1] = at
        else:
            r.key_overlaps += 1
            r.problem(f"key: run {run_id} changed slot {old} -> {new} at {at}")
    by_key: dict[bytes, list[tuple[Any, Any, uuid.UUID]]] = defaultdict(list)
    for run_id, spans in holds.items():
        r.key_holds += len(spans)
        for start, end in spans:
            by_key[keyed.get(run_id, b"")].append((start, end, run_id))
    for key, spans in by_key.items():
        spans.sort(key=lambda s: s[0])
        latest_end, holder = spans[0][1], spans[0][2]
        for start, end, run_id in spans[1:]:
            if start < latest_end and run_id != holder:
                r.key_overlaps += 1
                r.problem(
                    f"key {key.hex()[:12]}: runs {holder} and {run_id} held it at once "
                    f"(from {start} to {min(end, latest_end)})"
                )
            if end > latest_end:
                latest_end, holder = end, run_id
    for run_id, _, new, at, *_ in claim_rows:
        if new is None or run_id not in keyed:
            continue
        if not any(start <= at <= end for start, end in holds.get(run_id, [])):
            r.unheld_claims += 1
            r.problem(f"key: run {run_id} was claimed at {at} without holding its key")


def _writer_claim(
    history: list[tuple[Any, ...]], w_at: datetime.datetime, w_xid: int
) -> uuid.UUID | None:
    """The claim a write at `w_at` in transaction `w_xid` was made under (see the module doc)."""
    for old, _new, _at, xid in history:
        if xid == w_xid and old is not None:
            return old  # type: ignore[no-any-return]
    current = None
    for _old, new, at, xid in history:
        if at <= w_at and xid != w_xid:
            current = new
    return current  # type: ignore[no-any-return]


def _check_ticks(r: Report, conn: psycopg.Connection[Any]) -> None:
    from .app import SCHEDULE

    row = conn.execute(
        "SELECT s.created_at, (SELECT min(at) FROM chaos_faults WHERE kind = 'stop') "
        "FROM workflow_schedules s WHERE s.name = %s",
        (SCHEDULE,),
    ).fetchone()
    if row is None or row[1] is None:
        return
    registered, stopped = row
    keys = [
        key for (key,) in conn.execute(
            "SELECT idempotency_key FROM workflow_runs WHERE idempotency_key LIKE %s",
            (f"schedule:{SCHEDULE}:%",),
        ).fetchall()
    ]
    prefix = f"schedule:{SCHEDULE}:"
    fired = {key[len(prefix):] for key in keys}
    r.ticks = len(keys)
    # Ticks from the first whole minute after registration to 5 s before the stop: each
    # had at least 5 s with a worker looking.
    tick = registered.replace(second=0, microsecond=0) + datetime.timedelta(minutes=1)
    while tick <= stopped - datetime.timedelta(seconds=5):
        stamp = tick.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        if stamp not in fired:
            r.ticks_missed += 1
            r.problem(f"schedule: the tick {stamp} started no run")
        tick += datetime.timedelta(minutes=1)
