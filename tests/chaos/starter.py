"""The starter process: starts `Chaos.Three` runs continuously until SIGTERM.

    python -m tests.chaos.starter --database-url URL --rate R [--seed S] [--fast-share F]

Most runs are started with `start_tx`, one to three per transaction, each with its
`chaos_started` row in the same transaction: the row exists iff the run committed.
A share (`--fast-share`) is started with `start()` on this process's own manager,
whose fast path executes them here; their `chaos_started` row is written once
`start()` has returned (a run whose start raised is not recorded, but the checks
also hold every run in `workflow_runs` to SUCCEEDED). A start that fails on a lost
connection (the server restarting) is counted and the loop goes on. On SIGTERM it
stops starting, closes its manager (draining its local executions) and prints one
JSON line of counts on stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import sys
import threading
import time
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

import workflow

from . import app as chaos_app
from .ledger import URL_ENV


def _job(rng: random.Random, n: int) -> chaos_app.Job:
    roll = rng.random()
    fail_seq = hang_seq = 0
    hang_s = 0.0
    if roll < 0.05:
        fail_seq = rng.randint(1, 3)
    elif roll < 0.07:
        hang_seq = rng.randint(1, 3)
        hang_s = rng.uniform(3.5, 6.0)
    return chaos_app.Job(
        n=n, work_ms=rng.randint(20, 300), fail_seq=fail_seq, hang_seq=hang_seq, hang_s=hang_s
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.starter")
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--rate", type=float, default=6.0, help="runs per second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fast-share", type=float, default=0.3)
    args = parser.parse_args(argv)
    os.environ.setdefault(URL_ENV, args.database_url)

    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s"
    )
    log = logging.getLogger("chaos.starter")
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())

    rng = random.Random(args.seed)
    mgr = workflow.Manager(args.database_url, chaos_app.registry(), chaos_app.CONFIG)
    pool: ConnectionPool[Any] = ConnectionPool(
        args.database_url, min_size=1, max_size=2, open=True, name="chaos-starter"
    )
    counts = {"start_tx": 0, "start": 0, "failed": 0, "unrecorded": 0}
    n = 0
    next_at = time.monotonic()
    log.info("chaos starter: %.1f runs/s, pid %d", args.rate, os.getpid())
    while not stop.is_set():
        try:
            if rng.random() < args.fast_share:
                n += 1
                run = chaos_app.Chaos.start(mgr, _job(rng, n))
                counts["start"] += 1
                if not _record(pool, run.id, "start"):
                    counts["unrecorded"] += 1
                batch = 1
            else:
                batch = rng.randint(1, 3)
                with pool.connection() as conn, conn.transaction():
                    for _ in range(batch):
                        n += 1
                        run = chaos_app.Chaos.start_tx(conn, mgr, _job(rng, n))
                        conn.execute(
                            "INSERT INTO chaos_started (run_id, via) VALUES (%s, 'start_tx')",
                            (run.id,),
                        )
                counts["start_tx"] += batch
        except psycopg.OperationalError as e:
            counts["failed"] += 1
            log.warning("chaos starter: a start failed on a lost connection: %s", e)
            stop.wait(0.2)
            continue
        next_at += batch / args.rate
        stop.wait(max(0.0, next_at - time.monotonic()))
        next_at = max(next_at, time.monotonic() - 1.0)
    log.info("chaos starter: stopping; %s", counts)
    mgr.close(timeout=30)
    pool.close()
    print(json.dumps(counts), flush=True)
    return 0


def _record(pool: ConnectionPool[Any], run_id: str, via: str) -> bool:
    """Record a run started with `start()`; False if the database stayed unreachable."""
    deadline = time.monotonic() + 30
    while True:
        try:
            with pool.connection() as conn:
                conn.execute(
                    "INSERT INTO chaos_started (run_id, via) VALUES (%s, %s) "
                    "ON CONFLICT (run_id) DO NOTHING",
                    (run_id, via),
                )
            return True
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
