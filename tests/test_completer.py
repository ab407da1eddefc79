"""A worker's completer (issue 20): a run's last write made off its thread, in batches.

A worker thread whose run's last task succeeded hands the finishing write to its
poller's completer and goes on; the write is made with others' in one statement that
also claims the runs taking their place, and the execution ends (its events, its
waiters, its count in flight) on the completer's thread once the write has
committed. These tests hold the completer's statement on a row lock that another
transaction holds, so that what happens before and after the commit can be seen
apart. Each run's own fence still decides: a finish whose claim was lost ends as
lost; one the database refuses counts a failed attempt; a drain waits for every
finish handed over; a full completer makes the next thread wait.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
from helpers import (
    Inp,
    Out,
    Records,
    drain,
    insert_claimed_run,
    registry,
    start_each_in_its_own_transaction,
    threads_fail_to_start,
    wait_until,
)

import workflow
from workflow import Status
from workflow.completer import Completer
from workflow.events import (
    AttemptEnded,
    ClaimLost,
    ExecutionEnded,
    FinishHandedOver,
    Outcome,
    RunFinished,
)
from workflow.executor import Executor
from workflow.store import ClaimedRun, Store

A = workflow.Task("a", Out)


class Seen:
    """Every event of a manager, with the name of the thread it came on."""

    def __init__(self, mgr: workflow.Manager) -> None:
        self.events: list[tuple[Any, str]] = []
        self._lock = threading.Lock()
        mgr.events.subscribe(self._add)

    def _add(self, event: Any) -> None:
        with self._lock:
            self.events.append((event, threading.current_thread().name))

    def of(self, kind: type) -> list[tuple[Any, str]]:
        with self._lock:
            return [(e, thread) for e, thread in self.events if isinstance(e, kind)]


def status_of(db: psycopg.Connection[Any], run_id: uuid.UUID) -> tuple[Any, ...]:
    row = db.execute(
        "SELECT r.status, r.claim_id IS NOT NULL, t.attempts FROM workflow_runs r "
        "JOIN workflow_tasks t ON t.run_id = r.id WHERE r.id = %s", (run_id,),
    ).fetchone()
    assert row is not None
    return tuple(row)


def lock_row(blocker: psycopg.Connection[Any], run_id: uuid.UUID) -> None:
    blocker.execute("SELECT FROM workflow_runs WHERE id = %s FOR UPDATE", (run_id,))


def hand_held(
    blocker: psycopg.Connection[Any], executor: Executor, completer: Completer, run: ClaimedRun
) -> None:
    """Execute `run` with `completer`, its row locked by `blocker`: its finish is handed
    over and held in a statement on its way until `blocker` lets go."""
    lock_row(blocker, run.id)
    executor.admit()
    executor.execute(run, completer=completer)
    wait_until(lambda: completer.pending == 0, "the finish in a statement")


def refuse_outputs(db: psycopg.Connection[Any], when: str, after: float = 0.0) -> None:
    """A trigger that makes the database refuse (after `after` seconds) every write of a
    task's output for which `when` holds."""
    db.execute(
        "CREATE FUNCTION refuse_output() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        f"PERFORM pg_sleep({after}); RAISE EXCEPTION 'refused by the test'; END $$"
    )
    db.execute(
        "CREATE TRIGGER refuse_output BEFORE UPDATE ON workflow_tasks FOR EACH ROW "
        f"WHEN (NEW.output IS DISTINCT FROM OLD.output AND {when}) "
        "EXECUTE FUNCTION refuse_output()"
    )


def completer_of(mgr: workflow.Manager, limit: int = 4, flights: int = 1) -> Completer:
    """A completer over `mgr`'s store that claims nothing (no poller behind it). One
    flight unless told: the tests that hold a statement on a row lock see the finishes
    handed meanwhile wait for the next one (a poller's completer has `FLIGHTS`)."""
    completer = Completer(mgr._store, mgr._executor.log, ["W"], limit, lambda: None,
                          lambda wanted: 0, lambda runs, reserved: None, flights=flights)
    completer.start()
    return completer


