"""Per-key limits (SPEC 15): what runs without a key pay for the feature, and how fast
keyed backlogs drain.

`fastpath`: the typed 3-task fast path (`Bench.Order`, unkeyed) of the code at
`--before` (a git revision, on a database its own migrations built) against this
checkout's (on this checkout's schema), each in its own process, alternating
ABBA in slices from T threads. Per slice: runs/s, client CPU, server CPU (every
`postgres` process), WAL bytes and write transactions per run; medians, and the
median of the per-pair ratios after/before. WAL bytes are the server's LSN
difference (checkpoints' full-page images and vacuum's records fall in it) and,
where the server has pg_walinspect, also `own_wal_bytes`: the records of the
slice's own transactions.

`enqueue`: the same A/B of what a web view does to hand work to the workers, a
one-task `Bench.One` `start_tx` in its own transaction (one commit a start), from
T threads each on its own connection.

Both take `--history N`: before the rounds each database gets N finished typed runs
(three tasks with outputs each) under random ids, as a table that has served for a
while holds them; and `--checkpoint`: a CHECKPOINT at the start of each measured
slice, so that the slice pays the full-page images that the first change to each
page after a checkpoint writes (a server in service is always in some checkpoint's
cycle; a slice of a few seconds on a fresh table mostly is not). With `--history`,
`--settle S` (60 by default) first runs the workload S seconds on each side, unmeasured:
the history's pages, bulk-inserted, each keep a sliver of free space that the free space
map offers to the first rows inserted after it, one row a page, each page's first change
after a checkpoint a full-page image (measured: 9.0, 8.6, then 0.9 KB of WAL a start in
three successive slices of one side). A table that served for a while has used those
slivers; one that retention prunes offers whole free pages instead, which take many
rows each.

`drain`: a backlog of `--runs` one-task runs (`Bench.Keyed`, one run per account
at once) spread over K accounts, committed in one transaction while W worker
processes wait, drained; beside the same backlog of `Bench.Unkeyed`. K = 1 gives
the rate of one key's hand-off (a run finishes, the next of its key is claimed).

    PYTHONPATH=. python bench/keys.py fastpath --before REV [--threads 1,8] [--rounds 4]
        [--history N [--settle S]] [--checkpoint]
    PYTHONPATH=. python bench/keys.py enqueue --before REV [--threads 1,4] [--rounds 4]
        [--history N [--settle S]] [--checkpoint]
    PYTHONPATH=. python bench/keys.py drain [--keys 1000,100,10,1] [--runs 5000] [--workers 3]
    PYTHONPATH=. python bench/keys.py backlog --before REV [--runs 5000] [--workers 3] [--rounds 4]
        [--workflows 1|2]

`backlog`: runs without keys on the worker path, the code at `--before` against
this checkout's, each on its own schema: a backlog of `--runs` one-task runs of
`Bench.One` (inserted by SQL, the same for both) drained by W worker processes
of that code; alternating ABBA, the median runs/s of each and of the ratios, write
transactions and WAL bytes (server-wide) per run of the drain. `--workflows 2`
spreads the backlog over `Bench.One` and `Bench.Pickup`, interleaved in due order,
so that every claim finds runs of both due (Pickup's task records an output, One's
does not: compare before with after at the same `--workflows`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from bench.common import REPO, emit, log, scratch_db

HERE = os.path.dirname(os.path.abspath(__file__))


def _spent(before: Any, after: Any) -> float:
    """CPU seconds between two readings of a revision's `_Server`: totals (older
    revisions) or per-process readings (`bench.common.cpu_spent`'s rule)."""
    if isinstance(before, float):
        return float(after - before)
    return float(sum(t - before.get(pid, 0.0) for pid, t in after.items()))


def child(workload: str, url: str, threads: int, seconds: float, checkpoint: bool) -> None:
    """One slice of `workload` (`fastpath` or `enqueue`), with the `workflow` found first on
    PYTHONPATH (and the bench modules of that revision too, old or new); after its warm-up,
    a CHECKPOINT when `checkpoint`."""
    import psycopg

    import workflow
    from bench.common import slice_loops
    from bench.typed import _Server

    conns: list[Any] = []
    if workload == "fastpath":
        from bench.apps import Order, OrderFlow, order_registry

        mgr = workflow.Manager(url, order_registry(), workflow.Config(tracing=False))

        def one(i: int, n: int) -> None:
            run = OrderFlow.start(mgr, Order(order_id=n, cents=100 + n % 900))
            if run.wait(timeout=30) is not workflow.Status.SUCCEEDED:
                raise RuntimeError(f"run {run.id} did not succeed")
    else:
        from bench.apps import BenchInput, One, registry

        mgr = workflow.Manager(url, registry(), workflow.Config(tracing=False))
        conns = [psycopg.connect(url) for _ in range(threads)]

        def one(i: int, n: int) -> None:  # a web view's start_tx: one commit a start
            with conns[i].transaction():
                One.start_tx(conns[i], mgr, BenchInput(n=n))

    slice_loops(one, threads, 0.5, 0)  # warm up
    server = _Server(url)
    with psycopg.connect(url, autocommit=True) as probe:
        if checkpoint:
            probe.execute("CHECKPOINT")
        lsn0 = _flushed(probe)
        cpu0, wal0, xid0 = server.read()
        runs, client = slice_loops(one, threads, seconds, 10_000_000 * int(time.time() % 100))
        cpu1, wal1, xid1 = server.read()
        own = _own_wal(probe, lsn0, _flushed(probe), xid0, xid1)
    server.close()
    for conn in conns:
        conn.close()
    mgr.close()
    per = max(runs, 1)
    print("SLICE " + json.dumps({
        "runs_per_s": runs / seconds,
        "client_cpu_ms": 1000 * client / per,
        "server_cpu_ms": 1000 * _spent(cpu0, cpu1) / per,
        "wal_bytes": (wal1 - wal0) / per,
        "own_wal_bytes": None if own is None else own / per,
        "write_xacts": (xid1 - xid0) / per,
        "code": os.path.dirname(os.path.dirname(workflow.__file__)),
    }), flush=True)


def _flushed(conn: Any) -> str:
    row = conn.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()
    return str(row[0])


def _own_wal(conn: Any, lsn0: str, lsn1: str, xid0: int, xid1: int) -> int | None:
    """Bytes of the WAL records of the transactions that began between two readings of the
    next xid (the slice's own, when nothing else writes meanwhile: no checkpoint's or
    vacuum's records, which a server-wide LSN difference counts), read with pg_walinspect;
    None without that extension, or when it cannot answer (no WAL flushed in between, a
    role without its rights). Records without an xid are left out, the slice's own too:
    the page pruning its statements do before their transaction has an xid, and hint-bit
    full-page images on a cluster with checksums."""
    import psycopg

    row = conn.execute("SELECT 1 FROM pg_extension WHERE extname = 'pg_walinspect'").fetchone()
    low, high = xid0 & 0xFFFFFFFF, xid1 & 0xFFFFFFFF
    if row is None or high < low or lsn0 == lsn1:  # high < low: the 32-bit xid wrapped
        return None
    try:
        row = conn.execute(
            "SELECT coalesce(sum(record_length), 0) FROM pg_get_wal_records_info(%s, %s)"
            " WHERE xid::text::bigint >= %s AND xid::text::bigint < %s",
            (lsn0, lsn1, low, high),
        ).fetchone()
    except psycopg.Error:
        return None
    return int(row[0])


def _slice(workload: str, root: str, url: str, threads: int, seconds: float,
           checkpoint: bool) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": root}
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "keys.py"), "child", workload, url, str(threads),
         str(seconds), "checkpoint" if checkpoint else "-"],
        env=env, cwd=root, check=True, capture_output=True, text=True,
    ).stdout
    [line] = [line for line in out.splitlines() if line.startswith("SLICE ")]
    result: dict[str, Any] = json.loads(line[len("SLICE "):])
    assert result["code"] == root, (result["code"], root)
    return result


