"""Procrastinate: the 1-task workload as one job, the 3-task one as 3 chained jobs.

Each job of the chain defers the next (`await next.defer_async(n=n)`) when it
runs, so the three run strictly in order, as a run's tasks do. Jobs are `async
def` no-ops (procrastinate's native kind; sync tasks would add a thread hop).
A worker process (`--concurrency T`, LISTEN/NOTIFY on) runs them.

Procrastinate has no "await this job" API, so this is a throughput measurement:
once the worker is up, T client threads defer N runs (sync `defer`), and the
clock stops when the last job of every chain has succeeded. CPU per run is the
client's plus the worker process's CPU time over that window, divided by N.
Database: scratch `bench_procrastinate`.

    bench/.venvs/procrastinate/bin/python bench/peers/procrastinate/bench_procrastinate.py \
        --tasks 3 --threads 8 --runs 400
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)

import procrastinate  # noqa: E402

from bench.common import CpuMeter, db_url, emit, log, scratch_db  # noqa: E402

URL = db_url("bench_procrastinate")
app = procrastinate.App(
    connector=procrastinate.PsycopgConnector(conninfo=URL, min_size=1, max_size=20)
)


@app.task(name="one")
async def one(n: int) -> None:
    return None


@app.task(name="t3")
async def t3(n: int) -> None:
    return None


@app.task(name="t2")
async def t2(n: int) -> None:
    await t3.defer_async(n=n)


@app.task(name="t1")
async def t1(n: int) -> None:
    await t2.defer_async(n=n)


def run_worker(concurrency: int) -> None:
    app.run_worker(
        concurrency=concurrency,
        listen_notify=True,
        delete_jobs="never",
        fetch_job_polling_interval=1.0,
        install_signal_handlers=True,
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tasks", type=int, choices=[1, 3], default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--runs", type=int, default=400)
    p.add_argument("--worker", action="store_true", help="(internal) run the worker")
    p.add_argument("--timeout", type=float, default=300)
    args = p.parse_args()
    if args.worker:
        run_worker(args.threads)
        return

    import psycopg

    scratch_db("bench_procrastinate")
    with psycopg.connect(URL, autocommit=True) as conn:
        has = conn.execute("SELECT to_regclass('procrastinate_jobs')").fetchone()[0]
    if not has:
        app.open()
        app.schema_manager.apply_schema()
        app.close()
    with psycopg.connect(URL, autocommit=True) as conn:
        conn.execute(
            "TRUNCATE procrastinate_jobs, procrastinate_events, procrastinate_workers CASCADE"
        )

    worker = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--worker", "--threads", str(args.threads)],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        with psycopg.connect(URL, autocommit=True) as conn:
            while not conn.execute("SELECT count(*) FROM procrastinate_workers").fetchone()[0]:
                if worker.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("procrastinate worker did not start")
                time.sleep(0.05)
        time.sleep(0.5)
        first = one if args.tasks == 1 else t1
        last = "one" if args.tasks == 1 else "t3"
        app.open()
        log(f"procrastinate: {args.tasks}-task, {args.threads} threads, {args.runs} runs")
        meter = CpuMeter([worker.pid])
        meter.start()
        t0 = time.perf_counter()

        def defer(k: int) -> None:
            for n in range(k, args.runs, args.threads):
                first.defer(n=n)

        ts = [threading.Thread(target=defer, args=(k,)) for k in range(args.threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        deadline = time.monotonic() + args.timeout
        with psycopg.connect(URL, autocommit=True) as conn:
            while True:
                done, failed = conn.execute(
                    "SELECT count(*) FILTER (WHERE task_name = %s AND status = 'succeeded'),"
                    " count(*) FILTER (WHERE status IN ('failed', 'aborted'))"
                    " FROM procrastinate_jobs",
                    (last,),
                ).fetchone()
                if done >= args.runs:
                    break
                if failed or time.monotonic() > deadline:
                    raise RuntimeError(f"procrastinate: {done} done, {failed} failed")
                time.sleep(0.02)
        elapsed = time.perf_counter() - t0
        self_cpu, worker_cpu = meter.stop()
        app.close()
    finally:
        worker.terminate()
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            worker.kill()
    emit(
        {
            "system": "procrastinate",
            "workload": f"fast{args.tasks}",
            "mode": "drain",
            "tasks": args.tasks,
            "threads": args.threads,
            "runs": args.runs,
            "seconds": elapsed,
            "runs_per_s": args.runs / elapsed,
            "cpu_ms_per_run": (self_cpu + worker_cpu) * 1000.0 / args.runs,
            "client_cpu_ms_per_run": self_cpu * 1000.0 / args.runs,
            "worker_cpu_ms_per_run": worker_cpu * 1000.0 / args.runs,
        }
    )


if __name__ == "__main__":
    main()
