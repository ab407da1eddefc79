"""Per-key ordering and concurrency limits (SPEC 15), in one process.

`define(W, *steps, concurrency_key=fn, concurrency=N)`: at most N runs of W with
one key hold a claim at once, runs of one key are claimed in creation order, and
a key is held from a run's first claim until it is finished (a backoff keeps it;
a park or a cancel frees it). The key is stored as a SHA-256 digest. The
multi-process proofs (three workers, `kill -9`) are in `test_keys_workers.py`.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import attrs
import pgbouncer
import psycopg
import pytest
from helpers import wait_until

import workflow
from workflow import Status
from workflow.errors import RegistrationError


@attrs.frozen
class Acct:
    account: str | None
    n: int


@attrs.frozen
class Done:
    n: int


STEP = workflow.Task("keyed.step", Done)
WF = workflow.Workflow("Keyed.Transfer", Acct)
FREE = workflow.Workflow("Keyed.Free", Acct)


class Gates:
    """Handlers that record who is inside, and block runs whose n is in `blocked`
    until released; `order` is the order of first entries."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inside: dict[str | None, int] = {}
        self.most: dict[str | None, int] = {}
        self.order: list[int] = []
        self.gates: dict[int, threading.Event] = {}
        self.entered: dict[int, threading.Event] = {}
        self.fail: dict[int, int] = {}  # n -> attempts to fail
        self.permanent: set[int] = set()

    def block(self, *ns: int) -> None:
        for n in ns:
            self.gates[n] = threading.Event()
            self.entered[n] = threading.Event()

    def release(self, n: int) -> None:
        self.gates[n].set()

    def handler(self, run: workflow.TaskRun[Acct]) -> Done:
        key, n = run.input.account, run.input.n
        with self.lock:
            self.inside[key] = self.inside.get(key, 0) + 1
            self.most[key] = max(self.most.get(key, 0), self.inside[key])
            if run.attempt == 1:
                self.order.append(n)
        try:
            if n in self.entered:
                self.entered[n].set()
            if n in self.gates:
                self.gates[n].wait(30)
            else:
                time.sleep(0.01)
            if n in self.permanent:
                raise workflow.permanent(
                    workflow.with_code("account.unknown", LookupError("no such account"))
                )
            if run.attempt <= self.fail.get(n, 0):
                raise RuntimeError(f"attempt {run.attempt} fails")
            return Done(n)
        finally:
            with self.lock:
                self.inside[key] -= 1


def keyed(gates: Gates, concurrency: int | None = None, **step: Any) -> workflow.Registry:
    reg = workflow.Registry()
    reg.register(
        workflow.define(
            WF,
            workflow.handle(STEP, gates.handler, **step),
            concurrency_key=lambda i: i.account,
            concurrency=concurrency,
        )
    )
    reg.register(workflow.define(FREE, workflow.handle(workflow.Task("free.step", Done),
                                                         gates.handler)))
    return reg


@pytest.fixture
def gates() -> Gates:
    return Gates()


def status(db: psycopg.Connection[Any], run: workflow.Run) -> str:
    row = db.execute("SELECT status FROM workflow_runs WHERE id = %s", (run.id,)).fetchone()
    assert row is not None
    return str(row[0])


def busy_key(mgr: Any, gates: Gates, account: str) -> tuple[workflow.Run, workflow.Run]:
    """Run 1 of `account` started and blocked inside its handler (holding the key), then
    run 2 of the same account started: (run 1, run 2)."""
    gates.block(1)
    first = WF.start(mgr, Acct(account, 1))
    assert gates.entered[1].wait(10)
    return first, WF.start(mgr, Acct(account, 2))


