"""SPEC 9 invariants 1, 4 and 8 when a reply is lost after the server committed.

A real TCP proxy (`replyproxy.py`) sits between the engine's pool and PostgreSQL,
lets one statement commit, then drops its reply and the connection: what a
failover or a cut network does. The store retries the statement on a new
connection, and each statement must recognise its own earlier success:

- a claim (by id, or a poller's batch) re-selects what its lost try claimed, so
  nothing stays claimed by a claim id no executor knows (to be swept and charged
  an attempt that never ran);
- a keyed insert on the fast path recognises its own row instead of taking it
  for another start's duplicate and launching nothing, also when its connection was
  cut while the server still ran it and its retry found the key taken by that try;
- a failed attempt is counted once, not once per try;
- a park, a finish and a release that let go of the claim are recognised as this
  executor's (the ALERT of a park is logged; no "claim lost");
- an operator's cancel or resume, one run or a batch, finds the history rows its
  lost try wrote: each run is counted once and a resume is not refused as "not
  resumable" because it already happened.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers import Inp, Out, Records, registry, wait_until
from psycopg_pool import ConnectionPool
from replyproxy import ReplyProxy

import workflow
from workflow import Status
from workflow.store import _Q
from workflow.store.direct import _Statement

pytestmark = pytest.mark.direct(reason="the proxy stands where PgBouncer would")

A = workflow.Task("a", Out)
B = workflow.Task("b", Out)

# Text of the engine's statements, as sent (the same in the old and new SQL).
# A poller's claim (claim_runs: its workflows are its first parameter; the completer's claim
# has them ninth). Until migration 0011 this was "AND workflow = ANY(", which since 0010's
# claims matched only next_due: the test meant for a lost claim dropped next_due's reply.
CLAIM_BATCH = "SELECT $1::text[] AS workflows, $2::timestamptz[] AS floors"
CLAIM_BY_ID = "WHERE id = $1 AND claim_id IS NULL AND finished_at IS NULL"
INSERT = "INSERT INTO workflow_runs"
FAILURE = "error_code = $"
OUTPUT = "SET output = $"
RELEASE = "SET claim_id = NULL, heartbeat_at = NULL"
CANCEL = "SET status = 'cancelled'"
RESUME = "SET status = 'running', finished_at = NULL"
CLAIM_KEY_HEADS = "key_slot = numbered.slot"

# The statements each text above is meant to catch: a text that no longer matches what its
# test means (a statement rewritten) would drop some other statement's reply, or none.
MEANT = {
    CLAIM_BATCH: {"claim_runs"},
    CLAIM_BY_ID: {"claim_run"},
    INSERT: {"insert_run", "insert_idempotent_run", "insert_runs", "insert_keyed_run",
             "fork_run"},
    FAILURE: {"fail_task", "park_run"},
    OUTPUT: {"complete_task"},
    RELEASE: {"release_claim", "release_claims", "sweep"},
    CANCEL: {"cancel_runs"},
    RESUME: {"resume_runs"},
    CLAIM_KEY_HEADS: {"claim_key_heads"},
}


@pytest.mark.parametrize("text", list(MEANT))
def test_each_dropped_text_is_in_the_statements_it_means_and_no_other(text: str) -> None:
    """Until migration 0011, CLAIM_BATCH matched next_due alone (0010 rewrote the claims):
    the test of a poller's lost claim dropped next_due's reply and passed."""
    # As sent: `%(name)s` numbered `$n` in order of first appearance (psycopg and the
    # direct path alike), `%%` as `%`.
    sent = {name: _Statement(name, sql).text.decode() for name, sql in _Q.items()}
    assert {name for name, sql in sent.items() if text in sql} == MEANT[text]


@pytest.fixture
def proxy(db: psycopg.Connection[Any]) -> Iterator[ReplyProxy]:
    with ReplyProxy(db.info.host, db.info.port) as p:
        yield p


@pytest.fixture
def proxied_pool(proxy: ReplyProxy, db_url: str) -> Iterator[ConnectionPool[Any]]:
    """The engine's pool, through the proxy; every statement parsed afresh (its text seen)."""
    pool: ConnectionPool[Any] = ConnectionPool(
        proxy.url_for(db_url),
        min_size=1,
        max_size=4,
        kwargs={"autocommit": True, "prepare_threshold": None},
        open=True,
    )
    yield pool
    pool.close()


@pytest.fixture
def manager(
    proxied_pool: ConnectionPool[Any], logs: tuple[logging.Logger, Records]
) -> Iterator[Any]:
    built: list[workflow.Manager] = []

    def make(reg: workflow.Registry, config: workflow.Config | None = None) -> workflow.Manager:
        mgr = workflow.Manager(proxied_pool, reg, config, logger=logs[0])
        built.append(mgr)
        return mgr

    yield make
    for mgr in built:
        mgr.close(timeout=10)