def test_a_workers_thread_goes_on_before_its_runs_finish_has_committed(
    make_manager: Any, db: psycopg.Connection[Any], db_url: str
) -> None:
    """The execution returns as soon as its finish is handed over, with the write still
    waiting on a lock: the run is still running and claimed, its claim heartbeated and
    counted in flight. Once the write commits, the execution ends on the completer's
    thread: the attempt, the finish and the end are announced there, and only then."""
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)
    seen = Seen(mgr)
    start_each_in_its_own_transaction(db, wf, mgr, 1)
    executor, completer = mgr._executor, completer_of(mgr)
    (run,) = mgr._store.claim_runs(["W"], 1)
    with psycopg.connect(db_url) as blocker:
        lock_row(blocker, run.id)
        executor.admit()
        assert executor.execute(run, completer=completer) is True
        assert [thread for _, thread in seen.of(FinishHandedOver)] == ["MainThread"]
        time.sleep(0.2)
        assert status_of(db, run.id) == ("running", True, 0)
        assert executor._in_flight == 1
        assert [claim.run_id for claim in executor.heartbeat.claims()] == [run.id]
        assert not seen.of(AttemptEnded) and not seen.of(ExecutionEnded)
        blocker.rollback()
    wait_until(lambda: bool(seen.of(ExecutionEnded)), "the execution's end")
    assert status_of(db, run.id) == ("succeeded", False, 0)
    assert executor._in_flight == 0
    assert not executor.heartbeat.claims()
    ended = seen.of(AttemptEnded) + seen.of(RunFinished) + seen.of(ExecutionEnded)
    assert [(type(e).__name__, thread) for e, thread in ended] == [
        ("AttemptEnded", "workflow-completer"),
        ("RunFinished", "workflow-completer"),
        ("ExecutionEnded", "workflow-completer"),
    ]
    assert ended[0][0].outcome is Outcome.SUCCEEDED
    assert ended[1][0].status is Status.SUCCEEDED
    completer.stop(10)


def test_finishes_handed_over_together_share_one_statement_and_each_learns_its_fence(
    make_manager: Any, db: psycopg.Connection[Any], db_url: str
) -> None:
    """While one finish is held in flight, three more are handed over; one of them lost
    its claim meanwhile (another executor's now). The three go in one statement: two
    succeed, the one whose claim is gone ends as lost (announced, not counted, the run
    left to its owner)."""
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)
    seen = Seen(mgr)
    start_each_in_its_own_transaction(db, wf, mgr, 4)
    executor, completer = mgr._executor, completer_of(mgr)
    first, *others = mgr._store.claim_runs(["W"], 4)
    thief = uuid.uuid4()
    db.execute("UPDATE workflow_runs SET claim_id = %s WHERE id = %s", (thief, others[1].id))
    with psycopg.connect(db_url) as blocker:
        lock_row(blocker, first.id)
        for run in (first, *others):
            executor.admit()
            assert executor.execute(run, completer=completer) is True
            if run is first:
                wait_until(lambda: completer.pending == 0, "the first finish in flight")
        assert completer.pending == 3
        blocker.rollback()
    wait_until(lambda: len(seen.of(ExecutionEnded)) == 4, "every execution's end")
    assert completer.statements == 2
    assert [status_of(db, run.id) for run in (first, others[0], others[2])] == [
        ("succeeded", False, 0)
    ] * 3
    assert db.execute("SELECT status, claim_id FROM workflow_runs WHERE id = %s",
                      (others[1].id,)).fetchone() == ("running", thief)
    assert [e.run_id for e, _ in seen.of(ClaimLost)] == [others[1].id]
    lost = [e for e, _ in seen.of(AttemptEnded) if e.run_id == others[1].id]
    assert [(e.outcome, e.claim_lost) for e in lost] == [(Outcome.ABANDONED, True)]
    assert executor._in_flight == 0 and not executor.heartbeat.claims()
    completer.stop(10)


