"""Per-key limits across processes (SPEC 15): three real worker processes plus fast-path
starts from threads of this one, a `kill -9` mid-task, and a limit of three.

Every check reads `key_ledger`, where the handler (tests/worker_apps/keyed.py)
stamps its entry and exit with the database clock: no two runs of one key inside
the handler at once, a key's runs entered in the order they were started, and
other keys going on meanwhile.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from helpers import poll, wait_until
from worker_apps import keyed
from worker_apps.harness import WorkerProcess
from worker_apps.ledger import URL_ENV

import workflow

KEYED = "tests.worker_apps.keyed:registry"
THREE = "tests.worker_apps.keyed:three"
STALE_BY_HAND = "tests.worker_apps.keyed:stale_by_hand_app"

Spawn = Callable[..., WorkerProcess]


@pytest.fixture
def key_ledger(db: psycopg.Connection[Any], engine_url: str, monkeypatch: Any) -> Any:
    db.execute(keyed.CREATE_TABLE)
    monkeypatch.setenv(URL_ENV, engine_url)  # this process's fast-path handlers write too
    return db


Entry = tuple[str, int, int, Any, Any]  # account, n, attempt, entered_at, left_at


def entries(db: psycopg.Connection[Any]) -> list[Entry]:
    return db.execute(
        "SELECT account, n, attempt, entered_at, left_at FROM key_ledger ORDER BY entered_at"
    ).fetchall()


def by_key(rows: list[Entry]) -> dict[str, list[Entry]]:
    keys: dict[str, list[Entry]] = collections.defaultdict(list)
    for row in rows:
        keys[row[0]].append(row)
    return keys


def most_inside(rows: list[Entry]) -> int:
    """The most handler executions inside at one instant (entry before exit)."""
    edges = sorted(
        [(row[3], 1) for row in rows] + [(row[4], -1) for row in rows], key=lambda e: (e[0], e[1])
    )
    inside = most = 0
    for _, step in edges:
        inside += step
        most = max(most, inside)
    return most


def wait_all_succeeded(db: psycopg.Connection[Any], count: int, timeout: float) -> None:
    poll(
        db,
        "SELECT count(*) = %s FROM workflow_runs WHERE status = 'succeeded'",
        (count,),
        timeout=timeout,
        what=f"{count} runs to succeed",
    )


@pytest.mark.slow
def test_three_workers_and_fast_path_starts_keep_each_key_serial_and_in_order(
    key_ledger: psycopg.Connection[Any], spawn: Spawn, make_manager: Any
) -> None:
    keys, per_key, hold = 50, 20, 0.05
    workers = [spawn(KEYED, "--concurrency", "20") for _ in range(3)]
    for worker in workers:
        worker.wait_started()
    mgr = make_manager(keyed.registry(), workflow.Config(max_local_runs=10))
    errors: list[BaseException] = []

    def starter(mine: list[int]) -> None:
        # One thread starts all of its keys' runs, one after another: each key's runs
        # are started (and committed) in the order of n.
        try:
            for n in range(per_key):
                for k in mine:
                    # Every key's first run waits inside until all keys' first runs are:
                    # the keys must be able to go on side by side, at any start rate.
                    gate = keys if n == 0 else 0
                    keyed.Transfer.start(mgr, keyed.Move(f"acct-{k}", n, hold, gate))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [
        threading.Thread(target=starter, args=(list(range(t, keys, 5)),)) for t in range(5)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    wait_all_succeeded(key_ledger, keys * per_key, timeout=180)

    rows = entries(key_ledger)
    assert len(rows) == keys * per_key  # each run's task once: no retries, no duplicates
    assert all(attempt == 1 for _, _, attempt, _, _ in rows)
    for account, runs in by_key(rows).items():
        assert [n for _, n, *_ in runs] == list(range(per_key)), f"{account} out of order"
        for before, after in itertools.pairwise(runs):
            assert after[3] >= before[4], f"{account}: runs {before[1]} and {after[1]} overlap"
    # Keys went on side by side: at one instant every key was inside its handler (70
    # places: 3 workers of 20 and 10 local runs; a gated run would wait 60 s and fail).
    assert most_inside(rows) == keys
    # The fast path took part: some runs ran in this process, some in the workers.
    pids = {row[0] for row in key_ledger.execute("SELECT DISTINCT pid FROM key_ledger")}
    assert len(pids) >= 2
    span = (max(r[4] for r in rows) - min(r[3] for r in rows)).total_seconds()
    longest = max(
        (runs[-1][4] - runs[0][3]).total_seconds() for runs in by_key(rows).values()
    )
    total = sum((r[4] - r[3]).total_seconds() for r in rows)
    print(f"\nkeys={keys} runs={len(rows)} span={span:.2f}s longest key's span={longest:.2f}s "
          f"sum of all handler time={total:.2f}s span/longest={span / longest:.2f}")
    assert key_ledger.execute(
        "SELECT count(*) FROM workflow_runs WHERE key_slot IS NOT NULL"
    ).fetchone() == (0,)


@pytest.mark.slow
def test_a_killed_workers_key_is_held_until_the_sweep_then_its_run_goes_first(
    key_ledger: psycopg.Connection[Any], spawn: Spawn, make_manager: Any, pool: Any
) -> None:
    fast = ("--sweep-interval", "0.5", "--poll-interval", "1")
    a = spawn(STALE_BY_HAND, *fast)
    a.wait_started()
    mgr = make_manager(keyed.registry())
    with pool.connection() as conn, conn.transaction():
        first = keyed.Transfer.start_tx(conn, mgr, keyed.Move("acct", 0, hold=20))
    poll(key_ledger, "SELECT count(*) = 1 FROM key_ledger", (), timeout=20, what="run 0 to start")
    # Killed before the others exist: a worker still alive when they commit may claim the
    # other key's run and die inside it, holding that key too (CI saw it once).
    a.kill()
    with pool.connection() as conn, conn.transaction():
        later = [keyed.Transfer.start_tx(conn, mgr, keyed.Move("acct", n)) for n in (1, 2)]
        other = keyed.Transfer.start_tx(conn, mgr, keyed.Move("other", 0))
    b = spawn(STALE_BY_HAND, *fast)
    b.wait_started()
    # Another key is not held up by the dead worker's.
    wait_until(lambda: other.status().status is workflow.Status.SUCCEEDED, "the other key")
    assert [r.status().status for r in later] == [workflow.Status.PENDING] * 2
    assert first.status().status is workflow.Status.RUNNING
    # The dead claim's heartbeat grows old: what 60 s would do, without the wait.
    key_ledger.execute(
        "UPDATE workflow_runs SET heartbeat_at = now() - interval '1 hour' WHERE id = %s",
        (first.id,),
    )
    for run in (first, *later):
        assert run.wait(timeout=30) is workflow.Status.SUCCEEDED
    rows = [r for r in entries(key_ledger) if r[0] == "acct"]
    # The interrupted run's second attempt comes first, then the others in order.
    assert [(n, attempt) for _, n, attempt, _, _ in rows] == [(0, 1), (0, 2), (1, 1), (2, 1)]
    assert rows[1][4] <= rows[2][3]
    assert "released a stale claim" in b.stderr


@pytest.mark.slow
def test_a_limit_of_three_never_has_more_than_three_of_a_key_inside(
    key_ledger: psycopg.Connection[Any], spawn: Spawn, make_manager: Any, pool: Any
) -> None:
    workers = [spawn(THREE, "--concurrency", "8") for _ in range(3)]
    for worker in workers:
        worker.wait_started()
    mgr = make_manager(keyed.three())
    with pool.connection() as conn, conn.transaction():
        for n in range(30):
            keyed.Transfer.start_tx(conn, mgr, keyed.Move("acct", n, hold=0.2))
        for n in range(10):
            keyed.Transfer.start_tx(conn, mgr, keyed.Move("other", n, hold=0.2))
    wait_all_succeeded(key_ledger, 40, timeout=60)
    rows = entries(key_ledger)
    keys = by_key(rows)
    measured = {account: most_inside(runs) for account, runs in keys.items()}
    print(f"\nmost inside at once per key: {measured}")
    assert measured == {"acct": 3, "other": 3}
    # Slots are taken in creation order: the k-th run to enter is among the first k+2.
    for runs in keys.values():
        for position, (_, n, *_) in enumerate(runs):
            assert n <= position + 2, [r[1] for r in runs]
