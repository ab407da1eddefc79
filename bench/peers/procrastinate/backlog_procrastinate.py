"""Procrastinate 3.10 for bench/backlog.py's worker backlog.

One task, `noop`: an `async def` that does nothing with its argument. The
database is `$BENCH_BACKLOG_URL`.

    bench/.venvs/procrastinate/bin/python bench/peers/procrastinate/backlog_procrastinate.py install
    bench/.venvs/procrastinate/bin/python bench/peers/procrastinate/backlog_procrastinate.py \
        enqueue --n 3000

`install` applies procrastinate's schema; `enqueue` defers the backlog the way
its users do, `noop.defer(n=i)` once per job (one commit each) from one
connection. A consumer is procrastinate's own CLI worker, with this directory
on PYTHONPATH:

    procrastinate --app=backlog_procrastinate.app worker --concurrency=16

Its pool is `max_size=20` (as in bench_procrastinate.py) so that the 16 job
slots, the fetches and the LISTEN connection are not held back by psycopg_pool's
default of 4 connections.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import procrastinate

URL = os.environ.get("BENCH_BACKLOG_URL", "")
POOL_MAX = int(os.environ.get("BENCH_PROCRASTINATE_POOL_MAX", "20"))

app = procrastinate.App(
    connector=procrastinate.PsycopgConnector(conninfo=URL, min_size=1, max_size=POOL_MAX)
)


@app.task(name="noop")
async def noop(n: int) -> None:
    return None


def enqueue(n: int) -> float:
    """Defer `n` jobs, one `defer` (one commit) each; the seconds it took."""
    app.open()
    try:
        started = time.perf_counter()
        for i in range(n):
            noop.defer(n=i)
        return time.perf_counter() - started
    finally:
        app.close()


def main() -> None:
    if not URL:
        raise SystemExit("backlog_procrastinate: set BENCH_BACKLOG_URL")
    p = argparse.ArgumentParser(description="Procrastinate side of bench/backlog.py")
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("install", help="apply procrastinate's schema")
    eq = sub.add_parser("enqueue", help="defer the backlog, one commit per job")
    eq.add_argument("--n", type=int, required=True)
    args = p.parse_args()
    if args.what == "install":
        app.open()
        try:
            app.schema_manager.apply_schema()
        finally:
            app.close()
        return
    seconds = enqueue(args.n)
    print(json.dumps({"enqueued": args.n, "seconds": seconds}), flush=True)
    print(f"procrastinate: enqueued {args.n} in {seconds:.2f}s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
