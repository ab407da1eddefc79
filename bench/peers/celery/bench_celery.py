"""Celery with the Redis broker: 1 task, and a `chain` of 3 tasks.

A worker process (`celery worker --pool threads --concurrency T`) runs the
tasks; results go to Redis too (the result backend is needed to await a chain).
Each of T client threads loops `chain(a.si(n), b.si(n), c.si(n)).apply_async().get()`
(one task: `a.delay(n).get()`), started and awaited like the engine's
`W.start(mgr, input).wait()`. CPU per run is the client's plus the worker
process's CPU time over the measured window, divided by the runs counted.

Note: this stack is not durable in PostgreSQL's sense (Redis with its default
persistence, messages acked late or early per Celery's defaults); it is here
because it is what many Django/Flask shops run for background work.

    bench/.venvs/celery/bin/python bench/peers/celery/bench_celery.py --tasks 3 --threads 8
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
ROOT = os.path.dirname(ROOT)
sys.path.insert(0, ROOT)

from celery import Celery, chain  # noqa: E402

from bench.common import REDIS_URL, CpuMeter, emit, log  # noqa: E402

BROKER = os.environ.get("BENCH_CELERY_BROKER", REDIS_URL + "/5")
BACKEND = os.environ.get("BENCH_CELERY_BACKEND", REDIS_URL + "/6")

app = Celery("bench_celery", broker=BROKER, backend=BACKEND)
app.conf.update(
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    worker_hijack_root_logger=False,
    worker_prefetch_multiplier=4,
    broker_connection_retry_on_startup=True,
    result_expires=600,
)


@app.task(name="bench.a")
def a(n: int) -> None:
    return None


@app.task(name="bench.b")
def b(n: int) -> None:
    return None


@app.task(name="bench.c")
def c(n: int) -> None:
    return None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tasks", type=int, choices=[1, 3], default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=2.0)
    args = p.parse_args()
    import redis

    from bench.common import closed_loop

    r = redis.Redis.from_url(BROKER)
    r.flushdb()
    redis.Redis.from_url(BACKEND).flushdb()
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "bench_celery",
            "worker",
            "--pool",
            "threads",
            "--concurrency",
            str(args.threads),
            "--loglevel",
            "WARNING",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ],
        cwd=HERE,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, ROOT])),
        stdin=subprocess.DEVNULL,
    )
    try:
        # Ready when a task round-trips.
        deadline = time.monotonic() + 60
        while True:
            try:
                a.delay(-1).get(timeout=2)
                break
            except Exception:
                if worker.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("celery worker did not start") from None
        meter = CpuMeter([worker.pid])

        def setup(i: int):
            n = i * 10_000_000

            def run() -> None:
                nonlocal n
                n += 1
                if args.tasks == 1:
                    a.delay(n).get(timeout=60)
                else:
                    chain(a.si(n), b.si(n), c.si(n)).apply_async().get(timeout=60)

            return run

        log(f"celery: {args.tasks}-task, {args.threads} threads")
        # closed_loop measures this process's CPU over its window; the worker's is
        # read around the same window (warmup excluded).
        import threading

        box: dict[str, float] = {}

        def mark() -> None:
            time.sleep(args.warmup)
            meter.start()
            time.sleep(args.duration)
            box["worker"] = meter.stop()[1]

        marker = threading.Thread(target=mark)
        marker.start()
        result = closed_loop(setup, args.threads, args.warmup, args.duration)
        marker.join()
    finally:
        worker.terminate()
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            worker.kill()
    worker_ms = box["worker"] * 1000.0 / result["runs"] if result["runs"] else None
    emit(
        {
            "system": "celery",
            "workload": f"fast{args.tasks}",
            "mode": "loop",
            "tasks": args.tasks,
            "threads": args.threads,
            **result,
            "client_cpu_ms_per_run": result["cpu_ms_per_run"],
            "worker_cpu_ms_per_run": worker_ms,
            "cpu_ms_per_run": (result["cpu_ms_per_run"] or 0) + (worker_ms or 0),
        }
    )


if __name__ == "__main__":
    main()
