# ruff: noqa: RUF001, E501  (a Markdown template: long table lines, Unicode signs on purpose)
"""Render bench/RESULTS.md from the measurements run_all.py collected.

python -m bench.report [RESULTS.json [OUT.md]]
    # default: bench/.logs/results.json (the last full run) -> bench/RESULTS.md
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from collections import defaultdict
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = ["dbos", "procrastinate", "celery"]


def _num(x: Any) -> float | None:
    """x as a finite number, else None (a missing value, NaN or infinity)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return float(x)


def _med(xs: list[float]) -> float | None:
    xs = [v for v in map(_num, xs) if v is not None]
    return statistics.median(xs) if xs else None


def _f(x: float | None, nd: int = 0, suffix: str = "") -> str:
    x = _num(x)
    if x is None:
        return "—"
    return f"{x:,.{nd}f}{suffix}"


def _switches(voluntary: float | None, involuntary: float | None) -> str:
    if _num(voluntary) is None or _num(involuntary) is None:
        return "—"
    return f"{_f(voluntary, 2)} + {_f(involuntary, 2)}"


def _r(x: float | None) -> str:
    x = _num(x)
    return "—" if x is None else f"{x:.2f}×"


def _range(xs: list[float], nd: int = 2) -> str:
    xs = [v for v in map(_num, xs) if v is not None]
    if len(xs) < 2:
        return ""
    return f" ({min(xs):,.{nd}f}–{max(xs):,.{nd}f})"


TYPED_ENGINES = ("engine", "own-null", "min-null")
TYPED_RATIOS = ("engine/own-null", "own-null/min-null", "engine/min-null")
# (key in typed.py's RESULT, column title for values, for ratios, decimals)
TYPED_METRICS = (
    ("runs_per_s", "runs/s", "runs/s", 0),
    ("client_cpu_ms", "client CPU ms/run", "client CPU/run", 3),
    ("server_cpu_ms", "server CPU ms/run", "server CPU/run", 3),
    ("wal_bytes", "WAL bytes/run", "WAL/run", 0),
    ("write_xacts", "write transactions/run", "write transactions/run", 2),
)
BACKLOG_SYSTEMS = ("pgworkflow", "pgqueuer", "procrastinate")
BACKLOG_PEERS = {"pgqueuer": ("PGQueuer", 1.5), "procrastinate": ("Procrastinate", 5.0)}


def _met(v: float | None, ok: bool, shown: str) -> str:
    """`shown` (the value) — met / not met; or "not measured"."""
    if _num(v) is None:
        return "not measured"
    return f"{shown} — " + ("**met**" if ok else "**not met**")


def _threads(n: int) -> str:
    return f"{n} thread" + ("" if n == 1 else "s")


