"""DBOS: the 1-task and 3-task workloads as a `@DBOS.workflow` of `@DBOS.step`s.

Each thread loops `handle = DBOS.start_workflow(wf, n); handle.get_result()`
(started and awaited), like the engine's `W.start(mgr, input).wait()`. DBOS
executes the workflow on its own thread pool in this process, so this process's
CPU time is all of its client CPU. System database: scratch `bench_dbos`.

    bench/.venvs/dbos/bin/python bench/peers/dbos/bench_dbos.py --tasks 3 --threads 8
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
)

from dbos import DBOS, DBOSConfig

from bench.common import closed_loop, db_url, emit, log, scratch_db


@DBOS.step()
def step_a(n: int) -> None:
    return None


@DBOS.step()
def step_b(n: int) -> None:
    return None


@DBOS.step()
def step_c(n: int) -> None:
    return None


@DBOS.workflow()
def one(n: int) -> None:
    step_a(n)


@DBOS.workflow()
def three(n: int) -> None:
    step_a(n)
    step_b(n)
    step_c(n)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tasks", type=int, choices=[1, 3], default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=2.0)
    args = p.parse_args()
    scratch_db("bench_dbos")
    url = db_url("bench_dbos")
    config: DBOSConfig = {
        "name": "bench",
        "system_database_url": url,
        "log_level": "WARNING",
        "sys_db_pool_size": max(20, 2 * args.threads + 4),
    }
    DBOS(config=config)
    DBOS.launch()
    logging.getLogger("dbos").setLevel(logging.WARNING)
    wf = three if args.tasks == 3 else one

    def setup(i: int):
        n = i * 10_000_000

        def run() -> None:
            nonlocal n
            n += 1
            DBOS.start_workflow(wf, n).get_result()

        return run

    log(f"dbos: {args.tasks}-task, {args.threads} threads")
    try:
        result = closed_loop(setup, args.threads, args.warmup, args.duration)
    finally:
        DBOS.destroy(workflow_completion_timeout_sec=5)
    emit(
        {
            "system": "dbos",
            "workload": f"fast{args.tasks}",
            "mode": "loop",
            "tasks": args.tasks,
            "threads": args.threads,
            **result,
        }
    )
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