def test_a_finish_the_database_refuses_counts_a_failed_attempt(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    """The finish's write fails (a trigger refuses the output of this one run): the
    attempt that ran is counted as failed, on the completer's thread, as a thread's own
    failed write would be; the run is released for its retry, not left claimed."""
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)
    seen = Seen(mgr)
    (started,) = start_each_in_its_own_transaction(db, wf, mgr, 1)
    refuse_outputs(db, f"NEW.run_id = '{started.id}'")
    executor, completer = mgr._executor, completer_of(mgr)
    (run,) = mgr._store.claim_runs(["W"], 1)
    executor.admit()
    assert executor.execute(run, completer=completer) is True
    wait_until(lambda: bool(seen.of(ExecutionEnded)), "the execution's end")
    row = db.execute(
        "SELECT r.status, r.claim_id, t.attempts, t.error FROM workflow_runs r "
        "JOIN workflow_tasks t ON t.run_id = r.id WHERE r.id = %s", (run.id,),
    ).fetchone()
    assert row is not None
    assert row[:3] == ("running", None, 1)  # released until its retry is due
    assert "refused by the test" in row[3]
    assert [e.outcome for e, _ in seen.of(AttemptEnded)] == [Outcome.FAILED]
    assert executor._in_flight == 0 and not executor.heartbeat.claims()
    completer.stop(10)


def test_finishes_handed_while_a_statement_is_held_go_in_a_second_one(
    make_manager: Any, db: psycopg.Connection[Any], db_url: str
) -> None:
    """With two flights, a finish handed over while a statement is on its way goes in a
    second statement at once, on another thread, and its execution ends while the
    first is still held; one handed while both are held waits for the next, and every
    run succeeds once they are let go."""
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)
    ended: dict[uuid.UUID, int] = {}  # run id: the ident of the thread its end came on

    def note_end(event: Any) -> None:
        if isinstance(event, ExecutionEnded):
            ended[event.run_id] = threading.get_ident()

    mgr.events.subscribe(note_end)
    start_each_in_its_own_transaction(db, wf, mgr, 4)
    executor, completer = mgr._executor, completer_of(mgr, flights=2)
    first, second, third, fourth = mgr._store.claim_runs(["W"], 4)
    with psycopg.connect(db_url) as blocker:
        hand_held(blocker, executor, completer, first)
        executor.admit()
        executor.execute(second, completer=completer)
        wait_until(lambda: second.id in ended, "the second execution's end")
        assert status_of(db, second.id)[0] == "succeeded"
        assert status_of(db, first.id) == ("running", True, 0)
        hand_held(blocker, executor, completer, third)
        executor.admit()
        executor.execute(fourth, completer=completer)
        time.sleep(0.2)
        assert completer.pending == 1, "the fourth waits for a statement to end"
        assert [status_of(db, run.id)[0] for run in (first, third, fourth)] == ["running"] * 3
        assert list(ended) == [second.id]
        blocker.rollback()
    wait_until(lambda: len(ended) == 4, "every execution's end")
    assert [status_of(db, run.id)[0] for run in (first, second, third, fourth)] == [
        "succeeded"
    ] * 4
    assert completer.statements == 4
    assert ended[first.id] != ended[second.id], "two threads wrote the two statements"
    assert threading.get_ident() not in ended.values()
    completer.stop(10)


def test_a_stop_waits_for_a_statement_held_while_the_other_flight_is_idle(
    make_manager: Any, db: psycopg.Connection[Any], db_url: str
) -> None:
    """`stop()` returns once the statement in flight has committed and its execution
    ended, not when the idle thread has stopped; with a timeout shorter than the hold it
    returns at the timeout, and the statement still commits afterwards."""
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)
    seen = Seen(mgr)
    start_each_in_its_own_transaction(db, wf, mgr, 1)
    executor, completer = mgr._executor, completer_of(mgr, flights=2)
    (run,) = mgr._store.claim_runs(["W"], 1)
    with psycopg.connect(db_url) as blocker:
        hand_held(blocker, executor, completer, run)
        began = time.monotonic()
        completer.stop(0.3)
        assert time.monotonic() - began >= 0.3
        assert not seen.of(ExecutionEnded)
        stopper = threading.Thread(target=completer.stop)
        stopper.start()
        time.sleep(0.2)
        assert stopper.is_alive(), "stop() waits for the statement held"
        blocker.rollback()
    stopper.join(timeout=10)
    assert not stopper.is_alive()
    assert len(seen.of(ExecutionEnded)) == 1
    assert status_of(db, run.id) == ("succeeded", False, 0)