class Calls:
    def __init__(self) -> None:
        self.attempts: list[int] = []
        self.lock = threading.Lock()

    def add(self, attempt: int) -> None:
        with self.lock:
            self.attempts.append(attempt)


def succeeding(calls: Calls) -> Any:
    def fn(run: workflow.TaskRun[Inp]) -> Out:
        calls.add(run.attempt)
        return Out("ok")

    return fn


def tasks(db: psycopg.Connection[Any], run_id: str) -> list[tuple[Any, ...]]:
    return db.execute(
        "SELECT seq, attempts, error FROM workflow_tasks WHERE run_id = %s ORDER BY seq",
        (run_id,),
    ).fetchall()


def no_claim_lost(records: Records) -> None:
    lost = [m for m in records.messages() if "claim lost" in m]
    assert not lost, lost


# --- claims ----------------------------------------------------------------------------


def test_a_poller_claim_whose_reply_is_lost_executes_what_it_claimed(
    manager: Any, proxy: ReplyProxy, db: psycopg.Connection[Any],
    logs: tuple[logging.Logger, Records],
) -> None:
    """max_attempts=1: a stranded claim would be swept and charged an attempt that never
    ran, parking the run "already spent its 1 attempts" with its handler never called."""
    calls = Calls()
    reg, wf = registry(workflow.handle(A, succeeding(calls), max_attempts=1, timeout=1))
    mgr = manager(reg, workflow.Config(sweep_max_age=3, max_in_process_backoff=0))
    with db.transaction():
        run = wf.start_tx(db, mgr, Inp(1))
    proxy.drop_reply(CLAIM_BATCH)
    runnable = mgr.new_runnable(
        workflow.RunnerConfig(poll_interval=0.2, sweep_interval=0.5, listen=False)
    )
    runnable.start()
    try:
        proxy.wait_dropped(1)
        assert run.wait(timeout=20) is Status.SUCCEEDED
    finally:
        runnable.stop(timeout=10)
    assert calls.attempts == [1]
    assert tasks(db, run.id) == [(1, 0, None)]
    no_claim_lost(logs[1])


def test_a_claim_by_id_whose_reply_is_lost_executes_what_it_claimed(
    manager: Any, proxy: ReplyProxy, db: psycopg.Connection[Any]
) -> None:
    calls = Calls()
    reg, wf = registry(workflow.handle(A, succeeding(calls)))
    mgr = manager(reg)
    with db.transaction():
        run = wf.start_tx(db, mgr, Inp(1))
    proxy.drop_reply(CLAIM_BY_ID)
    assert run.wait(timeout=10) is Status.SUCCEEDED  # the wait() kicks: claim by id
    assert proxy.dropped == 1
    assert calls.attempts == [1]


# --- the insert --------------------------------------------------------------------------


def test_a_keyed_start_whose_insert_reply_is_lost_still_runs_on_the_fast_path(
    manager: Any, proxy: ReplyProxy, db: psycopg.Connection[Any]
) -> None:
    calls = Calls()
    reg, wf = registry(workflow.handle(A, succeeding(calls)))
    mgr = manager(reg)
    proxy.drop_reply(INSERT)
    run = wf.start(mgr, Inp(1), idempotency_key="order-1")
    assert proxy.dropped == 1
    assert run.wait(timeout=10) is Status.SUCCEEDED
    assert calls.attempts == [1]
    assert db.execute("SELECT count(*) FROM workflow_runs").fetchone() == (1,)
    assert wf.start(mgr, Inp(1), idempotency_key="order-1") == run


def test_a_keyed_start_cut_off_while_its_insert_waits_runs_once_on_the_fast_path(
    manager: Any, proxy: ReplyProxy, db: psycopg.Connection[Any], db_url: str
) -> None:
    """The connection is lost while the server still runs the insert (waiting on a lock):
    the store's retry finds nothing committed yet, inserts again and waits on the key the
    first try holds; the first try then commits, so the retry's ON CONFLICT inserts
    nothing. The run is this start's, claimed for it: it runs now, not after a sweep."""
    calls = Calls()
    reg, wf = registry(workflow.handle(A, succeeding(calls)))
    mgr = manager(reg)

    def waiting(n: int) -> Any:
        return lambda: db.execute(
            "SELECT count(*) >= %s FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'", (n,)
        ).fetchone() == (True,)

    started: list[workflow.Run] = []
    with psycopg.connect(db_url) as blocker:  # holds the insert's second half
        blocker.execute("LOCK TABLE workflow_tasks IN SHARE MODE")
        thread = threading.Thread(
            target=lambda: started.append(wf.start(mgr, Inp(1), idempotency_key="order-1"))
        )
        thread.start()
        wait_until(waiting(1), "the insert to wait for the lock")
        proxy.cut_all()
        wait_until(waiting(2), "the retry to wait for the key")
        blocker.rollback()
    thread.join(timeout=20)
    assert started, "the start did not return"
    (run,) = started
    assert run.wait(timeout=10) is Status.SUCCEEDED
    assert calls.attempts == [1]
    assert db.execute("SELECT count(*) FROM workflow_runs").fetchone() == (1,)


