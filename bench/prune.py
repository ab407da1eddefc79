"""Claim latency while `Admin.prune()` deletes a large history (SPEC 12, retention).

A database holds `--runs` finished runs old enough to prune (3 tasks each, a
history row for every tenth) and half as many recent ones that are kept. Two
workloads run throughout, each on its own connection:

- a claimer, as a worker's poller would: it enqueues one run with `start_tx`,
  claims it with the poller's `claim_runs` statement (timed: the round trip),
  and finishes it;
- the engine's fast path on a workflow users would write: an attrs input, three
  tasks with typed outputs, each reading the one before (start-to-done timed).

Each is measured for `--window` seconds before the prune, during it, and for
`--window` seconds after; the printed ratios are during ÷ before of the same run
on the same machine. The prune's own batch times are reported for its first and
last tenth: a delete whose cost grew with the rows already deleted or kept would
show there.

    PYTHONPATH=. python bench/prune.py [--runs 100000] [--batch-size 1000] [--window 8]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import threading
import time
import uuid
from typing import Any

import psycopg

import workflow
from bench.apps import Order, OrderFlow, _reserve, order_steps, reserve
from bench.common import emit, latency_summary, log, scratch_db
from workflow.store import _Q

HISTORY = """
WITH r AS (
    INSERT INTO workflow_runs (id, workflow, status, input, task_count, current_seq,
                               next_retry_at, created_at, finished_at)
    SELECT gen_random_uuid(), 'Bench.Order', 'succeeded',
           jsonb_build_object('order_id', g, 'cents', 100 + g %% 900), 3, 4,
           ts, ts, ts + interval '20 ms'
    FROM generate_series(1, %(n)s) AS g,
         LATERAL (SELECT now() - make_interval(days => %(days)s) + g * interval '1 ms') AS t (ts)
    RETURNING id, finished_at
), tasks AS (
    INSERT INTO workflow_tasks (run_id, seq, name, output, finished_at)
    SELECT r.id, s.seq::smallint, (ARRAY['reserve', 'charge', 'receipt'])[s.seq],
           jsonb_build_object('ref', r.id::text, 'seq', s.seq), r.finished_at
    FROM r, generate_series(1, 3) AS s (seq)
)
INSERT INTO workflow_events (run_id, at, kind, seq, attempt, error)
SELECT r.id, r.finished_at, 'failed', 2, 1, 'card network timeout'
FROM r WHERE ('x' || substr(r.id::text, 1, 8))::bit(32)::int %% 10 = 0
"""


Probe = workflow.Workflow("Bench.Probe", Order)


def registry() -> workflow.Registry:
    reg = workflow.Registry()
    reg.register(workflow.define(OrderFlow, *order_steps()))
    reg.register(workflow.define(Probe, workflow.handle(reserve, _reserve)))
    return reg


def populate(url: str, runs: int) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        t0 = time.perf_counter()
        for days, count in ((40, runs), (1, runs // 2)):
            done = 0
            while done < count:
                chunk = min(50_000, count - done)
                conn.execute(HISTORY, {"n": chunk, "days": days})
                done += chunk
        conn.execute("VACUUM ANALYZE workflow_runs")
        conn.execute("VACUUM ANALYZE workflow_tasks")
        conn.execute("VACUUM ANALYZE workflow_events")
        log(f"  {runs} prunable + {runs // 2} kept runs inserted ({time.perf_counter() - t0:.1f}s)")


class Samples:
    """(when, seconds) pairs from one workload, appended by its thread."""

    def __init__(self) -> None:
        self.points: list[tuple[float, float]] = []

    def between(self, start: float, end: float) -> list[float]:
        return [took for at, took in self.points if start <= at < end]


def claimer(url: str, mgr: workflow.Manager, stop: threading.Event, out: Samples) -> None:
    """Enqueue one Probe run, claim it with the poller's statement (timed), finish it."""
    sql = _Q["claim_runs"]
    n = 0
    with psycopg.connect(url, autocommit=True) as conn:
        while not stop.is_set():
            n += 1
            with conn.transaction():
                Probe.start_tx(conn, mgr, Order(order_id=n, cents=n % 900))
            params = {"workflows": ["Bench.Probe"], "floors": "{NULL}", "limit": 10,
                      "claims": [uuid.uuid4()]}
            t0 = time.perf_counter()
            claimed = conn.execute(sql, params).fetchall()
            took = time.perf_counter() - t0
            if not claimed:
                raise RuntimeError("the claimer claimed nothing")
            out.points.append((t0, took))
            conn.execute(
                "UPDATE workflow_runs SET status = 'succeeded', finished_at = now(),"
                " claim_id = NULL, heartbeat_at = NULL, current_seq = 2"
                " WHERE workflow = 'Bench.Probe' AND claim_id IS NOT NULL"
            )
            time.sleep(0.005)