def ab(workload: str, before: str, threads_list: list[int], rounds: int,
       seconds: float, history: int = 0, checkpoint: bool = False,
       settle: float = 60.0) -> None:
    """`workload` (`fastpath` or `enqueue`) of the code at `before` against this checkout's,
    alternating ABBA in slices from each thread count, on databases holding `history`
    finished runs (and then `settle` seconds of the workload, unmeasured), with a
    CHECKPOINT before each slice when `checkpoint`."""
    old = tempfile.mkdtemp(prefix="pgwf-before-")
    subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", old, before],
                   check=True, capture_output=True)
    try:
        urls = {}
        for name, root in (("before", old), ("after", REPO)):
            urls[name] = scratch_db(f"bench_keys_{name}", fresh=True)
            subprocess.run(
                [sys.executable, "-c",
                 "import sys; from workflow.store import migrate; migrate(sys.argv[1])",
                 urls[name]],
                env={**os.environ, "PYTHONPATH": root}, cwd=root, check=True,
            )
            _walinspect(urls[name])
            if history:
                _history(urls[name], history)
        roots = {"before": old, "after": REPO}
        if history and settle > 0:
            for name in ("before", "after"):
                log(f"settling {name}: {settle:.0f} s of {workload}, unmeasured")
                _slice(workload, roots[name], urls[name], max(threads_list), settle, False)
        for threads in threads_list:
            samples: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
            for r in range(rounds):
                order = ("before", "after") if r % 2 == 0 else ("after", "before")
                for name in order:
                    got = _slice(workload, roots[name], urls[name], threads, seconds, checkpoint)
                    samples[name].append(got)
                    log(f"  {name}: {got['runs_per_s']:.0f} runs/s, {got['wal_bytes']:.0f} WAL"
                        f" bytes a run, {got['server_cpu_ms']:.3f} ms server CPU a run")
                log(f"{workload}: {threads} thread(s), round {r + 1}/{rounds}")
            keys = ["runs_per_s", "client_cpu_ms", "server_cpu_ms", "wal_bytes", "write_xacts"]
            if all(s["own_wal_bytes"] is not None for n in samples for s in samples[n]):
                keys.insert(4, "own_wal_bytes")
            result: dict[str, Any] = {"bench": f"keys.{workload}", "threads": threads,
                                      "before_rev": before, "history": history,
                                      "settle": settle if history else 0,
                                      "checkpoint": checkpoint}
            for name in ("before", "after"):
                result[name] = {k: statistics.median(s[k] for s in samples[name]) for k in keys}
            result["after/before"] = {
                k: statistics.median(
                    a[k] / b[k] for a, b in zip(samples["after"], samples["before"], strict=True)
                )
                for k in keys
            }
            emit(result)
            print(f"\n{workload}, {threads} thread(s)  " + "".join(f"{k:>15}" for k in keys))
            for name in ("before", "after", "after/before"):
                print(f"  {name:<16}" + "".join(f"{result[name][k]:>15.3f}" for k in keys))
    finally:
        subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", old],
                       check=False, capture_output=True)


