"""Diagnostic: where a fast-path run's client CPU goes, from one thread.

Sequential 3-task runs, four ways, each the best of `--reps` batches of `--runs`,
with process-wide user and system CPU and voluntary context switches per run
(`getrusage`):

1. null: the null engine's statements on one connection (bench/null_engine.py);
2. store: the engine's own statements through `workflow.store.Store` (a warm
   store over a pool, as a Manager built from a URL has), on this thread: the
   engine's SQL path with no Manager and no thread hand-off;
3. engine: `Bench.Three.start(mgr, ...).wait()` through a Manager;
4. engine, no I/O: the same with `Store._run` answering at once from memory
   (no database round trip): the engine's own Python per run, hand-off included.
   A diagnostic stub, never a test: the engine's behaviour is its SQL.

Engine minus store is what the Manager adds; engine minus (store + no-I/O) is
what the two thread hand-offs cost once the statements block on I/O.

    python -m bench.handoff [--runs 600] [--reps 3]
"""

from __future__ import annotations

import argparse
import resource
import time
import uuid
from collections.abc import Callable
from typing import Any

from bench import apps, null_engine
from bench.common import log
from bench.engine import prepare


def measure(one: Callable[[], Any], runs: int, reps: int) -> dict[str, float]:
    for _ in range(min(200, runs)):
        one()
    best: dict[str, float] = {}
    for _ in range(reps):
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        for _ in range(runs):
            one()
        r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        got = {
            "cpu_ms": (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) / runs * 1e3,
            "user_ms": (r1.ru_utime - r0.ru_utime) / runs * 1e3,
            "sys_ms": (r1.ru_stime - r0.ru_stime) / runs * 1e3,
            "vcsw": (r1.ru_nvcsw - r0.ru_nvcsw) / runs,
            "wall_ms": (t1 - t0) / runs * 1e3,
        }
        if not best or got["cpu_ms"] < best["cpu_ms"]:
            best = got
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=600)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()

    import psycopg_pool

    import workflow
    import workflow.store as store_mod

    results: dict[str, dict[str, float]] = {}

    null_one = null_engine.make_worker(null_engine.prepare(null_engine.DB), 3)(0)
    results["null"] = measure(null_one, args.runs, args.reps)

    url = prepare("bench_engine")
    pool: psycopg_pool.ConnectionPool[Any] = psycopg_pool.ConnectionPool(
        url, min_size=1, max_size=16, kwargs={"autocommit": True}, open=True
    )
    pool.wait()
    store = store_mod.Store(pool, keep_warm=True)

    def store_one() -> None:
        run_id, claim_id = uuid.uuid4(), uuid.uuid4()
        store.insert_run(
            None,
            run_id=run_id,
            workflow="Bench.Three",
            status="running",
            idempotency_key=None,
            input='{"n":1}',
            input_sealed=None,
            context=None,
            context_sealed=None,
            task_count=3,
            current_seq=1,
            claim_id=claim_id,
            names='{"bench.a","bench.b","bench.c"}',
            skipped="{f,f,f}",
            wake=False,
        )
        for seq in (1, 2, 3):
            if not store.complete_task(run_id, claim_id, seq, None, seq + 1, seq == 3):
                raise RuntimeError("claim lost")

    results["store"] = measure(store_one, args.runs, args.reps)
    store.close()
    pool.close()

    mgr = workflow.Manager(url, apps.registry())
    wf = apps.WORKFLOWS[3]

    def engine_one() -> None:
        if wf.start(mgr, apps.BenchInput(1)).wait() is not workflow.Status.SUCCEEDED:
            raise RuntimeError("run failed")

    results["engine"] = measure(engine_one, args.runs, args.reps)

    # The store binds `Connections.run` when it is made (`Store._run`), so the stub
    # goes on the class before a second Manager is built over it.
    from workflow.store.connections import Connections

    real_run = Connections.run

    def no_io(
        self: Any, name: str, params: dict[str, Any], recover: str | None = None,
        **kwargs: Any,
    ) -> list[tuple[Any, ...]]:
        if name == "insert_run":  # (id, wake-up, claimed)
            return [(params["id"], None, params["claim_id"] is not None)]
        if name == "complete_task":  # a row: the claim matched
            return [(params["seq"],)]
        return real_run(self, name, params, recover, **kwargs)

    mgr.close()
    Connections.run = no_io  # type: ignore[method-assign]
    try:
        mgr = workflow.Manager(url, apps.registry())
        results["engine, no I/O"] = measure(engine_one, args.runs * 5, args.reps)
    finally:
        Connections.run = real_run  # type: ignore[method-assign]
    mgr.close()

    log(f"sequential 3-task runs, best of {args.reps} x {args.runs}")
    print("| path | CPU ms/run | user | sys | voluntary switches/run | wall ms/run |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['cpu_ms']:.3f} | {r['user_ms']:.3f} | {r['sys_ms']:.3f} "
            f"| {r['vcsw']:.1f} | {r['wall_ms']:.3f} |"
        )


if __name__ == "__main__":
    main()
