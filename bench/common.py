"""Shared helpers for the benchmark scripts (stdlib only at import time).

Every benchmark script prints one JSON object per measurement on a line that
starts with `RESULT `; `run_all.py` collects those lines. The peers run in their
own virtualenvs, so this module imports nothing outside the standard library
until a helper that needs psycopg or psutil is called.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

BASE_URL = os.environ.get("BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def db_url(name: str) -> str:
    """`BASE_URL` with its database replaced by `name`."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(BASE_URL)
    return urlunsplit(parts._replace(path="/" + name))


def scratch_db(name: str, *, fresh: bool = False) -> str:
    """Create database `name` if missing (drop it first when `fresh`); its URL."""
    import psycopg

    with psycopg.connect(BASE_URL, autocommit=True) as conn:
        if fresh:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{name}"')
    return db_url(name)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation; None when empty."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def latency_summary(seconds: list[float]) -> dict[str, Any]:
    """p50/p95/p99/max in milliseconds."""
    ms = [s * 1000.0 for s in seconds]
    return {
        "p50_ms": percentile(ms, 50),
        "p95_ms": percentile(ms, 95),
        "p99_ms": percentile(ms, 99),
        "max_ms": max(ms) if ms else None,
        "samples": len(ms),
    }


def emit(result: dict[str, Any]) -> None:
    """Print one measurement for run_all.py."""
    print("RESULT " + json.dumps(result, default=str), flush=True)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class CpuMeter:
    """CPU seconds of this process (all threads) plus the given child pids.

    Child CPU is read with psutil (user+system, including the child's own
    children), so it works while the children are still running.
    """

    def __init__(self, pids: list[int] | None = None) -> None:
        self.pids = list(pids or [])
        self._start_self = 0.0
        self._start_children = 0.0

    def _children(self) -> float:
        if not self.pids:
            return 0.0
        import psutil

        total = 0.0
        for pid in self.pids:
            try:
                proc = psutil.Process(pid)
                procs = [proc, *proc.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for p in procs:
                try:
                    t = p.cpu_times()
                    total += t.user + t.system
                except psutil.NoSuchProcess:
                    pass
        return total

    def start(self) -> None:
        self._start_self = time.process_time()
        self._start_children = self._children()

    def stop(self) -> tuple[float, float]:
        """(this process's CPU seconds, the children's CPU seconds) since start()."""
        return time.process_time() - self._start_self, self._children() - self._start_children


def machine_info() -> dict[str, Any]:
    """CPU model, cores, memory, OS and Python."""
    model = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_gib = round(int(line.split()[1]) / 1024 / 1024, 1)
                    break
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "memory_gib": mem_gib,
        "os": platform.platform(),
        "python": platform.python_version(),
        "loadavg_at_start": os.getloadavg(),
    }


def cpu_times() -> Any:
    """The machine's CPU time so far by state (psutil's `cpu_times()`: user, system,
    idle, ... and, on Linux, steal), to pass to `steal_share`."""
    import psutil

    return psutil.cpu_times()


def steal_share(before: Any, after: Any) -> float | None:
    """The share of the machine's CPU time between two `cpu_times()` readings that the
    hypervisor gave to other guests (steal): what makes timings on a shared cloud
    instance swing between minutes. None where the system does not report steal."""
    if not hasattr(before, "steal"):
        return None
    # guest and guest_nice are already counted in user and nice.
    fields = [f for f in before._fields if f not in ("guest", "guest_nice")]
    total = sum(getattr(after, f) - getattr(before, f) for f in fields)
    return (after.steal - before.steal) / total if total > 0 else None


def pg_info() -> dict[str, Any]:
    import psycopg

    with psycopg.connect(BASE_URL, autocommit=True) as conn:
        info: dict[str, Any] = {"version": conn.execute("SELECT version()").fetchone()[0]}
        for name in (
            "fsync",
            "synchronous_commit",
            "full_page_writes",
            "wal_sync_method",
            "shared_buffers",
            "max_connections",
            "work_mem",
        ):
            info[name] = conn.execute(f"SHOW {name}").fetchone()[0]
    return info


def spread(values: list[float]) -> float:
    """Relative spread (max-min)/median, for the noise column."""
    if len(values) < 2:
        return 0.0
    med = statistics.median(values)
    return (max(values) - min(values)) / med if med else 0.0