def test_a_completer_whose_second_thread_cannot_start_stops_the_first(
    make_manager: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread that cannot start (the process is out of threads) fails `start()`, and
    leaves no thread of it running: the first one ends."""
    reg, _ = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)
    completer = Completer(mgr._store, mgr._executor.log, ["W"], 4, lambda: None,
                          lambda wanted: 0, lambda runs, reserved: None, flights=2)
    started = threads_fail_to_start(monkeypatch, lambda thread: bool(started))
    with pytest.raises(RuntimeError, match="can't start new thread"):
        completer.start()
    monkeypatch.undo()
    started[0].join(timeout=10)
    assert not started[0].is_alive(), "the thread that started has ended"


def test_a_full_completer_makes_the_next_thread_wait(
    make_manager: Any, db: psycopg.Connection[Any], db_url: str
) -> None:
    """With `limit` finishes on their way (one in the statement in flight, the others
    waiting for the next), a thread handing one more waits until the statement in
    flight ends: a worker never holds more than twice its concurrency in claims."""
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)
    seen = Seen(mgr)
    start_each_in_its_own_transaction(db, wf, mgr, 4)
    executor, completer = mgr._executor, completer_of(mgr, limit=2)
    first, *others = mgr._store.claim_runs(["W"], 4)
    with psycopg.connect(db_url) as blocker:
        hand_held(blocker, executor, completer, first)
        executor.admit()
        executor.execute(others[0], completer=completer)
        last = threading.Thread(
            target=lambda: (executor.admit(), executor.execute(others[1], completer=completer))
        )
        last.start()
        time.sleep(0.3)
        assert last.is_alive(), "the third finish waits for room"
        assert completer.pending == 1
        blocker.rollback()
    last.join(timeout=10)
    assert not last.is_alive()
    executor.admit()
    executor.execute(others[2], completer=completer)
    wait_until(lambda: len(seen.of(ExecutionEnded)) == 4, "every execution's end")
    assert [status_of(db, run.id)[0] for run in (first, *others)] == ["succeeded"] * 4
    completer.stop(10)


def in_the_wait_for_room(completer: Completer) -> int:
    """How many threads wait for room in `completer` (CPython's Condition keeps its
    waiters' locks in `_waiters`)."""
    return len(completer._room._waiters)  # type: ignore[attr-defined]


def waiting_for_room(
    mgr: workflow.Manager, wf: Any, db: psycopg.Connection[Any],
    blocker: psycopg.Connection[Any], count: int,
) -> tuple[Completer, ClaimedRun, list[ClaimedRun], list[threading.Thread]]:
    """A completer with room for one finish, taken by a statement held on `blocker`'s row
    lock, and `count` threads (`hander-N`, daemons: one left waiting fails its test, not
    the session's exit) each executing a run whose finish waits for room."""
    start_each_in_its_own_transaction(db, wf, mgr, count + 1)
    executor, completer = mgr._executor, completer_of(mgr, limit=1)
    first, *others = mgr._store.claim_runs(["W"], count + 1)
    hand_held(blocker, executor, completer, first)
    waiting = [
        threading.Thread(
            target=lambda run=run: (executor.admit(), executor.execute(run, completer=completer)),
            name=f"hander-{n}",
            daemon=True,
        )
        for n, run in enumerate(others)
    ]
    for thread in waiting:
        thread.start()
    wait_until(lambda: in_the_wait_for_room(completer) == count, "every thread waiting for room")
    assert all(thread.is_alive() for thread in waiting)
    assert completer.pending == 0
    return completer, first, others, waiting


def test_threads_waiting_for_room_are_each_woken_as_room_frees(
    make_manager: Any, db: psycopg.Connection[Any], db_url: str
) -> None:
    """Each thread waiting for room is woken as a statement's end frees room for it: with
    room for one finish, three threads waiting behind a held statement each hand theirs
    in turn, one statement each, and none is left waiting. (That a statement wakes no
    more of them than it freed room for is not something this test can see.)"""
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)
    seen = Seen(mgr)
    with psycopg.connect(db_url) as blocker:
        completer, first, others, waiting = waiting_for_room(mgr, wf, db, blocker, 3)
        blocker.rollback()
    for thread in waiting:
        thread.join(timeout=10)
        assert not thread.is_alive()
    wait_until(lambda: len(seen.of(ExecutionEnded)) == 4, "every execution's end")
    assert [status_of(db, run.id)[0] for run in (first, *others)] == ["succeeded"] * 4
    assert completer.statements == 4
    completer.stop(10)


def test_threads_waiting_for_room_when_the_completer_stops_write_their_own(
    make_manager: Any, db: psycopg.Connection[Any], db_url: str
) -> None:
    """A stop wakes every thread waiting for room: with nothing left for the completer
    to take, each writes its own finish on its own thread, without waiting for the
    statement still held; the stop returns once that statement has committed."""
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)
    seen = Seen(mgr)
    with psycopg.connect(db_url) as blocker:
        completer, first, others, waiting = waiting_for_room(mgr, wf, db, blocker, 2)
        stopper = threading.Thread(target=completer.stop, daemon=True)
        stopper.start()
        for thread in waiting:
            thread.join(timeout=10)
            assert not thread.is_alive(), "a stop wakes the threads waiting for room"
        assert [status_of(db, run.id)[0] for run in others] == ["succeeded"] * 2
        assert sorted(thread for _, thread in seen.of(ExecutionEnded)) == [
            "hander-0", "hander-1"
        ]
        assert stopper.is_alive(), "the stop waits for the statement held"
        blocker.rollback()
    stopper.join(timeout=10)
    assert not stopper.is_alive()
    assert status_of(db, first.id) == ("succeeded", False, 0)


