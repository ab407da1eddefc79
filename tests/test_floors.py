"""Claims that start where the last ones left off (workflow/store/floors.py).

While a process drains a backlog, its claims of a workflow start at a floor: the
earliest due time among its last full claim's runs, less `MARGIN`, instead of the front
of `workflow_runs_ready_per_workflow`, where every run claimed since the last vacuum left
an entry to step over. A run still claimable before the floor (committed late, or let go
of without a new due time) waits at most `SPAN` seconds more; a claim that comes back
short drops the floor. The floors' clock is each test's own: no test waits for a floor
to expire, and none measures how long a claim took.
"""

from __future__ import annotations

import datetime
import logging
import time
import uuid
from typing import Any

import psycopg
import pytest
from helpers import Inp, Out, Records, registry, wait_until
from pgbouncer import runner_config
from psycopg_pool import ConnectionPool

import workflow
from workflow import Status
from workflow.store import Store
from workflow.store.floors import FULL, MARGIN, SPAN, Floors, floor_times
from workflow.store.rows import ClaimedRun


class Clock:
    """A monotonic clock that moves only when a test moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(
    pool: ConnectionPool[Any], logs: tuple[logging.Logger, Records], clock: Clock
) -> Store:
    store = Store(pool, logs[0])
    store.floors = Floors(clock)
    return store


def add_runs(db: psycopg.Connection[Any], workflow_name: str, dues: list[float]) -> list[uuid.UUID]:
    """One-task runs of `workflow_name`, due `dues[i]` seconds from now (negative: overdue),
    each inserted and committed in a transaction of its own; their ids."""
    made = []
    for due in dues:
        run_id = uuid.uuid4()
        with db.transaction():
            db.execute(
                """
                WITH run AS (
                    INSERT INTO workflow_runs (id, workflow, status, input, task_count,
                                               current_seq, next_retry_at, created_at)
                    VALUES (%s, %s, 'pending', '{"n": 1}', 1, 1,
                            now() + make_interval(secs => %s), clock_timestamp())
                    RETURNING id
                )
                INSERT INTO workflow_tasks (run_id, seq, name) SELECT id, 1, 'a' FROM run
                """,
                (run_id, workflow_name, due),
            )
        made.append(run_id)
    return made


def backlog(db: psycopg.Connection[Any], count: int, workflow_name: str = "W") -> list[uuid.UUID]:
    """`count` runs due 100, 99, ... seconds ago: claimed in this order."""
    return add_runs(db, workflow_name, [-100.0 + i for i in range(count)])


def ids(runs: list[Any]) -> list[uuid.UUID]:
    return [run.id for run in runs]


def test_a_full_claim_sets_a_floor_the_next_claims_start_at_until_it_expires(
    store: Store, db: psycopg.Connection[Any], clock: Clock
) -> None:
    queued = backlog(db, 40)
    first = store.claim_runs(["W"], 10)
    assert ids(first) == queued[:10]
    assert first[0].due_at is not None
    assert floor_times(store.floors.of(["W"])) == [first[0].due_at - MARGIN]
    # Committed now, due an hour ago: before the floor, as a run committed late is.
    late = add_runs(db, "W", [-3600.0])
    clock.now += 0.6 * SPAN
    second = store.claim_runs(["W"], 10)
    assert ids(second) == queued[10:20]  # from the floor: not the late run
    assert floor_times(store.floors.of(["W"])) == [second[0].due_at - MARGIN]  # moved on
    # A floor serves SPAN seconds from the claim that read from the front, however many
    # full claims moved it since; then a claim reads from the front again, in due order.
    # (A claim returns its runs in creation order: the late run comes last.)
    clock.now += 0.6 * SPAN
    assert ids(store.claim_runs(["W"], 10)) == [*queued[20:29], *late]


def test_a_short_claim_drops_the_floor(
    store: Store, db: psycopg.Connection[Any]
) -> None:
    queued = backlog(db, 15)
    assert ids(store.claim_runs(["W"], 10)) == queued[:10]
    assert store.floors.of(["W"]) != [None]
    assert ids(store.claim_runs(["W"], 10)) == queued[10:]  # 5 of 10: short
    assert store.floors.of(["W"]) == [None]
    late = add_runs(db, "W", [-3600.0])
    assert ids(store.claim_runs(["W"], 10)) == late


def test_each_workflow_has_its_own_floor(store: Store, db: psycopg.Connection[Any]) -> None:
    w_runs = backlog(db, 12, "W")
    assert ids(store.claim_runs(["W"], 10)) == w_runs[:10]
    v_runs = add_runs(db, "V", [-3600.0, -3599.0, -3598.0])  # before W's floor
    assert store.floors.of(["V", "W"])[0] is None
    assert ids(store.claim_runs(["V", "W"], 10)) == [*w_runs[10:], *v_runs]


def test_a_workflow_named_twice_is_claimed_once(store: Store, db: psycopg.Connection[Any]) -> None:
    queued = backlog(db, 8)
    assert ids(store.claim_runs(["W", "W"], 4)) == queued[:4]


def test_the_completers_claim_starts_at_the_floor_and_moves_it(
    store: Store, db: psycopg.Connection[Any], clock: Clock
) -> None:
    """A worker's finishes claim their threads' next runs (`finish_runs`) from the same
    floors as its poller's claims."""
    queued = backlog(db, 30)
    first = store.claim_runs(["W"], 10)
    late = add_runs(db, "W", [-3600.0])
    clock.now += 0.6 * SPAN
    steps = [Store.step_params(run.id, run.claim_id, 1, None, 2) for run in first]
    answers, claimed = store.finish_runs(steps, ["W"], 10)
    assert answers == [True] * 10
    assert ids(claimed) == queued[10:20]
    assert claimed[0].due_at is not None
    assert floor_times(store.floors.of(["W"])) == [claimed[0].due_at - MARGIN]
    clock.now += 0.6 * SPAN  # SPAN from the claim that read from the front, not from this
    steps = [Store.step_params(run.id, run.claim_id, 1, None, 2) for run in claimed]
    answers, claimed = store.finish_runs(steps, ["W"], 10)
    assert answers == [True] * 10
    assert ids(claimed) == [*queued[20:29], *late]  # (returned in creation order)