def fast_path(mgr: workflow.Manager, stop: threading.Event, out: Samples) -> None:
    n = 0
    while not stop.is_set():
        n += 1
        t0 = time.perf_counter()
        run = OrderFlow.start(mgr, Order(order_id=n, cents=100 + n % 900))
        if run.wait(timeout=60) is not workflow.Status.SUCCEEDED:
            raise RuntimeError(f"run {run.id} did not succeed")
        out.points.append((t0, time.perf_counter() - t0))


def ratio(during: dict[str, Any], before: dict[str, Any], key: str) -> float | None:
    if during[key] is None or not before[key]:
        return None
    return float(during[key] / before[key])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--window", type=float, default=8.0)
    args = parser.parse_args()

    url = scratch_db("bench_prune", fresh=True)
    workflow.store.migrate(url)
    populate(url, args.runs)

    mgr = workflow.Manager(url, registry())
    admin = workflow.Admin(url)
    stop = threading.Event()
    claims, runs = Samples(), Samples()
    threads = [
        threading.Thread(target=claimer, args=(url, mgr, stop, claims), daemon=True),
        threading.Thread(target=fast_path, args=(mgr, stop, runs), daemon=True),
    ]
    for thread in threads:
        thread.start()
    try:
        time.sleep(1.0)  # warm: connections, prepared statements
        before_start = time.perf_counter()
        time.sleep(args.window)
        batches: list[float] = []
        last = [time.perf_counter()]

        def progress(total: int) -> None:
            now = time.perf_counter()
            batches.append(now - last[0])
            last[0] = now

        prune_start = time.perf_counter()
        last[0] = prune_start
        deleted = admin.prune(
            older_than=datetime.timedelta(days=7), batch_size=args.batch_size, progress=progress
        )
        prune_end = time.perf_counter()
        time.sleep(args.window)
        after_end = time.perf_counter()
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
        mgr.close(timeout=10)
        admin.close()

    with psycopg.connect(url) as conn:
        left = conn.execute(
            "SELECT count(*) FILTER (WHERE finished_at < now() - interval '7 days'),"
            " count(*) FILTER (WHERE workflow = 'Bench.Order'"
            " AND finished_at >= now() - interval '7 days'"
            " AND created_at < now() - interval '12 hours')"
            " FROM workflow_runs"
        ).fetchone()
    if deleted != args.runs or left[0] != 0 or left[1] != args.runs // 2:
        raise SystemExit(f"prune deleted {deleted} (left {left}); expected {args.runs}")

    tenth = max(1, len(batches) // 10)
    first, final = batches[:tenth], batches[-tenth:]
    prune = {
        "deleted": deleted,
        "seconds": prune_end - prune_start,
        "runs_per_s": deleted / (prune_end - prune_start),
        "batches": len(batches),
        "first_tenth_batch_ms": statistics.median(first) * 1000,
        "last_tenth_batch_ms": statistics.median(final) * 1000,
    }
    emit({"bench": "prune", **prune})
    print(
        f"prune: {deleted} runs in {prune['seconds']:.1f}s ({prune['runs_per_s']:.0f} runs/s),"
        f" {len(batches)} batches of {args.batch_size}; median batch"
        f" {prune['first_tenth_batch_ms']:.0f} ms in the first tenth,"
        f" {prune['last_tenth_batch_ms']:.0f} ms in the last"
    )
    workloads = (("claim_runs round trip", claims), ("fast-path run, start to done", runs))
    for name, samples in workloads:
        windows = {
            "before": latency_summary(samples.between(before_start, prune_start)),
            "during": latency_summary(samples.between(prune_start, prune_end)),
            "after": latency_summary(samples.between(prune_end, after_end)),
        }
        emit({"bench": "prune", "workload": name, **windows})
        print(f"{name}:")
        for window, summary in windows.items():
            print(
                f"  {window:6} n={summary['samples']:5}  p50 {summary['p50_ms']:7.2f} ms"
                f"  p99 {summary['p99_ms']:7.2f} ms  max {summary['max_ms']:7.2f} ms"
            )
        print(
            "  during/before: p50 x{:.2f}  p99 x{:.2f}  max x{:.2f}".format(
                ratio(windows["during"], windows["before"], "p50_ms") or 0,
                ratio(windows["during"], windows["before"], "p99_ms") or 0,
                ratio(windows["during"], windows["before"], "max_ms") or 0,
            )
        )


if __name__ == "__main__":
    main()