def test_a_thread_that_fails_after_its_wake_up_for_room_passes_it_on(
    make_manager: Any, db: psycopg.Connection[Any], db_url: str
) -> None:
    """A statement's end wakes one thread waiting for each place it freed. When the woken
    thread fails before it takes the place (here the poller's `release` raises on it; an
    interrupt would do the same), the wake-up goes on to the next thread waiting: with
    nothing else in flight, that one would otherwise wait for ever."""
    reg, _ = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)

    def release() -> None:
        if threading.current_thread().name == "raiser":
            raise RuntimeError("release failed")

    completer = Completer(mgr._store, mgr._executor.log, ["W"], 1, release,
                          lambda wanted: 0, lambda runs, reserved: None, flights=1)
    completer.start()

    class Finish:
        def __init__(self) -> None:
            run_id, claim_id = insert_claimed_run(db, tasks=1)
            self.run_id = run_id
            self.params = Store.step_params(run_id, claim_id, 1, None, 2)
            self.answer: bool | Exception | None = None

        def resolve(self, answer: bool | Exception) -> None:
            self.answer = answer

    held, raised, last = Finish(), Finish(), Finish()
    failures: list[BaseException] = []

    def hand(finish: Finish) -> None:
        try:
            completer.hand(finish)
        except BaseException as e:
            failures.append(e)

    with psycopg.connect(db_url) as blocker:
        lock_row(blocker, held.run_id)
        completer.hand(held)
        wait_until(lambda: completer.pending == 0, "the held finish in a statement")
        threads = []
        for name, finish in (("raiser", raised), ("last", last)):
            thread = threading.Thread(target=hand, args=(finish,), name=name, daemon=True)
            thread.start()
            threads.append(thread)
            wait_until(lambda: in_the_wait_for_room(completer) == len(threads),
                       f"{name} waiting for room")
        blocker.rollback()
    wait_until(lambda: last.answer is not None, "the last thread's finish written")
    assert held.answer is True and last.answer is True and raised.answer is None
    assert [str(e) for e in failures] == ["release failed"]
    completer.stop(10)