def test_a_run_committed_behind_a_draining_worker_is_not_left_behind(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    """A worker draining a backlog claims from its floors (on the real clock); a run
    committed meanwhile with a due time an hour old, before any floor, runs within about
    `SPAN`, long before the backlog's end (2,000 handlers of 5 ms, four at once: 2.5 s at
    the least), not at its end; every run runs once."""
    done: list[int] = []
    late: list[uuid.UUID] = []
    floored: list[bool] = []

    def fn(run: workflow.TaskRun[Inp]) -> Out:
        done.append(run.input.n)
        if run.input.n == 0:  # the backlog's first run: commit the late one now
            late.extend(add_runs(db, "W", [-3600.0]))  # its input is {"n": 1}
        time.sleep(0.005)
        return Out("ok")

    reg, wf = registry(workflow.handle(workflow.Task("a", Out), fn))
    mgr = make_manager(reg)
    floors = mgr._store.floors
    handed = floors.of

    def of(workflows: Any) -> Any:
        given = handed(workflows)
        floored.extend(floor is not None for floor in given)
        return given

    floors.of = of
    with db.transaction():
        for n in range(2000):
            wf.start_tx(db, mgr, Inp(n))
    runnable = mgr.new_runnable(runner_config(concurrency=4, batch_size=4))
    runnable.start()
    try:
        wait_until(
            lambda: db.execute(
                "SELECT count(*) FILTER (WHERE status = 'succeeded') FROM workflow_runs"
            ).fetchone() == (2001,),
            "every run, the late one included, succeeded",
            timeout=120,
        )
    finally:
        assert runnable.stop(timeout=10)
    assert any(floored), "no claim started at a floor"
    assert sorted(done) == sorted([1, *range(2000)])
    assert mgr.run(str(late[0])).status().status is Status.SUCCEEDED
    after = db.execute(
        "SELECT count(*) FROM workflow_runs WHERE finished_at > (SELECT finished_at"
        " FROM workflow_runs WHERE id = %s)",
        (late[0],),
    ).fetchone()
    assert after is not None and after[0] > 100, f"only {after} runs finished after the late one"


def claimed(*dues: tuple[str, datetime.datetime]) -> list[ClaimedRun]:
    """Claimed runs of the given workflows and due times (for `Floors` alone)."""
    return [
        ClaimedRun(id=uuid.uuid4(), workflow=workflow_name, claim_id=uuid.uuid4(), input={},
                   input_sealed=None, context=None, context_sealed=None, current_seq=1,
                   db_now=None, tasks=(), due_at=due)
        for workflow_name, due in dues
    ]


T0 = datetime.datetime(2026, 12, 7, tzinfo=datetime.timezone.utc)


def full(due: datetime.datetime) -> list[ClaimedRun]:
    """A claim's `FULL` runs of W, the first due at `due`."""
    return claimed(*[("W", due + datetime.timedelta(seconds=i)) for i in range(FULL)])


def test_a_claim_of_fewer_than_full_runs_makes_no_floor(clock: Clock) -> None:
    """A worker's completer claims as many runs as the finishes it carries, often one
    under a light load: one run found for one asked says nothing of a backlog, and a run
    committed late must not wait behind a floor then."""
    floors = Floors(clock)
    floors.claimed(["W"], [None], claimed(("W", T0)), 1)
    floors.claimed(["W"], [None], full(T0)[: FULL - 1], FULL - 1)
    assert floors.of(["W"]) == [None]
    floors.claimed(["W"], [None], full(T0), FULL)
    assert floor_times(floors.of(["W"])) == [T0 - MARGIN]
    # Once a floor stands, a claim of one made from it moves it.
    floors.claimed(["W"], floors.of(["W"]), claimed(("W", T0 + datetime.timedelta(hours=1))), 1)
    assert floor_times(floors.of(["W"])) == [T0 + datetime.timedelta(hours=1) - MARGIN]


def test_a_claim_made_from_a_floor_set_anew_meanwhile_neither_moves_it_nor_renews_it(
    clock: Clock,
) -> None:
    """Claims overlap (a poller and two completer threads): one made from a floor that
    expired and was set anew by a claim from the front while it was on its way must not
    put its own later floor in the new one's place, nor give a floor a second it was not
    read from the front for."""
    floors = Floors(clock)
    floors.claimed(["W"], [None], full(T0), FULL)  # from the front: floor 1
    stale = floors.of(["W"])
    assert stale[0] is not None
    clock.now += SPAN
    fresh = floors.of(["W"])
    assert fresh == [None]  # expired: the next claim reads from the front
    floors.claimed(["W"], fresh, full(T0 + datetime.timedelta(seconds=1)), FULL)
    renewed_at = clock.now
    # The claim made from floor 1, still on its way, comes back full, much further on.
    clock.now += 0.5 * SPAN
    floors.claimed(["W"], stale, full(T0 + datetime.timedelta(hours=1)), FULL)
    assert floor_times(floors.of(["W"])) == [T0 + datetime.timedelta(seconds=1) - MARGIN]
    clock.now = renewed_at + SPAN
    assert floors.of(["W"]) == [None]


def test_a_claim_made_from_a_dropped_floor_does_not_make_one(clock: Clock) -> None:
    floors = Floors(clock)
    floors.claimed(["W"], [None], full(T0), FULL)
    stale = floors.of(["W"])
    floors.claimed(["W"], stale, [], FULL)  # short: dropped
    floors.claimed(["W"], stale, full(T0 + datetime.timedelta(seconds=1)), FULL)
    assert floors.of(["W"]) == [None]
