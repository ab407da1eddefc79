"""What users run, against two null engines: typed 3-task runs (issue 20's headline).

The workload is `Bench.Order` (bench/apps.py): an attrs input, three tasks each
returning a small attrs output (or text) that the next task reads. Three
engines do it, alternating in short slices from the same T threads, their order
rotating each round:

- `engine`: the fast path, `run = OrderFlow.start(mgr, order); run.wait()`,
  with `Config(tracing=False)` and no metrics;
- `own-null`: the engine's own four statements by hand on pgworkflow's tables
  (`bench/null_engine.py`'s shapes), with the same JSON outputs, each task
  reading the previous output from memory: what the Python costs is
  `engine / own-null`;
- `min-null`: the least SQL any durable ordered-workflow engine must commit, on
  a narrow schema of its own (a run row and its task rows, primary keys only):
  one insert of the run with its claimed tasks, one fenced update per task. What
  the schema costs is `own-null / min-null`.

Per engine and thread count: runs/s; client CPU per run (this process);
server CPU per run (every `postgres` process on the machine, psutil); WAL bytes
per run (`pg_current_wal_lsn()`); write transactions per run (xids assigned:
`pg_snapshot_xmax` of a snapshot before and after). Medians over the rounds of
each engine's value, and of the per-round ratios.

With `--pin`, the benchmark process runs on the first half of the machine's cores and
every PostgreSQL process (the postmaster too, so backends forked later) on the
other half, as if the database had a machine of its own (put back on every core at
the end). On 2 shared cores the engine's two threads a run and its server backend
otherwise take turns on the same cores, and per-run server CPU and runs/s then
measure that interference as much as the SQL (bench/README.md, "Client and server
on the same two cores").

    PYTHONPATH=. python bench/typed.py [--threads 1,4,8] [--rounds 5] [--slice 2] [--pin]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from typing import Any

import psutil
import psycopg

import workflow
from bench.apps import Order, OrderFlow, order_registry
from bench.common import (
    cpu_spent,
    emit,
    log,
    pinned_apart,
    postgres_cpu,
    scratch_db,
    slice_loops,
)
from workflow import ids
from workflow.store import migrate

DB = "bench_typed"
NAMES = "{reserve,charge,receipt}"

MIN_SCHEMA = """
CREATE TABLE IF NOT EXISTS min_runs (
    id uuid PRIMARY KEY, claim uuid, seq smallint NOT NULL, input jsonb NOT NULL,
    done boolean NOT NULL DEFAULT false
);
CREATE TABLE IF NOT EXISTS min_tasks (
    run_id uuid NOT NULL, seq smallint NOT NULL, output jsonb, PRIMARY KEY (run_id, seq)
);
"""
MIN_INSERT = """
WITH run AS (
    INSERT INTO min_runs (id, claim, seq, input) VALUES (%(id)s, %(claim)s, 1, %(input)s::jsonb)
    RETURNING id
)
INSERT INTO min_tasks (run_id, seq) SELECT run.id, s FROM run, generate_series(1, 3) AS s
"""
MIN_STEP = """
WITH run AS (
    UPDATE min_runs SET seq = %(next)s, done = %(done)s, claim = CASE WHEN %(done)s THEN NULL
                                                                     ELSE claim END
    WHERE id = %(id)s AND claim = %(claim)s RETURNING id
)
UPDATE min_tasks t SET output = %(output)s::jsonb FROM run
WHERE t.run_id = run.id AND t.seq = %(seq)s RETURNING t.seq
"""

OWN_INSERT = """
WITH run AS (
    INSERT INTO workflow_runs (id, workflow, status, input, task_count, current_seq,
                               claim_id, heartbeat_at)
    VALUES (%(id)s, 'Bench.OrderNull', 'running', %(input)s::jsonb, 3, 1, %(claim)s, now())
    RETURNING id, created_at
)
INSERT INTO workflow_tasks (run_id, seq, name, skipped, finished_at)
SELECT run.id, t.seq::smallint, t.name, false, NULL
FROM run, unnest(%(names)s::text[]) WITH ORDINALITY AS t (name, seq)
"""
OWN_ADVANCE = """
WITH run AS (
    UPDATE workflow_runs SET current_seq = %(next)s, heartbeat_at = now()
    WHERE id = %(id)s AND claim_id = %(claim)s RETURNING id
)
UPDATE workflow_tasks t SET output = %(output)s::jsonb, finished_at = now()
FROM run WHERE t.run_id = run.id AND t.seq = %(seq)s RETURNING t.seq
"""
OWN_FINISH = """
WITH run AS (
    UPDATE workflow_runs SET current_seq = %(next)s, status = 'succeeded', finished_at = now(),
           claim_id = NULL, heartbeat_at = NULL, released_claim = %(claim)s
    WHERE id = %(id)s AND claim_id = %(claim)s RETURNING id
)
UPDATE workflow_tasks t SET output = %(output)s::jsonb, finished_at = now()
FROM run WHERE t.run_id = run.id AND t.seq = %(seq)s RETURNING t.seq
"""


def _outputs(order_id: int, cents: int) -> list[str]:
    """The three outputs as the engine records them: the tasks' attrs outputs as JSON,
    each computed from the previous one (as the handlers do)."""
    hold = {"ref": f"hold-{order_id}", "cents": cents}
    paid = {"ref": hold["ref"].replace("hold", "charge"), "captured": hold["cents"]}
    receipt = f"{paid['ref']}: {paid['captured']} cents"
    return [json.dumps(hold), json.dumps(paid), json.dumps(receipt)]


def _null_one(conn: psycopg.Connection[Any], own: bool, n: int) -> None:
    # The engine's kind of ids (time-ordered), so that the ratios hold that alike.
    run_id, claim = ids.new_id(), ids.new_id()
    order = {"order_id": n, "cents": 100 + n % 900}
    if own:
        conn.execute(OWN_INSERT, {"id": run_id, "input": json.dumps(order), "claim": claim,
                                  "names": NAMES})
    else:
        conn.execute(MIN_INSERT, {"id": run_id, "claim": claim, "input": json.dumps(order)})
    outputs = _outputs(order["order_id"], order["cents"])
    for seq in (1, 2, 3):
        params = {"id": run_id, "claim": claim, "seq": seq, "next": seq + 1,
                  "output": outputs[seq - 1], "done": seq == 3}
        sql = (OWN_FINISH if seq == 3 else OWN_ADVANCE) if own else MIN_STEP
        if not conn.execute(sql, params).fetchall():
            raise RuntimeError("claim lost")


class _Server:
    """Server-side counters: CPU of every postgres process, WAL position, next xid."""

    def __init__(self, url: str) -> None:
        self._conn = psycopg.connect(url, autocommit=True)
        self._procs: dict[int, psutil.Process] = {}

    def read(self) -> tuple[dict[int, float], int, int]:
        """(CPU seconds by postgres process, WAL position, next xid): subtract CPU readings
        with `bench.common.cpu_spent`."""
        row = self._conn.execute(
            "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn, "
            "pg_snapshot_xmax(pg_current_snapshot())::text::bigint"
        ).fetchone()
        assert row is not None
        return postgres_cpu(self._procs), int(row[0]), int(row[1])

    def close(self) -> None:
        self._conn.close()


def measure(url: str, threads: int, rounds: int, seconds: float) -> dict[str, Any]:
    mgr = workflow.Manager(url, order_registry(), workflow.Config(tracing=False))
    conns = [psycopg.connect(url, autocommit=True) for _ in range(threads)]
    server = _Server(url)

    def engine(i: int, n: int) -> None:
        run = OrderFlow.start(mgr, Order(order_id=n, cents=100 + n % 900))
        if run.wait(timeout=30) is not workflow.Status.SUCCEEDED:
            raise RuntimeError(f"run {run.id} did not succeed")

    engines: dict[str, Callable[[int, int], None]] = {
        "engine": engine,
        "own-null": lambda i, n: _null_one(conns[i], True, n),
        "min-null": lambda i, n: _null_one(conns[i], False, n),
    }
    names = list(engines)
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    try:
        for name in names:
            slice_loops(engines[name], threads, 0.5, 0)  # warm up
        base = 1
        for r in range(rounds):
            for name in names[r % 3:] + names[: r % 3]:
                cpu0, wal0, xid0 = server.read()
                runs, client = slice_loops(engines[name], threads, seconds, base)
                cpu1, wal1, xid1 = server.read()
                base += 10_000_000
                per = max(runs, 1)
                samples[name].append({
                    "runs_per_s": runs / seconds,
                    "client_cpu_ms": 1000 * client / per,
                    "server_cpu_ms": 1000 * cpu_spent(cpu0, cpu1) / per,
                    "wal_bytes": (wal1 - wal0) / per,
                    # The counters' own reads assign no xid; one round trip each side.
                    "write_xacts": (xid1 - xid0) / per,
                })
    finally:
        server.close()
        for conn in conns:
            conn.close()
        mgr.close()
    result: dict[str, Any] = {}
    for name in names:
        result[name] = {
            key: statistics.median(s[key] for s in samples[name]) for key in samples[name][0]
        }
    for num, den in (("engine", "own-null"), ("own-null", "min-null"), ("engine", "min-null")):
        result[f"{num}/{den}"] = {
            key: statistics.median(
                a[key] / b[key] if b[key] else float("nan")
                for a, b in zip(samples[num], samples[den], strict=True)
            )
            for key in samples[num][0]
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 4, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--slice", type=float, default=2.0)
    parser.add_argument("--pin", action="store_true",
                        help="client and PostgreSQL on separate halves of the cores")
    args = parser.parse_args()
    url = scratch_db(DB, fresh=True)
    migrate(url)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(MIN_SCHEMA)
    rows = []
    with pinned_apart(args.pin):
        for threads in args.threads:
            log(f"typed: {threads} thread(s)" + (", pinned apart" if args.pin else ""))
            result = measure(url, threads, args.rounds, args.slice)
            emit({"bench": "typed", "threads": threads, "pinned": args.pin, **result})
            rows.append((threads, result))
    keys = ("runs_per_s", "client_cpu_ms", "server_cpu_ms", "wal_bytes", "write_xacts")
    print(f"\n{'threads':>7}  {'':<18}" + "".join(f"{k:>15}" for k in keys))
    for threads, result in rows:
        for name, values in result.items():
            print(f"{threads:>7}  {name:<18}" + "".join(f"{values[k]:>15.3f}" for k in keys))


if __name__ == "__main__":
    main()
