"""Group commit (issue 20): task steps recorded at the same moment share one statement.

Combining is forced, not hoped for: a first step is held in flight by a row lock
that another transaction holds on its run, the other steps are written meanwhile
(they queue behind it), then the lock is let go. The first step is then written
alone and the queued ones in one `complete_tasks` statement. Each caller must
still learn exactly whether its own fenced write matched; a combined statement
that fails must fall back to single writes, so one bad row fails only its own
run; a keyed run finishing inside a combined statement must wake the pollers; and
a combined write whose reply is lost after the commit must not be taken for a
lost claim.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers import Records, insert_claimed_run, wait_until
from psycopg_pool import ConnectionPool
from replyproxy import ReplyProxy

from workflow.store import CHANNEL, Store

OUTPUT = '{"ref": "x"}'


@pytest.fixture
def store(pool: ConnectionPool[Any], logs: tuple[logging.Logger, Records]) -> Store:
    return Store(pool, logs[0])


class Step:
    """One run's step as the executor records it, and what `complete_task` answered."""

    def __init__(self, run_id: uuid.UUID, claim_id: uuid.UUID, *, seq: int = 1,
                 finishes: bool = False, output: str | None = OUTPUT) -> None:
        self.run_id, self.claim_id, self.seq = run_id, claim_id, seq
        self.finishes, self.output = finishes, output
        self.matched: bool | None = None
        self.error: BaseException | None = None

    def write(self, store: Store) -> None:
        try:
            next_seq = 4 if self.finishes else self.seq + 1
            self.matched = store.complete_task(
                self.run_id, self.claim_id, self.seq, self.output, next_seq, self.finishes
            )
        except BaseException as e:
            self.error = e


def write_combined(store: Store, db_url: str, first: Step, queued: list[Step]) -> None:
    """Write `first`, held in flight by a row lock, then `queued` behind it; let go."""
    threads: list[threading.Thread] = []

    def start(step: Step) -> None:
        thread = threading.Thread(target=step.write, args=(store,))
        thread.start()
        threads.append(thread)

    with psycopg.connect(db_url) as blocker:
        blocker.execute("SELECT FROM workflow_runs WHERE id = %s FOR UPDATE", (first.run_id,))
        start(first)
        wait_until(lambda: store.steps.busy, "the first step in flight")
        for step in queued:
            start(step)
        wait_until(lambda: store.steps.queued == len(queued), "the other steps queued")
        blocker.rollback()
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive()


def run_row(db: psycopg.Connection[Any], run_id: uuid.UUID) -> tuple[Any, ...]:
    row = db.execute(
        "SELECT r.current_seq, r.status, r.claim_id IS NOT NULL, "
        "array_agg(t.output::text ORDER BY t.seq) "
        "FROM workflow_runs r JOIN workflow_tasks t ON t.run_id = r.id WHERE r.id = %s "
        "GROUP BY r.id",
        (run_id,),
    ).fetchone()
    assert row is not None
    return tuple(row)


def xids(db: psycopg.Connection[Any]) -> int:
    """The next transaction id the server will assign (write transactions so far)."""
    row = db.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint").fetchone()
    assert row is not None
    return int(row[0])


def test_queued_steps_share_one_statement_and_each_learns_its_own_fence(
    store: Store, db: psycopg.Connection[Any], db_url: str
) -> None:
    """One stale claim among valid ones: only its run is refused, and only it is untouched."""
    runs = [insert_claimed_run(db) for _ in range(6)]
    first = Step(*runs[0])
    queued = [Step(*run, finishes=(i % 2 == 0)) for i, run in enumerate(runs[1:5])]
    stale = Step(runs[5][0], uuid.uuid4())  # another executor's claim now holds this run
    before = xids(db)
    write_combined(store, db_url, first, [*queued, stale])
    # The blocker's lock took an id; then the first step alone and the five together.
    assert xids(db) - before == 3
    assert store.steps.combined_steps == 5
    assert [s.error for s in (first, *queued, stale)] == [None] * 6
    assert first.matched is True
    assert [s.matched for s in queued] == [True] * 4
    assert stale.matched is False
    assert run_row(db, runs[0][0]) == (2, "running", True, [OUTPUT, None, None])
    for i, (run_id, _) in enumerate(runs[1:5]):
        if i % 2 == 0:
            assert run_row(db, run_id) == (4, "succeeded", False, [OUTPUT, None, None])
        else:
            assert run_row(db, run_id) == (2, "running", True, [OUTPUT, None, None])
    assert run_row(db, runs[5][0]) == (1, "running", True, [None, None, None])


def test_a_lone_step_is_written_alone_at_once(store: Store, db: psycopg.Connection[Any]) -> None:
    run_id, claim_id = insert_claimed_run(db)
    before = xids(db)
    assert store.complete_task(run_id, claim_id, 1, OUTPUT, 2, False) is True
    assert xids(db) - before == 1
    assert (store.steps.flushes, store.steps.combined_steps) == (1, 0)


