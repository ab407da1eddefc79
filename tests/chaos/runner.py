"""The chaos run: a private PostgreSQL, three workers, a starter, kills, a restart, lost replies.

1. Start a private PostgreSQL (`tests/privatepg.py`), create the `chaos` database,
   migrate it as the owner, add the test's own tables and triggers (`schema.py`).
   Put a `ReplyProxy` (`tests/replyproxy.py`) in front of it: the engine of every
   process talks to PostgreSQL through it, and it drops the reply of a random
   share of the engine's statements after the server committed them (and cuts
   that connection), as a failover or a cut network does. The handlers' ledger
   writes go straight to the server.
2. Start three `python -m workflow.worker --app tests.chaos.app:app` processes and
   the starter (`python -m tests.chaos.starter`), which starts runs continuously
   with `start_tx` and, for a share, `start()` on its own manager (whose fast path
   executes them in the starter). Each process's sessions carry its own
   `application_name`, so the claims trigger knows who set each claim.
3. For the load period, every 2-4 s SIGKILL a random worker and start a
   replacement at once; once, part-way, restart PostgreSQL (`pg_ctl restart -m
   fast`); every 1-3 s an operator (`workflow.Admin`, application name
   `chaos-operator`) cancels a random unfinished run, and resumes about half of
   the runs it cancelled a moment later. Each kill and the restart are recorded
   in `chaos_faults` (database clock). A worker that exits on its own after it
   had started is a crash; a replacement that fails to start (it may find the
   server down) is restarted.
4. SIGTERM the starter (it drains its manager and reports its counts), wait with a
   deadline until no run is unfinished, SIGTERM the workers (each must exit 0).
5. Run the checks (`checks.py`) and print one summary line.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import attrs
import psycopg

import workflow
from workflow.store import migrate

from . import app as chaos_app
from .checks import Report, check
from .ledger import URL_ENV
from .schema import TABLES

try:
    from tests.privatepg import PrivatePostgres, available
    from tests.replyproxy import ReplyProxy
except ImportError:  # imported as `chaos` by pytest, with tests/ on sys.path
    from privatepg import PrivatePostgres, available  # type: ignore[no-redef]
    from replyproxy import ReplyProxy  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.chaos.app:app"
STARTED = "workflow: worker started"
WORKERS = 3
WORKER_ARGS = (
    "--concurrency",
    "8",
    "--batch-size",
    "8",
    "--poll-interval",
    "1",
    "--sweep-interval",
    "1",
    "--log-level",
    "INFO",
)


@attrs.frozen
class Plan:
    """How long and how hard to shake."""

    load_seconds: float
    rate: float = 6.0
    kill_every: tuple[float, float] = (2.0, 4.0)
    restart_at: float = 0.45
    drain_timeout: float = 90.0
    seed: int = 0
    drop_probability: float = 0.01
    """The share of the engine's statements whose reply is lost after commit."""
    operate_every: tuple[float, float] = (1.0, 3.0)
    """Seconds between an operator's cancels (half of them resumed a moment later)."""

    @classmethod
    def short(cls, seed: int = 0) -> Plan:
        return cls(load_seconds=70.0, drain_timeout=60.0, seed=seed)

    @classmethod
    def long(cls, minutes: float, seed: int = 0) -> Plan:
        return cls(load_seconds=minutes * 60.0, drain_timeout=180.0, seed=seed)


