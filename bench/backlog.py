"""The worker backlog, side by side: pgworkflow, PGQueuer 1.6 and Procrastinate 3.10.

A backlog of `--n` one-task jobs (each a no-op taking a small payload, `{"n": i}`)
is inserted one commit per job from one client connection, the way each
library's users enqueue (pgworkflow: `Bench.One.start_tx(conn, mgr, BenchInput(n))`
inside `with conn.transaction():`; PGQueuer: `Queries.enqueue`; Procrastinate:
`noop.defer(n=i)`), while no consumer runs. Then C consumer processes drain it,
each one OS process started the way that library's users start one:

- pgworkflow: `python -m workflow.worker --app bench.apps:factory --concurrency 16`,
- PGQueuer: a QueueManager with one no-op `@qm.entrypoint`, every default
  (`bench/peers/pgqueuer/bench_pgqueuer.py consume`; `--pgq-batch-size` sets its
  dequeue batch, 10 by default),
- Procrastinate: `procrastinate worker --concurrency=16` with one no-op async task
  (`bench/peers/procrastinate/backlog_procrastinate.py`).

How the consumers start (`--start`), so that no consumer runs during the insert
and process start-up stays out of the drain (on 2 cores, eight Python processes
importing their library take seconds, longer than some drains):

- `warm` (the default): the C processes are launched before the insert with their
  modules imported (the command's own modules, its app's, the library's), and
  wait at a gate (a read on their stdin) without any database connection; after
  the insert one byte each releases them into the command's own `__main__`
  (`runpy`), which then connects, LISTENs and drains as it would have from a
  shell.
- `cold`: the commands are launched after the insert, as from a shell.
- `frozen`: the commands are launched before the insert, seen idle (connected,
  LISTENing), stopped with SIGSTOP during it, and sent SIGCONT together. Their
  LISTEN connections then hold one notification per job, which they read in a
  burst on waking; a consumer that ran during the insert would have read them
  one by one, so this start charges the peers for wake-ups that the other starts
  do not (and that the brief's workload does not have).

Measured from the database, per system and C: throughput = (N - 1) / (last
completion - first completion), on the database's own timestamps
(pgworkflow `workflow_runs.finished_at`; PGQueuer `pgqueuer_log.created` of the
'successful' rows, written in the transaction that deletes the job; Procrastinate
`procrastinate_events.at` of the 'succeeded' events), and beside it the rate
between the 10th and 90th percentile completions, which a late first or last
batch does not move. Per job over the drain (counters read on an admin
connection after the insert, before the consumers are released, and when the
drain is seen complete): write transactions (xids assigned, server-wide), WAL
bytes (server-wide), the same two for the bench database alone ("own", read
from the WAL with pg_walinspect: see `WalReader`; other work on the server does
not reach them), server CPU: user+system of every `postgres` process (as
bench/typed.py's `_Server` reads it, except that a process gone by the second
read drops out of both, so other clients' exits cannot make it negative; other
work on the server still counts), and of the bench database's backends alone.
Every job must have completed exactly once (N completions of N distinct jobs,
none failed, retried or picked twice) or the measurement fails. Then the
consumers get SIGTERM (kill after 15 s).

`--analyze`: the bench database is analysed (`ANALYZE`, every table) after the
insert and before the counters are read, for every system alike: the drain then
meets the statistics of a table that has lived a while (autovacuum analyses a
table once a tenth of it has changed), where without it every drain is of a
table filled moments ago, which no statistics describe yet. pgworkflow plans
differently on the two (its combined statements keep one plan per connection
either way since 8a54b7b; before, only on a table without statistics).

Each round runs every C, and for each C the systems in a rotating order.
Medians over rounds; the ratios pgworkflow/peer are per round, then medianed.

    PYTHONPATH=. python bench/backlog.py [--n 10000] [--consumers 1,4,8] [--rounds 2]
        [--systems pgworkflow,pgqueuer,procrastinate] [--start warm|cold|frozen] [--analyze]
        [--concurrency 16] [--pgq-batch-size 10] [--procrastinate-n N]

`--procrastinate-n` gives Procrastinate a backlog of its own size. The full run
(run_all.py) drains 30,000 jobs, and Procrastinate 10,000: it drains about a
thirtieth as fast as the others here, so 30,000 would take it minutes per drain,
while pgworkflow's drains of 10,000 lasted one or two seconds, too short to steer by
(their ratio to PGQueuer's swung by +-25% between minutes). A smaller backlog
favours Procrastinate, whose rate falls as its backlog grows (602 jobs/s from one
worker on 300 jobs; about 150 on 10,000 in the 2026-12-06 01:28 full run, 248 at
04:13), so the ratios against it err on its side.

The peers' virtualenvs are bench/.venvs/pgqueuer and bench/.venvs/procrastinate,
created on first use from bench/peers/<name>/requirements.txt (as run_all.py does).
Scratch databases: bench_backlog_<system>, made anew for every measurement, and
bench_backlog_wal (pg_walinspect).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.common import emit, log, postgres_cpu, scratch_db  # noqa: E402

SYSTEMS = ("pgworkflow", "pgqueuer", "procrastinate")
PEERS = {"pgqueuer": "pgqueuer", "procrastinate": "procrastinate"}
PGQ_SCRIPT = os.path.join(HERE, "peers", "pgqueuer", "bench_pgqueuer.py")
PROC_DIR = os.path.join(HERE, "peers", "procrastinate")
PROC_SCRIPT = os.path.join(PROC_DIR, "backlog_procrastinate.py")

# Jobs completed so far (the drain's progress), per system: cheap enough to poll.
DONE_SQL = {
    "pgworkflow": "SELECT count(*) FROM workflow_runs WHERE status = 'succeeded'",
    "pgqueuer": "SELECT count(*) FROM pgqueuer_log WHERE status = 'successful'",
    "procrastinate": "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'",
}
# Completion times on the database's clock: (column, the rows of completed jobs).
COMPLETED = {
    "pgworkflow": ("finished_at", "workflow_runs WHERE status = 'succeeded'"),
    "pgqueuer": ("created", "pgqueuer_log WHERE status = 'successful'"),
    "procrastinate": ("at", "procrastinate_events WHERE type = 'succeeded'"),
}
COMPLETED_ID = {"pgworkflow": "id", "pgqueuer": "job_id", "procrastinate": "job_id"}
# Anything that did not succeed, or ran twice: must be 0.
NOT_ONCE_SQL = {
    # A failed, swept (abandoned and re-claimed) or parked attempt leaves an event.
    "pgworkflow": (
        "SELECT (SELECT count(*) FROM workflow_runs WHERE status <> 'succeeded')"
        " + (SELECT count(*) FROM workflow_events)"
    ),
    "pgqueuer": (
        "SELECT (SELECT count(*) FROM pgqueuer)"
        " + (SELECT count(*) FROM pgqueuer_log WHERE status NOT IN"
        " ('queued', 'picked', 'successful'))"
        " + abs((SELECT count(*) FROM pgqueuer_log WHERE status = 'picked')"
        " - (SELECT count(*) FROM pgqueuer_log WHERE status = 'queued'))"
    ),
    "procrastinate": (
        "SELECT (SELECT count(*) FROM procrastinate_jobs WHERE status <> 'succeeded')"
        " + (SELECT count(*) FROM procrastinate_events WHERE type NOT IN"
        " ('deferred', 'started', 'succeeded'))"
        " + abs((SELECT count(*) FROM procrastinate_events WHERE type = 'started')"
        " - (SELECT count(*) FROM procrastinate_jobs))"
    ),
}
# Jobs waiting before the drain (all N must be there, none done).
WAITING_SQL = {
    "pgworkflow": "SELECT count(*) FILTER (WHERE status = 'pending'), count(*) FROM workflow_runs",
    "pgqueuer": "SELECT count(*) FILTER (WHERE status = 'queued'), count(*) FROM pgqueuer",
    "procrastinate": (
        "SELECT count(*) FILTER (WHERE status = 'todo'), count(*) FROM procrastinate_jobs"
    ),
}


class _Shim:
    """What run_all.ensure_venv needs of its Runner."""

    def __init__(self) -> None:
        self.errors: list[dict[str, Any]] = []

    def say(self, msg: str) -> None:
        log(msg)


def peer_python(name: str) -> str:
    """bench/.venvs/<name>/bin/python, created from its requirements on first use."""
    from bench.run_all import ensure_venv

    shim = _Shim()
    py = ensure_venv(shim, name)  # type: ignore[arg-type]
    if py is None:
        raise RuntimeError(f"cannot build bench/.venvs/{name}: {shim.errors}")
    return py


class Counters:
    """Server-side counters on an admin connection: next xid, WAL position, and the
    CPU (user+system) of every `postgres` process and of this database's backends."""

    def __init__(self, conn: Any, skip_pids: tuple[int, ...] = ()) -> None:
        self.conn = conn
        self.skip = set(skip_pids)  # the WalReader's backend: not the systems' work
        self._procs: dict[int, Any] = {}

    def _cpu(self) -> dict[int, float]:
        return postgres_cpu(self._procs, self.skip)

    def read(self) -> dict[str, Any]:
        row = self.conn.execute(
            "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn,"
            " pg_snapshot_xmax(pg_current_snapshot())::text::bigint,"
            " ARRAY(SELECT pid FROM pg_stat_activity WHERE datname = current_database()),"
            " pg_current_wal_lsn()::text"
        ).fetchone()
        return {"cpu": self._cpu(), "wal": int(row[0]), "xid": int(row[1]), "db_pids": row[2],
                "lsn": row[3]}

    @staticmethod
    def per_job(before: dict[str, Any], after: dict[str, Any], n: int) -> dict[str, float]:
        server = sum(cpu - before["cpu"].get(pid, 0.0) for pid, cpu in after["cpu"].items())
        own = sum(after["cpu"].get(pid, 0.0) - before["cpu"].get(pid, 0.0)
                  for pid in after["db_pids"])
        return {
            "write_xacts_per_job": (after["xid"] - before["xid"]) / n,
            "wal_bytes_per_job": (after["wal"] - before["wal"]) / n,
            "server_cpu_ms_per_job": 1000.0 * server / n,
            "db_backends_cpu_ms_per_job": 1000.0 * own / n,
        }


