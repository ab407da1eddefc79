"""The null engine: the minimal SQL of pgworkflow's design, by hand, with psycopg 3.

This is the physical limit of the design on this machine and server: no
Python engine, no thread hand-off, no status reads, no heartbeat. Per run, on
one autocommit connection per thread (so one statement is one transaction, one
WAL flush):

1. one INSERT of the run *already claimed* (status running, claim id, heartbeat)
   together with its task rows, in the shape of `insert_run` in
   workflow/store/queries.sql (a CTE inserting the run, then the tasks from
   `unnest(names) WITH ORDINALITY`);
2. per task, one statement recording the output and advancing the run, fenced by
   the claim id, in the shape of `complete_task` (a CTE updating the run, then
   the task); the last one finishes the run and drops the claim.

So a 3-task run is 4 transactions, exactly as in the engine's fast path. The
tables are pgworkflow's own, created by `workflow.store.migrate()` on a scratch
database. Tasks are no-ops recording no output (`output = NULL`), like the
engine's `Bench.*` workflows.

    python -m bench.null_engine --tasks 3 --threads 8 --duration 10
"""

from __future__ import annotations

import argparse
import uuid
from typing import Any

import psycopg

from bench.common import closed_loop, emit, log, scratch_db

DB = "bench_null"

INSERT_RUN = """
WITH run AS (
    INSERT INTO workflow_runs (id, workflow, status, input, task_count, current_seq,
                               claim_id, heartbeat_at)
    VALUES (%(id)s, %(workflow)s, 'running', %(input)s::jsonb, %(task_count)s, 1,
            %(claim_id)s, now())
    RETURNING id
)
INSERT INTO workflow_tasks (run_id, seq, name)
SELECT run.id, t.seq::smallint, t.name
FROM run, unnest(%(names)s::text[]) WITH ORDINALITY AS t (name, seq)
"""

# Not the last task: record it, move the run on, refresh the heartbeat.
ADVANCE = """
WITH run AS (
    UPDATE workflow_runs SET current_seq = %(next_seq)s, heartbeat_at = now()
    WHERE id = %(id)s AND claim_id = %(claim_id)s
    RETURNING id
)
UPDATE workflow_tasks t SET output = %(output)s::jsonb, finished_at = now()
FROM run WHERE t.run_id = run.id AND t.seq = %(seq)s
RETURNING t.seq
"""

# The last task: record it, finish the run, drop the claim.
FINISH = """
WITH run AS (
    UPDATE workflow_runs
    SET current_seq = %(next_seq)s, status = 'succeeded', finished_at = now(),
        claim_id = NULL, heartbeat_at = NULL
    WHERE id = %(id)s AND claim_id = %(claim_id)s
    RETURNING id
)
UPDATE workflow_tasks t SET output = %(output)s::jsonb, finished_at = now()
FROM run WHERE t.run_id = run.id AND t.seq = %(seq)s
RETURNING t.seq
"""

NAMES = {1: ["bench.a"], 3: ["bench.a", "bench.b", "bench.c"]}
WORKFLOW = {1: "Bench.One", 3: "Bench.Three"}


def prepare(url_db: str) -> str:
    from workflow.store import migrate

    url = scratch_db(url_db)
    migrate(url)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE workflow_runs, workflow_tasks, workflow_events")
    return url


def make_worker(url: str, tasks: int, conns: list[Any] | None = None) -> Any:
    """`closed_loop`'s per-thread setup: one autocommit connection per thread.

    Connections opened are appended to `conns` (when given) for the caller to close.
    """
    names = NAMES[tasks]
    workflow = WORKFLOW[tasks]

    def setup(i: int) -> Any:
        conn = psycopg.connect(url, autocommit=True)
        if conns is not None:
            conns.append(conn)
        n = 0

        def one() -> None:
            nonlocal n
            n += 1
            run_id = uuid.uuid4()
            claim_id = uuid.uuid4()
            conn.execute(
                INSERT_RUN,
                {
                    "id": run_id,
                    "workflow": workflow,
                    "input": f'{{"n": {n}}}',
                    "task_count": tasks,
                    "claim_id": claim_id,
                    "names": names,
                },
            )
            for seq in range(1, tasks + 1):
                rows = conn.execute(
                    FINISH if seq == tasks else ADVANCE,
                    {
                        "id": run_id,
                        "claim_id": claim_id,
                        "seq": seq,
                        "next_seq": seq + 1,
                        "output": None,
                    },
                ).fetchall()
                if not rows:
                    raise RuntimeError("claim lost")

        return one

    return setup


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, choices=[1, 3], default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=2.0)
    args = p.parse_args()
    url = prepare(DB)
    log(f"null engine: {args.tasks}-task, {args.threads} threads, {args.duration:g}s")
    result = closed_loop(make_worker(url, args.tasks), args.threads, args.warmup, args.duration)
    emit(
        {
            "system": "null",
            "workload": f"fast{args.tasks}",
            "mode": "loop",
            "tasks": args.tasks,
            "threads": args.threads,
            **result,
        }
    )


if __name__ == "__main__":
    main()