def test_outputs_of_none_only_combine(
    store: Store, db: psycopg.Connection[Any], db_url: str
) -> None:
    """Tasks that return nothing: an array of nothing but NULLs is still typed."""
    runs = [insert_claimed_run(db) for _ in range(4)]
    steps = [Step(*run, output=None) for run in runs]
    write_combined(store, db_url, steps[0], steps[1:])
    assert [s.matched for s in steps] == [True] * 4
    assert store.steps.combined_steps == 3


def test_a_row_the_server_refuses_fails_only_its_own_run(
    store: Store, db: psycopg.Connection[Any], db_url: str, logs: tuple[logging.Logger, Records]
) -> None:
    runs = [insert_claimed_run(db) for _ in range(5)]
    first = Step(*runs[0])
    bad = Step(*runs[2], output="{not json")
    queued = [Step(*runs[1]), bad, Step(*runs[3], finishes=True), Step(*runs[4])]
    write_combined(store, db_url, first, queued)
    assert isinstance(bad.error, psycopg.errors.InvalidTextRepresentation)
    assert [s.matched for s in (first, *queued) if s is not bad] == [True] * 4
    assert [s.error for s in (first, *queued) if s is not bad] == [None] * 4
    assert store.steps.combined_steps == 0, "the combined statement failed as a whole"
    logs[1].wait_for("writing them one by one")
    assert run_row(db, runs[2][0]) == (1, "running", True, [None, None, None])
    assert run_row(db, runs[3][0]) == (4, "succeeded", False, [OUTPUT, None, None])
    assert run_row(db, runs[4][0]) == (2, "running", True, [OUTPUT, None, None])


def test_a_keyed_run_finishing_in_a_combined_write_wakes_the_pollers(
    store: Store, db: psycopg.Connection[Any], db_url: str
) -> None:
    key = b"k" * 32
    keyed = insert_claimed_run(db, workflow_name="Keyed", key=key, slot=0)
    db.execute(  # a run of the same key waiting for its slot
        "INSERT INTO workflow_runs (id, workflow, status, input, task_count, current_seq, "
        "concurrency_key) VALUES (gen_random_uuid(), 'Keyed', 'pending', '{}'::jsonb, 3, 1, %s)",
        (key,),
    )
    runs = [insert_claimed_run(db) for _ in range(3)]
    with psycopg.connect(db_url, autocommit=True) as listener:
        listener.execute(f"LISTEN {CHANNEL}")
        finishing = Step(*keyed, seq=3, finishes=True)
        write_combined(store, db_url, Step(*runs[0]), [Step(*runs[1]), finishing, Step(*runs[2])])
        assert finishing.matched is True
        assert store.steps.combined_steps == 3
        notes = [n.payload for n in listener.notifies(timeout=10, stop_after=1)]
    assert notes == ["Keyed"]
    row = db.execute("SELECT key_slot, status FROM workflow_runs WHERE id = %s",
                     (keyed[0],)).fetchone()
    assert row == (None, "succeeded")


# --- a lost reply ------------------------------------------------------------------------

COMBINED = "AS s (id, claim_id, seq, output, next_seq"


@pytest.fixture
def proxied_store(db: psycopg.Connection[Any], db_url: str,
                  logs: tuple[logging.Logger, Records]) -> Iterator[tuple[Store, ReplyProxy]]:
    with ReplyProxy(db.info.host, db.info.port) as proxy:
        pool: ConnectionPool[Any] = ConnectionPool(
            proxy.url_for(db_url), min_size=1, max_size=8,
            kwargs={"autocommit": True, "prepare_threshold": None}, open=True,
        )
        try:
            yield Store(pool, logs[0]), proxy
        finally:
            pool.close()


@pytest.mark.direct(reason="the proxy stands where PgBouncer would")
def test_a_combined_write_whose_reply_is_lost_is_not_taken_for_lost_claims(
    proxied_store: tuple[Store, ReplyProxy], db: psycopg.Connection[Any], db_url: str
) -> None:
    """The combined statement commits and its reply is dropped: the steps written one
    by one after it find their finishes already done (`released`) and their other steps
    still theirs, so every caller learns True."""
    store, proxy = proxied_store
    runs = [insert_claimed_run(db) for _ in range(5)]
    first = Step(*runs[0])
    queued = [Step(*run, finishes=(i % 2 == 0)) for i, run in enumerate(runs[1:])]
    proxy.drop_reply(COMBINED)
    write_combined(store, db_url, first, queued)
    assert proxy.dropped == 1
    assert [s.error for s in (first, *queued)] == [None] * 5
    assert [s.matched for s in (first, *queued)] == [True] * 5
    for i, (run_id, _) in enumerate(runs[1:]):
        expected = (4, "succeeded", False) if i % 2 == 0 else (2, "running", True)
        assert run_row(db, run_id)[:3] == expected