def _typed_section(w: Any, results: list[dict[str, Any]]) -> None:
    """The headline: bench/typed.py's typed 3-task runs on the engine and two null engines."""
    ty = [r for r in results if r.get("bench") == "typed"]
    if not ty:
        return
    by: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in ty:
        by[r["threads"]].append(r)

    def val(threads: int, name: str, key: str) -> float | None:
        return _med([(r.get(name) or {}).get(key) for r in by.get(threads, [])])

    w("## Headline: what users run (typed 3-task runs) against two null engines")
    w("")
    w(
        "`bench/typed.py`: `Bench.Order` runs (an attrs input; three tasks, each returning a "
        "small typed output that the next task reads), started and awaited in closed loops from "
        "T threads on three engines that alternate in short slices, their order rotating each "
        "round. **engine**: pgworkflow's fast path, `OrderFlow.start(mgr, order).wait()` with "
        "tracing off. **own-null**: pgworkflow's own four statements by hand on its own tables, "
        "with the same JSON outputs. **min-null**: the least SQL any durable ordered-workflow "
        "engine must commit (one insert of the run with its claimed tasks, one fenced update "
        "per task) on a narrow schema with primary keys only. Per run: client CPU (the "
        "benchmark process), server CPU (every `postgres` process on the machine, so other work "
        "on it leaks in), WAL bytes and write transactions (xids assigned). Values are medians "
        "over rounds; ratios are taken within a round, then medianed."
    )
    w("")
    w(
        "How to read the ratios: **engine/own-null** is the cost of pgworkflow's Python (the "
        "same SQL with and without the library); **own-null/min-null** is the cost of "
        "pgworkflow's schema (its statements on its tables against the minimal SQL on the narrow "
        "schema); **engine/min-null** is the total, what a user pays against the least any "
        "engine could do. On runs/s a ratio above 1 means faster than the denominator; on "
        "client CPU, server CPU, WAL and write transactions per run a ratio above 1 means more "
        "cost than the denominator (for engine/min-null: more than the minimal engine)."
    )
    w("")
    for threads in sorted(by):
        w(f"### {_threads(threads)}")
        w("")
        w("| engine | " + " | ".join(t for _, t, _, _ in TYPED_METRICS) + " |")
        w("|---" * (len(TYPED_METRICS) + 1) + "|")
        for name in TYPED_ENGINES:
            w(
                f"| {name} | "
                + " | ".join(_f(val(threads, name, k), nd) for k, _, _, nd in TYPED_METRICS)
                + " |"
            )
        w("")
        w("| ratio | " + " | ".join(t for _, _, t, _ in TYPED_METRICS) + " |")
        w("|---" * (len(TYPED_METRICS) + 1) + "|")
        for name in TYPED_RATIOS:
            cells = [_r(val(threads, name, k)) for k, _, _, _ in TYPED_METRICS]
            if name == "engine/min-null":
                w(f"| **{name}** | " + " | ".join(f"**{c}**" for c in cells) + " |")
            else:
                w(f"| {name} | " + " | ".join(cells) + " |")
        w("")

    negative = [
        f"{name}, {_threads(threads)}"
        for threads in sorted(by)
        for name in TYPED_ENGINES
        if (_num(val(threads, name, "server_cpu_ms")) or 0) < 0
    ]
    if negative:
        w(
            "Negative server CPU (" + "; ".join(negative) + "): typed.py sums the CPU of every "
            "`postgres` process before and after a slice, and a backend that exits in between "
            "(another client's) takes its CPU out of the second sum. Those figures, and the "
            "ratios made from them, are not measurements."
        )
        w("")

    w("### Goals (engine/min-null)")
    w("")
    goals: list[tuple[str, str, int, float, bool]] = [
        ("runs/s", "runs_per_s", 1, 0.85, True),
        ("runs/s", "runs_per_s", 8, 1.0, True),
        ("server CPU per run", "server_cpu_ms", 1, 1.2, False),
        ("server CPU per run", "server_cpu_ms", 8, 0.8, False),
        ("WAL per run", "wal_bytes", 1, 1.2, False),
        ("WAL per run", "wal_bytes", 8, 0.8, False),
    ]
    goals += [("client CPU per run", "client_cpu_ms", th, 1.5, False) for th in sorted({1, 8, *by})]
    for title, key, threads, limit, at_least in goals:
        v = _num(val(threads, "engine/min-null", key))
        ok = v is not None and (v >= limit if at_least else v <= limit)
        sign = "≥" if at_least else "≤"
        head = f"- {title} {sign} {limit:g}× min-null at {_threads(threads)}: "
        if v is not None and v < 0:  # a cost cannot be negative: see the note above
            w(head + f"{_r(v)} — **not measurable** (negative)")
        else:
            w(head + _met(v, ok, _r(v)))
    w("")


