"""Where a typed 3-task run's WAL goes: bytes a run by relation and record kind, for the
engine, own-null and min-null (bench/typed.py's three systems), read from the WAL itself.

Each system runs `--runs` runs from one thread on one fresh database (migrated, with
min-null's tables beside pgworkflow's), after 200 unmeasured ones, for `--rounds`
rounds. The WAL between the flush positions before and after (every commit of the runs
is flushed by then) is read with pg_walinspect
(`pg_get_wal_records_info`), and every record on a block of that database is counted
under its first block's relation (heap, index or its split, prune and dedup records),
and every other record of a transaction that wrote one (its commit) under `(xact)`.
A temporary physical replication slot keeps the segments until they are read.
Full-page images (the first change to a page after a checkpoint) are counted apart,
in `fpi`. A checkpoint that falls in one system's slice and not another's is not a
difference of their SQL, and it changes more than the images (page pruning, for one),
so compare rounds without any: the totals without full-page images, printed beside
the totals, do not make a round with them comparable.

Bytes are exact, not timed: other databases' work does not reach them, but a
checkpoint does (through `fpi`), and so do autovacuum's and analyze's records on the
bench database's own tables.

    PYTHONPATH=. python bench/wal_split.py [--runs 2000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
from collections.abc import Callable
from typing import Any

import psycopg

import workflow
from bench.apps import Order, OrderFlow, order_registry
from bench.common import emit, log, scratch_db
from bench.typed import MIN_SCHEMA, _null_one
from workflow.store import migrate

DB = "bench_wal_split"
SLOT = "bench_wal_split"
# PostgreSQL 15-18: "blkref #0: rel 1663/16384/16390 fork main blk 3" (spc/db/relfilenode).
BLOCK = re.compile(r"rel \d+/(\d+)/(\d+)")
WARM = 200

Split = dict[tuple[str, str], list[float]]  # (relation, record kind) -> [bytes, fpi bytes, records]


def _split(conn: psycopg.Connection[Any], dboid: int, start: Any, end: Any, runs: int) -> Split:
    """The records between two positions that belong to the database `dboid`, per run."""
    names = dict(conn.execute(
        "SELECT pg_relation_filenode(oid)::text, relname FROM pg_class"
        " WHERE pg_relation_filenode(oid) IS NOT NULL"
    ).fetchall())
    records = conn.execute(
        "SELECT xid::text::bigint, resource_manager, record_type, record_length, fpi_length,"
        " block_ref FROM pg_get_wal_records_info(%s, %s)",
        (start, end),
    ).fetchall()
    relation: list[str | None] = []
    writers = set()
    for xid, _, _, _, _, block_ref in records:
        found = BLOCK.search(block_ref or "")
        ours = found is not None and int(found.group(1)) == dboid
        relation.append(names.get(found.group(2), found.group(2)) if ours and found else None)
        if ours and xid:
            writers.add(xid)
    split: Split = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    for (xid, manager, kind, length, fpi, _), rel in zip(records, relation, strict=True):
        if rel is None and xid not in writers:
            continue
        row = split[(rel or "(xact)", f"{manager}/{kind.split()[0]}")]
        row[0] += length / runs
        row[1] += fpi / runs
        row[2] += 1 / runs
    return split


def measure(runs: int, rounds: int) -> dict[str, list[Split]]:
    url = scratch_db(DB, fresh=True)
    migrate(url)
    admin = psycopg.connect(url, autocommit=True)
    admin.execute(MIN_SCHEMA)
    admin.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
    (dboid,) = admin.execute(
        "SELECT oid::int FROM pg_database WHERE datname = current_database()"
    ).fetchone() or (0,)
    admin.execute(
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots"
        " WHERE slot_name = %s", (SLOT,)
    )
    admin.execute("SELECT pg_create_physical_replication_slot(%s, true, true)", (SLOT,))
    mgr = workflow.Manager(url, order_registry(), workflow.Config(tracing=False))
    conn = psycopg.connect(url, autocommit=True)

    def engine(n: int) -> None:
        run = OrderFlow.start(mgr, Order(order_id=n, cents=100 + n % 900))
        if run.wait(timeout=30) is not workflow.Status.SUCCEEDED:
            raise RuntimeError(f"run {run.id} did not succeed")

    systems: dict[str, Callable[[int], None]] = {
        "engine": engine,
        "own-null": lambda n: _null_one(conn, True, n),
        "min-null": lambda n: _null_one(conn, False, n),
    }
    result: dict[str, list[Split]] = {name: [] for name in systems}
    n = 0
    try:
        for r in range(rounds):
            for name, one in systems.items():
                for _ in range(WARM):
                    n += 1
                    one(n)
                (start,) = admin.execute("SELECT pg_current_wal_flush_lsn()").fetchone() or ("",)
                for _ in range(runs):
                    n += 1
                    one(n)
                (end,) = admin.execute("SELECT pg_current_wal_flush_lsn()").fetchone() or ("",)
                split = _split(admin, dboid, start, end, runs)
                result[name].append(split)
                total = sum(v[0] for v in split.values())
                fpi = sum(v[1] for v in split.values())
                log(f"wal_split: round {r + 1}/{rounds} {name}: {total:.0f} bytes a run,"
                    f" {fpi:.0f} of them full-page images")
    finally:
        mgr.close()
        conn.close()
        admin.close()  # and with it the slot, temporary to its session
    return result


def _report(result: dict[str, list[Split]]) -> None:
    for name, rounds in result.items():
        keys = sorted(set().union(*rounds), key=lambda k: -statistics.median(
            s.get(k, [0.0])[0] for s in rounds))
        print(f"\n== {name}: bytes a run per round, records a run, full-page image bytes a run")
        for key in keys:
            cells = [s.get(key, [0.0, 0.0, 0.0]) for s in rounds]
            if max(c[0] for c in cells) < 1:
                continue
            print(f"  {key[0]:<36} {key[1]:<22}"
                  + "".join(f"{c[0]:8.1f}" for c in cells)
                  + f"   n={statistics.median(c[2] for c in cells):5.2f}"
                  + "  fpi=" + "/".join(f"{c[1]:.0f}" for c in cells))
        totals = [sum(v[0] for v in s.values()) for s in rounds]
        clean = [sum(v[0] - v[1] for v in s.values()) for s in rounds]
        print(f"  {'total':<59}" + "".join(f"{t:8.1f}" for t in totals))
        print(f"  {'total without full-page images':<59}" + "".join(f"{t:8.1f}" for t in clean))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    result = measure(args.runs, args.rounds)
    emit({"bench": "wal_split", "runs": args.runs, "split": {
        name: [{f"{rel} {kind}": v for (rel, kind), v in s.items()} for s in rounds]
        for name, rounds in result.items()
    }})
    _report(result)


if __name__ == "__main__":
    main()