@pytest.fixture
def runner(make_manager: Any) -> Iterator[Any]:
    """`runner(registry, config=None, **runner_settings)`: a manager with a started
    Runnable (poll interval 60 s, so only wake-ups and due times drive it; behind
    PgBouncer, poll-only)."""
    started: list[Any] = []

    def build(reg: workflow.Registry, config: Any = None, **settings: Any) -> Any:
        mgr = make_manager(reg, config)
        if not pgbouncer.ENABLED:  # behind PgBouncer: poll-only, a short interval
            settings.setdefault("poll_interval", 60)
        runnable = mgr.new_runnable(
            pgbouncer.runner_config(**{"concurrency": 8, **settings})
        )
        runnable.start()
        started.append(runnable)
        return mgr

    yield build
    for runnable in started:
        runnable.stop(timeout=10)


# Declaring.


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"concurrency": 2}, "needs a concurrency_key"),
        ({"concurrency_key": "account"}, "must be a function of the input"),
        ({"concurrency_key": len, "concurrency": 0}, "from 1 to 1000"),
        ({"concurrency_key": len, "concurrency": 1001}, "from 1 to 1000"),
        ({"concurrency_key": len, "concurrency": True}, "must be an int"),
        ({"concurrency_key": len, "concurrency": 2.0}, "must be an int"),
    ],
)
def test_a_bad_limit_is_refused_at_registration(kwargs: dict[str, Any], match: str) -> None:
    reg = workflow.Registry()
    with pytest.raises(RegistrationError, match=match):
        reg.register(workflow.define(WF, workflow.handle(STEP, lambda run: Done(1)), **kwargs))


def test_the_key_is_stored_as_its_sha256_digest_never_as_text(
    make_manager: Any, db: psycopg.Connection[Any], gates: Gates
) -> None:
    mgr = make_manager(keyed(gates))
    with db.transaction():
        run = WF.start_tx(db, mgr, Acct("acct-7731", 1))
        other = WF.start_tx(db, mgr, Acct(None, 2))
    row = db.execute(
        "SELECT concurrency_key, key_slot FROM workflow_runs WHERE id = %s", (run.id,)
    ).fetchone()
    assert row == (hashlib.sha256(b"acct-7731").digest(), None)
    assert b"acct-7731" not in row[0]
    # None: a run with no key, free of any limit.
    none = db.execute(
        "SELECT concurrency_key FROM workflow_runs WHERE id = %s", (other.id,)
    ).fetchone()
    assert none == (None,)