def closed_loop(
    make_worker: Any,
    threads: int,
    warmup: float,
    duration: float,
) -> dict[str, Any]:
    """Run `threads` closed loops of one run at a time; measure a window.

    `make_worker(i)` is called on each thread and returns a callable doing one run
    (start it and wait until it is done) and returning None, or doing several
    and returning the list of their start-to-done latencies (seconds). The first
    `warmup` seconds are not counted; then runs that *finish* inside the next `duration` seconds are
    counted, with their start-to-done latency, and this process's CPU time over
    the same window is divided by their number.
    """
    import threading

    stop = threading.Event()
    ready = threading.Barrier(threads + 1)
    finished: list[list[tuple[float, float]]] = [[] for _ in range(threads)]
    # (end time, latency) of every run; a batch shares its end time.
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            one = make_worker(i)
        except BaseException as e:
            errors.append(e)
            ready.abort()
            return
        try:
            ready.wait()
        except threading.BrokenBarrierError:
            return
        out = finished[i]
        pc = time.perf_counter
        try:
            while not stop.is_set():
                t0 = pc()
                several = one()
                t1 = pc()
                if several is None:
                    out.append((t1, t1 - t0))
                else:
                    out.extend((t1, lt) for lt in several)
        except BaseException as e:
            errors.append(e)
            stop.set()

    ts = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(threads)]
    for t in ts:
        t.start()
    try:
        ready.wait()
    except threading.BrokenBarrierError:
        raise RuntimeError(f"a bench thread failed to set up: {errors[0]!r}") from errors[0]
    time.sleep(warmup)
    cpu0 = time.process_time()
    w0 = time.perf_counter()
    time.sleep(duration)
    w1 = time.perf_counter()
    cpu1 = time.process_time()
    stop.set()
    for t in ts:
        t.join(60)
    if errors:
        raise RuntimeError(f"a bench thread failed: {errors[0]!r}") from errors[0]
    lat = [lt for out in finished for (end, lt) in out if w0 <= end < w1]
    n = len(lat)
    return {
        "runs": n,
        "seconds": w1 - w0,
        "runs_per_s": n / (w1 - w0),
        "cpu_ms_per_run": (cpu1 - cpu0) * 1000.0 / n if n else None,
        **latency_summary(lat),
    }


def slice_loops(
    one: Any, threads: int, seconds: float, base: int
) -> tuple[int, float]:
    """`threads` closed loops calling `one(thread_index, n)` for `seconds` (n counts up
    from `base + thread_index * 1_000_000`): (calls finished, this process's CPU seconds
    over the slice). The first exception of a loop stops them all and is raised."""
    import threading

    stop = threading.Event()
    counts = [0] * threads
    errors: list[BaseException] = []

    def loop(i: int) -> None:
        n = base + i * 1_000_000
        try:
            while not stop.is_set():
                one(i, n)
                counts[i] += 1
                n += 1
        except BaseException as e:
            errors.append(e)
            stop.set()

    workers = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(threads)]
    cpu0 = time.process_time()
    for w in workers:
        w.start()
    stop.wait(seconds)
    stop.set()
    for w in workers:
        w.join(30)
    if errors:
        raise errors[0]
    return sum(counts), time.process_time() - cpu0


def postgres_cpu(
    known: dict[int, Any], skip: set[int] | frozenset[int] = frozenset()
) -> dict[int, float]:
    """CPU seconds (user + system) of every `postgres` process on this machine, by pid.

    `known` caches the psutil handles between calls (pass the same dict each time);
    `skip` leaves pids out. A process that is gone is left out of the answer.
    """
    import psutil

    out: dict[int, float] = {}
    for proc in psutil.process_iter(["name"]):
        if proc.info["name"] != "postgres" or proc.pid in skip:
            continue
        handle = known.setdefault(proc.pid, proc)
        try:
            times = handle.cpu_times()
        except psutil.Error:
            continue
        out[proc.pid] = times.user + times.system
    return out


def cpu_spent(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two `postgres_cpu` readings: a process present in both
    counts its difference, one started in between all of its time, one gone by the
    second reading nothing (so other clients' exits can never make it negative)."""
    return sum(t - before.get(pid, 0.0) for pid, t in after.items())


@contextlib.contextmanager
def pinned_apart(pin: bool = True) -> Iterator[None]:
    """With `pin`, this process on the first half of the machine's cores and every
    PostgreSQL process on this machine (the postmaster too: backends it forks later
    inherit it) on the other half, for the block; everything back on every core
    afterwards. Needs at least 2 cores, and the right to set the server's affinity
    (the same user, or root)."""
    if not pin:
        yield
        return
    import psutil

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("--pin needs at least 2 cores")
    half = len(cores) // 2
    client, server = set(cores[:half]), cores[half:]
    every = list(range(psutil.cpu_count() or len(cores)))

    def postgres() -> list[psutil.Process]:
        return [p for p in psutil.process_iter(["name"])
                if p.info["name"] and "postgres" in p.info["name"]]

    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, client)
    try:
        for proc in postgres():
            with contextlib.suppress(psutil.Error):
                proc.cpu_affinity(server)
        yield
    finally:
        for proc in postgres():
            with contextlib.suppress(psutil.Error):
                proc.cpu_affinity(every)
        os.sched_setaffinity(0, mine)
