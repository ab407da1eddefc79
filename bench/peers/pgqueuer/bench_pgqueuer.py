"""PGQueuer 1.6 (asyncio, asyncpg driver) for bench/backlog.py's worker backlog.

One entrypoint, `noop`: an `async def` handler that does nothing with its
payload. The database is `$BENCH_BACKLOG_URL`; its schema is installed with the
`pgq install` CLI (bench/backlog.py runs it).

    bench/.venvs/pgqueuer/bin/python bench/peers/pgqueuer/bench_pgqueuer.py enqueue --n 3000

inserts the backlog the way PGQueuer's users enqueue: `Queries.enqueue`, one
call (one statement, one commit) per job, from one asyncpg connection.

    bench/.venvs/pgqueuer/bin/python bench/peers/pgqueuer/bench_pgqueuer.py consume

is one consumer: `pgqueuer.run(factory)` on uvloop, which is what `pgq run
bench_pgqueuer:factory` does (the CLI itself fails in 1.6.0 with typer 0.29:
its `--log-level` reaches the logger as a str), with every default: batch size
10 (`--batch-size` sets another), no cap on concurrent jobs, 30 s dequeue timeout,
SIGTERM/SIGINT handlers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator

import asyncpg
import pgqueuer
import uvloop
from pgqueuer import QueueManager
from pgqueuer.db import AsyncpgDriver
from pgqueuer.models import Job
from pgqueuer.queries import Queries

ENTRYPOINT = "noop"


def _url() -> str:
    url = os.environ.get("BENCH_BACKLOG_URL")
    if not url:
        raise SystemExit("bench_pgqueuer: set BENCH_BACKLOG_URL")
    return url


@contextlib.asynccontextmanager
async def factory() -> AsyncIterator[QueueManager]:
    """`pgq run bench_pgqueuer:factory`: a QueueManager over one asyncpg connection."""
    connection = await asyncpg.connect(_url())
    qm = QueueManager(Queries(AsyncpgDriver(connection)))

    @qm.entrypoint(ENTRYPOINT)
    async def noop(job: Job) -> None:
        return None

    try:
        yield qm
    finally:
        await connection.close()


async def enqueue(n: int) -> float:
    """Enqueue `n` jobs, one `enqueue` call (one commit) each; the seconds it took."""
    connection = await asyncpg.connect(_url())
    try:
        queries = Queries(AsyncpgDriver(connection))
        started = time.perf_counter()
        for i in range(n):
            await queries.enqueue(ENTRYPOINT, json.dumps({"n": i}).encode())
        return time.perf_counter() - started
    finally:
        await connection.close()


def main() -> None:
    p = argparse.ArgumentParser(description="PGQueuer side of bench/backlog.py")
    sub = p.add_subparsers(dest="what", required=True)
    eq = sub.add_parser("enqueue", help="insert the backlog, one commit per job")
    eq.add_argument("--n", type=int, required=True)
    co = sub.add_parser("consume", help="run one consumer until SIGTERM")
    co.add_argument("--batch-size", type=int, default=10,
                    help="jobs a dequeue takes at most (10, PGQueuer's default)")
    args = p.parse_args()
    if args.what == "consume":
        if args.batch_size < 1:
            p.error("--batch-size must be at least 1")
        uvloop.run(pgqueuer.run(factory, batch_size=args.batch_size))
        return
    seconds = asyncio.run(enqueue(args.n))
    print(json.dumps({"enqueued": args.n, "seconds": seconds}), flush=True)
    print(f"pgqueuer: enqueued {args.n} in {seconds:.2f}s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