@attrs.define
class Result:
    report: Report
    kills: int = 0
    restarts: int = 0
    crashes: int = 0
    replacement_failures: int = 0
    worker_exits: list[int | None] = attrs.field(factory=list)
    starter: dict[str, Any] = attrs.field(factory=dict)
    starter_exit: int | None = None
    drained: bool = False
    lost_replies: int = 0
    cut_transactions: int = 0
    cancels: int = 0
    resumes: int = 0
    seconds: float = 0.0
    logdir: Path | None = None
    problems: list[str] = attrs.field(factory=list)

    @property
    def ok(self) -> bool:
        return (
            not self.problems
            and self.report.violations == 0
            and self.report.runs > 0
            and self.kills > 0
            and self.restarts == 1
            and self.lost_replies > 0
        )

    def summary(self) -> str:
        r = self.report
        return (
            f"chaos summary: runs={r.runs} kills={self.kills} restarts={self.restarts} "
            f"lost_replies={self.lost_replies} cancels={self.cancels} resumes={self.resumes} "
            f"re-executions={r.re_executions} lost={r.lost} "
            f"overwritten={r.overwritten} miscounted={r.miscounted} "
            f"overlaps={r.overlaps} attempts_over={r.attempts_over} "
            f"stale_reads={r.stale_reads} crashes={self.crashes} "
            f"(executions={r.executions} sweeps={r.sweeps} injected_failures="
            f"{r.injected_failures} killed_mid_task={r.killed_executions} "
            f"stale_executions={r.stale_executions} fast_path_executions="
            f"{r.fast_path_executions} started_recorded={r.started_recorded} "
            f"failed_starts={self.starter.get('failed', '?')} "
            f"cut_transactions={self.cut_transactions} uncounted={r.uncounted} "
            f"phantom_attempts={r.phantom_attempts} double_counted={r.double_counted} "
            f"replacement_failures={self.replacement_failures} ticks={r.ticks} "
            f"ticks_missed={r.ticks_missed} keyed_runs={r.keyed_runs} key_holds={r.key_holds} "
            f"key_overlaps={r.key_overlaps} unheld_claims={r.unheld_claims} "
            f"seconds={self.seconds:.0f})"
        )


def _named(url: str, name: str) -> str:
    """`url` with the sessions' `application_name` set to `name`."""
    return f"{url}{'&' if '?' in url else '?'}application_name={name}"


class _Proc:
    """A subprocess with stdout and stderr in files of the run's log directory.

    `url` is where its handlers write the ledger (straight to the server); its
    engine's URL is in its arguments.
    """

    def __init__(self, name: str, argv: list[str], url: str, logdir: Path) -> None:
        self.name = name
        env = {k: v for k, v in os.environ.items() if k != "WORKFLOW_DATABASE_URL"}
        env[URL_ENV] = url
        env["PYTHONUNBUFFERED"] = "1"
        self.log = logdir / f"{name}.log"
        self.out = logdir / f"{name}.out"
        self._err: IO[str] = self.log.open("w")
        self._stdout: IO[str] = self.out.open("w")
        self.proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._stdout,
            stderr=self._err,
            text=True,
        )
        self.killed = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        self.killed = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self.close_files()

    def close_files(self) -> None:
        for f in (self._err, self._stdout):
            with contextlib.suppress(OSError):
                f.close()


def _worker(index: int, url: str, engine_url: str, logdir: Path) -> _Proc:
    name = f"worker-{index:03d}"
    argv = [
        sys.executable,
        "-m",
        "workflow.worker",
        "--app",
        APP,
        "--database-url",
        _named(engine_url, f"chaos-{name}"),
        *WORKER_ARGS,
    ]
    return _Proc(name, argv, url, logdir)


class _Operator:
    """A person at `python -m workflow runs`: cancels random unfinished runs, resumes some.

    Each action rides out the server restart (it is skipped when the server is
    down); a run it resumes must still reach a terminal status by the end.
    """

    def __init__(self, url: str, rng: random.Random) -> None:
        self._url = url
        self._rng = rng
        self._to_resume: list[str] = []
        self.cancels = 0
        self.resumes = 0

    def act(self) -> None:
        try:
            with workflow.Admin(self._url) as admin:
                for run_id in self._to_resume:
                    try:
                        admin.resume(run_id, reason="chaos: changed its mind", actor="chaos")
                        self.resumes += 1
                    except workflow.NotResumable:
                        pass
                self._to_resume = []
                page = admin.runs(status=["pending", "running"], limit=50)
                if not page.items:
                    return
                victim = self._rng.choice(page.items)
                status = admin.cancel(victim.id, reason="chaos: withdrawn", actor="chaos")
                if status.status is workflow.Status.CANCELLED:
                    self.cancels += 1
                    if self._rng.random() < 0.5:
                        self._to_resume.append(victim.id)
        except (psycopg.OperationalError, workflow.WorkflowError):
            pass  # the server is restarting: the next action goes on

    def finish(self) -> None:
        """Resume what was left to resume, so those runs too must finish."""
        deadline = time.monotonic() + 30
        while self._to_resume and time.monotonic() < deadline:
            self.act()