def test_the_finishing_statement_takes_every_lock_on_the_fast_path(
    make_manager: Any, db: psycopg.Connection[Any], db_url: str
) -> None:
    """A worker's hottest statement (finishes, and the claims riding with them) locks
    `workflow_runs` with every index of it and `workflow_tasks` with its key: 12
    relations since 0013 (15 before), each taken on the backend's fast path. PostgreSQL
    15 has 16 fast-path lock slots a backend; beyond them a lock goes through the shared
    lock table, whose partitions are contended under load (bench/README.md, "The checks
    PostgreSQL reads at every write"). Five more indexes on the runs would cross that
    edge here."""
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)
    start_each_in_its_own_transaction(db, wf, mgr, 3)
    executor, completer = mgr._executor, completer_of(mgr)
    run, *_ = mgr._store.claim_runs(["W"], 1)

    def held() -> int | None:  # the backend of the statement waiting for the row lock
        row = db.execute("SELECT pid FROM pg_locks WHERE NOT granted LIMIT 1").fetchone()
        return None if row is None else int(row[0])

    with psycopg.connect(db_url) as blocker:
        hand_held(blocker, executor, completer, run)
        wait_until(lambda: held() is not None, "the statement waiting for the row lock")
        locks = db.execute(
            "SELECT relation::regclass::text, bool_and(fastpath) FROM pg_locks"
            " WHERE pid = %s AND locktype = 'relation' GROUP BY 1", (held(),),
        ).fetchall()
        blocker.rollback()
    completer.stop(10)
    relations = dict(locks)
    assert {"workflow_runs", "workflow_runs_pkey", "workflow_tasks"} <= set(relations)
    assert [name for name, fast in relations.items() if not fast] == []
    assert len(relations) <= 16


def test_a_finish_handed_to_a_stopped_completer_is_written_on_its_own_thread(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)
    seen = Seen(mgr)
    start_each_in_its_own_transaction(db, wf, mgr, 1)
    executor, completer = mgr._executor, completer_of(mgr)
    completer.stop(10)
    (run,) = mgr._store.claim_runs(["W"], 1)
    executor.admit()
    assert executor.execute(run, completer=completer) is True
    assert [thread for _, thread in seen.of(ExecutionEnded)] == ["MainThread"]
    assert status_of(db, run.id) == ("succeeded", False, 0)


def test_a_batch_claims_runs_in_the_places_its_finishes_left_and_delivers_them(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    """The completer asks for as many places as it has finishes, claims that many runs
    (oldest first) in the finishes' commit, and hands them over with the places
    reserved; places it could not fill are given back through `deliver`."""
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)
    runs = start_each_in_its_own_transaction(db, wf, mgr, 3)
    asked: list[int] = []
    delivered: list[tuple[list[ClaimedRun], int]] = []

    def reserve(wanted: int) -> int:
        asked.append(wanted)
        return wanted

    store: Store = mgr._store
    completer = Completer(store, mgr._executor.log, ["W"], 4, lambda: None, reserve,
                          lambda got, reserved: delivered.append((got, reserved)))
    finished = [insert_claimed_run(db, tasks=1) for _ in range(2)]

    class Finish:
        def __init__(self, run_id: uuid.UUID, claim_id: uuid.UUID) -> None:
            self.params = Store.step_params(run_id, claim_id, 1, None, 2)
            self.answer: bool | Exception | None = None

        def resolve(self, answer: bool | Exception) -> None:
            self.answer = answer

    finishes = [Finish(*run) for run in finished]
    completer._write(list(finishes))  # as its thread writes a batch
    assert [f.answer for f in finishes] == [True, True]
    assert asked == [2]
    ((got, reserved),) = delivered
    assert reserved == 2 and [str(run.id) for run in got] == [str(run.id) for run in runs[:2]]
    completer._write([Finish(*insert_claimed_run(db, tasks=1)) for _ in range(3)])
    assert asked == [2, 3]
    assert [str(run.id) for run in delivered[1][0]] == [str(runs[2].id)]
    assert delivered[1][1] == 3


