"""The same workloads as the null engine, through pgworkflow.

Subcommands (each prints `RESULT {json}` lines for run_all.py):

  fast     fast path: threads loop `run = W.start(mgr, input); run.wait()`
           (`--mode loop`), or start a batch then wait for all of it
           (`--mode batch`); runs/s, start-to-done latency p50/p95/p99, and
           client CPU per run (this process's CPU time / runs: the engine's
           executor threads, heartbeat and pool included).
  workers  N runs inserted with `start_tx` in one transaction, drained by P
           worker processes (`python -m workflow.worker`, or bench/worker.py
           while that module does not exist); runs/s from the commit to the
           last `finished_at`, and CPU per run of the workers.
  pickup   commit-to-handler latency of one `start_tx` run by an idle worker,
           LISTEN vs poll-only (`--no-listen --poll-interval 1`); the handler's
           first line stamps time.time() and records it as its output.
  scale    timed execution and EXPLAIN ANALYZE of the claim (`claim_runs`,
           `claim_run`) and `sweep` statements from `workflow.store._Q`, with
           10k and with 1M finished runs in the tables (bulk-inserted with
           generate_series); each inside a transaction that is rolled back.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any

import psycopg

import workflow
from bench import apps
from bench.common import (
    REPO,
    CpuMeter,
    closed_loop,
    emit,
    latency_summary,
    log,
    scratch_db,
)


def make_manager(url: str, pool_size: int | None) -> workflow.Manager:
    """A Manager over `url`: the engine's own pool by default (min 1, max 16), or a
    given pool of exactly `pool_size` open connections."""
    if not pool_size:
        return workflow.Manager(url, apps.registry(), workflow.Config())
    from psycopg_pool import ConnectionPool

    pool = ConnectionPool(
        url, min_size=pool_size, max_size=pool_size, kwargs={"autocommit": True}, open=True
    )
    pool.wait()
    return workflow.Manager(pool, apps.registry(), workflow.Config())


def prepare(db: str, *, fresh: bool = False) -> str:
    url = scratch_db(db, fresh=fresh)
    workflow.store.migrate(url)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE workflow_runs, workflow_tasks, workflow_events")
    return url


# 1. The fast path.


def cmd_fast(args: argparse.Namespace) -> None:
    url = prepare("bench_engine")
    mgr = make_manager(url, args.pool_size)
    wf = apps.WORKFLOWS[args.tasks]
    Input = apps.BenchInput
    batch = args.batch or max(1, 64 // args.threads)

    def setup(i: int) -> Any:
        n = 0

        if args.mode == "loop":

            def one() -> None:
                nonlocal n
                n += 1
                run = wf.start(mgr, Input(n))
                status = run.wait()
                if status is not workflow.Status.SUCCEEDED:
                    raise RuntimeError(f"run {run.id} ended {status}")

            return one

        def several() -> list[float]:
            nonlocal n
            pc = time.perf_counter
            started = []
            for _ in range(batch):
                n += 1
                started.append((pc(), wf.start(mgr, Input(n))))
            lat = []
            for t0, run in started:
                status = run.wait()
                if status is not workflow.Status.SUCCEEDED:
                    raise RuntimeError(f"run {run.id} ended {status}")
                lat.append(pc() - t0)
            return lat

        return several

    log(f"engine fast: {args.tasks}-task, {args.threads} threads, mode {args.mode}")
    try:
        result = closed_loop(setup, args.threads, args.warmup, args.duration)
    finally:
        mgr.close(timeout=10)
    emit(
        {
            "system": "engine",
            "workload": f"fast{args.tasks}",
            "mode": args.mode,
            "tasks": args.tasks,
            "threads": args.threads,
            **({"batch": batch} if args.mode == "batch" else {}),
            **result,
        }
    )


# 1b. Paired: the null engine and the engine alternating in one process.


def cmd_paired(args: argparse.Namespace) -> None:
    """Alternate short slices of the null engine and the engine, same threads.

    On a shared machine the load changes from second to second; alternating
    1-2 s slices makes each engine slice's neighbour a null slice under the same
    load, so the ratio of the two is far steadier than that of two separate runs.
    """
    from bench import null_engine

    null_url = null_engine.prepare(null_engine.DB)
    url = prepare("bench_engine")
    mgr = make_manager(url, args.pool_size)
    wf = apps.WORKFLOWS[args.tasks]

    def engine_setup(i: int) -> Any:
        n = 0

        def one() -> None:
            nonlocal n
            n += 1
            run = wf.start(mgr, apps.BenchInput(n))
            if run.wait() is not workflow.Status.SUCCEEDED:
                raise RuntimeError(f"run {run.id} failed")

        return one

    log(f"paired null/engine: {args.tasks}-task, {args.threads} threads, {args.slices} slices")
    slices: dict[str, list[dict[str, Any]]] = {"null": [], "engine": []}
    try:
        for k in range(args.slices):
            order = ["null", "engine"] if k % 2 == 0 else ["engine", "null"]
            for who in order:
                conns: list[Any] = []
                setup = (
                    null_engine.make_worker(null_url, args.tasks, conns)
                    if who == "null"
                    else engine_setup
                )
                slices[who].append(closed_loop(setup, args.threads, args.warmup, args.slice))
                for c in conns:
                    c.close()
    finally:
        mgr.close(timeout=10)
    ratios = [
        e["runs_per_s"] / n["runs_per_s"]
        for n, e in zip(slices["null"], slices["engine"], strict=True)
    ]
    for who, rs in slices.items():
        runs = sum(r["runs"] for r in rs)
        secs = sum(r["seconds"] for r in rs)
        cpu = [r["cpu_ms_per_run"] * r["runs"] for r in rs if r["runs"]]
        emit(
            {
                "system": who,
                "workload": f"fast{args.tasks}",
                "mode": "paired",
                "tasks": args.tasks,
                "threads": args.threads,
                "runs": runs,
                "seconds": secs,
                "runs_per_s": runs / secs,
                "slice_runs_per_s": [round(r["runs_per_s"], 1) for r in rs],
                "cpu_ms_per_run": sum(cpu) / runs if runs else None,
                "p50_ms": statistics.median(r["p50_ms"] for r in rs),
                "p95_ms": statistics.median(r["p95_ms"] for r in rs),
                "p99_ms": statistics.median(r["p99_ms"] for r in rs),
                **(
                    {
                        "ratio_median": statistics.median(ratios),
                        "ratio_slices": [round(x, 3) for x in ratios],
                    }
                    if who == "engine"
                    else {}
                ),
            }
        )


# Worker processes.


def worker_command(url: str, extra: list[str]) -> list[str]:
    """`python -m workflow.worker ...`, or bench/worker.py while it does not exist."""
    module = "workflow.worker" if importlib.util.find_spec("workflow.worker") else "bench.worker"
    return [
        sys.executable,
        "-m",
        module,
        "--app",
        "bench.apps:factory",
        "--database-url",
        url,
        *extra,
    ]


def start_workers(url: str, db: str, procs: int, extra: list[str], listen: bool) -> list[Any]:
    cmd = worker_command(url, extra)
    log(f"  workers: {procs} x {' '.join(cmd[2:3])} {' '.join(extra)}")
    popens = []
    for i in range(procs):
        env = dict(os.environ, PGAPPNAME=f"bench-worker-{i}", PYTHONPATH=REPO)
        popens.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL))
    # Ready: every worker has claimed once, or read its next due time (its poller is
    # up: both statements read its workflows one by one, the claim's as
    # `AS w (name, floor)` and next_due's as `AS w (name)`), and, with LISTEN, its
    # listener has subscribed.
    deadline = time.monotonic() + 60
    with psycopg.connect(url, autocommit=True) as conn:
        while True:
            rows = conn.execute(
                """
                SELECT application_name,
                       bool_or(query LIKE 'LISTEN%%'),
                       bool_or(query LIKE '%%AS w (name%%')
                FROM pg_stat_activity WHERE datname = %s AND application_name LIKE 'bench-worker-%%'
                GROUP BY application_name
                """,
                (db,),
            ).fetchall()
            ok = [name for name, lis, claim in rows if claim and (lis or not listen)]
            if len(ok) == procs:
                break
            for p in popens:
                if p.poll() is not None:
                    stop_workers(popens)
                    raise RuntimeError(f"a worker exited with {p.returncode} before it was ready")
            if time.monotonic() > deadline:
                stop_workers(popens)
                raise RuntimeError(f"workers not ready after 60s: {rows}")
            time.sleep(0.05)
    time.sleep(0.2)
    return popens


def stop_workers(popens: list[Any]) -> None:
    for p in popens:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in popens:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# 2. Workers draining a backlog.


def cmd_workers(args: argparse.Namespace) -> None:
    db = "bench_workers"
    url = prepare(db)
    wf = apps.WORKFLOWS[args.tasks]
    extra = [
        "--concurrency",
        str(args.concurrency),
        "--batch-size",
        str(args.batch_size),
        "--log-level",
        "WARNING",
    ]
    popens = start_workers(url, db, args.procs, extra, listen=True)
    try:
        mgr = workflow.Manager(url, apps.registry(), workflow.Config())
        meter = CpuMeter([p.pid for p in popens])
        meter.start()
        with psycopg.connect(url) as conn:
            with conn.transaction():
                for i in range(args.runs):
                    wf.start_tx(conn, mgr, apps.BenchInput(i))
            t_commit = time.time()
        deadline = time.monotonic() + args.timeout
        with psycopg.connect(url, autocommit=True) as conn:
            while True:
                left, done, last = conn.execute(
                    "SELECT count(*) FILTER (WHERE finished_at IS NULL),"
                    " count(*) FILTER (WHERE status = 'succeeded'),"
                    " extract(epoch FROM max(finished_at))::float8 FROM workflow_runs"
                ).fetchone()
                if left == 0:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{left} runs still unfinished after {args.timeout}s")
                time.sleep(0.05)
        self_cpu, worker_cpu = meter.stop()
        mgr.close(timeout=5)
    finally:
        stop_workers(popens)
    elapsed = last - t_commit
    emit(
        {
            "system": "engine",
            "workload": f"workers{args.tasks}",
            "tasks": args.tasks,
            "procs": args.procs,
            "concurrency": args.concurrency,
            "batch_size": args.batch_size,
            "runs": args.runs,
            "succeeded": done,
            "seconds": elapsed,
            "runs_per_s": args.runs / elapsed,
            "worker_cpu_ms_per_run": worker_cpu * 1000.0 / args.runs,
            "insert_cpu_ms_per_run": self_cpu * 1000.0 / args.runs,
        }
    )


# 3. Pickup latency.


def cmd_pickup(args: argparse.Namespace) -> None:
    db = "bench_pickup"
    url = prepare(db)
    extra = ["--concurrency", "4", "--batch-size", "10", "--log-level", "WARNING"]
    if not args.listen:
        extra += ["--no-listen", "--poll-interval", str(args.poll_interval)]
    popens = start_workers(url, db, 1, extra, listen=args.listen)
    lat: list[float] = []
    try:
        mgr = workflow.Manager(url, apps.registry(), workflow.Config())
        rnd = random.Random(7)
        with psycopg.connect(url) as conn, psycopg.connect(url, autocommit=True) as watch:
            for i in range(args.samples):
                with conn.transaction():
                    run = apps.Pickup.start_tx(conn, mgr, apps.BenchInput(i))
                t_commit = time.time()
                deadline = time.monotonic() + 3 * args.poll_interval + 30
                while True:
                    row = watch.execute(
                        "SELECT output FROM workflow_tasks"
                        " WHERE run_id = %s AND output IS NOT NULL",
                        (uuid.UUID(run.id),),
                    ).fetchone()
                    if row is not None:
                        lat.append(float(row[0]) - t_commit)
                        break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"run {run.id} not picked up")
                    time.sleep(0.005)
                # Let the worker go idle again (its poller back to sleep). Poll-only:
                # a random phase against the poll timer (the poller polls again right
                # after each run it executes, so a fixed gap would bias the sample).
                gap = 0.2 if args.listen else args.poll_interval
                time.sleep(rnd.uniform(0.05, 0.05 + gap))
        mgr.close(timeout=5)
    finally:
        stop_workers(popens)
    emit(
        {
            "system": "engine",
            "workload": "pickup",
            "listen": args.listen,
            "poll_interval": None if args.listen else args.poll_interval,
            **latency_summary(lat),
            "mean_ms": statistics.mean(lat) * 1000.0,
            "min_ms": min(lat) * 1000.0,
        }
    )


# 4. Scale: claim and sweep latency against history size.

BULK_FINISHED = """
WITH r AS (
    INSERT INTO workflow_runs (id, workflow, status, input, task_count, current_seq,
                               next_retry_at, created_at, finished_at)
    SELECT gen_random_uuid(), 'Bench.Three', 'succeeded', jsonb_build_object('n', g), 3, 4,
           ts, ts, ts + interval '20 ms'
    FROM generate_series(1, %(n)s) AS g,
         LATERAL (SELECT now() - interval '30 days' + g * interval '1 ms') AS t (ts)
    RETURNING id, finished_at
)
INSERT INTO workflow_tasks (run_id, seq, name, finished_at)
SELECT r.id, s.seq::smallint, (ARRAY['bench.a', 'bench.b', 'bench.c'])[s.seq], r.finished_at
FROM r, generate_series(1, 3) AS s (seq)
"""

LIVE_RUNS = """
WITH r AS (
    INSERT INTO workflow_runs (id, workflow, status, input, task_count, current_seq,
                               claim_id, heartbeat_at)
    SELECT gen_random_uuid(), 'Bench.Three', %(status)s, jsonb_build_object('n', g), 3, 1,
           CASE WHEN %(claimed)s THEN gen_random_uuid() END,
           CASE WHEN %(claimed)s THEN now() - make_interval(secs => %(age)s) END
    FROM generate_series(1, %(n)s) AS g
    RETURNING id
)
INSERT INTO workflow_tasks (run_id, seq, name)
SELECT r.id, s.seq::smallint, (ARRAY['bench.a', 'bench.b', 'bench.c'])[s.seq]
FROM r, generate_series(1, 3) AS s (seq)
"""


def _explain(conn: Any, sql: str, params: dict[str, Any]) -> tuple[float, int, str]:
    """(execution ms, shared buffers touched, plan text) of one rolled-back EXPLAIN ANALYZE."""
    conn.execute("BEGIN")
    try:
        rows = conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql, params).fetchall()
    finally:
        conn.execute("ROLLBACK")
    plan = "\n".join(r[0] for r in rows)
    ms = float(re.search(r"Execution Time: ([0-9.]+) ms", plan).group(1))
    m = re.search(r"Buffers: shared((?: \w+=\d+)+)", plan)
    buffers = 0
    if m:
        for kind, count in re.findall(r"(\w+)=(\d+)", m.group(1)):
            if kind in ("hit", "read"):
                buffers += int(count)
    return ms, buffers, plan


def _populate(url: str, size: int) -> None:
    """Live state plus `size` finished runs (3 tasks each), vacuumed and analyzed."""
    with psycopg.connect(url, autocommit=True) as conn:
        counts = conn.execute(
            "SELECT count(*) FILTER (WHERE status = 'succeeded'),"
            " count(*) FILTER (WHERE status = 'pending'),"
            " count(*) FILTER (WHERE claim_id IS NOT NULL) FROM workflow_runs"
        ).fetchone()
        if tuple(counts) != (size, 100, 50):
            conn.execute("TRUNCATE workflow_runs, workflow_tasks, workflow_events")
            t0 = time.perf_counter()
            # Live state: 40 claimed runs with a fresh heartbeat, 10 stale ones (the
            # sweep releases these), 100 pending runs for the claim to take 10 of.
            conn.execute(LIVE_RUNS, {"status": "running", "claimed": True, "age": 1, "n": 40})
            conn.execute(LIVE_RUNS, {"status": "running", "claimed": True, "age": 3600, "n": 10})
            conn.execute(LIVE_RUNS, {"status": "pending", "claimed": False, "age": 0, "n": 100})
            have = 0
            while have < size:
                chunk = min(200_000, size - have)
                conn.execute(BULK_FINISHED, {"n": chunk})
                have += chunk
            log(f"  scale: {size} finished runs inserted ({time.perf_counter() - t0:.1f}s)")
        else:
            # Fresh heartbeats for the live claims (the 40 must not be stale).
            conn.execute(
                "UPDATE workflow_runs SET heartbeat_at = now() - interval '1 second'"
                " WHERE claim_id IS NOT NULL AND heartbeat_at > now() - interval '30 minutes'"
            )
        conn.execute("ALTER TABLE workflow_runs SET (autovacuum_enabled = true)")
        conn.execute("VACUUM ANALYZE workflow_runs")
        conn.execute("VACUUM ANALYZE workflow_tasks")


def _statements(conn: Any) -> dict[str, tuple[str, dict[str, Any]]]:
    from workflow.store import _Q, CHANNEL

    claims = [uuid.uuid4() for _ in range(10)]
    pending_id = conn.execute(
        "SELECT id FROM workflow_runs WHERE status = 'pending' ORDER BY created_at LIMIT 1"
    ).fetchone()[0]
    return {
        "claim_runs (10 of 100 pending)": (
            _Q["claim_runs"],
            {"workflows": ["Bench.Three", "Bench.One"], "floors": "{NULL,NULL}", "limit": 10,
             "claims": claims},
        ),
        "claim_runs (idle: none claimable)": (
            _Q["claim_runs"],
            {"workflows": ["Bench.Other"], "floors": "{NULL}", "limit": 10, "claims": claims},
        ),
        "claim_run (by id)": (_Q["claim_run"], {"id": pending_id, "claim_id": uuid.uuid4()}),
        "sweep (10 stale of 50 claimed)": (
            _Q["sweep"],
            {"max_age": 600, "limit": 100, "channel": CHANNEL},
        ),
    }


def cmd_scale(args: argparse.Namespace) -> None:
    """Same statements, same live state, two history sizes, measured interleaved."""
    sizes = sorted(int(s) for s in args.sizes.split(","))
    urls = {}
    for size in sizes:
        db = f"bench_scale_{size}"
        url = scratch_db(db)
        workflow.store.migrate(url)
        _populate(url, size)
        urls[size] = url
    conns = {size: psycopg.connect(url, autocommit=True) for size, url in urls.items()}
    try:
        stmts = {size: _statements(conn) for size, conn in conns.items()}
        names = list(stmts[sizes[0]])
        times: dict[tuple[str, int], list[float]] = {(n, s): [] for n in names for s in sizes}
        rows: dict[tuple[str, int], int] = {}
        explains: dict[tuple[str, int], list[tuple[float, int, str]]] = {k: [] for k in times}
        for rep in range(args.reps):
            for name in names:
                for size in sizes[:: 1 if rep % 2 == 0 else -1]:
                    conn = conns[size]
                    sql, params = stmts[size][name]
                    conn.execute("BEGIN")
                    t0 = time.perf_counter()
                    rows[(name, size)] = len(conn.execute(sql, params).fetchall())
                    times[(name, size)].append(time.perf_counter() - t0)
                    conn.execute("ROLLBACK")
                    if rep % max(1, args.reps // 10) == 0:
                        explains[(name, size)].append(_explain(conn, sql, params))
        for (name, size), ts in times.items():
            ex = explains[(name, size)]
            table_mb = (
                conns[size]
                .execute(
                    "SELECT (pg_total_relation_size('workflow_runs')"
                    " + pg_total_relation_size('workflow_tasks')) / 1048576.0"
                )
                .fetchone()[0]
            )
            emit(
                {
                    "system": "engine",
                    "workload": "scale",
                    "statement": name,
                    "finished_runs": size,
                    "tables_mb": float(table_mb),
                    "rows": rows[(name, size)],
                    "median_ms": statistics.median(ts) * 1000.0,
                    "p95_ms": sorted(ts)[int(0.95 * (len(ts) - 1))] * 1000.0,
                    "server_ms": statistics.median(e[0] for e in ex),
                    "buffers": statistics.median(e[1] for e in ex),
                    "plan": ex[-1][2],
                }
            )
        if args.churn:
            _churn(conns[sizes[-1]], sizes[-1], args.churn, stmts[sizes[-1]])
    finally:
        for conn in conns.values():
            conn.close()


def _churn(conn: Any, size: int, n: int, stmts: dict[str, tuple[str, dict[str, Any]]]) -> None:
    """`n` runs go pending -> finished by UPDATE, with no vacuum after: the claim
    index then holds `n` dead entries, as it does after a burst, until autovacuum
    runs. The first claim walks them (and marks them dead); later ones skip them.
    (Their task rows are left out: the claim never reads tasks of finished runs.)"""
    conn.execute("ALTER TABLE workflow_runs SET (autovacuum_enabled = false)")
    t0 = time.perf_counter()
    # Older than the live pending runs, so the claim's index scan meets them first.
    conn.execute(
        "INSERT INTO workflow_runs (id, workflow, status, input, task_count, current_seq,"
        " created_at, next_retry_at)"
        " SELECT gen_random_uuid(), 'Bench.Three', 'pending', '{}', 3, 1,"
        " now() - interval '1 day' + g * interval '1 ms', now() - interval '1 day'"
        " FROM generate_series(1, %(n)s) AS g",
        {"n": n},
    )
    conn.execute(
        "UPDATE workflow_runs SET status = 'succeeded', current_seq = 4, finished_at = now()"
        " WHERE status = 'pending' AND created_at < now() - interval '1 hour'"
    )
    log(f"  scale: churned {n} runs ({time.perf_counter() - t0:.1f}s), no vacuum")
    for name in ("claim_runs (idle: none claimable)", "claim_runs (10 of 100 pending)"):
        sql, params = stmts[name]
        ts = []
        first = None
        for i in range(30):
            conn.execute("BEGIN")
            t = time.perf_counter()
            conn.execute(sql, params).fetchall()
            ts.append(time.perf_counter() - t)
            conn.execute("ROLLBACK")
            if i == 0:
                first = ts[0]
        emit(
            {
                "system": "engine",
                "workload": "scale-churn",
                "statement": name,
                "finished_runs": size,
                "dead_claim_index_entries": n,
                "first_ms": first * 1000.0,
                "median_ms": statistics.median(ts[1:]) * 1000.0,
                "plan": _explain(conn, sql, params)[2],
            }
        )
    conn.execute("ALTER TABLE workflow_runs SET (autovacuum_enabled = true)")


def main() -> None:
    p = argparse.ArgumentParser(description="pgworkflow benchmarks")
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fast")
    f.add_argument("--tasks", type=int, choices=[1, 3], default=3)
    f.add_argument("--threads", type=int, default=1)
    f.add_argument("--mode", choices=["loop", "batch"], default="loop")
    f.add_argument("--batch", type=int, default=0, help="runs per thread per batch (batch mode)")
    f.add_argument("--duration", type=float, default=10.0)
    f.add_argument("--warmup", type=float, default=2.0)
    f.add_argument(
        "--pool-size",
        type=int,
        default=0,
        help="give the Manager a pool of this many connections (default: its own)",
    )
    q = sub.add_parser("paired")
    q.add_argument("--tasks", type=int, choices=[1, 3], default=3)
    q.add_argument("--threads", type=int, default=1)
    q.add_argument("--slices", type=int, default=6, help="slices of each (alternating)")
    q.add_argument("--slice", type=float, default=2.0, help="seconds measured per slice")
    q.add_argument("--warmup", type=float, default=0.3)
    q.add_argument(
        "--pool-size",
        type=int,
        default=0,
        help="give the Manager a pool of this many connections (default: its own)",
    )
    w = sub.add_parser("workers")
    w.add_argument("--tasks", type=int, choices=[1, 3], default=3)
    w.add_argument("--procs", type=int, default=1)
    w.add_argument("--runs", type=int, default=2000)
    w.add_argument("--concurrency", type=int, default=16)
    w.add_argument("--batch-size", type=int, default=32)
    w.add_argument("--timeout", type=float, default=300)
    k = sub.add_parser("pickup")
    k.add_argument("--listen", action=argparse.BooleanOptionalAction, default=True)
    k.add_argument("--poll-interval", type=float, default=1.0)
    k.add_argument("--samples", type=int, default=50)
    s = sub.add_parser("scale")
    s.add_argument("--sizes", default="10000,1000000")
    s.add_argument("--reps", type=int, default=100)
    s.add_argument("--churn", type=int, default=0, help="then churn this many runs, unvacuumed")
    args = p.parse_args()
    {
        "fast": cmd_fast,
        "paired": cmd_paired,
        "workers": cmd_workers,
        "pickup": cmd_pickup,
        "scale": cmd_scale,
    }[args.cmd](args)


if __name__ == "__main__":
    main()