def _backlog_section(w: Any, results: list[dict[str, Any]]) -> None:
    """bench/backlog.py: the worker backlog beside PGQueuer and Procrastinate."""
    bl = [r for r in results if r.get("bench") == "backlog"]
    if not bl:
        return
    by: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in bl:
        by[(r["system"], r["consumers"])].append(r)
    cs = sorted({c for _, c in by})
    systems = [x for x in BACKLOG_SYSTEMS if any(k[0] == x for k in by)]
    systems += sorted({k[0] for k in by} - set(systems))

    def med(system: str, c: int, key: str) -> float | None:
        return _med([r.get(key) for r in by.get((system, c), [])])

    def rounds(system: str, c: int, key: str) -> list[float]:
        return [x for r in by.get((system, c), []) for x in r.get(f"{key}_rounds") or []]

    first = next((r for r in bl if r["system"] == "pgworkflow"), bl[0])
    sizes = {r["system"]: r.get("n", 0) for r in bl}
    n_rounds = max(r.get("rounds", 1) for r in bl)
    w("## Worker backlog: pgworkflow, PGQueuer, Procrastinate")
    w("")
    w(
        f"`bench/backlog.py`: a backlog of {first.get('n', 0):,} one-task no-op jobs"
        + "".join(f" ({system}: {n:,})" for system, n in sizes.items() if n != first.get("n"))
        + ", inserted "
        "one commit per job the way each library's users enqueue (pgworkflow: `start_tx` in "
        "its own transaction; PGQueuer: `Queries.enqueue`; Procrastinate: `defer`) while no "
        "consumer runs, then drained by C consumer processes started the way each library's "
        "users start one (pgworkflow: `python -m workflow.worker --concurrency "
        f"{first.get('concurrency')}`; PGQueuer: a QueueManager with one no-op entrypoint, every "
        f"default, a dequeue batch of {first.get('pgq_batch_size', 10)} (10 unless "
        "`--pgq-batch-size` says otherwise; bench/README.md, \"One worker's concurrency\", "
        "says what a larger one does); "
        f"Procrastinate: `procrastinate worker --concurrency={first.get('concurrency')}`). "
        f"Consumers start `{first.get('start')}`"
        + (
            " (launched before the insert with their modules imported, released together after it)"
            if first.get("start") == "warm"
            else ""
        )
        + ". jobs/s = (N − 1) / (first to last completion), on the database's own timestamps; "
        "p10–90 = the rate between the 10th and 90th percentile completions, which a late first "
        "or last batch does not move. Per job over the drain: write transactions (xids "
        "assigned) server-wide and own (the bench database's alone, read from the WAL with "
        "pg_walinspect), WAL bytes (own), server CPU (every `postgres` process; other work on "
        "the machine leaks in), consumer CPU (the consumer processes' own user+system CPU from "
        "their release to the drain's end; — in runs made before it was measured), and the "
        "consumers' context switches (voluntary + involuntary, summed over every live thread "
        "of theirs; — in runs made before they were counted). Every job "
        "must complete exactly once or the measurement fails. "
        f"Medians over {n_rounds} round(s) (range of jobs/s in brackets when there are several); "
        "the ratios are taken within a round, then medianed."
    )
    w("")
    w(
        "| consumers | system | jobs/s | p10–90 jobs/s | write xacts/job (server) "
        "| write xacts/job (own) | WAL bytes/job (own) | server CPU ms/job "
        "| consumer CPU ms/job | consumer switches/job |"
    )
    w("|---|---|---|---|---|---|---|---|---|---|")
    for c in cs:
        for x in systems:
            if (x, c) not in by:
                continue
            w(
                f"| {c} | {x} | {_f(med(x, c, 'jobs_per_s'))}{_range(rounds(x, c, 'jobs_per_s'), 0)} "
                f"| {_f(med(x, c, 'jobs_per_s_p10_p90'))} "
                f"| {_f(med(x, c, 'write_xacts_per_job'), 2)} "
                f"| {_f(med(x, c, 'own_write_xacts_per_job'), 2)} "
                f"| {_f(med(x, c, 'own_wal_bytes_per_job'))} "
                f"| {_f(med(x, c, 'server_cpu_ms_per_job'), 3)} "
                f"| {_f(med(x, c, 'consumer_cpu_ms_per_job'), 3)} "
                f"| {_switches(med(x, c, 'consumer_vcsw_per_job'), med(x, c, 'consumer_ivcsw_per_job'))} |"
            )
    w("")
    peers = [x for x in BACKLOG_PEERS if x in systems]
    if "pgworkflow" in systems and peers:
        w("Throughput ratio pgworkflow / peer (above 1: pgworkflow drains faster):")
        w("")
        w("| consumers | " + " | ".join(f"pgworkflow/{x} jobs/s" for x in peers) + " |")
        w("|---" * (len(peers) + 1) + "|")
        for c in cs:
            w(
                f"| {c} | "
                + " | ".join(
                    f"{_r(med('pgworkflow', c, f'pgworkflow/{x}'))}"
                    f"{_range(rounds('pgworkflow', c, f'pgworkflow/{x}'))}"
                    for x in peers
                )
                + " |"
            )
        w("")

    w("### Goals (worker backlog)")
    w("")
    for x, (title, limit) in BACKLOG_PEERS.items():
        for c in cs:
            v = _num(med("pgworkflow", c, f"pgworkflow/{x}"))
            w(
                f"- pgworkflow ≥ {limit:g}× {title}'s jobs/s, {c} consumer(s): "
                + _met(v, v is not None and v >= limit, _r(v))
            )
    for c in cs:
        own = _num(med("pgworkflow", c, "own_write_xacts_per_job"))
        src = "own"
        if own is None:
            own, src = _num(med("pgworkflow", c, "write_xacts_per_job")), "server-wide"
        v = None if own is None else own + 1
        w(
            f"- write transactions per 1-task job ≤ 1.2, counting its enqueue commit, "
            f"{c} consumer(s): "
            + _met(
                v, v is not None and v <= 1.2, f"{_f(v, 2)} ({src} {_f(own, 2)} in the drain + 1)"
            )
        )
    w("")