class WalReader:
    """Write transactions and WAL bytes of one database alone, read from the WAL
    (pg_walinspect, from a database of its own, `bench_backlog_wal`, so that its
    backend is none of the bench database's): every record on a relation of that
    database, and every record (commits too) of a transaction that wrote one.

    Other work on the server can write WAL fast and force checkpoints (DROP
    DATABASE does), which recycle segments within seconds: `hold()` creates a
    temporary physical replication slot (dropped by `totals()`, or by the server
    when this connection ends) that keeps them until they are read, and the WAL
    is read in steps during the drain. `totals()` is None if a segment was gone
    anyway (or pg_walinspect is missing)."""

    SQL = """
        SELECT xid::text::bigint, coalesce(block_ref LIKE %(rel)s, false) AS ours,
               sum(record_length)
        FROM pg_get_wal_records_info(%(a)s::pg_lsn, %(b)s::pg_lsn)
        GROUP BY 1, 2 ORDER BY 2 DESC
    """

    def __init__(self) -> None:
        import psycopg

        url = scratch_db("bench_backlog_wal")
        self.conn = psycopg.connect(url, autocommit=True)
        self.pid = self.conn.info.backend_pid
        self.ok = True
        try:
            self.conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        except Exception as e:
            log(f"own WAL: pg_walinspect unavailable ({e})")
            self.ok = False
        self.slot = f"bench_backlog_{os.getpid()}"
        self.start("0/0", "")

    def hold(self) -> None:
        """Keep the WAL from the last checkpoint on until `totals()` (before the
        counters' first read)."""
        if not self.ok:
            return
        self._release()  # a failed measurement's
        try:
            self.conn.execute("SELECT pg_create_physical_replication_slot(%s, true, true)",
                              (self.slot,))
        except Exception as e:
            log(f"own WAL: no replication slot ({e}); reading without one")

    def _release(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.execute("SELECT pg_drop_replication_slot(slot_name) FROM"
                              " pg_replication_slots WHERE slot_name = %s", (self.slot,))

    def start(self, lsn: str, database: str) -> None:
        row = self.conn.execute("SELECT oid FROM pg_database WHERE datname = %s",
                                (database,)).fetchone()
        self.rel = f"%rel %/{row[0]}/%" if row else ""
        self.last = lsn
        self.xids: set[int] = set()
        self.bytes = 0
        self.failed = not self.ok

    def step(self, upto: str | None = None) -> None:
        """Read from where the last step ended to `upto` (default: the flushed end)."""
        if self.failed:
            return
        try:
            if upto is None:
                upto = self.conn.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0]
            if self.conn.execute("SELECT %s::pg_lsn > %s::pg_lsn",
                                 (upto, self.last)).fetchone()[0]:
                rows = self.conn.execute(self.SQL, {"rel": self.rel, "a": self.last,
                                                    "b": upto}).fetchall()
                self.last = upto
                for xid, ours, size in rows:
                    if ours and xid:
                        self.xids.add(xid)
                    if ours or xid in self.xids:
                        self.bytes += int(size)
        except Exception as e:
            log(f"own WAL: not read ({e})")
            self.failed = True

    def totals(self, upto: str, n: int) -> dict[str, float | None]:
        deadline = time.monotonic() + 5
        while (self.ok and not self.failed and time.monotonic() < deadline
               and not self.conn.execute("SELECT pg_current_wal_flush_lsn() >= %s::pg_lsn",
                                         (upto,)).fetchone()[0]):
            time.sleep(0.05)
        self.step(upto)
        self._release()
        if self.failed:
            return {"own_write_xacts_per_job": None, "own_wal_bytes_per_job": None}
        return {"own_write_xacts_per_job": len(self.xids) / n,
                "own_wal_bytes_per_job": self.bytes / n}