def _history(url: str, runs: int) -> None:
    """`runs` finished `Bench.Order` runs at `url`, created one a second up to now, under
    random ids (as every release before time-ordered ids made them), three tasks each
    with their outputs; then VACUUM ANALYZE, as autovacuum would have left the tables."""
    import psycopg

    log(f"history: {runs:,} finished runs")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        conn.execute(
            "CREATE TEMP TABLE history AS SELECT gen_random_uuid() AS id,"
            " now() - make_interval(secs => %s - g) AS at FROM generate_series(1, %s) AS g",
            (runs, runs),
        )
        conn.execute(
            "INSERT INTO workflow_runs (id, workflow, status, input, task_count, current_seq,"
            " next_retry_at, created_at, finished_at)"
            " SELECT id, 'Bench.Order', 'succeeded', '{\"order_id\": 1, \"cents\": 100}', 3, 4,"
            " at, at, at + interval '1 second' FROM history"
        )
        conn.execute(
            "INSERT INTO workflow_tasks (run_id, seq, name, output, finished_at)"
            " SELECT id, s, (ARRAY['reserve', 'charge', 'receipt'])[s],"
            " '{\"ref\": \"hold-1\", \"cents\": 100}', at + interval '1 second'"
            " FROM history, generate_series(1, 3) AS s"
        )
        conn.execute("VACUUM ANALYZE workflow_runs")
        conn.execute("VACUUM ANALYZE workflow_tasks")


