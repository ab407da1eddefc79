"""The Store's warm connections, against real PostgreSQL.

A Manager that builds its own pool keeps the connections it just used in a
last-in-first-out stack in front of the pool (`Store(keep_warm=True)`), so the
next statement reuses the most recently used backend. These tests pin what that
must never do: hold a connection after `close()`, keep one a failed statement
left unfit, keep one past `WARM_IDLE` unused or `WARM_FOR` out of the pool, or
keep anything for a pool the caller lent.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers import Records, other_backends, wait_until
from psycopg_pool import ConnectionPool

import workflow
import workflow.store as store_mod
from workflow.store import Store

SIZE = 4


@pytest.fixture
def fixed_pool(engine_url: str) -> Iterator[ConnectionPool[Any]]:
    """A pool of exactly SIZE autocommit connections."""
    from pgbouncer import engine_pool_kwargs

    p: ConnectionPool[Any] = ConnectionPool(
        engine_url, min_size=SIZE, max_size=SIZE, open=True, **engine_pool_kwargs(autocommit=True)
    )
    p.wait()
    yield p
    p.close()


def available(pool: ConnectionPool[Any]) -> int:
    return int(pool.get_stats()["pool_available"])


def read(store: Store) -> None:
    """One statement through the store (a status read of a run that does not exist)."""
    assert store.run_status(uuid.uuid4()) is None


def test_a_warm_store_reuses_the_connection_it_used_last(fixed_pool: ConnectionPool[Any]) -> None:
    store = Store(fixed_pool, keep_warm=True)
    read(store)
    assert len(store._warm) == 1
    first = store._warm[-1][0]
    for _ in range(5):
        read(store)
        assert [entry[0] for entry in store._warm] == [first]
    assert available(fixed_pool) == SIZE - 1
    store.close()
    assert store._warm == []
    assert available(fixed_pool) == SIZE


def test_a_store_not_kept_warm_returns_every_connection(fixed_pool: ConnectionPool[Any]) -> None:
    store = Store(fixed_pool)
    for _ in range(3):
        read(store)
    assert store._warm == []
    assert available(fixed_pool) == SIZE


def test_close_returns_connections_used_by_several_threads(
    fixed_pool: ConnectionPool[Any],
) -> None:
    store = Store(fixed_pool, keep_warm=True)
    barrier = threading.Barrier(3)

    def work() -> None:
        barrier.wait()
        for _ in range(20):
            read(store)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 1 <= len(store._warm) <= 3
    assert available(fixed_pool) == SIZE - len(store._warm)
    store.close()
    assert available(fixed_pool) == SIZE
    # After close nothing is kept any more.
    read(store)
    assert store._warm == []
    assert available(fixed_pool) == SIZE


def test_a_failed_statement_does_not_keep_its_connection(fixed_pool: ConnectionPool[Any]) -> None:
    store = Store(fixed_pool, keep_warm=True)
    params = {
        "id": uuid.uuid4(),
        "workflow": "W",
        "status": "pending",
        "idempotency_key": None,
        "input": "1",
        "input_sealed": None,
        "context": None,
        "context_sealed": None,
        "task_count": 1,
        "current_seq": 1,
        "claim_id": None,
        "names": "not an array literal",
        "skipped": "{f}",
        "wake": False,
    }
    with pytest.raises(psycopg.errors.InvalidTextRepresentation):
        store.insert_run(None, params)
    assert store._warm == []
    assert available(fixed_pool) == SIZE
    store.close()


def test_a_burst_wider_than_the_pool_never_waits_beside_warm_connections(
    engine_url: str, logs: tuple[logging.Logger, Records]
) -> None:
    # Six threads on a 2-connection pool: a thread that finds nothing warm waits
    # on the pool, and the connections given back meanwhile must reach it rather
    # than stay warm (it would wait for the pool's 3 s timeout, logged as a lost
    # connection).
    from pgbouncer import engine_pool_kwargs

    logger, records = logs
    pool: ConnectionPool[Any] = ConnectionPool(
        engine_url,
        min_size=2,
        max_size=2,
        timeout=3.0,
        open=True,
        **engine_pool_kwargs(autocommit=True),
    )
    try:
        pool.wait()
        store = Store(pool, logger, keep_warm=True)
        errors: list[BaseException] = []

        def work() -> None:
            try:
                for _ in range(50):
                    read(store)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=work) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert [m for m in records.messages() if "connection lost" in m] == []
        store.close()
        assert available(pool) == 2
    finally:
        pool.close()


def test_a_connection_unused_for_warm_idle_goes_back(
    fixed_pool: ConnectionPool[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_mod, "WARM_IDLE", 0.2)
    store = Store(fixed_pool, keep_warm=True)
    # Two connections out at once (two concurrent statements), given back apart.
    a, b = store._take(), store._take()
    store._give_back(a[0], a[0].cursor(), a[2])
    time.sleep(0.3)
    store._give_back(b[0], b[0].cursor(), b[2])
    assert [entry[0] for entry in store._warm] == [b[0]]
    assert available(fixed_pool) == SIZE - 1
    store.close()


def test_tidy_returns_the_connections_unused_for_warm_idle(
    fixed_pool: ConnectionPool[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_mod, "WARM_IDLE", 0.2)
    store = Store(fixed_pool, keep_warm=True)
    read(store)
    store.tidy()  # used just now: stays
    assert len(store._warm) == 1
    time.sleep(0.3)
    store.tidy()
    assert store._warm == []
    assert available(fixed_pool) == SIZE


def test_a_connection_out_for_warm_for_goes_back(
    fixed_pool: ConnectionPool[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_mod, "WARM_FOR", 0.2)
    store = Store(fixed_pool, keep_warm=True)
    read(store)
    assert len(store._warm) == 1
    time.sleep(0.3)
    read(store)  # reuses it, then gives it back to the pool: out too long
    assert store._warm == []
    assert available(fixed_pool) == SIZE


# Through the Manager.

WF = workflow.Workflow("Store.Warm", int)
STEP = workflow.Task("store.step", int)


def registry() -> workflow.Registry:
    reg = workflow.Registry()
    reg.register(workflow.define(WF, workflow.handle(STEP, lambda run: run.input + 1)))
    return reg


@pytest.mark.direct("counts the engine's backends in pg_stat_activity")
def test_a_manager_with_its_own_pool_keeps_warm_and_close_releases_everything(
    db_url: str, db: psycopg.Connection[Any]
) -> None:
    mgr = workflow.Manager(db_url, registry())
    try:
        runs = [WF.start(mgr, i) for i in range(20)]
        assert {run.wait(timeout=30) for run in runs} == {workflow.Status.SUCCEEDED}
        assert mgr._store._warm
    finally:
        mgr.close(timeout=10)
    assert mgr._store._warm == []
    wait_until(lambda: other_backends(db) == 0, "every connection of the owned pool to close")


def test_a_manager_keeps_nothing_warm_from_a_pool_it_borrows(pool: ConnectionPool[Any]) -> None:
    mgr = workflow.Manager(pool, registry())
    try:
        assert WF.start(mgr, 1).wait(timeout=30) is workflow.Status.SUCCEEDED
        assert mgr._store._warm == []
    finally:
        mgr.close(timeout=10)


@pytest.mark.direct("terminates the engine's backends")
def test_warm_connections_killed_under_a_manager_are_ridden_out(
    db_url: str, db: psycopg.Connection[Any]
) -> None:
    mgr = workflow.Manager(db_url, registry())
    try:
        runs = [WF.start(mgr, i) for i in range(10)]
        assert {run.wait(timeout=30) for run in runs} == {workflow.Status.SUCCEEDED}
        assert mgr._store._warm
        db.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        runs = [WF.start(mgr, i) for i in range(10)]
        assert {run.wait(timeout=60) for run in runs} == {workflow.Status.SUCCEEDED}
    finally:
        mgr.close(timeout=10)