def test_the_drain_waits_for_the_finishes_handed_over(
    make_manager: Any, db: psycopg.Connection[Any], db_url: str
) -> None:
    """`stop()` returns only once the finish a worker thread handed over has committed
    (held meanwhile on a row lock): the run succeeds, it is not released to be run
    again."""
    entered, go_on = threading.Event(), threading.Event()

    def handler(run: workflow.TaskRun[Inp]) -> Out:
        entered.set()
        go_on.wait(10)
        return Out("x")

    reg, wf = registry(workflow.handle(A, handler))
    mgr = make_manager(reg)
    seen = Seen(mgr)
    (run,) = start_each_in_its_own_transaction(db, wf, mgr, 1)
    runnable = mgr.new_runnable(workflow.RunnerConfig(poll_interval=0.1, listen=False))
    runnable.start()
    assert entered.wait(10)
    stopper = threading.Thread(target=runnable.stop, kwargs={"timeout": 30})
    with psycopg.connect(db_url) as blocker:
        lock_row(blocker, run.id)
        go_on.set()
        wait_until(lambda: bool(seen.of(FinishHandedOver)), "the finish handed over")
        stopper.start()
        time.sleep(0.3)
        assert stopper.is_alive(), "the drain waits for the finish"
        assert status_of(db, run.id) == ("running", True, 0)
        blocker.rollback()
    stopper.join(timeout=30)
    assert not stopper.is_alive()
    assert status_of(db, run.id) == ("succeeded", False, 0)


@pytest.mark.parametrize("raised_on", [RunFinished, ExecutionEnded])
def test_a_subscriber_raising_on_the_completers_thread_stops_nothing(
    make_manager: Any, db: psycopg.Connection[Any], raised_on: type,
    logs: tuple[logging.Logger, Records],
) -> None:
    """A `SystemExit` that a subscriber raises as a handed-over run finishes (on the
    completer's thread) is logged; the execution still ends (uncounted, its claim no
    longer heartbeated) and the completer goes on writing the other runs' finishes."""
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg, logger=logs[0])
    runs = start_each_in_its_own_transaction(db, wf, mgr, 6)
    doomed = str(runs[0].id)

    def exit_on(event: Any) -> None:
        if isinstance(event, raised_on) and str(event.run_id) == doomed:
            raise SystemExit(3)

    mgr.events.subscribe(exit_on)
    runnable = drain(db, mgr, runs, poll_interval=0.1, concurrency=2, batch_size=2)
    raised = logs[1].wait_for("ending an execution whose finish was written raised")
    assert raised.threadName == "workflow-completer"
    assert mgr._executor._in_flight == 0
    assert not mgr._executor.heartbeat.claims()
    assert runnable._poller._running == 0