def _walinspect(url: str) -> None:
    """pg_walinspect in the database at `url` where the server has it (PostgreSQL 15 and
    later, contrib), for `_own_wal`."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        try:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        except psycopg.Error as e:
            log(f"no pg_walinspect ({e}): WAL per run is the server-wide LSN difference only")


@contextlib.contextmanager
def _workers(root: str, url: str, app: str, workers: int, concurrency: int) -> Iterator[None]:
    """`workers` worker processes of the code at `root`, up (LISTENing) on entry, stopped
    on exit."""
    import psycopg

    with tempfile.TemporaryFile("w+") as logs:
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "workflow.worker", "--app", app, "--database-url", url,
                 "--concurrency", str(concurrency), "--log-level", "warning"],
                env={**os.environ, "PYTHONPATH": root}, cwd=root, stderr=logs,
            )
            for _ in range(workers)
        ]
        try:
            with psycopg.connect(url, autocommit=True) as probe:
                while True:
                    row = probe.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = "
                        "current_database() AND query = 'LISTEN workflow_runs'"
                    ).fetchone()
                    if row is not None and row[0] >= workers:
                        break
                    if any(proc.poll() is not None for proc in procs):
                        logs.seek(0)
                        raise RuntimeError("a worker exited:\n" + logs.read())
                    time.sleep(0.05)
            yield
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(30)


def _until_succeeded(conn: Any, runs: int) -> float:
    """Seconds until `runs` runs have succeeded, from now."""
    started = time.monotonic()
    while True:
        row = conn.execute(
            "SELECT count(*) FROM workflow_runs WHERE status = 'succeeded'"
        ).fetchone()
        if row is not None and row[0] >= runs:
            return time.monotonic() - started
        time.sleep(0.02)


def _drain_once(url: str, keyed: bool, keys: int, runs: int, workers: int,
                concurrency: int) -> float:
    """Runs/s of one drain: `runs` runs over `keys` accounts, `workers` worker processes."""
    import psycopg

    import workflow
    from bench.apps import Keyed, Payment, Unkeyed, keys_factory
    from workflow.store import migrate

    scratch_db("bench_keys_drain", fresh=True)
    migrate(url)
    with _workers(REPO, url, "bench.apps:keys_factory", workers, concurrency):
        mgr = workflow.Manager(url, keys_factory(), workflow.Config(tracing=False))
        wf = Keyed if keyed else Unkeyed
        with psycopg.connect(url) as conn:
            with conn.transaction():
                for n in range(runs):
                    wf.start_tx(conn, mgr, Payment(account=n % keys, n=n))
            conn.autocommit = True
            elapsed = _until_succeeded(conn, runs)
        mgr.close()
        return runs / elapsed


BACKLOG = """
WITH runs AS (
    INSERT INTO workflow_runs (id, workflow, status, input, task_count, current_seq, created_at)
    SELECT gen_random_uuid(), (%(names)s::text[])[1 + i %% %(mix)s], 'pending',
           jsonb_build_object('n', i), 1, 1, clock_timestamp()
    FROM generate_series(1, %(runs)s) AS i
    RETURNING id, workflow
)
INSERT INTO workflow_tasks (run_id, seq, name)
SELECT id, 1, (%(tasks)s::text[])[array_position(%(names)s::text[], workflow)] FROM runs
"""

# The one-task workflows of bench.apps:factory a backlog is spread over (`--workflows`),
# with their tasks, their runs interleaved in due order: every claim then finds runs of
# each due. Bench.Pickup's task records its output (a timestamp), Bench.One's nothing:
# compare a drain over one with a drain over two only before against after.
MIX = [("Bench.One", "bench.a"), ("Bench.Pickup", "bench.stamp")]


def _next_xid(conn: Any) -> int:
    row = conn.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint").fetchone()
    return int(row[0])


def _wal(conn: Any) -> int:
    row = conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()
    return int(row[0])


def _backlog_once(root: str, url_name: str, runs: int, workers: int,
                  concurrency: int, mix: int) -> tuple[float, float, float]:
    """Runs/s of one drain, write transactions per run of the drain (claims,
    completions, heartbeats: the backlog's own insert is one transaction), and WAL
    bytes per run of the drain (server-wide)."""
    import psycopg

    url = scratch_db(url_name, fresh=True)
    subprocess.run(
        [sys.executable, "-c",
         "import sys; from workflow.store import migrate; migrate(sys.argv[1])", url],
        env={**os.environ, "PYTHONPATH": root}, cwd=root, check=True,
    )
    with (
        _workers(root, url, "bench.apps:factory", workers, concurrency),
        psycopg.connect(url, autocommit=True) as conn,
    ):
        names = [name for name, _ in MIX[:mix]]
        conn.execute(BACKLOG, {"runs": runs, "names": names, "mix": mix,
                               "tasks": [task for _, task in MIX[:mix]]})
        # The counters are read before the workers are woken, so that their first claims
        # count (a poll may still come first; LISTENing workers wait for the wake-up).
        xid, wal = _next_xid(conn), _wal(conn)
        with conn.transaction():
            for name in names:
                conn.execute("SELECT pg_notify('workflow_runs', %s)", (name,))
        rate = runs / _until_succeeded(conn, runs)
        return rate, (_next_xid(conn) - xid) / runs, (_wal(conn) - wal) / runs


def backlog(before: str, runs: int, workers: int, concurrency: int, rounds: int,
            mix: int) -> None:
    old = tempfile.mkdtemp(prefix="pgwf-before-")
    subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", old, before],
                   check=True, capture_output=True)
    try:
        roots = {"before": old, "after": REPO}
        # Per code and metric, one figure per round: runs/s, write transactions and WAL
        # bytes per run of the drain.
        got: dict[str, dict[str, list[float]]] = {
            name: {"rate": [], "xacts": [], "wal": []} for name in roots
        }
        for r in range(rounds):
            order = ("before", "after") if r % 2 == 0 else ("after", "before")
            for name in order:
                figures = _backlog_once(roots[name], f"bench_keys_{name}", runs, workers,
                                        concurrency, mix)
                for metric, value in zip(("rate", "xacts", "wal"), figures, strict=True):
                    got[name][metric].append(value)
            log(f"backlog: round {r + 1}/{rounds}")

        def med(name: str, metric: str) -> float:
            return statistics.median(got[name][metric])

        def ratio(metric: str) -> float:  # the median of the rounds' after/before
            return statistics.median(a / b for a, b in zip(
                got["after"][metric], got["before"][metric], strict=True))

        emit({"bench": "keys.backlog", "before_rev": before, "runs": runs, "workers": workers,
              "workflows": mix, "before_wal": med("before", "wal"),
              "after_wal": med("after", "wal"), "wal after/before": ratio("wal"),
              "before_runs_per_s": med("before", "rate"),
              "after_runs_per_s": med("after", "rate"), "after/before": ratio("rate"),
              "before_write_xacts": med("before", "xacts"),
              "after_write_xacts": med("after", "xacts")})
        print(f"\nunkeyed backlog of {runs} over {mix} workflow(s), {workers} workers: before "
              f"{med('before', 'rate'):.0f} runs/s, after {med('after', 'rate'):.0f} runs/s, "
              f"after/before {ratio('rate'):.3f}; write transactions per run of the drain: "
              f"before {med('before', 'xacts'):.2f}, after {med('after', 'xacts'):.2f}; WAL "
              f"bytes per run: before {med('before', 'wal'):.0f}, after "
              f"{med('after', 'wal'):.0f}, after/before {ratio('wal'):.3f}")
    finally:
        subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", old],
                       check=False, capture_output=True)


def drain(keys_list: list[int], runs: int, workers: int, concurrency: int, rounds: int) -> None:
    url = scratch_db("bench_keys_drain", fresh=True)
    print(f"\n{'accounts':>8} {'runs':>7} {'keyed runs/s':>14} {'unkeyed runs/s':>16} "
          f"{'keyed/unkeyed':>14}")
    for keys in keys_list:
        n = min(runs, keys * 200) if keys < 10 else runs
        keyed_rates, free_rates = [], []
        for r in range(rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            for keyed in order:
                rate = _drain_once(url, keyed, keys, n, workers, concurrency)
                (keyed_rates if keyed else free_rates).append(rate)
        keyed_rate, free_rate = statistics.median(keyed_rates), statistics.median(free_rates)
        emit({"bench": "keys.drain", "accounts": keys, "runs": n, "workers": workers,
              "concurrency": concurrency, "keyed_runs_per_s": keyed_rate,
              "unkeyed_runs_per_s": free_rate})
        print(f"{keys:>8} {n:>7} {keyed_rate:>14.0f} {free_rate:>16.0f} "
              f"{keyed_rate / free_rate:>14.2f}", flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]),
              sys.argv[6:7] == ["checkpoint"])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    for workload, threads in (("fastpath", [1, 8]), ("enqueue", [1, 4])):  # the A/Bs of ab()
        w = sub.add_parser(workload)
        w.add_argument("--before", required=True)
        w.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")],
                       default=threads)
        w.add_argument("--rounds", type=int, default=4)
        w.add_argument("--slice", type=float, default=3.0)
        w.add_argument("--history", type=int, default=0)
        w.add_argument("--settle", type=float, default=60.0)
        w.add_argument("--checkpoint", action="store_true")
    dr = sub.add_parser("drain")
    dr.add_argument("--keys", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1000, 100, 10, 1])
    dr.add_argument("--runs", type=int, default=5000)
    dr.add_argument("--workers", type=int, default=3)
    dr.add_argument("--concurrency", type=int, default=16)
    dr.add_argument("--rounds", type=int, default=2)
    bl = sub.add_parser("backlog")
    bl.add_argument("--before", required=True)
    bl.add_argument("--runs", type=int, default=5000)
    bl.add_argument("--workers", type=int, default=3)
    bl.add_argument("--concurrency", type=int, default=16)
    bl.add_argument("--rounds", type=int, default=4)
    bl.add_argument("--workflows", type=int, choices=range(1, len(MIX) + 1), default=1)
    args = parser.parse_args()
    if args.what in ("fastpath", "enqueue"):
        ab(args.what, args.before, args.threads, args.rounds, args.slice, args.history,
           args.checkpoint, args.settle)
    elif args.what == "backlog":
        backlog(args.before, args.runs, args.workers, args.concurrency, args.rounds,
                args.workflows)
    else:
        drain(args.keys, args.runs, args.workers, args.concurrency, args.rounds)


if __name__ == "__main__":
    main()