def _record_fault(url: str, sql: str, params: tuple[Any, ...]) -> None:
    """Write a `chaos_faults` row (straight to the server), riding out a restart."""
    deadline = time.monotonic() + 60
    while True:
        try:
            with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
                conn.execute(sql, params)
            return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.1)


def run_chaos(plan: Plan, *, say: Any = print, keep_logs: bool = False) -> Result:
    """Run the whole chaos scenario of `plan`; the result (checks included)."""
    reason = available()
    if reason is not None:
        raise RuntimeError(f"chaos needs a private PostgreSQL: {reason}")
    began = time.monotonic()
    rng = random.Random(plan.seed)
    logdir = Path(tempfile.mkdtemp(prefix="workflow-chaos-"))
    pg = PrivatePostgres(max_connections=300)
    proxy = ReplyProxy("127.0.0.1", pg.port)
    procs: list[_Proc] = []
    result = Result(report=Report(), logdir=logdir)
    try:
        pg.start()
        proxy.start()
        with psycopg.connect(pg.url(), autocommit=True) as admin:
            admin.execute("CREATE DATABASE chaos")
        url = pg.url("chaos")
        migrate(url)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(TABLES)
        engine_url = proxy.url_for(url)
        proxy.drop_randomly(
            plan.drop_probability, contains=["workflow_runs", "workflow_tasks"], seed=plan.seed
        )
        say(
            f"chaos: PostgreSQL on {pg.url()} (data {pg.base}), the engines through a proxy "
            f"on port {proxy.port} losing {plan.drop_probability:.1%} of replies, logs in {logdir}"
        )

        workers = [_worker(i, url, engine_url, logdir) for i in range(WORKERS)]
        procs.extend(workers)
        next_index = WORKERS
        _wait_for(lambda: all(STARTED in w.text() for w in workers), 60, "workers to start")
        starter = _Proc(
            "starter",
            [
                sys.executable,
                "-m",
                "tests.chaos.starter",
                "--database-url",
                _named(engine_url, "chaos-starter"),
                "--rate",
                str(plan.rate),
                "--seed",
                str(plan.seed),
            ],
            url,
            logdir,
        )
        procs.append(starter)

        operator = _Operator(_named(url, "chaos-operator"), rng)
        load_end = time.monotonic() + plan.load_seconds
        restart_at = time.monotonic() + plan.load_seconds * plan.restart_at
        next_kill = time.monotonic() + rng.uniform(*plan.kill_every)
        next_operation = time.monotonic() + rng.uniform(*plan.operate_every)
        while time.monotonic() < load_end:
            now = time.monotonic()
            if now >= next_operation:
                operator.act()
                next_operation = now + rng.uniform(*plan.operate_every)
            if result.restarts == 0 and now >= restart_at:
                say("chaos: restarting PostgreSQL (pg_ctl restart -m fast)")
                _record_fault(url, "INSERT INTO chaos_faults (kind) VALUES ('restart')", ())
                pg.restart()
                _record_fault(
                    url,
                    "UPDATE chaos_faults SET until_ = clock_timestamp() WHERE kind = 'restart'",
                    (),
                )
                result.restarts += 1
            if now >= next_kill:
                victim = rng.choice(workers)
                victim.kill()
                _record_fault(
                    url,
                    "INSERT INTO chaos_faults (kind, app) VALUES ('kill', %s)",
                    (f"chaos-{victim.name}",),
                )
                result.kills += 1
                workers[workers.index(victim)] = replacement = _worker(
                    next_index, url, engine_url, logdir
                )
                procs.append(replacement)
                next_index += 1
                next_kill = now + rng.uniform(*plan.kill_every)
            for i, w in enumerate(workers):
                code = w.proc.poll()
                if code is None:
                    continue
                if STARTED in w.text():
                    result.crashes += 1
                    result.problems.append(
                        f"{w.name} (pid {w.pid}) exited {code} on its own: see {w.log}"
                    )
                else:
                    result.replacement_failures += 1
                w.close_files()
                workers[i] = _worker(next_index, url, engine_url, logdir)
                procs.append(workers[i])
                next_index += 1
            if starter.proc.poll() is not None:
                result.problems.append(f"the starter exited early: see {starter.log}")
                break
            time.sleep(0.1)

        operator.finish()
        result.cancels, result.resumes = operator.cancels, operator.resumes
        say(f"chaos: load over after {time.monotonic() - began:.0f}s; stopping the starter")
        if starter.proc.poll() is None:
            _record_fault(
                url, "INSERT INTO chaos_faults (kind, app) VALUES ('stop', 'chaos-starter')", ()
            )
            starter.proc.send_signal(signal.SIGTERM)
        try:
            result.starter_exit = starter.proc.wait(60)
        except subprocess.TimeoutExpired:
            starter.kill()
            result.problems.append("the starter did not stop within 60s of SIGTERM")
        starter.close_files()
        with contextlib.suppress(OSError, ValueError):
            lines = starter.out.read_text().strip().splitlines()
            result.starter = json.loads(lines[-1]) if lines else {}
        if result.starter_exit not in (0, None):
            result.problems.append(f"the starter exited {result.starter_exit}: see {starter.log}")

        with psycopg.connect(url, autocommit=True) as conn:
            deadline = time.monotonic() + plan.drain_timeout
            while True:
                row = conn.execute(
                    "SELECT count(*) FROM workflow_runs WHERE finished_at IS NULL"
                ).fetchone()
                if row is not None and row[0] == 0:
                    result.drained = True
                    break
                if time.monotonic() > deadline:
                    result.problems.append(
                        f"{row[0] if row else '?'} runs unfinished {plan.drain_timeout:g}s "
                        "after the starter stopped"
                    )
                    break
                time.sleep(0.25)
            say(f"chaos: drained={result.drained}; stopping the workers")
            # A worker spawned to replace a killed one may still be importing: a SIGTERM
            # then meets Python's default action (exit -15), not the worker's drain, which
            # begins with its handlers installed, before it logs STARTED.
            ready_by = time.monotonic() + 60
            for w in workers:
                while (w.proc.poll() is None and STARTED not in w.text()
                       and time.monotonic() < ready_by):
                    time.sleep(0.1)
            for w in workers:
                if w.proc.poll() is None:
                    conn.execute(
                        "INSERT INTO chaos_faults (kind, app) VALUES ('stop', %s)",
                        (f"chaos-{w.name}",),
                    )
                    w.proc.send_signal(signal.SIGTERM)
            for w in workers:
                try:
                    result.worker_exits.append(w.proc.wait(60))
                except subprocess.TimeoutExpired:
                    w.kill()
                    result.worker_exits.append(None)
                w.close_files()
                if result.worker_exits[-1] != 0:
                    result.problems.append(
                        f"{w.name} exited {result.worker_exits[-1]} after SIGTERM: see {w.log}"
                    )
            result.lost_replies = proxy.dropped
            result.cut_transactions = proxy.dropped_in_transaction
            result.report = check(
                conn, chaos_app.MAX_ATTEMPTS, starter.pid, chaos_app.CONFIG_SWEEP_MAX_AGE
            )
        result.seconds = time.monotonic() - began
        return result
    finally:
        for p in procs:
            if p.proc.poll() is None:
                with contextlib.suppress(Exception):
                    p.kill()
            p.close_files()
        proxy.stop()
        if not result.ok:
            tail = pg.log_tail(40)
            (logdir / "postgres.log").write_text(tail)
        pg.cleanup()
        if result.ok and not keep_logs:
            shutil.rmtree(logdir, ignore_errors=True)