def test_a_key_of_another_type_is_refused_before_any_sql(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    reg = workflow.Registry()
    reg.register(workflow.define(
        WF, workflow.handle(STEP, lambda run: Done(1)), concurrency_key=lambda i: [i.account]
    ))
    mgr = make_manager(reg)
    with pytest.raises(TypeError, match="concurrency_key returned list"):
        WF.start(mgr, Acct("a", 1))
    assert db.execute("SELECT count(*) FROM workflow_runs").fetchone() == (0,)


def test_ints_and_uuids_are_keys_by_their_text(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    reg = workflow.Registry()
    reg.register(workflow.define(
        WF, workflow.handle(STEP, lambda run: Done(1)), concurrency_key=lambda i: i.n
    ))
    mgr = make_manager(reg)
    with db.transaction():
        run = WF.start_tx(db, mgr, Acct("a", 42))
    row = db.execute(
        "SELECT concurrency_key FROM workflow_runs WHERE id = %s", (run.id,)
    ).fetchone()
    assert row == (hashlib.sha256(b"42").digest(),)


# The fast path.


def test_a_start_whose_key_is_busy_waits_and_runs_once_the_key_frees(
    runner: Any, db: psycopg.Connection[Any], gates: Gates
) -> None:
    mgr = runner(keyed(gates))
    first, second = busy_key(mgr, gates, "a")
    other_key = WF.start(mgr, Acct("b", 3))
    unkeyed = FREE.start(mgr, Acct("a (unkeyed)", 4))
    # Another key and a workflow without keys go on at once; the busy key's run waits.
    assert other_key.wait(timeout=10) is Status.SUCCEEDED
    assert unkeyed.wait(timeout=10) is Status.SUCCEEDED
    assert status(db, second) == "pending"
    # A wait() kicks only a claimable run: one waiting for its key is not.
    assert second.wait(timeout=0.5) is Status.RUNNING  # not finished
    assert status(db, second) == "pending"
    gates.release(1)
    # No poll interval (60 s) passes: the first run's finish wakes the poller.
    assert second.wait(timeout=10) is Status.SUCCEEDED
    assert first.status().status is Status.SUCCEEDED
    assert gates.most["a"] == 1
    assert gates.order.index(1) < gates.order.index(2)


def test_a_keyed_start_with_its_key_free_is_claimed_at_insert(
    make_manager: Any, db: psycopg.Connection[Any], gates: Gates
) -> None:
    gates.block(1)
    mgr = make_manager(keyed(gates))
    run = WF.start(mgr, Acct("a", 1))
    assert gates.entered[1].wait(10)
    row = db.execute(
        "SELECT status, claim_id IS NOT NULL, key_slot FROM workflow_runs WHERE id = %s",
        (run.id,),
    ).fetchone()
    assert row == ("running", True, 0)
    gates.release(1)
    assert run.wait(timeout=10) is Status.SUCCEEDED
    row = db.execute("SELECT key_slot FROM workflow_runs WHERE id = %s", (run.id,)).fetchone()
    assert row == (None,)


def test_a_start_does_not_jump_ahead_of_a_run_already_waiting_for_its_key(
    runner: Any, make_manager: Any, db: psycopg.Connection[Any], gates: Gates
) -> None:
    """The key frees while an older run waits for a poller: a new start must not take it."""
    mgr = make_manager(keyed(gates))
    with db.transaction():
        older = WF.start_tx(db, mgr, Acct("a", 1))  # waiting: no poller yet
    newer = WF.start(mgr, Acct("a", 2))
    assert status(db, newer) == "pending"
    runner(keyed(gates))
    assert newer.wait(timeout=10) is Status.SUCCEEDED
    assert older.status().status is Status.SUCCEEDED
    assert gates.order == [1, 2]


# Holding the key until the run is finished.


def test_a_run_waiting_out_a_backoff_keeps_its_key(
    runner: Any, db: psycopg.Connection[Any], gates: Gates
) -> None:
    gates.fail[1] = 1
    # 6 s is above max_in_process_backoff (5 s): the claim is released until then.
    mgr = runner(keyed(gates, backoff_schedule=[6]))
    first = WF.start(mgr, Acct("a", 1))
    wait_until(
        lambda: db.execute(
            "SELECT claim_id IS NULL AND attempts = 1 FROM workflow_runs r "
            "JOIN workflow_tasks t ON t.run_id = r.id WHERE r.id = %s", (first.id,)
        ).fetchone() == (True,),
        "the first attempt to fail and release the claim",
    )
    second = WF.start(mgr, Acct("a", 2))
    time.sleep(1.0)
    assert status(db, second) == "pending", "the second run took a key held through a backoff"
    assert first.wait(timeout=20) is Status.SUCCEEDED
    assert second.wait(timeout=10) is Status.SUCCEEDED
    assert gates.order == [1, 2]


def test_a_parked_run_frees_its_key_and_a_resumed_one_goes_first_when_it_frees(
    runner: Any, db: psycopg.Connection[Any], gates: Gates
) -> None:
    gates.permanent.add(1)
    gates.block(2)
    mgr = runner(keyed(gates))
    first = WF.start(mgr, Acct("a", 1))
    assert first.wait(timeout=10) is Status.PARKED
    second = WF.start(mgr, Acct("a", 2))  # the parked run freed the key
    assert gates.entered[2].wait(10)
    third = WF.start(mgr, Acct("a", 3))
    gates.permanent.discard(1)
    workflow.Admin(mgr.pool).resume(first.id)
    time.sleep(0.5)
    assert status(db, first) == "running" and status(db, third) == "pending"
    gates.release(2)
    # The resumed run is older than the third: it takes the key first.
    for run in (first, second, third):
        assert run.wait(timeout=10) is Status.SUCCEEDED
    assert gates.order == [1, 2, 1, 3]  # a resume's first attempt is attempt 1 again
    assert gates.most["a"] == 1


def test_a_cancelled_run_frees_its_key(
    runner: Any, db: psycopg.Connection[Any], gates: Gates
) -> None:
    mgr = runner(keyed(gates))
    first, second = busy_key(mgr, gates, "a")
    assert status(db, second) == "pending"
    workflow.Admin(mgr.pool).cancel(first.id)
    assert second.wait(timeout=10) is Status.SUCCEEDED
    gates.release(1)
    assert first.wait(timeout=10) is Status.CANCELLED


# Limits above one.


def test_concurrency_three_never_runs_more_than_three_of_a_key_and_reaches_three(
    runner: Any, db: psycopg.Connection[Any], gates: Gates
) -> None:
    def slow(run: workflow.TaskRun[Acct]) -> Done:
        time.sleep(0.15)
        return gates.handler(run)

    reg = workflow.Registry()
    reg.register(workflow.define(
        WF, workflow.handle(STEP, slow), concurrency_key=lambda i: i.account, concurrency=3
    ))
    mgr = runner(reg, concurrency=10)
    with db.transaction():
        runs = [WF.start_tx(db, mgr, Acct("a", n)) for n in range(12)]
    for run in runs:
        assert run.wait(timeout=30) is Status.SUCCEEDED
    assert gates.most["a"] == 3
    slots = db.execute("SELECT count(*) FROM workflow_runs WHERE key_slot IS NOT NULL").fetchone()
    assert slots == (0,)


# Races for a slot: the unique index decides, and the loser does nothing.


HOLDER = """
INSERT INTO workflow_runs (id, workflow, status, input, task_count, current_seq,
                           concurrency_key, key_slot, claim_id, heartbeat_at)
VALUES (gen_random_uuid(), 'Keyed.Transfer', 'running', '{}', 1, 1, %s, 0,
        gen_random_uuid(), now())
"""


def _blocked_on_a_lock(db: psycopg.Connection[Any]) -> bool:
    row = db.execute(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() AND wait_event_type = 'Lock'"
    ).fetchone()
    return row is not None and row[0] > 0


def test_a_start_that_loses_the_race_for_its_keys_slot_waits_for_it_instead(
    make_manager: Any, db: psycopg.Connection[Any], db_url: str, gates: Gates
) -> None:
    """Another transaction takes slot 0 of the key, not committed yet: the start's insert
    does not see it, picks slot 0 too, waits on the unique index, and fails once the other
    commits. The start inserts the run waiting instead, and returns."""
    mgr = make_manager(keyed(gates))
    digest = hashlib.sha256(b"a").digest()
    with psycopg.connect(db_url) as rival:
        rival.execute(HOLDER, (digest,))  # in a transaction: not committed
        result: list[workflow.Run] = []
        thread = threading.Thread(target=lambda: result.append(WF.start(mgr, Acct("a", 1))))
        thread.start()
        wait_until(lambda: _blocked_on_a_lock(db), "the start to wait on the rival's slot")
        rival.commit()
        thread.join(10)
    [run] = result
    row = db.execute(
        "SELECT status, claim_id, key_slot FROM workflow_runs WHERE id = %s", (run.id,)
    ).fetchone()
    assert row == ("pending", None, None)
    assert gates.order == []


def test_a_claim_that_loses_the_race_for_a_slot_claims_nothing(
    make_manager: Any, db: psycopg.Connection[Any], db_url: str, gates: Gates
) -> None:
    from workflow.store import Store, slot_race

    mgr = make_manager(keyed(gates))
    with db.transaction():
        waiting = WF.start_tx(db, mgr, Acct("a", 1))
    store = Store(mgr.pool)
    with psycopg.connect(db_url) as rival:
        rival.execute(HOLDER, (hashlib.sha256(b"a").digest(),))
        errors: list[BaseException] = []

        def claim() -> None:
            try:
                store.claim_key_heads(["Keyed.Transfer"], [1], 10)
            except BaseException as e:
                errors.append(e)

        thread = threading.Thread(target=claim)
        thread.start()
        wait_until(lambda: _blocked_on_a_lock(db), "the claim to wait on the rival's slot")
        rival.commit()
        thread.join(10)
    [error] = errors
    assert isinstance(error, psycopg.errors.UniqueViolation) and slot_race(error)
    row = db.execute(
        "SELECT claim_id, key_slot FROM workflow_runs WHERE id = %s", (waiting.id,)
    ).fetchone()
    assert row == (None, None)
    store.close()


def test_a_run_started_with_a_delay_takes_its_key_when_due_without_a_wake_up(
    make_manager: Any, db: psycopg.Connection[Any], gates: Gates
) -> None:
    """A keyed delayed run waits for its key from its start; nothing wakes the poller when it
    falls due, so the poller's next due time must include it (its poll interval is 60 s)."""
    mgr = make_manager(keyed(gates))
    run = WF.start(mgr, Acct("a", 1), delay=1.5)
    runnable = mgr.new_runnable(workflow.RunnerConfig(listen=False, poll_interval=60))
    runnable.start()
    try:
        assert run.wait(timeout=15) is Status.SUCCEEDED
    finally:
        runnable.stop(timeout=10)


def test_a_fork_of_a_keyed_run_keeps_its_key_and_waits_its_turn(
    runner: Any, db: psycopg.Connection[Any], gates: Gates
) -> None:
    mgr = runner(keyed(gates))
    first = WF.start(mgr, Acct("a", 1))
    assert first.wait(timeout=10) is Status.SUCCEEDED
    gates.block(2)
    WF.start(mgr, Acct("a", 2))
    assert gates.entered[2].wait(10)
    fork = workflow.Admin(mgr.pool).fork(first.id, from_task="keyed.step")
    keys = db.execute(
        "SELECT count(DISTINCT concurrency_key) FROM workflow_runs WHERE id IN (%s, %s)",
        (first.id, fork),
    ).fetchone()
    assert keys == (1,)
    time.sleep(0.5)
    assert _status_of(db, fork) == "pending"
    gates.release(2)
    wait_until(lambda: _status_of(db, fork) == "succeeded", "the fork to run")
    assert gates.order == [1, 2, 1]


def _status_of(db: psycopg.Connection[Any], run_id: str) -> str:
    row = db.execute("SELECT status FROM workflow_runs WHERE id = %s", (run_id,)).fetchone()
    assert row is not None
    return str(row[0])


def test_admin_shows_the_keys_digest_and_whether_the_run_holds_it_or_waits(
    make_manager: Any, db: psycopg.Connection[Any], gates: Gates
) -> None:
    mgr = make_manager(keyed(gates))
    first, second = busy_key(mgr, gates, "acct-1")
    admin = workflow.Admin(mgr.pool)
    held, waiting = admin.run(first.id), admin.run(second.id)
    digest = hashlib.sha256(b"acct-1").hexdigest()
    assert (held.concurrency_key, held.key_state) == (digest, "held")
    assert (waiting.concurrency_key, waiting.key_state) == (digest, "waiting")
    gates.release(1)
    assert first.wait(timeout=10) is Status.SUCCEEDED
    assert admin.run(first.id).key_state is None


def test_an_idle_poller_with_keyed_workflows_does_not_spin(
    make_manager: Any, gates: Gates, monkeypatch: Any
) -> None:
    """Nothing to claim: the keys' claim is read again after a pause that grows while it
    finds nothing, not every few milliseconds."""
    from workflow.store import Store

    calls: list[float] = []
    claim = Store.claim_key_heads

    def counted(self: Store, *args: Any) -> Any:
        calls.append(time.monotonic())
        return claim(self, *args)

    monkeypatch.setattr(Store, "claim_key_heads", counted)
    mgr = make_manager(keyed(gates))
    runnable = mgr.new_runnable(workflow.RunnerConfig(listen=False, poll_interval=60))
    runnable.start()
    try:
        time.sleep(3.0)
    finally:
        runnable.stop(timeout=10)
    assert len(calls) < 30, f"{len(calls)} key claims in 3 s while idle"