def test_an_unkeyed_start_whose_insert_reply_is_lost_runs_once(
    manager: Any, proxy: ReplyProxy, db: psycopg.Connection[Any]
) -> None:
    calls = Calls()
    reg, wf = registry(workflow.handle(A, succeeding(calls)))
    mgr = manager(reg)
    proxy.drop_reply(INSERT)
    run = wf.start(mgr, Inp(1))
    assert run.wait(timeout=10) is Status.SUCCEEDED
    assert calls.attempts == [1]
    assert db.execute("SELECT count(*) FROM workflow_runs").fetchone() == (1,)


def keyed_registry(calls: Calls, gate: threading.Event | None = None) -> tuple[Any, Any]:
    """One workflow whose runs are limited to one per `Inp.n` at once (SPEC 15)."""
    def fn(run: workflow.TaskRun[Inp]) -> Out:
        calls.add(run.attempt)
        if gate is not None:
            gate.wait(20)
        return Out("ok")

    wf = workflow.Workflow("W", Inp)
    reg = workflow.Registry()
    reg.register(
        workflow.define(wf, workflow.handle(A, fn, timeout=1), concurrency_key=lambda i: i.n)
    )
    return reg, wf


def test_a_start_taking_its_keys_slot_whose_reply_is_lost_runs_once_and_frees_it(
    manager: Any, proxy: ReplyProxy, db: psycopg.Connection[Any]
) -> None:
    calls = Calls()
    reg, wf = keyed_registry(calls)
    mgr = manager(reg)
    proxy.drop_reply(INSERT)
    run = wf.start(mgr, Inp(1))
    assert proxy.dropped == 1
    assert run.wait(timeout=10) is Status.SUCCEEDED
    assert calls.attempts == [1]
    assert db.execute("SELECT count(*), count(key_slot) FROM workflow_runs").fetchone() == (1, 0)


def test_a_key_slot_claim_whose_reply_is_lost_executes_what_it_claimed(
    manager: Any, proxy: ReplyProxy, db: psycopg.Connection[Any],
    logs: tuple[logging.Logger, Records],
) -> None:
    """The poller's claim of a key's waiting run re-selects what its lost try claimed:
    otherwise the run would hold its key's slot under a claim no executor knows."""
    calls = Calls()
    reg, wf = keyed_registry(calls)
    mgr = manager(reg, workflow.Config(sweep_max_age=3, max_in_process_backoff=0))
    with db.transaction():
        runs = [wf.start_tx(db, mgr, Inp(1)) for _ in range(2)]
    proxy.drop_reply(CLAIM_KEY_HEADS)
    runnable = mgr.new_runnable(
        workflow.RunnerConfig(poll_interval=0.2, sweep_interval=0.5, listen=False)
    )
    runnable.start()
    try:
        proxy.wait_dropped(1)
        for run in runs:
            assert run.wait(timeout=20) is Status.SUCCEEDED
    finally:
        runnable.stop(timeout=10)
    assert calls.attempts == [1, 1]
    assert [tasks(db, run.id) for run in runs] == [[(1, 0, None)]] * 2
    no_claim_lost(logs[1])


# --- writes under a claim --------------------------------------------------------------


def test_a_failed_attempt_whose_reply_is_lost_counts_once(
    manager: Any, proxy: ReplyProxy, db: psycopg.Connection[Any],
    logs: tuple[logging.Logger, Records],
) -> None:
    seen: list[int] = []

    def flaky(run: workflow.TaskRun[Inp]) -> Out:
        seen.append(run.attempt)
        if run.attempt == 1:
            raise RuntimeError("provider down")
        return Out("ok")

    reg, wf = registry(workflow.handle(A, flaky, max_attempts=5, backoff_schedule=[0.01]))
    mgr = manager(reg)
    proxy.drop_reply(FAILURE)
    run = wf.start(mgr, Inp(1))
    assert run.wait(timeout=10) is Status.SUCCEEDED
    assert proxy.dropped == 1
    assert seen == [1, 2]
    assert tasks(db, run.id) == [(1, 1, "provider down")]
    no_claim_lost(logs[1])