def write_report(
    path: str, meta: dict[str, Any], results: list[dict[str, Any]], errors: list[dict[str, Any]]
) -> None:
    out: list[str] = []
    w = out.append
    m, pg = meta["machine"], meta["postgres"]
    probe = meta.get("latency_probe", {})
    w("# pgworkflow benchmarks: results")
    w("")
    kind = (
        "**quick run** (small, for a smoke check; quote the full run)"
        if meta.get("quick")
        else "full run"
    )
    w(
        f"Written by `python bench/run_all.py{' --quick' if meta.get('quick') else ''}` "
        f"({kind}) on {meta['date']}, in {meta.get('elapsed_s', 0) / 60:.1f} min. "
        "How to read it: bench/README.md."
    )
    if meta.get("note"):
        w("")
        w(str(meta["note"]))
    w("")
    w("| | |")
    w("|---|---|")
    w(f"| machine | {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; {m['os']} |")
    w(
        f"| load average at start | {', '.join(f'{x:.2f}' for x in m['loadavg_at_start'])} "
        "(shared machine: other engineers' test suites run alongside) |"
    )
    if meta.get("cpu_steal") is not None:
        w(
            f"| CPU steal during the run | {100 * meta['cpu_steal']:.1f}% of the machine's CPU "
            "time went to other guests of the hypervisor (psutil), unevenly over the run: "
            "the timings below are slowed by it, some more than others |"
        )
    w(f"| Python | {m['python']} |")
    w(f"| PostgreSQL | {pg['version'].split(' on ')[0]}, same machine, TCP 127.0.0.1 |")
    w(
        f"| settings | fsync={pg['fsync']}, synchronous_commit={pg['synchronous_commit']}, "
        f"full_page_writes={pg['full_page_writes']}, wal_sync_method={pg['wal_sync_method']}, "
        f"shared_buffers={pg['shared_buffers']}, max_connections={pg['max_connections']} |"
    )
    if probe:
        c, r = probe["commit"], probe["read"]
        w(
            f"| commit round trip (one WAL flush) | p50 {c['p50_ms']:.2f} ms, p99 {c['p99_ms']:.2f} ms "
            f"(`SELECT 1`: p50 {r['p50_ms']:.2f} ms) |"
        )
    g = meta.get("git", {})
    dirty = g.get("engine_dirty") or []
    w(
        f"| engine code | commit {g.get('commit', '?')}"
        + (
            ", with uncommitted changes: " + ", ".join(f"`{d.strip()}`" for d in dirty)
            if dirty
            else ", clean"
        )
        + " |"
    )
    if meta.get("peer_versions"):
        w(
            "| peers | "
            + ", ".join(
                f"{k} {v}" + (" (worker backlog only)" if k == "pgqueuer" else "")
                for k, v in meta["peer_versions"].items()
            )
            + "; Redis on 127.0.0.1:6379 for Celery |"
        )
    s = meta.get("settings", {})
    p_runs = ", ".join(
        f"{v} {k}-task" for k, v in sorted((s.get("procrastinate_runs") or {}).items())
    )
    ty = s.get("typed")
    if ty:
        w(
            f"| method (headline) | per thread count ({', '.join(map(str, ty['threads']))}): "
            f"{ty['rounds']} round(s), each engine one {ty['slice_s']:g} s slice per round, "
            "the order rotating |"
        )
    w(
        f"| method (untyped fast path, peers) | {s.get('rounds')} round(s); null and engine alternate in "
        f"{s.get('paired_slices')}×2 slices of {s.get('slice_s')} s each per round; peers "
        f"{s.get('peer_duration_s')} s after {s.get('warmup_s')} s warm-up (Procrastinate: "
        f"{p_runs} runs drained) |"
    )
    bl = s.get("backlog")
    if bl:
        w(
            f"| method (worker backlog) | {bl['n']:,} jobs per measurement"
            + (f" (Procrastinate {bl['procrastinate_n']:,})"
               if "procrastinate_n" in bl and "procrastinate" in (bl.get("systems") or [])
               else "")
            + "; "
            f"{', '.join(map(str, bl['consumers']))} consumer processes; {bl['rounds']} round(s); "
            f"{', '.join(bl.get('systems') or [])} |"
        )
    w("")

    _typed_section(w, results)

    fast = [r for r in results if str(r.get("workload", "")).startswith("fast")]
    by: dict[tuple[str, int, int, str], list[dict[str, Any]]] = defaultdict(list)
    for r in fast:
        by[(r["system"], r["tasks"], r["threads"], r.get("mode", "loop"))].append(r)

    def eng(tasks: int, threads: int) -> list[dict[str, Any]]:
        return by.get(("engine", tasks, threads, "paired"), [])

    def peer(name: str, tasks: int, threads: int) -> list[dict[str, Any]]:
        for mode in ("loop", "drain"):
            if by.get((name, tasks, threads, mode)):
                return by[(name, tasks, threads, mode)]
        return []

    def per_round_ratio(
        a: list[dict[str, Any]], b: list[dict[str, Any]], key: str, invert: bool = False
    ) -> list[float]:
        rb = {x.get("round"): x for x in b}
        out = []
        for x in a:
            y = rb.get(x.get("round"))
            if y and x.get(key) and y.get(key):
                out.append(y[key] / x[key] if invert else x[key] / y[key])
        return out

    combos = sorted({(t, th) for (_, t, th, _) in by}, key=lambda k: (-k[0], k[1]))
    peers_present = [p for p in PEERS if any(k[0] == p for k in by)]

    # The untyped fast path (the headline before typed.py).
    w("## Untyped no-op runs: engine vs its own-SQL null engine, and peers: ratios")
    w("")
    w(
        "The workload of this section and the next: `Bench.Three` / `Bench.One` (bench/apps.py), "
        "untyped tasks that do nothing and record no output, started and awaited in closed "
        "loops; null = `bench/null_engine.py`, the engine's own statements by hand on "
        "pgworkflow's tables (not the minimal engine of the headline)."
    )
    w("")
    w(
        "Throughput ratio engine / X (above 1: the engine is faster); client CPU ratio "
        "X / engine (above 1: X burns more CPU per run). Each ratio is taken within a round, "
        "then the median over rounds (range in brackets when there are several); engine/null "
        "is the median over all paired slices."
    )
    w("")
    hdr = "| workload | threads | engine/null runs/s |"
    sep = "|---|---|---|"
    for p_ in peers_present:
        hdr += f" engine/{p_} runs/s | {p_}/engine CPU |"
        sep += "---|---|"
    w(hdr)
    w(sep)
    for tasks, threads in combos:
        e = eng(tasks, threads)
        if not e:
            continue
        slices = [x for r in e for x in r.get("ratio_slices", [])]
        row = f"| {tasks}-task fast path | {threads} | **{_r(_med(slices))}**{_range([r['ratio_median'] for r in e])} |"
        for p_ in peers_present:
            pr = peer(p_, tasks, threads)
            rr = per_round_ratio(e, pr, "runs_per_s")
            cr = per_round_ratio(e, pr, "cpu_ms_per_run", invert=True)
            row += f" {_r(_med(rr))}{_range(rr)} | {_r(_med(cr))} |"
        w(row)
    w("")

    # Absolute fast-path figures.
    w("## Fast path and peers: absolute figures (medians over rounds)")
    w("")
    w(
        "runs/s; latency = start to done (ms); CPU = client CPU ms per run (for peers with a "
        "worker process: client + worker)."
    )
    w("")
    w("| workload | threads | system | runs/s | p50 ms | p95 ms | p99 ms | CPU ms/run |")
    w("|---|---|---|---|---|---|---|---|")
    for tasks, threads in combos:
        rows = [
            ("null", by.get(("null", tasks, threads, "paired"), [])),
            ("engine", eng(tasks, threads)),
            ("engine, batch mode", by.get(("engine", tasks, threads, "batch"), [])),
        ]
        rows += [(p_, peer(p_, tasks, threads)) for p_ in peers_present]
        for name, rs in rows:
            if not rs:
                continue
            extra = ""
            if name == "engine, batch mode":
                extra = f" ({rs[0].get('batch')} per thread)"
            if name == "procrastinate":
                extra = " (drain)"
            w(
                f"| {tasks}-task | {threads} | {name}{extra} | {_f(_med([r['runs_per_s'] for r in rs]))} "
                f"| {_f(_med([r.get('p50_ms') for r in rs]), 1)} | {_f(_med([r.get('p95_ms') for r in rs]), 1)} "
                f"| {_f(_med([r.get('p99_ms') for r in rs]), 1)} | {_f(_med([r.get('cpu_ms_per_run') for r in rs]), 2)} |"
            )
    w("")
    split = [
        (p_, t, th, r)
        for (p_, t, th, _), rs in by.items()
        if p_ in ("celery", "procrastinate")
        for r in rs[:1]
    ]
    if split:
        w(
            "Peer CPU split (client / worker ms per run, first round): "
            + "; ".join(
                f"{p_} {t}-task ×{th}: {_f(r.get('client_cpu_ms_per_run'), 2)} / "
                f"{_f(r.get('worker_cpu_ms_per_run'), 2)}"
                for p_, t, th, r in sorted(split, key=lambda x: (x[0], -x[1], x[2]))
            )
            + "."
        )
        w("")

    # Workers.
    wk = [r for r in results if str(r.get("workload", "")).startswith("workers")]
    if wk:
        w("## Workers: draining a backlog inserted with start_tx")
        w("")
        null8 = _med([r["runs_per_s"] for r in by.get(("null", 3, 8, "paired"), [])])
        w(
            "N runs inserted with `start_tx` in one transaction, then drained by worker processes "
            "(`python -m workflow.worker`); runs/s from the commit to the last `finished_at`. "
            "The null engine from 8 threads is shown for scale (it does not claim)."
        )
        w("")
        w(
            "| worker processes | runs | concurrency / batch | runs/s | worker CPU ms/run | vs null 3-task ×8 |"
        )
        w("|---|---|---|---|---|---|")
        for procs in sorted({r["procs"] for r in wk}):
            rs = [r for r in wk if r["procs"] == procs]
            rps = _med([r["runs_per_s"] for r in rs])
            w(
                f"| {procs} | {rs[0]['runs']} | {rs[0]['concurrency']} / {rs[0]['batch_size']} "
                f"| {_f(rps)}{_range([r['runs_per_s'] for r in rs], 0)} "
                f"| {_f(_med([r['worker_cpu_ms_per_run'] for r in rs]), 2)} "
                f"| {_r(rps / null8 if rps and null8 else None)} |"
            )
        w("")

    _backlog_section(w, results)

    # Pickup.
    pk = [r for r in results if r.get("workload") == "pickup"]
    if pk:
        w("## Pickup latency of a start_tx run by an idle worker")
        w("")
        w(
            "From the caller's `commit()` returning to the handler's first line (`time.time()` on "
            "both sides, same machine)."
        )
        w("")
        w("| mode | samples | p50 ms | p95 ms | p99 ms | max ms |")
        w("|---|---|---|---|---|---|")
        for r in pk:
            mode = (
                "LISTEN/NOTIFY"
                if r["listen"]
                else f"poll-only, poll_interval={r['poll_interval']:g}s"
            )
            w(
                f"| {mode} | {r['samples']} | {_f(r['p50_ms'], 1)} | {_f(r['p95_ms'], 1)} "
                f"| {_f(r['p99_ms'], 1)} | {_f(r['max_ms'], 1)} |"
            )
        w("")

    # Scale.
    sc = [r for r in results if r.get("workload") == "scale"]
    if sc:
        sizes = sorted({r["finished_runs"] for r in sc})
        lo, hi = sizes[0], sizes[-1]
        w(f"## Scale: claim and sweep statements with {lo:,} vs {hi:,} finished runs")
        w("")
        w(
            "Each statement runs inside a transaction that is rolled back; the two databases "
            "hold the same live state (100 pending, 40 claimed, 10 stale claims) and differ only "
            "in history (finished runs with 3 tasks each, vacuumed). Timings interleave the two "
            "databases. client = round trip from Python (median); server = EXPLAIN ANALYZE "
            "execution time (median); buffers = shared buffers the plan touched."
        )
        w("")
        w(
            f"| statement | rows | client ms {lo:,} | client ms {hi:,} | ratio | server ms {lo:,} "
            f"| server ms {hi:,} | ratio | buffers {lo:,} / {hi:,} |"
        )
        w("|---|---|---|---|---|---|---|---|---|")
        for name in dict.fromkeys(r["statement"] for r in sc):
            a = next(r for r in sc if r["statement"] == name and r["finished_runs"] == lo)
            b = next(r for r in sc if r["statement"] == name and r["finished_runs"] == hi)
            w(
                f"| {name} | {a['rows']} | {a['median_ms']:.3f} | {b['median_ms']:.3f} "
                f"| {_r(b['median_ms'] / a['median_ms'])} | {a['server_ms']:.3f} | {b['server_ms']:.3f} "
                f"| {_r(b['server_ms'] / a['server_ms'])} | {a['buffers']:g} / {b['buffers']:g} |"
            )
        w("")
        w(
            f"Table sizes (runs + tasks, with indexes): {lo:,}: "
            f"{next(r['tables_mb'] for r in sc if r['finished_runs'] == lo):.0f} MB; {hi:,}: "
            f"{next(r['tables_mb'] for r in sc if r['finished_runs'] == hi):.0f} MB."
        )
        w("")
        ch = [r for r in results if r.get("workload") == "scale-churn"]
        if ch:
            w(
                f"**Before vacuum.** Then, on the {hi:,} database, "
                f"{ch[0]['dead_claim_index_entries']:,} more runs went pending → succeeded by "
                "UPDATE (older than the live pending runs) with autovacuum off: the claim's partial "
                "index keeps that many dead entries until a vacuum. (Autovacuum's default trigger "
                "on a 1M-row table is ~200k dead rows, so this state is normal between vacuums of a "
                "busy table.)"
            )
            w("")
            w("| statement | first execution ms | then, median ms |")
            w("|---|---|---|")
            for r in ch:
                w(f"| {r['statement']} | {r['first_ms']:.1f} | {r['median_ms']:.3f} |")
            w("")
        w(f"<details><summary>Plans (EXPLAIN ANALYZE, BUFFERS) at {hi:,} finished runs</summary>")
        w("")
        for r in sc:
            if r["finished_runs"] == hi:
                w(f"**{r['statement']}**")
                w("")
                w("```")
                w(r["plan"])
                w("```")
                w("")
        w("</details>")
        w("")

    # Targets.
    w("## Targets (issue 7)")
    w("")
    w("| target | measured | met? |")
    w("|---|---|---|")

    def yes(ok: bool | None) -> str:
        return "—" if ok is None else ("**yes**" if ok else "**no**")

    for threads in sorted(
        {th for (s_, t, th, mo) in by if s_ == "engine" and t == 3 and mo == "paired"}
    ):
        e = eng(3, threads)
        v = _med([x for r in e for x in r.get("ratio_slices", [])])
        w(
            f"| fast-path 3-task throughput ≥ 0.8× null, {threads} thread(s) | {_r(v)} | "
            f"{yes(None if v is None else v >= 0.8)} |"
        )
    cpus = [
        (th, _med([r["cpu_ms_per_run"] for r in eng(3, th)]))
        for th in sorted(
            {th for (s_, t, th, mo) in by if s_ == "engine" and t == 3 and mo == "paired"}
        )
    ]
    if cpus:
        worst = max(c for _, c in cpus if c is not None)
        w(
            "| ≤ 2 ms client CPU per 3-task run | "
            + ", ".join(f"{c:.2f} ms (×{th})" for th, c in cpus if c is not None)
            + f" | {yes(worst <= 2.0)} |"
        )
    for r in pk:
        if r["listen"]:
            w(f"| LISTEN pickup p50 < 20 ms | {r['p50_ms']:.1f} ms | {yes(r['p50_ms'] < 20)} |")
            w(f"| LISTEN pickup p99 < 100 ms | {r['p99_ms']:.1f} ms | {yes(r['p99_ms'] < 100)} |")
    if sc:
        for name in dict.fromkeys(r["statement"] for r in sc):
            if not name.startswith("claim_runs"):
                continue
            a = next(r for r in sc if r["statement"] == name and r["finished_runs"] == lo)
            b = next(r for r in sc if r["statement"] == name and r["finished_runs"] == hi)
            rc, rs_ = b["median_ms"] / a["median_ms"], b["server_ms"] / a["server_ms"]
            w(
                f"| claim latency at {hi:,} within 1.5× of {lo:,}: {name} | client {_r(rc)}, "
                f"server {_r(rs_)} | {yes(max(rc, rs_) <= 1.5)} |"
            )
    w("")

    if errors:
        w("## Failures")
        w("")
        w("Measurements that did not produce a result (the run carried on without them):")
        w("")
        for e in errors:
            w(
                f"- **{e['label']}** (rc={e.get('rc', '?')}): `{' '.join(str(e['error']).split())[:400]}`"
            )
        w("")
    with open(path, "w") as f:
        f.write("\n".join(out))


def main() -> None:
    src = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, ".logs", "results.json")
    with open(src) as f:
        data = json.load(f)
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.join(HERE, "RESULTS.md")
    write_report(out, data["meta"], data["results"], data["errors"])
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
