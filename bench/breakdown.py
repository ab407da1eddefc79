"""Where one fast-path run's time goes: a timeline of `start()` + `wait()`, from one thread.

Wraps (monkeypatches, in this process only) the store calls and the executor
entry point to stamp each phase of a 3-task run, runs N runs one after another,
and prints the median duration of each phase next to the null engine doing the
same statements by hand. Compare "SQL" to "in between" to see what the engine
adds around the four round trips.

    python -m bench.breakdown --runs 500
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import threading
import time
import uuid
from typing import Any

import psycopg
import psycopg_pool

import workflow
from bench import apps, null_engine
from bench.engine import prepare
from workflow.executor import Executor
from workflow.store import Store

_stamps = threading.local()
_timeline: dict[str, list[tuple[str, float]]] = {}


def _mark(key: str, what: str) -> None:
    _timeline.setdefault(key, []).append((what, time.perf_counter()))


def instrument() -> None:
    orig_insert = Store.insert_run
    orig_complete = Store.complete_task
    orig_execute = Executor.execute

    def insert_run(self: Store, conn: Any, **params: Any) -> Any:
        key = str(params["run_id"])
        _mark(key, "insert sent")
        r = orig_insert(self, conn, **params)
        _mark(key, "insert done")
        return r

    def complete_task(
        self: Store, run_id: uuid.UUID, claim_id: uuid.UUID, seq: int, *a: Any, **kw: Any
    ) -> Any:
        key = str(run_id)
        _mark(key, f"task {seq} sent")
        r = orig_complete(self, run_id, claim_id, seq, *a, **kw)
        _mark(key, f"task {seq} done")
        return r

    def execute(self: Executor, run: Any, **kwargs: Any) -> None:
        _mark(str(run.id), "executor begins")
        orig_execute(self, run, **kwargs)
        _mark(str(run.id), "executor ends")

    Store.insert_run = insert_run  # type: ignore[method-assign]
    Store.complete_task = complete_task  # type: ignore[method-assign]
    Executor.execute = execute  # type: ignore[method-assign]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=500)
    p.add_argument("--tasks", type=int, choices=[1, 3], default=3)
    args = p.parse_args()
    url = prepare("bench_engine")
    instrument()
    mgr = workflow.Manager(url, apps.registry(), workflow.Config())
    wf = apps.WORKFLOWS[args.tasks]
    for i in range(50):  # warm up (prepared statements, pool)
        wf.start(mgr, apps.BenchInput(i)).wait()
    _timeline.clear()
    cpu0 = time.process_time()
    for i in range(args.runs):
        t0 = time.perf_counter()
        run = wf.start(mgr, apps.BenchInput(i))
        t1 = time.perf_counter()
        run.wait()
        t2 = time.perf_counter()
        _timeline[run.id].insert(0, ("start() called", t0))
        _timeline[run.id].append(("start() returned", t1))
        _timeline[run.id].append(("wait() returned", t2))
    cpu = (time.process_time() - cpu0) / args.runs
    mgr.close()
    gaps: dict[tuple[str, str], list[float]] = {}
    order: list[tuple[str, str]] = []
    for marks in _timeline.values():
        marks.sort(key=lambda m: m[1])
        for (a, ta), (b, tb) in itertools.pairwise(marks):
            k = (a, b)
            if k not in gaps:
                order.append(k)
            gaps.setdefault(k, []).append(tb - ta)
    total = statistics.median(m[-1][1] - m[0][1] for m in _timeline.values())
    print(
        f"engine, {args.tasks}-task, 1 thread, {args.runs} runs: median start-to-done "
        f"{total * 1000:.3f} ms, client CPU {cpu * 1000:.3f} ms/run"
    )
    print(f"{'phase':55s} {'median ms':>10s} {'n':>6s}")
    for k in order:
        v = gaps[k]
        if len(v) < args.runs * 0.5:
            continue
        print(f"{k[0] + ' -> ' + k[1]:55s} {statistics.median(v) * 1000:10.3f} {len(v):6d}")

    # The null engine's statements, timed the same way.
    null_url = null_engine.prepare(null_engine.DB)
    conns: list[Any] = []
    one = null_engine.make_worker(null_url, args.tasks, conns)(0)
    for _ in range(50):
        one()
    conn = conns[0]
    stmt_times: dict[str, list[float]] = {}
    orig = conn.execute

    def timed(sql: str, params: Any = None) -> Any:
        t = time.perf_counter()
        r = orig(sql, params)  # returns once the result is in (fetchall reads a buffer)
        name = "insert" if "INSERT" in sql else ("finish" if "succeeded" in sql else "advance")
        stmt_times.setdefault(name, []).append(time.perf_counter() - t)
        return r

    conn.execute = timed  # type: ignore[method-assign]
    totals = []
    cpu0 = time.process_time()
    for _ in range(args.runs):
        t = time.perf_counter()
        one()
        totals.append(time.perf_counter() - t)
    cpu = (time.process_time() - cpu0) / args.runs
    print(
        f"\nnull engine, same: median run {statistics.median(totals) * 1000:.3f} ms, "
        f"client CPU {cpu * 1000:.3f} ms/run"
    )
    for name, v in stmt_times.items():
        print(f"  {name:10s} median {statistics.median(v) * 1000:.3f} ms (n={len(v)})")
    for c in conns:
        c.close()
    statement_overhead(url, args.runs)


def statement_overhead(url: str, n: int) -> None:
    """One "advance" write three ways, rotated over the same runs: through the
    engine's Store (pool checkout + wrapper), the engine's SQL on a dedicated
    connection, and the null engine's hand-written statement."""
    from workflow.store import _Q, _step

    pool = psycopg_pool.ConnectionPool(url, min_size=2, max_size=4, kwargs={"autocommit": True})
    pool.wait()
    store = Store(pool)
    conn = psycopg.connect(url, autocommit=True)
    names = ["bench.a", "bench.b", "bench.c", "bench.d"]

    def via_store(run_id: uuid.UUID, claim: uuid.UUID, seq: int) -> None:
        assert store.complete_task(run_id, claim, seq, None, seq + 1, False)

    def engine_sql(run_id: uuid.UUID, claim: uuid.UUID, seq: int) -> None:
        params = _step(run_id, claim, seq, None, seq + 1, False, True)
        assert conn.execute(_Q["complete_task"], params).fetchall()

    def null_sql(run_id: uuid.UUID, claim: uuid.UUID, seq: int) -> None:
        assert conn.execute(
            null_engine.ADVANCE,
            {"id": run_id, "claim_id": claim, "seq": seq, "output": None, "next_seq": seq + 1},
        ).fetchall()

    ways = {
        "Store.complete_task (pool)": via_store,
        "engine SQL, own connection": engine_sql,
        "null engine SQL, own connection": null_sql,
    }
    times: dict[str, list[float]] = {k: [] for k in ways}
    cpus: dict[str, list[float]] = {k: [] for k in ways}
    keys = list(ways)
    for i in range(n + 50):
        run_id, claim = uuid.uuid4(), uuid.uuid4()
        conn.execute(
            null_engine.INSERT_RUN,
            {
                "id": run_id,
                "workflow": "Bench.Four",
                "input": "{}",
                "task_count": 4,
                "claim_id": claim,
                "names": names,
            },
        )
        for seq in (1, 2, 3):
            k = keys[(i + seq) % 3]
            c0, t0 = time.process_time(), time.perf_counter()
            ways[k](run_id, claim, seq)
            if i >= 50:
                times[k].append(time.perf_counter() - t0)
                cpus[k].append(time.process_time() - c0)
        conn.execute(
            null_engine.FINISH,
            {"id": run_id, "claim_id": claim, "seq": 4, "output": None, "next_seq": 5},
        )
    print("\none 'advance' write (record a task, move the run on), rotated over the same runs:")
    for k in keys:
        print(
            f"  {k:34s} median {statistics.median(times[k]) * 1000:.3f} ms, "
            f"client CPU {statistics.mean(cpus[k]) * 1000:.3f} ms"
        )
    conn.close()
    pool.close()


if __name__ == "__main__":
    main()
