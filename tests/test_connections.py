"""The store's connections (`workflow/store/connections.py`), against real PostgreSQL.

A Manager that builds its own pool keeps the connections it just used in a
last-in-first-out stack in front of the pool (`keep_warm=True`), so the next
statement reuses the most recently used backend. These tests pin what that must
never do: hold a connection after `close()`, keep one a failed statement left
unfit, keep one past `WARM_IDLE` unused or `WARM_FOR` out of the pool, or keep
anything for a pool the caller lent. Ages are read on an injected clock, so no
test sleeps past a limit.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers import Records, other_backends, wait_until
from psycopg_pool import ConnectionPool

import workflow
from workflow.logs import EngineLog
from workflow.store import Store
from workflow.store.connections import WARM_FOR, WARM_IDLE, Connections

SIZE = 4
LOG = EngineLog(logging.getLogger("test.connections"))


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


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def available(pool: ConnectionPool[Any]) -> int:
    return int(pool.get_stats()["pool_available"])


def backend(connections: Connections) -> int:
    """One statement through `connections`: the backend that ran it."""
    (row,) = connections.run("SELECT pg_backend_pid()", {})
    return int(row[0])


def read(store: Store) -> None:
    """One statement through the store (a status read of a run that does not exist)."""
    assert store.run_status(uuid.uuid4()) is None


@pytest.mark.direct("reads which backend ran each statement")
def test_warm_connections_reuse_the_backend_used_last(fixed_pool: ConnectionPool[Any]) -> None:
    connections = Connections(fixed_pool, LOG, keep_warm=True)
    first = backend(connections)
    assert connections.warm == 1
    assert [backend(connections) for _ in range(5)] == [first] * 5
    assert available(fixed_pool) == SIZE - 1
    connections.close()
    assert connections.warm == 0
    assert available(fixed_pool) == SIZE


def test_connections_not_kept_warm_return_every_connection(
    fixed_pool: ConnectionPool[Any],
) -> None:
    store = Store(fixed_pool)
    for _ in range(3):
        read(store)
    assert store.connections.warm == 0
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
    assert 1 <= store.connections.warm <= 3
    assert available(fixed_pool) == SIZE - store.connections.warm
    store.close()
    assert available(fixed_pool) == SIZE
    # After close nothing is kept any more.
    read(store)
    assert store.connections.warm == 0
    assert available(fixed_pool) == SIZE


def test_a_failed_statement_does_not_keep_its_connection(fixed_pool: ConnectionPool[Any]) -> None:
    connections = Connections(fixed_pool, LOG, keep_warm=True)
    with pytest.raises(psycopg.errors.InvalidTextRepresentation):
        connections.run("SELECT 'not an array literal'::text[]", {})
    assert connections.warm == 0
    assert available(fixed_pool) == SIZE
    connections.close()


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


def test_a_connection_unused_for_warm_idle_goes_back(fixed_pool: ConnectionPool[Any]) -> None:
    clock = Clock()
    connections = Connections(fixed_pool, LOG, keep_warm=True, clock=clock)
    # Two connections out at once (two concurrent statements): both kept warm.
    barrier = threading.Barrier(2)

    def both() -> None:
        barrier.wait()
        connections.run("SELECT pg_sleep(0.2)", {})

    threads = [threading.Thread(target=both) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert connections.warm == 2
    clock.now += WARM_IDLE + 1
    backend(connections)  # reuses the last one; the other went unused too long
    assert connections.warm == 1
    assert available(fixed_pool) == SIZE - 1
    connections.close()


def test_tidy_returns_the_connections_unused_for_warm_idle(
    fixed_pool: ConnectionPool[Any],
) -> None:
    clock = Clock()
    connections = Connections(fixed_pool, LOG, keep_warm=True, clock=clock)
    backend(connections)
    connections.tidy()  # used just now: stays
    assert connections.warm == 1
    clock.now += WARM_IDLE
    connections.tidy()
    assert connections.warm == 0
    assert available(fixed_pool) == SIZE


def test_a_connection_out_for_warm_for_goes_back(fixed_pool: ConnectionPool[Any]) -> None:
    clock = Clock()
    connections = Connections(fixed_pool, LOG, keep_warm=True, clock=clock)
    backend(connections)
    assert connections.warm == 1
    taken = clock.now
    while clock.now + WARM_IDLE / 2 - taken < WARM_FOR:  # in use all along, never idle
        clock.now += WARM_IDLE / 2
        backend(connections)
        assert connections.warm == 1
    clock.now = taken + WARM_FOR
    backend(connections)
    assert connections.warm == 0, "reused, then given back to the pool: out too long"
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
        assert mgr._store.connections.warm
    finally:
        mgr.close(timeout=10)
    assert mgr._store.connections.warm == 0
    wait_until(lambda: other_backends(db) == 0, "every connection of the owned pool to close")


def test_a_manager_keeps_nothing_warm_from_a_pool_it_borrows(pool: ConnectionPool[Any]) -> None:
    mgr = workflow.Manager(pool, registry())
    try:
        assert WF.start(mgr, 1).wait(timeout=30) is workflow.Status.SUCCEEDED
        assert mgr._store.connections.warm == 0
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
        assert mgr._store.connections.warm
        db.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        runs = [WF.start(mgr, i) for i in range(10)]
        assert {run.wait(timeout=60) for run in runs} == {workflow.Status.SUCCEEDED}
    finally:
        mgr.close(timeout=10)


@pytest.mark.direct("reads the prepared statements of the pool's one backend")
def test_a_pool_made_for_a_manager_prepares_each_statement_at_its_first_execution(
    db_url: str,
) -> None:
    """A new connection parses and plans each engine statement once, not five times."""
    from workflow.store.connections import make_pool, open_pool

    pool = make_pool(db_url, max_size=1)
    open_pool(pool, 10.0)
    mgr = workflow.Manager(pool, registry())
    try:
        assert WF.start(mgr, 1).wait(timeout=30) is workflow.Status.SUCCEEDED
        with pool.connection() as conn:
            statements = [row[0] for row in conn.execute(
                "SELECT statement FROM pg_prepared_statements"
            )]
    finally:
        mgr.close(timeout=10)
        pool.close()
    assert any("INSERT INTO workflow_runs" in text for text in statements), statements