def test_a_park_whose_reply_is_lost_still_logs_its_alert(
    manager: Any, proxy: ReplyProxy, db: psycopg.Connection[Any],
    logs: tuple[logging.Logger, Records],
) -> None:
    def rejects(run: workflow.TaskRun[Inp]) -> Out:
        raise workflow.Permanent("card declined", code="declined")

    reg, wf = registry(workflow.handle(A, rejects))
    mgr = manager(reg)
    proxy.drop_reply(FAILURE)
    run = wf.start(mgr, Inp(1))
    assert run.wait(timeout=10) is Status.PARKED
    assert proxy.dropped == 1
    records = logs[1]
    wait_until(lambda: bool(records.alerts()), "the park's ALERT")
    (alert,) = records.alerts()
    assert alert.run_id == run.id  # type: ignore[attr-defined]
    assert "card declined" in alert.getMessage()
    assert tasks(db, run.id) == [(1, 1, "card declined")]
    no_claim_lost(records)


def test_a_finish_whose_reply_is_lost_is_seen_as_a_success(
    manager: Any, proxy: ReplyProxy, db: psycopg.Connection[Any],
    logs: tuple[logging.Logger, Records],
) -> None:
    """One task: its write records the output and finishes the run, letting go of the claim."""
    calls = Calls()
    reg, wf = registry(workflow.handle(A, succeeding(calls)))
    mgr = manager(reg)
    proxy.drop_reply(OUTPUT)
    run = wf.start(mgr, Inp(1))
    assert run.wait(timeout=10) is Status.SUCCEEDED
    assert proxy.dropped == 1
    assert calls.attempts == [1]
    no_claim_lost(logs[1])


def test_a_release_whose_reply_is_lost_is_seen_as_released(
    manager: Any, proxy: ReplyProxy, db: psycopg.Connection[Any],
    logs: tuple[logging.Logger, Records],
) -> None:
    """close() while task a runs: a's success is recorded, then the claim is released."""
    entered, go_on = threading.Event(), threading.Event()

    def slow(run: workflow.TaskRun[Inp]) -> Out:
        entered.set()
        go_on.wait(10)
        return Out("a")

    reg, wf = registry(workflow.handle(A, slow), workflow.handle(B, lambda run: Out("b")))
    mgr = manager(reg)
    run = wf.start(mgr, Inp(1))
    assert entered.wait(10)
    proxy.drop_reply(RELEASE)
    closer = threading.Thread(target=mgr.close, kwargs={"timeout": 20})
    closer.start()
    wait_until(mgr._executor.draining.is_set, "the drain to begin")
    go_on.set()
    closer.join(30)
    assert proxy.dropped == 1
    row = db.execute(
        "SELECT claim_id, current_seq, status FROM workflow_runs WHERE id = %s", (run.id,)
    ).fetchone()
    assert row == (None, 2, "running"), "released on task b, claimable at once"
    no_claim_lost(logs[1])


# --- an operator's actions -------------------------------------------------------------


def events(db: psycopg.Connection[Any], kind: str) -> int:
    row = db.execute("SELECT count(*) FROM workflow_events WHERE kind = %s", (kind,)).fetchone()
    return int(row[0])


def test_a_bulk_cancel_whose_reply_is_lost_counts_each_run_once(
    proxied_pool: ConnectionPool[Any], proxy: ReplyProxy, db: psycopg.Connection[Any],
    manager: Any,
) -> None:
    reg, wf = registry(workflow.handle(A, lambda run: Out("a")))
    mgr = manager(reg)
    with db.transaction():
        for n in range(3):
            wf.start_tx(db, mgr, Inp(n))
    proxy.drop_reply(CANCEL)
    counted: list[int] = []
    total = workflow.Admin(proxied_pool).cancel_matching(workflow="W", progress=counted.append)
    assert proxy.dropped == 1
    assert (total, counted) == (3, [3]), "the retry found the three its lost try cancelled"
    assert events(db, "cancelled") == 3


def test_a_resume_whose_reply_is_lost_is_seen_as_resumed(
    proxied_pool: ConnectionPool[Any], proxy: ReplyProxy, db: psycopg.Connection[Any],
    manager: Any,
) -> None:
    reg, wf = registry(workflow.handle(A, lambda run: Out("a")))
    mgr = manager(reg)
    with db.transaction():
        run = wf.start_tx(db, mgr, Inp(1))
    admin = workflow.Admin(proxied_pool)
    admin.cancel(run.id)
    proxy.drop_reply(RESUME)
    assert admin.resume(run.id).status is Status.RUNNING, "not refused as not resumable"
    assert proxy.dropped == 1
    assert events(db, "resumed") == 1
