"""Group commit (issue 20): task steps recorded, and runs started, at the same moment
share one statement.

Combining is forced, not hoped for: a first step is held in flight by a row lock
that another transaction holds on its run, the other steps are written meanwhile
(they queue behind it: these tests allow one write in flight, where the store
allows a second lone one beside the first, which its own tests below cover),
then the lock is let go. The first step is then written
alone and the queued ones in one `complete_tasks` statement. Each caller must
still learn exactly whether its own fenced write matched; a combined statement
that fails must fall back to single writes, so one bad row fails only its own
run; a keyed run finishing inside a combined statement must wake the pollers; and
a combined write whose reply is lost after the commit must not be taken for a
lost claim. The fast path's starts (no transaction, idempotency key or concurrency
key of the caller's) combine the same way; a table lock holds the first in flight.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers import Records, insert_claimed_run, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg_pool import ConnectionPool
from replyproxy import ReplyProxy

import workflow.store
from workflow.store import CHANNEL, ClaimedRun, Store, array_literal
from workflow.store.group_commit import GroupCommit

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


class Finishes:
    """A worker completer's batch of finishing steps (`Store.finish_runs`), claiming up
    to `claim` runs of W; what it answered and claimed, or raised."""

    def __init__(self, steps: list[tuple[uuid.UUID, uuid.UUID]], claim: int,
                 outputs: dict[int, str] | None = None) -> None:
        self.params = [
            Store.step_params(run_id, claim_id, 1, (outputs or {}).get(i, OUTPUT), 4)
            for i, (run_id, claim_id) in enumerate(steps)
        ]
        self.claim = claim
        self.answers: list[bool | Exception] = []
        self.claimed: list[ClaimedRun] = []
        self.error: BaseException | None = None

    def write(self, store: Store) -> None:
        try:
            self.answers, self.claimed = store.finish_runs(self.params, ["W"], self.claim)
        except BaseException as e:
            self.error = e


def insert_waiting_run(db: psycopg.Connection[Any], workflow_name: str = "W") -> uuid.UUID:
    """A run of `workflow_name` waiting to be claimed (its own commit: created after the
    ones inserted before it)."""
    run_id, _ = insert_claimed_run(db, workflow_name=workflow_name)
    db.execute("UPDATE workflow_runs SET claim_id = NULL, heartbeat_at = NULL, "
               "status = 'pending' WHERE id = %s", (run_id,))
    return run_id


def claim_of(db: psycopg.Connection[Any], run_id: uuid.UUID) -> tuple[Any, ...]:
    """(claim id, released claim, the tasks' attempts) of a run."""
    row = db.execute(
        "SELECT r.claim_id, r.released_claim, (SELECT sum(attempts) FROM workflow_tasks t "
        "WHERE t.run_id = r.id) FROM workflow_runs r WHERE r.id = %s", (run_id,),
    ).fetchone()
    assert row is not None
    return tuple(row)


def write_combined(store: Store, db_url: str, first: Step, queued: list[Step]) -> None:
    """Write `first`, held in flight by a row lock, then `queued` behind it; let go."""
    lock = ("SELECT FROM workflow_runs WHERE id = %s FOR UPDATE", (first.run_id,))
    _held_then_queued(store, store.steps, db_url, lock, first, queued)


def _held_then_queued(store: Store, group: GroupCommit[Any], db_url: str,
                      lock: tuple[str, tuple[Any, ...]], first: Any, queued: list[Any]) -> None:
    """`first.write(store)` held in flight by `lock` (taken by another transaction), the
    `queued` writes made meanwhile, then the lock let go and every write awaited."""
    threads: list[threading.Thread] = []

    def start(write: Any) -> None:
        thread = threading.Thread(target=write.write, args=(store,))
        thread.start()
        threads.append(thread)

    group.flights = 1  # the writes after the first queue, none rides beside it
    with psycopg.connect(db_url) as blocker:
        blocker.execute(*lock)
        start(first)
        wait_until(lambda: group.in_flight == 1, "the first write in flight")
        for write in queued:
            start(write)
        wait_until(lambda: group.queued == len(queued), "the other writes queued")
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


def writers(db: psycopg.Connection[Any], run_ids: list[uuid.UUID]) -> set[str]:
    """The transactions that last wrote these runs' rows and their task rows (xmin): one
    commit shared by several runs shows as one id."""
    rows = db.execute(
        "SELECT xmin::text FROM workflow_runs WHERE id = ANY(%s) "
        "UNION SELECT xmin::text FROM workflow_tasks WHERE run_id = ANY(%s) AND output IS NOT NULL",
        (run_ids, run_ids),
    ).fetchall()
    return {row[0] for row in rows}


def test_queued_steps_share_one_statement_and_each_learns_its_own_fence(
    store: Store, db: psycopg.Connection[Any], db_url: str
) -> None:
    """One stale claim among valid ones: only its run is refused, and only it is untouched."""
    runs = [insert_claimed_run(db) for _ in range(6)]
    first = Step(*runs[0])
    queued = [Step(*run, finishes=(i % 2 == 0)) for i, run in enumerate(runs[1:5])]
    stale = Step(runs[5][0], uuid.uuid4())  # another executor's claim now holds this run
    write_combined(store, db_url, first, [*queued, stale])
    # The first step alone, then the five together: one commit for the four that matched.
    assert (store.steps.flushes, store.steps.combined) == (2, 5)
    together = writers(db, [s.run_id for s in queued])
    assert len(together) == 1
    assert together.isdisjoint(writers(db, [first.run_id]))
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


def test_a_stale_claims_step_sharing_a_batch_with_the_live_claims_step_of_its_run_is_refused(
    store: Store, db: psycopg.Connection[Any], db_url: str
) -> None:
    """A handler past its timeout was swept and its run claimed again by this process:
    the old execution's step and the new one's can meet in one combined write. Only the
    live claim's step lands, and only its caller is told so."""
    runs = [insert_claimed_run(db) for _ in range(2)]
    run_id, live = runs[1]
    stale = Step(run_id, uuid.uuid4(), seq=1, output='"stale"')
    current = Step(run_id, live, seq=1)
    write_combined(store, db_url, Step(*runs[0]), [stale, current])
    assert store.steps.combined == 2
    assert (current.matched, stale.matched) == (True, False)
    assert run_row(db, run_id) == (2, "running", True, [OUTPUT, None, None])


def test_finishes_written_together_claim_the_runs_taking_their_place_in_the_same_commit(
    store: Store, db: psycopg.Connection[Any]
) -> None:
    """A worker's completer writes its runs' finishes in one statement that claims, in
    the same commit, the oldest runs waiting, as many as it asks for: each finish learns
    whether its own claim matched (a stale one is refused, the others are not), and the
    runs claimed are held and snapshotted as a poller's claim returns them."""
    runs = [insert_claimed_run(db) for _ in range(3)]
    waiting = [insert_waiting_run(db) for _ in range(5)]
    insert_waiting_run(db, "Other")  # not of the workflows asked for
    stale = (insert_claimed_run(db)[0], uuid.uuid4())
    batch = Finishes([runs[0], stale, runs[1], runs[2]], claim=3)
    batch.write(store)
    assert batch.error is None
    assert batch.answers == [True, False, True, True]
    assert [run.id for run in batch.claimed] == waiting[:3]
    for run in batch.claimed:
        assert claim_of(db, run.id) == (run.claim_id, None, 0)
        assert [t.seq for t in run.tasks] == [1, 2, 3]
    for run_id, _ in runs:
        assert run_row(db, run_id) == (4, "succeeded", False, [OUTPUT, None, None])
    assert claim_of(db, stale[0])[0] is not None  # the stale finish touched nothing
    # One commit wrote the finishes and the claims.
    assert len(writers(db, [*(run_id for run_id, _ in runs), *waiting[:3]])) == 1
    assert [claim_of(db, run_id)[0] for run_id in waiting[3:]] == [None, None]


def test_finishes_asking_for_more_runs_than_wait_get_what_there_is(
    store: Store, db: psycopg.Connection[Any]
) -> None:
    runs = [insert_claimed_run(db) for _ in range(3)]
    waiting = insert_waiting_run(db)
    batch = Finishes(runs, claim=3)
    batch.write(store)
    assert batch.answers == [True] * 3
    assert [run.id for run in batch.claimed] == [waiting]


def test_finishes_claiming_nothing_are_written_without_a_claim(
    store: Store, db: psycopg.Connection[Any]
) -> None:
    runs = [insert_claimed_run(db) for _ in range(2)]
    waiting = insert_waiting_run(db)
    batch = Finishes(runs, claim=0)
    batch.write(store)
    assert (batch.answers, batch.claimed) == ([True, True], [])
    assert claim_of(db, waiting) == (None, None, 0)


def test_a_failed_batch_of_finishes_is_written_alone_and_claims_none(
    store: Store, db: psycopg.Connection[Any], logs: tuple[logging.Logger, Records]
) -> None:
    """A row the server refuses fails the statement before its commit: the finishes are
    written one by one (each learns its own answer: the bad one its error), and nothing
    is claimed (the poller claims)."""
    runs = [insert_claimed_run(db) for _ in range(3)]
    waiting = [insert_waiting_run(db) for _ in range(2)]
    batch = Finishes(runs, claim=2, outputs={1: "{not json"})
    batch.write(store)
    assert batch.error is None
    assert batch.answers[0] is True and batch.answers[2] is True
    assert isinstance(batch.answers[1], psycopg.errors.InvalidTextRepresentation)
    assert batch.claimed == []
    logs[1].wait_for("a combined write of 3 finishing steps failed")
    assert run_row(db, runs[1][0]) == (1, "running", True, [None, None, None])
    assert [claim_of(db, run_id) for run_id in waiting] == [(None, None, 0)] * 2


def test_a_lone_step_is_written_alone_at_once(store: Store, db: psycopg.Connection[Any]) -> None:
    run_id, claim_id = insert_claimed_run(db)
    assert store.complete_task(run_id, claim_id, 1, OUTPUT, 2, False) is True
    assert (store.steps.flushes, store.steps.combined) == (1, 0)
    assert len(writers(db, [run_id])) == 1


class Held:
    """Writes held in flight by row locks on their runs, each let go of on its own."""

    def __init__(self, store: Store, db_url: str) -> None:
        self._store, self._db_url = store, db_url
        self._blockers: dict[uuid.UUID, psycopg.Connection[Any]] = {}
        self.threads: dict[uuid.UUID, threading.Thread] = {}

    def start(self, step: Step, *, hold: bool = True) -> None:
        if hold:
            blocker = self._blockers[step.run_id] = psycopg.connect(self._db_url)
            blocker.execute(lock_run(step.run_id)[0], (step.run_id,))
        thread = self.threads[step.run_id] = threading.Thread(target=step.write,
                                                               args=(self._store,))
        thread.start()

    def let_go(self, step: Step) -> None:
        self._blockers.pop(step.run_id).close()
        self.join(step)

    def join(self, step: Step) -> None:
        self.threads[step.run_id].join(timeout=30)
        assert not self.threads[step.run_id].is_alive()

    def close(self) -> None:
        for blocker in self._blockers.values():
            blocker.close()


def ride_side_by_side(store: Store, db: psycopg.Connection[Any], db_url: str) -> None:
    """Two lone steps: the first held in flight by a row lock on its run, the second
    written meanwhile; the second must be made (and answered) while the first is still
    in flight, then the first is let go of."""
    first, second = (Step(*insert_claimed_run(db)) for _ in range(2))
    held = Held(store, db_url)
    try:
        held.start(first)
        wait_until(lambda: store.steps.in_flight == 1, "the first step in flight")
        assert not store.steps.busy
        held.start(second, hold=False)
        held.join(second)
        assert second.matched is True
        assert store.steps.in_flight == 1 and held.threads[first.run_id].is_alive()
        held.let_go(first)
    finally:
        held.close()
    assert first.matched is True


def test_a_second_lone_step_rides_beside_one_in_flight_instead_of_queueing(
    store: Store, db: psycopg.Connection[Any], db_url: str
) -> None:
    """Two threads' steps at once: the second is made at once on its own connection while
    the first is still in flight (held there by a row lock), not queued behind it to be
    made alone anyway after it."""
    ride_side_by_side(store, db, db_url)
    assert (store.steps.flushes, store.steps.combined, store.steps.in_flight) == (2, 0, 0)


def test_steps_queue_behind_two_in_flight_and_the_last_to_end_makes_the_queue(
    store: Store, db: psycopg.Connection[Any], db_url: str
) -> None:
    """With two lone steps in flight the next ones queue; so does one arriving while a
    queue waits, even after one of the two has ended (the queue is not overtaken), and
    the queue goes to the one still in flight: when it ends, the queue is made in one
    statement. While that statement is in flight, a step arriving queues behind it."""
    a, b, c, d, e, f = (Step(*insert_claimed_run(db)) for _ in range(6))
    held = Held(store, db_url)
    try:
        held.start(a)
        wait_until(lambda: store.steps.in_flight == 1, "a in flight")
        held.start(b)
        wait_until(lambda: store.steps.in_flight == 2, "a and b in flight")
        assert store.steps.busy
        held.start(c)  # held too: the statement that carries it stays in flight
        held.start(d, hold=False)
        wait_until(lambda: store.steps.queued == 2, "c and d queued")
        held.let_go(a)
        # a ended while b was still in flight: it left the queue to b.
        assert (store.steps.in_flight, store.steps.queued) == (1, 2)
        held.start(e, hold=False)
        wait_until(lambda: store.steps.queued == 3, "e queued behind c and d")
        held.let_go(b)
        wait_until(lambda: store.steps.queued == 0, "b handed the queue on")
        assert store.steps.in_flight == 1  # c, d and e in one statement, held by c's lock
        held.start(f, hold=False)
        wait_until(lambda: store.steps.queued == 1, "f queued behind the combined statement")
        held.let_go(c)
        for step in (d, e, f):
            held.join(step)
    finally:
        held.close()
    assert [s.error for s in (a, b, c, d, e, f)] == [None] * 6
    assert [s.matched for s in (a, b, c, d, e, f)] == [True] * 6
    assert (store.steps.flushes, store.steps.combined, store.steps.in_flight) == (4, 3, 0)
    assert len(writers(db, [c.run_id, d.run_id, e.run_id])) == 1
    # Once the combined statement has ended, two lone steps ride side by side again.
    ride_side_by_side(store, db, db_url)


def test_a_queued_step_interrupted_while_it_waits_still_makes_the_queue_it_is_handed(
    store: Store, db: psycopg.Connection[Any], db_url: str
) -> None:
    """Ctrl-C on the main thread while its step waits behind another in flight: the step
    waits on, is handed the queue when that one ends, makes it, and only then raises the
    interrupt. Had it stopped waiting, the queue handed to it would never be made, and
    every later step of the process would wait behind it for ever."""
    store.steps.flights = 1  # the main thread's step queues behind the first
    first, mine, later = (Step(*insert_claimed_run(db)) for _ in range(3))
    held = Held(store, db_url)
    main = threading.main_thread().ident
    assert main == threading.get_ident(), "signals reach the main thread only"
    # Ctrl-C's own handler, whatever the suite was started from: a background job of a
    # non-interactive shell (`cmd &` in a script) starts with SIGINT ignored, and Python
    # then leaves it ignored.
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)

    def interrupt_then_let_go() -> None:
        wait_until(lambda: store.steps.queued == 1, "the main thread's step queued")
        signal.pthread_kill(main, signal.SIGINT)
        time.sleep(0.2)  # the interrupt handled while the step waits
        held.let_go(first)

    try:
        held.start(first)
        wait_until(lambda: store.steps.in_flight == 1, "the first step in flight")
        helper = threading.Thread(target=interrupt_then_let_go)
        helper.start()
        with pytest.raises(KeyboardInterrupt):
            store.complete_task(mine.run_id, mine.claim_id, 1, OUTPUT, 2, False)
        helper.join(timeout=30)
    finally:
        held.close()
        if handler is not None:  # None: a handler not set from Python, left as it was
            signal.signal(signal.SIGINT, handler)
    assert first.matched is True
    assert run_row(db, mine.run_id) == (2, "running", True, [OUTPUT, None, None])
    assert (store.steps.in_flight, store.steps.queued) == (0, 0)
    later.write(store)
    assert later.matched is True


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(threads=st.integers(min_value=2, max_value=8), steps=st.integers(min_value=1, max_value=5))
def test_steps_of_many_threads_at_once_are_all_written_and_none_is_left_waiting(
    store: Store, db: psycopg.Connection[Any], threads: int, steps: int
) -> None:
    """Threads writing steps as fast as they can, each of its own run: every step is
    written once and answered, whatever mix of lone flights and combined statements
    the timing made, and nothing is left in flight or queued (no lost wake-up)."""
    runs = [insert_claimed_run(db, tasks=6) for _ in range(threads)]
    answers: list[list[bool]] = [[] for _ in runs]

    def walk(i: int) -> None:
        run_id, claim_id = runs[i]
        for seq in range(1, steps + 1):
            answers[i].append(store.complete_task(run_id, claim_id, seq, OUTPUT, seq + 1,
                                                  False))

    workers = [threading.Thread(target=walk, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
        assert not worker.is_alive()
    assert answers == [[True] * steps] * threads
    assert (store.steps.in_flight, store.steps.queued) == (0, 0)
    rows = db.execute(
        "SELECT r.current_seq, count(t.output) FROM workflow_runs r "
        "JOIN workflow_tasks t ON t.run_id = r.id WHERE r.id = ANY(%s) GROUP BY r.id",
        ([run_id for run_id, _ in runs],),
    ).fetchall()
    assert rows == [(steps + 1, steps)] * threads


def test_outputs_of_none_only_combine(
    store: Store, db: psycopg.Connection[Any], db_url: str
) -> None:
    """Tasks that return nothing: an array of nothing but NULLs is still typed."""
    runs = [insert_claimed_run(db) for _ in range(4)]
    steps = [Step(*run, output=None) for run in runs]
    write_combined(store, db_url, steps[0], steps[1:])
    assert [s.matched for s in steps] == [True] * 4
    assert store.steps.combined == 3


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
    assert store.steps.combined == 0, "the combined statement failed as a whole"
    logs[1].wait_for("a combined write of 4 task steps failed")
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
        assert store.steps.combined == 3
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


@pytest.mark.direct(reason="the proxy stands where PgBouncer would")
def test_runs_claimed_by_a_batch_of_finishes_whose_reply_is_lost_are_let_go_of(
    proxied_store: tuple[Store, ReplyProxy], db: psycopg.Connection[Any]
) -> None:
    """The completer's statement commits its finishes and its claims, and its reply is
    dropped: nobody knows the runs it claimed, so they are released at once (not left
    for the sweeper, which would count an attempt none of them made), claimable by the
    next claim; the finishes, written again one by one, find themselves done."""
    store, proxy = proxied_store
    runs = [insert_claimed_run(db) for _ in range(2)]
    waiting = [insert_waiting_run(db) for _ in range(3)]
    proxy.drop_reply(COMBINED)
    batch = Finishes(runs, claim=2)
    batch.write(store)
    assert proxy.dropped == 1
    assert (batch.error, batch.answers, batch.claimed) == (None, [True, True], [])
    released = [claim_of(db, run_id) for run_id in waiting[:2]]
    assert all(claim is None and gone is not None and attempts == 0
               for claim, gone, attempts in released), released
    assert claim_of(db, waiting[2]) == (None, None, 0)
    assert [run.id for run in store.claim_runs(["W"], 5)] == waiting


def statements(db: psycopg.Connection[Any], text: str = "", *, waiting: bool = False) -> int:
    """How many statements of this database (but `db`'s own) whose text (its first
    kilobyte) has `text` run now; `waiting`: only those waiting on a lock."""
    row = db.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND pid <> pg_backend_pid() AND state = 'active' AND query LIKE %s "
        "AND (NOT %s OR wait_event_type = 'Lock')",
        (f"%{text}%", waiting),
    ).fetchone()
    assert row is not None
    return int(row[0])


# The fence of complete_tasks(_claiming) and insert_runs; no write made alone has it.
COMBINED = ") AS held"


def assert_orphans_run_on(db: psycopg.Connection[Any]) -> None:
    """The server goes on running a statement whose client is gone: it does not check
    the connection (`client_connection_check_interval`, from PostgreSQL 14; 13 never
    checks)."""
    setting = "SELECT current_setting('client_connection_check_interval', true)"
    row = db.execute(setting).fetchone()
    gone_on = "the server must go on running a statement whose client is gone"
    assert row in {("0",), (None,)}, gone_on


def cut_while_running(store: Store, group: GroupCommit[Any], proxy: ReplyProxy,
                      db: psycopg.Connection[Any], db_url: str, hold: tuple[str, tuple[Any, ...]],
                      block: tuple[str, tuple[Any, ...]], first: Any, queued: list[Any],
                      *, block_for_good: bool = False) -> None:
    """`first` held in flight by `hold`, `queued` queued behind it, then their combined
    statement made to wait by `block` (another transaction's lock); its connection cut
    while the server still runs it; then `block` let go, so the server commits it after
    its writer has given up on it. Returns when every write has returned.

    `block_for_good`: `block` is let go of only once the combined statement has gone
    from the server (its writer must end it: the blocker is an idle transaction that
    would hold on for ever)."""
    assert_orphans_run_on(db)
    threads = [threading.Thread(target=write.write, args=(store,)) for write in (first, *queued)]
    group.flights = 1  # the writes after the first queue, none rides beside it
    with psycopg.connect(db_url) as holder, psycopg.connect(db_url) as blocker:
        holder.execute(*hold)
        threads[0].start()
        wait_until(lambda: group.in_flight == 1, "the first write in flight")
        for thread in threads[1:]:
            thread.start()
        wait_until(lambda: group.queued == len(queued), "the other writes queued")
        blocker.execute(*block)
        holder.rollback()
        wait_until(lambda: statements(db, COMBINED, waiting=True) > 0,
                   "the combined write on a lock")
        proxy.cut_all()
        # The writers go on: something of theirs waits on a lock too (a write made alone
        # on the blocker's or the combined write's, or a wait for the combined write).
        wait_until(lambda: statements(db, waiting=True) >= 2, "the writers going on to wait")
        if block_for_good:
            wait_until(lambda: statements(db, COMBINED) == 0, "the combined write ended")
        blocker.rollback()
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive()


def lock_run(run_id: uuid.UUID) -> tuple[str, tuple[Any, ...]]:
    return "SELECT FROM workflow_runs WHERE id = %s FOR UPDATE", (run_id,)


def steps_survive_a_cut(store: Store, proxy: ReplyProxy, db: psycopg.Connection[Any],
                        db_url: str, finishes: list[bool], *, block_for_good: bool = False) -> None:
    """A first step, then steps that finish or not as `finishes` says, combined and cut
    while running (`cut_while_running`, blocked on the last one's run): every caller
    learns True, and every run is where its step took it."""
    runs = [insert_claimed_run(db) for _ in range(len(finishes) + 1)]
    first = Step(*runs[0])
    queued = [Step(*run, finishes=done) for run, done in zip(runs[1:], finishes, strict=True)]
    cut_while_running(store, store.steps, proxy, db, db_url, lock_run(runs[0][0]),
                      lock_run(runs[-1][0]), first, queued, block_for_good=block_for_good)
    assert [(s.error, s.matched) for s in (first, *queued)] == [(None, True)] * len(runs)
    for step in (first, *queued):
        finished = (4, "succeeded", False) if step.finishes else (2, "running", True)
        assert run_row(db, step.run_id)[:3] == finished


@pytest.mark.direct(reason="the proxy stands where PgBouncer would")
def test_steps_of_a_combined_write_still_running_when_its_connection_is_lost_are_found(
    proxied_store: tuple[Store, ReplyProxy], db: psycopg.Connection[Any], db_url: str
) -> None:
    """The connection of a combined write is lost while the server still runs it (it
    waits on a row lock another transaction holds), and the server commits it after its
    writer has given up on it. The steps made again one by one wait for it to end and
    find themselves done: no caller takes its own committed step for a lost claim (and
    stops executing a run that still holds its claim)."""
    steps_survive_a_cut(*proxied_store, db, db_url, [True, False, True])


@pytest.mark.direct(reason="the proxy stands where PgBouncer would")
def test_a_combined_write_whose_connection_is_lost_is_ended_when_it_waits_too_long(
    proxied_store: tuple[Store, ReplyProxy], db: psycopg.Connection[Any], db_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The combined write whose connection was lost waits on a lock that an idle
    transaction holds for good: after `OUTLAST_PATIENCE` its backend is terminated (its
    transaction rolled back) rather than every later step of the process waiting behind
    it, and the steps are made again one by one."""
    monkeypatch.setattr(workflow.store, "OUTLAST_PATIENCE", 0.3)
    steps_survive_a_cut(*proxied_store, db, db_url, [True, False], block_for_good=True)


@pytest.mark.direct(reason="the proxy stands where PgBouncer would")
def test_runs_claimed_by_finishes_still_running_when_their_connection_is_lost_are_let_go_of(
    proxied_store: tuple[Store, ReplyProxy], db: psycopg.Connection[Any], db_url: str
) -> None:
    """The completer's statement waits on a row lock another transaction holds, its
    connection is cut, and the server commits it after its writer gave up on it: what it
    claimed is let go of once it has committed, not looked for before and missed, so
    the runs are neither stranded until the sweeper nor charged an attempt none of them
    made; the finishes, written again one by one after it ended, find themselves done."""
    store, proxy = proxied_store
    assert_orphans_run_on(db)
    runs = [insert_claimed_run(db) for _ in range(2)]
    waiting = [insert_waiting_run(db) for _ in range(3)]
    batch = Finishes(runs, claim=2)
    writer = threading.Thread(target=batch.write, args=(store,))
    with psycopg.connect(db_url) as blocker:
        blocker.execute(*lock_run(runs[1][0]))
        writer.start()
        wait_until(lambda: statements(db, COMBINED, waiting=True) > 0,
                   "the batch's statement on a lock")
        proxy.cut_all()
        wait_until(lambda: statements(db, waiting=True) >= 2, "the writer going on to wait")
        blocker.rollback()
    writer.join(timeout=30)
    assert not writer.is_alive()
    assert (batch.error, batch.answers, batch.claimed) == (None, [True, True], [])

    def let_go() -> bool:
        return all(claim is None and gone is not None
                   for claim, gone, _ in (claim_of(db, run_id) for run_id in waiting[:2]))

    wait_until(let_go, "the runs the lost statement claimed let go of")
    assert [claim_of(db, run_id)[2] for run_id in waiting] == [0, 0, 0]
    assert claim_of(db, waiting[2]) == (None, None, 0)
    assert [run.id for run in store.claim_runs(["W"], 5)] == waiting


# --- starts --------------------------------------------------------------------------


class Start:
    """One fast-path start as the starter makes it, and what `insert_run` answered."""

    def __init__(self, *, claimed: bool = True, input: str = '{"n": 1}',
                 idempotency_key: str | None = None) -> None:
        self.run_id = uuid.uuid4()
        self.claim_id = uuid.uuid4() if claimed else None
        self.input, self.idempotency_key = input, idempotency_key
        self.answer: tuple[uuid.UUID, bool] | None = None
        self.error: BaseException | None = None

    def write(self, store: Store) -> None:
        try:
            self.answer = store.insert_run(
                None, run_id=self.run_id, workflow="W", status="running" if self.claim_id
                else "pending", idempotency_key=self.idempotency_key, input=self.input,
                input_sealed=None, context=None, context_sealed=None, task_count=3,
                current_seq=1, claim_id=self.claim_id, names="{a,b,c}", skipped="{f,t,f}",
                wake=self.claim_id is None,
            )
        except BaseException as e:
            self.error = e


TABLE_LOCK = ("LOCK TABLE workflow_runs IN SHARE MODE", ())


def start_combined(store: Store, db_url: str, first: Start, queued: list[Start]) -> None:
    """Start `first`, held in flight by a table lock, then `queued` behind it; let go."""
    _held_then_queued(store, store.starts, db_url, TABLE_LOCK, first, queued)


def task_rows(db: psycopg.Connection[Any], run_id: uuid.UUID) -> list[tuple[Any, ...]]:
    return db.execute(
        "SELECT seq, name, skipped, finished_at IS NOT NULL FROM workflow_tasks "
        "WHERE run_id = %s ORDER BY seq", (run_id,),
    ).fetchall()


def test_queued_starts_share_one_insert_and_each_gets_its_own_run(
    store: Store, db: psycopg.Connection[Any], db_url: str
) -> None:
    first = Start()
    queued = [Start(), Start(claimed=False), Start(), Start(claimed=False)]
    with psycopg.connect(db_url, autocommit=True) as listener:
        listener.execute(f"LISTEN {CHANNEL}")
        start_combined(store, db_url, first, queued)
        notes = [n.payload for n in listener.notifies(timeout=10, stop_after=2)]
    assert notes == ["W"], "the starts left for a poller wake the pollers (one notice a commit)"
    assert [s.error for s in (first, *queued)] == [None] * 5
    assert [s.answer for s in (first, *queued)] == [
        (s.run_id, s.claim_id is not None) for s in (first, *queued)
    ]
    assert (store.starts.flushes, store.starts.combined) == (2, 4)
    rows = db.execute(
        "SELECT id, status, claim_id, heartbeat_at IS NOT NULL, input FROM workflow_runs "
        "ORDER BY created_at"
    ).fetchall()
    assert [row[0] for row in rows] == [s.run_id for s in (first, *queued)], "in start order"
    for row, s in zip(rows, (first, *queued), strict=True):
        assert row[1:] == ("running" if s.claim_id else "pending", s.claim_id,
                           s.claim_id is not None, {"n": 1})
        assert task_rows(db, s.run_id) == [(1, "a", False, False), (2, "b", True, True),
                                           (3, "c", False, False)]


def test_a_start_the_server_refuses_fails_only_its_own(
    store: Store, db: psycopg.Connection[Any], db_url: str
) -> None:
    bad = Start(input="{not json")
    queued = [Start(), bad, Start(claimed=False)]
    start_combined(store, db_url, Start(), queued)
    assert isinstance(bad.error, psycopg.errors.InvalidTextRepresentation)
    assert store.starts.combined == 0
    assert [s.answer is not None for s in queued] == [True, False, True]
    row = db.execute("SELECT count(*), count(*) FILTER (WHERE id = %s) FROM workflow_runs",
                     (bad.run_id,)).fetchone()
    assert row == (3, 0)


def test_starts_with_an_idempotency_key_are_never_combined(
    store: Store, db: psycopg.Connection[Any], db_url: str
) -> None:
    """Their insert waits for a key another transaction holds, bounded per statement."""
    keyed = Start(idempotency_key="k1")
    keyed.write(store)
    assert keyed.error is None and keyed.answer == (keyed.run_id, True)
    assert store.starts.flushes == 0


COMBINED_START = "WITH ORDINALITY AS g (id, workflow"


@pytest.mark.direct(reason="the proxy stands where PgBouncer would")
def test_a_combined_start_whose_reply_is_lost_recognises_its_runs(
    proxied_store: tuple[Store, ReplyProxy], db: psycopg.Connection[Any], db_url: str
) -> None:
    store, proxy = proxied_store
    first, queued = Start(), [Start(), Start(claimed=False), Start()]
    proxy.drop_reply(COMBINED_START)
    start_combined(store, db_url, first, queued)
    assert proxy.dropped == 1
    assert [s.error for s in (first, *queued)] == [None] * 4
    assert [s.answer for s in (first, *queued)] == [
        (s.run_id, s.claim_id is not None) for s in (first, *queued)
    ]
    row = db.execute("SELECT count(*), count(DISTINCT id) FROM workflow_runs").fetchone()
    assert row == (4, 4), "each run inserted once"


def hold_id(run_id: uuid.UUID) -> tuple[str, tuple[Any, ...]]:
    """A row with `run_id`, inserted and not committed: an insert of that id waits on it."""
    return ("INSERT INTO workflow_runs (id, workflow, status, input, task_count, current_seq) "
            "VALUES (%s, 'W', 'pending', '{}'::jsonb, 3, 1)", (run_id,))


@pytest.mark.direct(reason="the proxy stands where PgBouncer would")
def test_a_combined_start_still_running_when_its_connection_is_lost_recognises_its_runs(
    proxied_store: tuple[Store, ReplyProxy], db: psycopg.Connection[Any], db_url: str
) -> None:
    """The connection of a combined start is lost while the server still runs it (one of
    its ids waits on another transaction's insert), and the server commits it later: the
    starts made again one by one wait for it to end and recognise their runs, rather
    than insert them again and fail on their own ids."""
    store, proxy = proxied_store
    first, queued = Start(), [Start(), Start(claimed=False)]
    cut_while_running(store, store.starts, proxy, db, db_url, hold_id(first.run_id),
                      hold_id(queued[1].run_id), first, queued)
    assert [s.error for s in (first, *queued)] == [None] * 3
    assert [s.answer for s in (first, *queued)] == [
        (s.run_id, s.claim_id is not None) for s in (first, *queued)
    ]
    row = db.execute("SELECT count(*), count(DISTINCT id) FROM workflow_runs").fetchone()
    assert row == (3, 3), "each run inserted once"


def test_a_start_whose_earlier_try_committed_unseen_recognises_its_run(
    store: Store, db: psycopg.Connection[Any]
) -> None:
    """A start made again after its earlier try committed without its caller seeing it
    (that try's connection was lost while the server still ran it, so the lookup of
    the retry came too soon) meets its own id: it answers with that run, not with the
    primary key's violation."""
    start = Start()
    start.write(store)
    assert start.error is None
    start.answer = None
    start.write(store)  # the same id, claim and snapshot: what a retry sends
    assert (start.error, start.answer) == (None, (start.run_id, True))
    row = db.execute("SELECT count(*) FROM workflow_runs").fetchone()
    assert row == (1,)


def test_a_finishing_step_whose_earlier_try_committed_unseen_is_not_a_lost_claim(
    store: Store, db: psycopg.Connection[Any]
) -> None:
    """A run's last step made again after its earlier try finished the run unseen: the
    claim is gone, let go of by this very claim, so the step is recognised as written;
    a step under a claim some other write took from it is still refused."""
    run_id, claim_id = insert_claimed_run(db)
    assert store.complete_task(run_id, claim_id, 3, OUTPUT, 4, True)
    assert store.complete_task(run_id, claim_id, 3, OUTPUT, 4, True)
    other, _ = insert_claimed_run(db)
    assert not store.complete_task(other, uuid.uuid4(), 3, OUTPUT, 4, True)


# --- the arrays sent as literals -----------------------------------------------------

_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"))


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.none(), _TEXT), max_size=8))
def test_text_arrays_sent_as_literals_arrive_as_they_were(
    db: psycopg.Connection[Any], values: list[str | None]
) -> None:
    """Outputs (JSON text with quotes, backslashes, braces, commas, blanks, NULL) go to
    the combined writes as one array literal: the server must read back every element."""
    row = db.execute("SELECT %s::text[]", (array_literal(values),)).fetchone()
    assert row is not None and row[0] == values


def test_uuid_int_and_bool_arrays_sent_as_literals(db: psycopg.Connection[Any]) -> None:
    ids = [uuid.uuid4(), uuid.uuid4()]
    row = db.execute(
        "SELECT %s::uuid[], %s::smallint[], %s::boolean[]",
        (array_literal(ids), array_literal([1, None, 3]), array_literal([True, False, None])),
    ).fetchone()
    assert row == (ids, [1, None, 3], [True, False, None])