def test_a_subscriber_raising_as_a_finish_is_handed_over_loses_no_success(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    """A `SystemExit` raised by a subscriber of `FinishHandedOver` (on the handler's
    thread) does not keep the finish from the completer: the success is written, not
    left claimed without a heartbeat for the sweeper to count as a failed attempt."""
    calls: list[int] = []

    def handler(run: workflow.TaskRun[Inp]) -> Out:
        calls.append(run.attempt)
        return Out("x")

    reg, wf = registry(workflow.handle(A, handler))
    mgr = make_manager(reg)
    runs = start_each_in_its_own_transaction(db, wf, mgr, 1)

    def exit_on(event: Any) -> None:
        if isinstance(event, FinishHandedOver):
            raise SystemExit(3)

    mgr.events.subscribe(exit_on)
    runnable = drain(db, mgr, runs, poll_interval=0.1, concurrency=1)
    assert calls == [1]
    assert mgr._executor._in_flight == 0 and not mgr._executor.heartbeat.claims()
    assert runnable._poller._running == 0


def test_a_thread_slow_to_come_back_from_a_hand_over_leaves_no_place_idle(
    make_manager: Any, db: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's place is free from the moment its finish is handed over, not from when its
    thread comes back (here 0.1 s later, as a preempted thread might): the completer
    claims in it, and a backlog never waits out the poll interval (5 s) with places
    free."""
    execute = Executor.execute

    def slow_to_come_back(self: Executor, run: ClaimedRun, **kwargs: Any) -> bool:
        handed = execute(self, run, **kwargs)
        if handed:
            time.sleep(0.1)
        return handed

    monkeypatch.setattr(Executor, "execute", slow_to_come_back)
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)
    runs = start_each_in_its_own_transaction(db, wf, mgr, 4)
    began = time.monotonic()
    runnable = drain(db, mgr, runs, poll_interval=5, concurrency=1)
    assert time.monotonic() - began < 4, "a place stayed idle for a poll interval"
    assert runnable._poller._running == 0


def test_a_failure_to_hand_over_what_a_batch_claimed_stops_nothing(
    make_manager: Any, db: psycopg.Connection[Any], logs: tuple[logging.Logger, Records]
) -> None:
    """`deliver` raising (it cannot start a thread, say) is logged: the batch's executions
    still end and the completer goes on taking finishes."""
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg, logger=logs[0])
    seen = Seen(mgr)
    start_each_in_its_own_transaction(db, wf, mgr, 2)
    failures = [RuntimeError("no thread")]

    def deliver(runs: list[ClaimedRun], reserved: int) -> None:
        if failures:
            raise failures.pop()

    completer = Completer(mgr._store, mgr._executor.log, ["W"], 4, lambda: None,
                          lambda wanted: 0, deliver)
    completer.start()
    executor = mgr._executor
    for run in mgr._store.claim_runs(["W"], 2):
        executor.admit()
        assert executor.execute(run, completer=completer) is True
        wait_until(lambda: not executor.heartbeat.claims(), "the execution's end")
    assert len(seen.of(ExecutionEnded)) == 2 and executor._in_flight == 0
    logs[1].wait_for("handing over the runs a batch claimed failed")
    completer.stop(10)


def test_a_finish_refused_after_its_thread_came_back_is_retried_when_due(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    """A handed-over finish that the database refuses releases its run for a retry, on the
    completer's thread, after the run's thread has come back and the poller has read
    the next due time again (the finish's statement is slow here, and so is the write
    of the failure): the poller must read it once more, so the retry runs when due
    (0.1 s), not a poll interval (30 s) later. The failed attempt's duration ends at
    the hand-over, as a successful one's does."""
    reg, wf = registry(workflow.handle(A, lambda run: Out("x"), backoff_schedule=[0.1]))
    mgr = make_manager(reg)
    seen = Seen(mgr)
    (started,) = start_each_in_its_own_transaction(db, wf, mgr, 1)
    # The first attempt's output only: its failure sets attempts to 1.
    refuse_outputs(db, "OLD.attempts = 0", after=0.6)
    db.execute(
        "CREATE FUNCTION slow_failure() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "PERFORM pg_sleep(0.5); RETURN NEW; END $$"
    )
    db.execute(
        "CREATE TRIGGER slow_failure BEFORE UPDATE ON workflow_tasks FOR EACH ROW "
        "WHEN (NEW.attempts > OLD.attempts) EXECUTE FUNCTION slow_failure()"
    )
    began = time.monotonic()
    drain(db, mgr, [started], poll_interval=30)
    assert time.monotonic() - began < 10, "the retry waited out the poll interval"
    assert status_of(db, started.id) == ("succeeded", False, 1)
    # Each attempt lasted until its finish was handed over, the refused one too: the
    # statement's wait is the completer's, not the attempt's.
    ended = [e for e, _ in seen.of(AttemptEnded)]
    assert [e.outcome for e in ended] == [Outcome.FAILED, Outcome.SUCCEEDED]
    assert all(e.seconds < 1.0 for e in ended), [e.seconds for e in ended]