class System:
    """How to install, enqueue into and consume from one system's scratch database."""

    def __init__(self, name: str, concurrency: int, pgq_batch_size: int = 10) -> None:
        self.name = name
        self.concurrency = concurrency
        self.pgq_batch_size = pgq_batch_size
        self.py = sys.executable if name == "pgworkflow" else peer_python(PEERS[name])
        self.url = ""

    def env(self) -> dict[str, str]:
        env = {**os.environ, "BENCH_BACKLOG_URL": self.url, "PYTHONUNBUFFERED": "1"}
        if self.name == "pgworkflow":
            env["PYTHONPATH"] = REPO
        elif self.name == "procrastinate":
            env["PYTHONPATH"] = PROC_DIR
        else:
            env.pop("PYTHONPATH", None)
        return env

    def install(self) -> None:
        self.url = scratch_db(f"bench_backlog_{self.name}", fresh=True)
        if self.name == "pgworkflow":
            from workflow.store import migrate

            migrate(self.url)
        elif self.name == "pgqueuer":
            pgq = os.path.join(os.path.dirname(self.py), "pgq")
            subprocess.run([pgq, "--pg-dsn", self.url, "install"], env=self.env(),
                           check=True, capture_output=True, text=True)
        else:
            subprocess.run([self.py, PROC_SCRIPT, "install"], env=self.env(), check=True,
                           capture_output=True, text=True)

    def enqueue(self, n: int) -> float:
        """Insert the backlog, one commit per job; the seconds it took."""
        if self.name == "pgworkflow":
            import psycopg

            import workflow
            from bench.apps import BenchInput, One, registry

            mgr = workflow.Manager(self.url, registry(), workflow.Config(tracing=False))
            try:
                with psycopg.connect(self.url, autocommit=True) as conn:
                    started = time.perf_counter()
                    for i in range(n):
                        with conn.transaction():
                            One.start_tx(conn, mgr, BenchInput(n=i))
                    return time.perf_counter() - started
            finally:
                mgr.close()
        script = PGQ_SCRIPT if self.name == "pgqueuer" else PROC_SCRIPT
        out = subprocess.run([self.py, script, "enqueue", "--n", str(n)], env=self.env(),
                             check=True, capture_output=True, text=True).stdout
        return float(json.loads(out.strip().splitlines()[-1])["seconds"])

    def consumer_cmd(self) -> tuple[list[str], str]:
        """The command one consumer is, as from a shell, and its working directory."""
        if self.name == "pgworkflow":
            return [self.py, "-m", "workflow.worker", *self._worker_args()], REPO
        if self.name == "pgqueuer":
            return [self.py, PGQ_SCRIPT, *self._worker_args()], os.path.dirname(PGQ_SCRIPT)
        exe = os.path.join(os.path.dirname(self.py), "procrastinate")
        return [exe, *self._worker_args()], PROC_DIR

    def _worker_args(self) -> list[str]:
        if self.name == "pgworkflow":
            return ["--app", "bench.apps:factory", "--database-url", self.url,
                    "--concurrency", str(self.concurrency), "--log-level", "warning"]
        if self.name == "pgqueuer":
            return ["consume", "--batch-size", str(self.pgq_batch_size)]
        return ["--app=backlog_procrastinate.app", "--log-level=warning", "worker",
                f"--concurrency={self.concurrency}"]

    def gated_cmd(self) -> tuple[list[str], str]:
        """The same consumer with its modules imported first, waiting for one byte on
        stdin before it runs the command's `__main__` (runpy) with the same arguments."""
        module, preload = {
            "pgworkflow": ("workflow.worker", ["workflow.worker", "bench.apps"]),
            "pgqueuer": ("bench_pgqueuer", ["bench_pgqueuer"]),
            "procrastinate": ("procrastinate", ["procrastinate.cli", "backlog_procrastinate"]),
        }[self.name]
        code = (
            "import importlib, runpy, sys\n"
            f"for m in {preload!r}: importlib.import_module(m)\n"
            "if sys.stdin.buffer.read(1) != b'g': sys.exit(0)\n"
            f"sys.argv = [{module!r}, *{self._worker_args()!r}]\n"
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n"
        )
        return [self.py, "-c", code], self.consumer_cmd()[1]

    def ready_count(self, conn: Any) -> int:
        """How many consumers show, in the database, that they are up and listening."""
        if self.name == "pgworkflow":
            sql = ("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                   " AND query = 'LISTEN workflow_runs'")
        elif self.name == "procrastinate":
            sql = "SELECT count(*) FROM procrastinate_workers"
        else:  # one asyncpg connection per consumer, idle between dequeues
            sql = ("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                   " AND backend_type = 'client backend' AND pid <> pg_backend_pid()")
        row = conn.execute(sql).fetchone()
        return int(row[0]) if row else 0


class Sampler:
    """`--sample`: where a drain's time goes while it runs, on a connection of its own
    (to `bench_backlog_wal`, so it is not one of the bench database's backends).

    Every `every` seconds it reads how many tasks the kernel has runnable
    (`/proc/loadavg`'s fourth field, the sampler itself included) and the state and
    wait event of every backend of the bench database (`pg_stat_activity`). Over the
    whole drain it reads the machine's idle time (`/proc/stat`: idle and iowait).
    Its own reads cost CPU on both sides (one query every `every` seconds), the same
    for every system sampled: compare systems, not a sampled drain with an unsampled one.
    """

    def __init__(self, every: float) -> None:
        import threading

        import psycopg

        self.every = every
        self.conn = psycopg.connect(scratch_db("bench_backlog_wal"), autocommit=True)
        self._stop = threading.Event()
        self._thread: Any = None
        self.runnable: list[int] = []
        self.backends: dict[str, int] = {}
        self.samples = 0
        self._stat0: list[int] = []

    @staticmethod
    def _stat() -> list[int]:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]

    def start(self, datname: str) -> None:
        import threading

        self.runnable, self.backends, self.samples = [], {}, 0
        self._stop.clear()
        self._stat0 = self._stat()
        self._thread = threading.Thread(target=self._loop, args=(datname,), daemon=True)
        self._thread.start()

    def _loop(self, datname: str) -> None:
        sql = ("SELECT CASE WHEN state = 'active' THEN 'active: '"
               " || coalesce(wait_event_type || ':' || wait_event, 'no wait (CPU)')"
               " ELSE coalesce(state, '?') || coalesce(' (' || wait_event || ')', '') END,"
               " count(*) FROM pg_stat_activity WHERE datname = %s GROUP BY 1")
        while not self._stop.wait(self.every):
            with open("/proc/loadavg") as f:
                self.runnable.append(int(f.read().split()[3].split("/")[0]))
            for what, count in self.conn.execute(sql, (datname,)).fetchall():
                self.backends[what] = self.backends.get(what, 0) + count
            self.samples += 1

    def stop(self) -> dict[str, Any]:
        """Stop sampling; what was seen (`sample_*` keys)."""
        self._stop.set()
        self._thread.join()
        stat = self._stat()
        delta = [b - a for a, b in zip(self._stat0, stat, strict=False)]
        total = sum(delta[:8]) or 1  # user..steal; guest time is counted in user
        cores = os.cpu_count() or 1
        n = max(self.samples, 1)
        hist: dict[str, float] = {}
        for k in self.runnable:
            key = str(min(k, cores + 2)) + ("+" if k >= cores + 2 else "")
            hist[key] = hist.get(key, 0) + 1 / n
        return {
            "sample_count": self.samples,
            "sample_idle_cores": cores * (delta[3] + delta[4]) / total,
            "sample_steal_cores": cores * delta[7] / total,
            "sample_runnable_hist": dict(sorted(hist.items())),
            "sample_backends": {k: v / n for k, v in
                                sorted(self.backends.items(), key=lambda kv: -kv[1])},
        }


def _tree(proc: subprocess.Popen[bytes]) -> list[Any]:
    """`proc` and its children, as psutil processes ([] once it is gone)."""
    import psutil

    try:
        p = psutil.Process(proc.pid)
        return [p, *p.children(recursive=True)]
    except psutil.Error:
        return []


def _tree_cpu(procs: list[subprocess.Popen[bytes]]) -> list[float]:
    import psutil

    out = []
    for proc in procs:
        total = 0.0
        for q in _tree(proc):
            try:
                t = q.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system
        out.append(total)
    return out


def _tree_switches(procs: list[subprocess.Popen[bytes]]) -> tuple[int, int]:
    """The voluntary and involuntary context switches of every live thread of the
    consumers and their children (`/proc/PID/task/*/status`: a process's own status,
    which psutil reads, counts its first thread only)."""
    counts = {"voluntary_ctxt_switches:": 0, "nonvoluntary_ctxt_switches:": 0}
    for proc in procs:
        for q in _tree(proc):
            try:
                tids = os.listdir(f"/proc/{q.pid}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    with open(f"/proc/{q.pid}/task/{tid}/status") as f:
                        for line in f:
                            key, _, value = line.partition("\t")
                            if key in counts:
                                counts[key] += int(value)
                except OSError:
                    pass
    return counts["voluntary_ctxt_switches:"], counts["nonvoluntary_ctxt_switches:"]


def _signal_all(procs: list[subprocess.Popen[bytes]], sig: int) -> None:
    import psutil

    for proc in procs:
        try:
            p = psutil.Process(proc.pid)
            for q in [p, *p.children(recursive=True)]:
                q.send_signal(sig)
        except psutil.Error:
            pass


@contextlib.contextmanager
def consumers(system: System, count: int,
              gated: bool = False) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`count` consumer processes (stderr to a temporary file); SIGTERM, then kill, on exit.
    `gated`: each waits, imported, for `release()`."""
    cmd, cwd = system.gated_cmd() if gated else system.consumer_cmd()
    with tempfile.TemporaryFile("w+") as logs:
        procs = [subprocess.Popen(cmd, cwd=cwd, env=system.env(),
                                  stdin=subprocess.PIPE if gated else subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=logs)
                 for _ in range(count)]
        try:
            yield procs
        except BaseException:
            logs.seek(0)
            tail = "\n".join(logs.read().strip().splitlines()[-15:])
            if tail:
                log(f"{system.name} consumers' stderr (tail):\n{tail}")
            raise
        finally:
            _signal_all(procs, signal.SIGCONT)
            for proc in procs:
                if proc.stdin is not None and not proc.stdin.closed:
                    with contextlib.suppress(OSError):
                        proc.stdin.close()  # a gated one that was never released exits
                if proc.poll() is None:
                    proc.terminate()
            deadline = time.monotonic() + 15
            for proc in procs:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)


def release(procs: list[subprocess.Popen[bytes]]) -> None:
    """Open the gate of every gated consumer, one after the other as fast as can be."""
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(b"g")
        proc.stdin.flush()
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.close()


def _check_alive(system: System, procs: list[subprocess.Popen[bytes]]) -> None:
    dead = [p.returncode for p in procs if p.poll() is not None]
    if dead:
        raise RuntimeError(f"{system.name}: a consumer exited (rc {dead})")


def wait_idle(system: System, conn: Any, procs: list[subprocess.Popen[bytes]],
              in_db: bool, timeout: float = 120) -> float:
    """Until every consumer's CPU has gone quiet (and, `in_db`, every one is up in the
    database); seconds."""
    started = time.monotonic()
    quiet = 0
    last = _tree_cpu(procs)
    while True:
        _check_alive(system, procs)
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"{system.name}: consumers not idle after {timeout:.0f}s")
        time.sleep(0.25)
        now = _tree_cpu(procs)
        busy = max(b - a for a, b in zip(last, now, strict=True))
        last = now
        up = not in_db or system.ready_count(conn) >= len(procs)
        quiet = quiet + 1 if up and busy < 0.01 else 0
        if quiet >= 2:
            return time.monotonic() - started


def wait_drained(system: System, conn: Any, procs: list[subprocess.Popen[bytes]], n: int,
                 timeout: float, wal: WalReader) -> tuple[float, int]:
    """Until N jobs have completed: (seconds by this clock, peak backends of the database).
    Steps `wal` on every half second."""
    started = time.monotonic()
    stepped = started
    peak = 0
    sql = (f"SELECT ({DONE_SQL[system.name]}), (SELECT count(*) FROM pg_stat_activity"
           " WHERE datname = current_database())")
    while True:
        done, backends = conn.execute(sql).fetchone()
        peak = max(peak, backends)
        if done >= n:
            return time.monotonic() - started, peak
        _check_alive(system, procs)
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"{system.name}: {done}/{n} done after {timeout:.0f}s")
        if time.monotonic() - stepped > 0.5:
            wal.step()
            stepped = time.monotonic()
        time.sleep(0.1)


def completions(system: System, conn: Any, n: int) -> dict[str, Any]:
    """Completion count and times from the database; raises unless exactly N, once each.

    `jobs_per_s` is (N - 1) / (last - first); `jobs_per_s_p10_p90` the rate between
    the 10th and 90th percentile completion times, which a batch flushed late at
    either end (PGQueuer's log buffer waits up to 0.1 s for its last < 10 jobs)
    does not move."""
    column, rows = COMPLETED[system.name]
    count, distinct, first, last, p10, p90 = conn.execute(
        f"SELECT count(*), count(DISTINCT {COMPLETED_ID[system.name]}), min({column}),"
        f" max({column}), percentile_cont(0.1) WITHIN GROUP (ORDER BY extract(epoch FROM"
        f" {column})), percentile_cont(0.9) WITHIN GROUP (ORDER BY extract(epoch FROM"
        f" {column})) FROM {rows}"
    ).fetchone()
    bad = conn.execute(NOT_ONCE_SQL[system.name]).fetchone()[0]
    if count != n or distinct != n or bad:
        raise RuntimeError(f"{system.name}: {count} completions of {distinct} distinct jobs "
                           f"(want {n} of {n}), {bad} not succeeded or run twice")
    span = (last - first).total_seconds()
    mid = float(p90) - float(p10)
    return {"completions": count, "span_s": span,
            "jobs_per_s": (n - 1) / span if span > 0 else float("inf"),
            "jobs_per_s_p10_p90": 0.8 * n / mid if mid > 0 else float("inf")}


def measure(system: System, c: int, n: int, start: str, timeout: float,
            wal: WalReader, analyze: bool = False,
            sampler: Sampler | None = None) -> dict[str, Any]:
    import psycopg

    system.install()
    with psycopg.connect(system.url, autocommit=True) as admin:
        counters = Counters(admin, (wal.pid,))
        result: dict[str, Any] = {"bench": "backlog", "system": system.name, "consumers": c,
                                  "n": n, "start": start, "concurrency": system.concurrency,
                                  "analyze": analyze}
        if start == "cold":
            before = _insert(system, admin, counters, n, result, wal, analyze)
            with consumers(system, c) as procs:
                # Cold: the consumers' start-up is in their CPU too.
                _drain(system, admin, counters, procs, n, timeout, before, result, wal, 0.0)
            return result
        with consumers(system, c, gated=start == "warm") as procs:
            result["startup_s"] = wait_idle(system, admin, procs, in_db=start == "frozen")
            if start == "frozen":
                _signal_all(procs, signal.SIGSTOP)
            before = _insert(system, admin, counters, n, result, wal, analyze)
            consumer_cpu = sum(_tree_cpu(procs))
            switches = _tree_switches(procs)
            if sampler is not None:
                sampler.start(f"bench_backlog_{system.name}")
            if start == "frozen":
                _signal_all(procs, signal.SIGCONT)
            else:
                release(procs)
            try:
                _drain(system, admin, counters, procs, n, timeout, before, result, wal,
                       consumer_cpu, switches)
            finally:
                if sampler is not None:
                    result.update(sampler.stop())
        return result


def _insert(system: System, admin: Any, counters: Counters, n: int,
            result: dict[str, Any], wal: WalReader, analyze: bool) -> dict[str, Any]:
    """Insert the backlog, check it is all there and waiting (and `analyze` the database);
    the counters after it."""
    result["enqueue_jobs_per_s"] = n / system.enqueue(n)
    waiting, total = admin.execute(WAITING_SQL[system.name]).fetchone()
    if waiting != n or total != n:
        raise RuntimeError(f"{system.name}: backlog has {waiting} waiting of {total}, want {n}")
    if analyze:
        admin.execute("ANALYZE")
    wal.hold()
    before = counters.read()
    wal.start(before["lsn"], f"bench_backlog_{system.name}")
    return before


def _drain(system: System, admin: Any, counters: Counters,
           procs: list[subprocess.Popen[bytes]], n: int, timeout: float,
           before: dict[str, Any], result: dict[str, Any], wal: WalReader,
           consumer_cpu: float, switches: tuple[int, int] = (0, 0)) -> None:
    """Until the consumers have done all N; the counters, checked completions (before
    the consumers are stopped). `consumer_cpu`, `switches`: the consumers' CPU seconds
    and context switches when released."""
    wall, peak = wait_drained(system, admin, procs, n, timeout, wal)
    result["consumer_cpu_ms_per_job"] = 1000.0 * (sum(_tree_cpu(procs)) - consumer_cpu) / n
    v0, i0 = switches
    v1, i1 = _tree_switches(procs)
    result["consumer_vcsw_per_job"] = (v1 - v0) / n
    result["consumer_ivcsw_per_job"] = (i1 - i0) / n
    after = counters.read()
    result.update(completions(system, admin, n))
    result.update(Counters.per_job(before, after, n))
    result.update(wal.totals(after["lsn"], n))
    result["wall_s"] = wall
    result["peak_backends"] = peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=10000, help="jobs in the backlog (10000)")
    p.add_argument("--consumers", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 4, 8], help="consumer processes, a list (1,4,8)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--systems", type=lambda s: s.split(","), default=list(SYSTEMS))
    p.add_argument("--concurrency", type=int, default=16,
                   help="pgworkflow's and Procrastinate's per-process concurrency (16)")
    p.add_argument("--pgq-batch-size", type=int, default=10,
                   help="PGQueuer's dequeue batch size (10, its default)")
    p.add_argument("--start", choices=["warm", "cold", "frozen"], default="warm",
                   help="how the consumers start (see the module's doc): warm")
    p.add_argument("--analyze", action="store_true",
                   help="analyse the bench database after the insert (see the module's doc)")
    p.add_argument("--procrastinate-n", type=int,
                   help="Procrastinate's backlog, when it should differ from --n (see the "
                        "module's doc)")
    p.add_argument("--timeout", type=float, default=240, help="seconds allowed per drain")
    p.add_argument("--sample", type=float, metavar="SECONDS",
                   help="sample runnable tasks and backend states every SECONDS during "
                        "each drain (not with --start cold; see `Sampler`)")
    args = p.parse_args()
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}")
    if args.concurrency < 1 or args.pgq_batch_size < 1:
        p.error("--concurrency and --pgq-batch-size must be at least 1")
    args.n_of = {name: args.n for name in SYSTEMS}
    if args.procrastinate_n is not None:
        args.n_of["procrastinate"] = args.procrastinate_n
    if min(args.n_of[name] for name in args.systems) < 2:
        p.error("a backlog needs at least 2 jobs")
    if args.sample is not None and (args.sample <= 0 or args.start == "cold"):
        p.error("--sample needs a positive interval and a warm or frozen start")
    systems = {name: System(name, args.concurrency, args.pgq_batch_size)
               for name in args.systems}
    names = list(args.systems)
    wal = WalReader()
    sampler = Sampler(args.sample) if args.sample is not None else None
    samples: dict[tuple[str, int], list[dict[str, Any]]] = {}
    began = time.monotonic()
    failures = 0
    k = 0
    for r in range(args.rounds):
        for c in args.consumers:
            order = names[k % len(names):] + names[:k % len(names)]
            k += 1
            for name in order:
                try:
                    res = measure(systems[name], c, args.n_of[name], args.start, args.timeout,
                                  wal, args.analyze, sampler)
                except Exception as e:
                    failures += 1
                    log(f"round {r + 1} C={c} {name}: FAILED: {e}")
                    continue
                res["round"] = r + 1
                samples.setdefault((name, c), []).append(res)
                log(f"round {r + 1} C={c} {name:<13} {res['jobs_per_s']:8.0f} jobs/s"
                    f" (p10-90 {res['jobs_per_s_p10_p90']:.0f})  "
                    f"xacts {res['write_xacts_per_job']:.2f}"
                    f" (own {_fmt(res['own_write_xacts_per_job'], 0, 2)})"
                    f"  WAL {res['wal_bytes_per_job']:.0f} B"
                    f" (own {_fmt(res['own_wal_bytes_per_job'], 0, 0)})"
                    f"  server CPU {res['server_cpu_ms_per_job']:.3f} ms"
                    f"  (db backends {res['db_backends_cpu_ms_per_job']:.3f} ms)"
                    f"  consumer CPU {res['consumer_cpu_ms_per_job']:.3f} ms"
                    f"  switches {res['consumer_vcsw_per_job']:.2f}"
                    f" + {res['consumer_ivcsw_per_job']:.2f}"
                    f"  enqueue {res['enqueue_jobs_per_s']:.0f}/s  wall {res['wall_s']:.2f}s"
                    f"  peak backends {res['peak_backends']}  [{time.monotonic() - began:.0f}s]")
                if sampler is not None:
                    log(f"  sampled {res['sample_count']}x: idle cores"
                        f" {res['sample_idle_cores']:.2f}, steal {res['sample_steal_cores']:.2f};"
                        f" runnable {res['sample_runnable_hist']}")
                    log("  backends: " + ", ".join(
                        f"{k} {v:.2f}" for k, v in res["sample_backends"].items()))
    report(samples, names, args)
    if failures:
        log(f"{failures} measurement(s) failed")
        sys.exit(1)


KEYS = ("jobs_per_s", "jobs_per_s_p10_p90", "write_xacts_per_job", "own_write_xacts_per_job",
        "wal_bytes_per_job", "own_wal_bytes_per_job", "server_cpu_ms_per_job",
        "db_backends_cpu_ms_per_job", "consumer_cpu_ms_per_job", "consumer_vcsw_per_job",
        "consumer_ivcsw_per_job", "enqueue_jobs_per_s", "span_s", "wall_s", "peak_backends")


def report(samples: dict[tuple[str, int], list[dict[str, Any]]], names: list[str],
           args: argparse.Namespace) -> None:
    medians: dict[tuple[str, int], dict[str, float]] = {}
    for (name, c), runs in samples.items():
        med = {key: _median([run[key] for run in runs]) for key in KEYS}
        medians[(name, c)] = med
        row: dict[str, Any] = {"bench": "backlog", "system": name, "consumers": c,
                               "n": args.n_of[name], "rounds": len(runs), "start": args.start,
                               "analyze": args.analyze,
                               "concurrency": args.concurrency,
                               "pgq_batch_size": args.pgq_batch_size, **med,
                               **{f"{key}_rounds": [run[key] for run in runs] for key in KEYS}}
        if name == "pgworkflow":
            for peer in names:
                if peer != "pgworkflow" and (peer, c) in samples:
                    row[f"pgworkflow/{peer}"] = _ratio(samples, peer, c)
                    row[f"pgworkflow/{peer}_rounds"] = [
                        a["jobs_per_s"] / b["jobs_per_s"]
                        for a in runs for b in samples[(peer, c)] if a["round"] == b["round"]]
        emit(row)
    others = "".join(f", {name} {args.n_of[name]}" for name in names
                     if args.n_of[name] != args.n)
    print(f"\nworker backlog: N={args.n}{others} one-task jobs inserted one commit each, "
          f"drained by C consumer processes (start: {args.start}"
          f"{', analysed' if args.analyze else ''}); medians of {args.rounds} round(s)")
    print(f"{'system':<14}{'C':>3}{'jobs/s':>8}{'p10-90':>8}{'xacts':>7}{'own':>6}{'WAL B':>8}"
          f"{'own':>7}{'srv CPU':>9}{'db CPU':>8}{'cons CPU':>9}{'switches':>13}{'enq/s':>7}"
          f"{'conns':>6}")
    for c in args.consumers:
        for name in names:
            m = medians.get((name, c))
            if m is None:
                continue
            print(f"{name:<14}{c:>3}{m['jobs_per_s']:>8.0f}{m['jobs_per_s_p10_p90']:>8.0f}"
                  f"{m['write_xacts_per_job']:>7.2f}"
                  f"{_fmt(m['own_write_xacts_per_job'], 6, 2)}{m['wal_bytes_per_job']:>8.0f}"
                  f"{_fmt(m['own_wal_bytes_per_job'], 7, 0)}{m['server_cpu_ms_per_job']:>9.3f}"
                  f"{m['db_backends_cpu_ms_per_job']:>8.3f}"
                  f"{m['consumer_cpu_ms_per_job']:>9.3f}"
                  f"{m['consumer_vcsw_per_job']:>7.2f}+{m['consumer_ivcsw_per_job']:<5.2f}"
                  f"{m['enqueue_jobs_per_s']:>7.0f}"
                  f"{m['peak_backends']:>6.0f}")
    print("  jobs/s: (N-1)/(last-first completion); p10-90: the rate between the 10th and"
          " 90th percentile completions")
    print("  per job over the drain: write transactions and WAL bytes (server-wide; own: this"
          " database's, from the WAL),\n  server CPU ms (every postgres process; db: this"
          " database's backends); cons CPU: the consumer processes' own CPU ms\n  (user+system,"
          " from their release to the drain's end; with --start cold, from their launch);\n"
          "  switches: the consumers' context switches a job, voluntary + involuntary, every"
          " live thread of theirs;"
          " enq/s: the one-commit-per-job insert;\n"
          "  conns: peak"
          " connections to the bench database")
    peers = [peer for peer in names if peer != "pgworkflow"]
    if "pgworkflow" in names and peers:
        print("\nthroughput ratio (median of per-round ratios)")
        print(f"{'C':>3}" + "".join(f"{'pgworkflow/' + peer:>28}" for peer in peers))
        for c in args.consumers:
            print(f"{c:>3}" + "".join(f"{_ratio(samples, peer, c):>28.2f}" for peer in peers))


def _median(values: list[Any]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _fmt(value: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def _ratio(samples: dict[tuple[str, int], list[dict[str, Any]]], peer: str, c: int) -> float:
    """Median over rounds of pgworkflow's jobs/s over the peer's (rounds both have)."""
    theirs = {run["round"]: run["jobs_per_s"] for run in samples.get((peer, c), [])}
    ratios = [run["jobs_per_s"] / theirs[run["round"]]
              for run in samples.get(("pgworkflow", c), []) if run["round"] in theirs]
    return statistics.median(ratios) if ratios else float("nan")

if __name__ == "__main__":
    main()
