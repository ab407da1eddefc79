"""Run ids: opaque to callers (SPEC 4), time-ordered underneath.

A run's id is the primary key of its run row and leads the primary key of its task
rows. Ids made one after another sort one after another, so a start's index entries
land on the few rightmost leaf pages of those two indexes instead of on a random one
of a table's history: after each checkpoint a random one costs a full-page image in
the WAL (bench/README.md, "Time-ordered run ids"). The id carries the millisecond
of its making in its first 48 bits, as a UUID of version 7 (RFC 9562) does, and 74
random bits.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import psycopg
from helpers import Inp, Out, drain, registry

import workflow
from workflow import Status, ids

A = workflow.Task("a", Out)
B = workflow.Task("b", Out)


def _millisecond(run_id: uuid.UUID | str) -> int:
    return uuid.UUID(str(run_id)).int >> 80


def _ms_now() -> int:
    return time.time_ns() // 1_000_000


def test_a_new_id_is_a_version_7_uuid_of_the_current_millisecond() -> None:
    before = _ms_now()
    made = [ids.new_id() for _ in range(1000)]
    after = _ms_now()
    assert all(i.version == 7 and i.variant == uuid.RFC_4122 for i in made)
    assert all(before <= _millisecond(i) <= after for i in made)
    assert len(set(made)) == len(made)


def test_ids_made_in_later_milliseconds_sort_later() -> None:
    made = []
    for _ in range(5):
        made.append(ids.new_id())
        while _ms_now() <= _millisecond(made[-1]):  # past the id's own millisecond
            pass
    assert made == sorted(made)
    assert [str(i) for i in made] == sorted(str(i) for i in made), "and as text"


RANDOM_BITS = 0x0FFF_3FFF_FFFF_FFFF_FFFF  # rand_a (12 bits), then rand_b (62)


def test_ids_differ_in_each_of_their_74_random_bits() -> None:
    # 74 random bits: a clash among a million ids of one millisecond has odds of about
    # 3e-11. Ids made as fast as possible share a millisecond with a few hundred others.
    made = [ids.new_id() for _ in range(20_000)]
    assert len(set(made)) == len(made)
    assert len({i.int & RANDOM_BITS for i in made}) == len(made)
    ones = zeros = 0
    for i in made:
        ones |= i.int & RANDOM_BITS
        zeros |= ~i.int & RANDOM_BITS
    assert ones == zeros == RANDOM_BITS, "every random bit is seen both ways"
    assert bin(RANDOM_BITS).count("1") == 74


def _steps() -> tuple[workflow.Registry, Any]:
    return registry(
        workflow.handle(A, lambda run: Out("a")),
        workflow.handle(B, lambda run: Out(run.output(A).value + "b")),
    )


def test_runs_started_on_each_path_get_time_ordered_ids(
    make_manager: Any, db: psycopg.Connection[Any], engine_url: str
) -> None:
    reg, wf = _steps()
    mgr = make_manager(reg)
    made: list[tuple[int, str, int]] = []

    def note(start: Any) -> str:
        before = _ms_now()
        run_id = start()
        made.append((before, run_id, _ms_now()))
        first = _ms_now()
        while _ms_now() == first:
            pass
        return str(run_id)

    fast = note(lambda: wf.start(mgr, Inp(1)).id)
    with psycopg.connect(engine_url) as conn, conn.transaction():
        note(lambda: wf.start_tx(conn, mgr, Inp(2)).id)
    assert mgr.run(fast).wait(timeout=10) is Status.SUCCEEDED
    admin = workflow.Admin(engine_url)
    try:
        note(lambda: admin.fork(fast, from_task="b"))
    finally:
        admin.close()
    for before, run_id, after in made:
        assert uuid.UUID(run_id).version == 7, run_id
        assert before <= _millisecond(run_id) <= after
    listed = [r[0] for r in db.execute("SELECT id::text FROM workflow_runs ORDER BY id")]
    assert listed == [run_id for _, run_id, _ in made], "the primary key's order is the starts'"


def test_claims_and_events_get_time_ordered_ids_too(
    make_manager: Any, db: psycopg.Connection[Any], engine_url: str
) -> None:
    # A claim id keys workflow_runs_claims, an event id workflow_events_pkey: random
    # ones would scatter their entries as random run ids did. Every event takes an id
    # made here, but a sweep's, made by the server in the same layout (below).
    reg, wf = _steps()
    mgr = make_manager(reg)
    fast = wf.start(mgr, Inp(1))
    assert fast.wait(timeout=10) is Status.SUCCEEDED
    with psycopg.connect(engine_url) as conn, conn.transaction():
        polled = wf.start_tx(conn, mgr, Inp(2))
    drain(db, mgr, [polled], poll_interval=0.2)
    with psycopg.connect(engine_url) as conn, conn.transaction():
        cancelled = wf.start_tx(conn, mgr, Inp(3))
    admin = workflow.Admin(engine_url)
    try:
        admin.cancel(cancelled.id, reason="test")
    finally:
        admin.close()
    claims = [r[0] for r in db.execute(
        "SELECT released_claim FROM workflow_runs WHERE id = ANY(%s::uuid[]) ORDER BY created_at",
        ([fast.id, polled.id],),
    )]
    events = [r[0] for r in db.execute("SELECT id FROM workflow_events")]
    assert len(claims) == 2 and len(events) == 1
    assert [i.version for i in claims + events] == [7, 7, 7], (claims, events)


def test_failed_and_parked_events_get_time_ordered_ids(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    def flaky(run: workflow.TaskRun[Inp]) -> Out:
        if run.attempt == 1:
            raise RuntimeError("the provider timed out")
        raise workflow.Permanent("the provider refused", code="refused")

    reg, wf = registry(
        workflow.handle(A, flaky, max_attempts=3, backoff_schedule=[0.01, 0.01]),
    )
    mgr = make_manager(reg)
    run = wf.start(mgr, Inp(1))
    assert run.wait(timeout=10) is Status.PARKED
    events = db.execute(
        "SELECT kind, id FROM workflow_events WHERE run_id = %s ORDER BY at", (run.id,)
    ).fetchall()
    assert [kind for kind, _ in events] == ["failed", "parked"]
    assert [i.version for _, i in events] == [7, 7], events


def test_swept_events_get_time_ordered_ids_made_by_the_server(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    # One sweep releases any number of claims at once, so its events' ids are made in
    # its statement: the server's millisecond, version 7's bits, the rest random.
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)
    with db.transaction():
        runs = [wf.start_tx(db, mgr, Inp(n)) for n in range(3)]
    db.execute(
        "UPDATE workflow_runs SET claim_id = gen_random_uuid(), status = 'running', "
        "heartbeat_at = now() - interval '1 hour'"
    )
    before = _ms_now()
    assert mgr.new_runnable(workflow.RunnerConfig(listen=False)).sweeper.sweep() == 3
    after = _ms_now()
    events = [r[0] for r in db.execute("SELECT id FROM workflow_events WHERE kind = 'swept'")]
    assert len(events) == len(runs)
    assert all(i.version == 7 and i.variant == uuid.RFC_4122 for i in events), events
    # The server's clock is this machine's; a millisecond of slack for the rounding.
    assert all(before - 1 <= _millisecond(i) <= after + 1 for i in events), events
