"""`python -m workflow.worker`: usage errors, start-up failures and a clean stop (SPEC 6, 11).

Every start-up failure is exactly one line on stderr, no traceback: exit 2 for a
usage error, a bad `--app` included (no such module or attribute, a factory that
returns something else); 1 for an application whose own import or factory
raises, an unreachable database, an outdated schema or a thread that cannot start.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from helpers import Inp, Out, poll, registry
from pgbouncer import ENABLED as PGBOUNCER
from pgbouncer import worker_args
from worker_apps.harness import ROOT, WorkerProcess

import workflow
from workflow import worker
from workflow.store import SCHEMA_VERSION

APP = "tests.worker_apps.three_tasks:registry"
UNREACHABLE = "postgresql://postgres@127.0.0.1:1/postgres"


def run_worker(*args: str, env_url: str | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m workflow.worker ARGS` to completion, `$WORKFLOW_DATABASE_URL` = `env_url`."""
    env = {k: v for k, v in os.environ.items() if k != "WORKFLOW_DATABASE_URL"}
    if env_url is not None:
        env["WORKFLOW_DATABASE_URL"] = env_url
    return subprocess.run(
        [sys.executable, "-m", "workflow.worker", *args],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )


def one_line(proc: subprocess.CompletedProcess[str], code: int) -> str:
    """The single stderr line of a worker that exited with `code`."""
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert proc.stdout == ""
    return lines[0]


# --- Usage errors: exit 2 ------------------------------------------------------------


def test_without_app_exits_2() -> None:
    line = one_line(run_worker("--database-url", UNREACHABLE), 2)
    assert "--app" in line


@pytest.mark.parametrize(
    "spec",
    [
        "tests.worker_apps.three_tasks",
        "registry",
        ":registry",
        "tests.worker_apps.three_tasks:",
        "a b:c",
        "a:b:c",
    ],
)
def test_a_malformed_app_exits_2(spec: str) -> None:
    line = one_line(run_worker("--app", spec, "--database-url", UNREACHABLE), 2)
    assert "PACKAGE.MODULE:FACTORY" in line


def test_without_a_database_url_exits_2() -> None:
    line = one_line(run_worker("--app", APP), 2)
    assert "WORKFLOW_DATABASE_URL" in line


@pytest.mark.parametrize(
    "args",
    [
        ["--concurrency", "0"],
        ["--batch-size", "many"],
        ["--poll-interval", "-1"],
        ["--sweep-interval", "0"],
        ["--prune-interval", "0"],
        ["--keep-succeeded", "soon"],
        ["--keep-parked=-1d"],
        ["--keep-succeeded", "20000w"],
        ["--poll-interval", "1e300"],
        ["--keep-succeeded", "99999999999d"],
        ["--no-prune", "--keep-cancelled", "1d"],
        ["--no-prune", "--prune-interval", "60"],
        ["--unknown-flag"],
    ],
)
def test_bad_options_exit_2(args: list[str]) -> None:
    one_line(run_worker("--app", APP, "--database-url", UNREACHABLE, *args), 2)


def test_a_bogus_log_level_exits_2() -> None:
    line = one_line(
        run_worker("--app", APP, "--database-url", UNREACHABLE, "--log-level", "chatty"), 2
    )
    assert "chatty" in line


# --- A bad --app: exit 2; an application that fails to load: exit 1 -------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("tests.worker_apps.no_such_module:registry", "no module named"),
        ("no_such_package.apps:registry", "no module named 'no_such_package'"),
        ("tests.worker_apps.three_tasks:no_such_factory", "has no attribute 'no_such_factory'"),
        ("tests.worker_apps.bad:not_a_registry", "returned 42 (type int), not a workflow.Registry"),
        ("tests.worker_apps.bad:NOT_CALLABLE", "not a workflow.Registry"),
        ("tests.worker_apps.bad:app_with_a_bad_registry", "not a workflow.Registry"),
    ],
)
def test_a_bad_app_is_a_usage_error_one_line_and_exit_2(
    db_url: str, spec: str, expected: str
) -> None:
    line = one_line(run_worker("--app", spec, "--database-url", db_url), 2)
    assert expected in line
    assert line.startswith("workflow: --app ")


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("tests.worker_apps.bad:explodes", "RuntimeError: the factory could not read"),
        (
            "tests.worker_apps.broken_import:registry",
            "importing 'tests.worker_apps.broken_import' failed: ModuleNotFoundError: "
            "No module named 'a_dependency_that_is_not_installed'",
        ),
    ],
)
def test_an_app_whose_own_code_fails_is_one_line_and_exit_1(
    db_url: str, spec: str, expected: str
) -> None:
    line = one_line(run_worker("--app", spec, "--database-url", db_url), 1)
    assert expected in line
    assert line.startswith("workflow: --app ")


# --- The database: exit 1 ------------------------------------------------------------


def test_an_unreachable_database_is_one_line_and_exit_1() -> None:
    started = time.monotonic()
    line = one_line(run_worker("--app", APP, "--database-url", UNREACHABLE), 1)
    assert line.startswith("workflow: cannot connect to the database:")
    assert time.monotonic() - started < 20


def test_the_url_defaults_to_the_environment() -> None:
    line = one_line(run_worker("--app", APP, env_url=UNREACHABLE), 1)
    assert line.startswith("workflow: cannot connect to the database:")


def test_an_outdated_schema_is_one_line_naming_both_versions(empty_db_url: str) -> None:
    line = one_line(run_worker("--app", APP, "--database-url", empty_db_url), 1)
    assert f"at version 0, this code needs {SCHEMA_VERSION}" in line
    assert "python -m workflow migrate" in line


# --- Running and stopping ------------------------------------------------------------


@pytest.mark.parametrize(
    "level",
    [
        "debug",
        "DEBUG",
        pytest.param(
            "Warning",
            marks=pytest.mark.direct(
                reason="above INFO nothing is printed at start-up: its LISTEN shows it is up"
            ),
        ),
    ],
)
def test_log_level_takes_standard_names_in_any_case(
    db_url: str, engine_url: str, level: str
) -> None:
    worker = WorkerProcess(APP, engine_url, *worker_args("--log-level", level))
    try:
        if level.lower() == "debug":
            worker.wait_started()
        else:
            # Above INFO the start-up line is not shown: wait for the LISTEN instead.
            _wait_for_listener(db_url)
        worker.signal(signal.SIGTERM)
        assert worker.wait() == 0, worker.stderr
        assert "Traceback" not in worker.stderr
        if level.lower() != "debug":
            assert "worker started" not in worker.stderr
    finally:
        worker.kill()


def _wait_for_listener(db_url: str, timeout: float = 30.0) -> None:
    import psycopg

    deadline = time.monotonic() + timeout
    with psycopg.connect(db_url, autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND query = 'LISTEN workflow_runs'"
            ).fetchone()
            if row and row[0]:
                return
            time.sleep(0.05)
    raise AssertionError("the worker never LISTENed")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_an_idle_worker_with_exit_0(engine_url: str, signum: int) -> None:
    worker = WorkerProcess(APP, engine_url, *worker_args("--poll-interval", "30"))
    try:
        started = worker.wait_for_line("workflow: worker started")
        # Behind PgBouncer ($WORKFLOW_TEST_PGBOUNCER) the worker is poll-only.
        assert "concurrency=4" in started
        assert ("listen=off" if PGBOUNCER else "listen=on") in started
        assert " INFO " in started
        sent = time.monotonic()
        worker.signal(signum)
        assert worker.wait(timeout=15) == 0, worker.stderr
        assert time.monotonic() - sent < 5
        assert "worker draining" in worker.stderr
        assert worker.stderr.splitlines()[-1].endswith("workflow: worker stopped")
        assert "Traceback" not in worker.stderr
    finally:
        worker.kill()


def test_the_start_up_line_shows_the_options(engine_url: str) -> None:
    worker = WorkerProcess(
        APP,
        engine_url,
        "--concurrency",
        "7",
        "--batch-size",
        "3",
        "--poll-interval",
        "2.5",
        "--no-sweep",
        "--no-listen",
        "--no-prune",
    )
    try:
        started = worker.wait_for_line("workflow: worker started")
        for part in (
            "concurrency=7",
            "batch_size=3",
            "poll_interval=2.5s",
            "sweep=off",
            "prune=off",
            "listen=off",
            "Ledger.Three",
            f"pid={worker.pid}",
        ):
            assert part in started
        worker.signal(signal.SIGTERM)
        assert worker.wait() == 0, worker.stderr
    finally:
        worker.kill()


@pytest.mark.parametrize(
    "spec", ["tests.worker_apps.objects:REGISTRY", "tests.worker_apps.objects:APP"]
)
def test_app_may_name_a_registry_or_an_app_object(engine_url: str, spec: str) -> None:
    worker = WorkerProcess(spec, engine_url, *worker_args())
    try:
        assert "workflows=Ledger.Three" in worker.wait_for_line("workflow: worker started")
        worker.signal(signal.SIGTERM)
        assert worker.wait() == 0, worker.stderr
    finally:
        worker.kill()


def test_a_config_the_manager_refuses_is_one_line_and_exit_1(db_url: str) -> None:
    line = one_line(
        run_worker(
            "--app", "tests.worker_apps.bad:inconsistent_timeouts", "--database-url", db_url
        ),
        1,
    )
    assert line.startswith("workflow: cannot start the worker: ")
    assert "sweep_max_age" in line


@pytest.mark.parametrize(
    ("factory", "thread"),
    [
        ("no_thread_for_the_poller", "workflow-poller"),
        ("no_thread_for_the_heartbeat", "workflow-heartbeat"),
        ("no_thread_for_the_pool", "the connection pool"),
    ],
)
def test_a_thread_that_cannot_start_is_one_line_and_exit_1(
    db_url: str, factory: str, thread: str
) -> None:
    """A process out of threads (here: one thread refused by name) ends the worker with
    one line, not a traceback."""
    line = one_line(
        run_worker("--app", f"tests.worker_apps.bad:{factory}", "--database-url", db_url), 1
    )
    assert line == (
        f"workflow: cannot start the worker: {thread}: can't start new thread "
        "(is the process out of threads?)"
    )


def test_the_current_directory_is_importable_even_when_python_leaves_it_off_the_path() -> None:
    # -P (PYTHONSAFEPATH) arrived in 3.11; on 3.10, isolated mode (-I) leaves it off too.
    proc = subprocess.run(
        [
            sys.executable,
            "-P" if sys.version_info >= (3, 11) else "-I",
            "-m",
            "workflow.worker",
            "--app",
            "tests.worker_apps.bad:not_a_registry",
            "--database-url",
            UNREACHABLE,
        ],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "returned 42" in one_line(proc, 2)


def test_handling_signals_off_the_main_thread_raises_and_leaves_no_descriptor_open() -> None:
    from workflow import worker

    def open_fds() -> set[str]:
        """The pipes this process has open (other tests' sockets come and go)."""
        found = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:  # the listing's own descriptor, closed by now
                continue
            if target.startswith("pipe:"):
                found.add(f"{fd} {target}")
        return found

    before = open_fds()
    handler = signal.getsignal(signal.SIGTERM)
    errors: list[BaseException] = []

    def install() -> None:
        try:
            with worker.handling_signals():
                pass
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=install)
    thread.start()
    thread.join()
    [error] = errors
    assert isinstance(error, ValueError) and "main thread" in str(error)
    assert open_fds() - before == set()
    assert signal.getsignal(signal.SIGTERM) is handler


def test_an_uninstall_cut_short_leaves_no_wakeup_fd_pointing_at_a_closed_pipe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A second Ctrl-C while the handlers are put back: the wake-up fd Python writes
    # every signal to must be the previous one again before the pipe is closed, or a
    # later signal writes into whatever reuses that descriptor number.
    from workflow import worker

    before = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(before)
    signals = worker.Signals()
    signals.install()
    real_signal = signal.signal

    def interrupted(signum: int, handler: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(signal, "signal", interrupted)
    with pytest.raises(KeyboardInterrupt):
        signals.uninstall()
    monkeypatch.undo()
    try:
        assert signal.set_wakeup_fd(before) == before
    finally:
        for signum, handler in signals._previous.items():
            real_signal(signum, handler)


def test_uninstall_after_the_previous_wakeup_fd_was_closed_still_closes_its_pipe() -> None:
    # Another library's wake-up fd, closed while the worker ran: putting it back fails,
    # and the uninstall must still leave no handler of ours and no pipe of ours open.
    from workflow import worker

    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    before = signal.set_wakeup_fd(write_fd)
    handler = signal.getsignal(signal.SIGTERM)
    signals = worker.Signals()
    signals.install()
    ours = {signals._read_fd, signals._write_fd}
    os.close(read_fd)
    os.close(write_fd)
    try:
        signals.uninstall()
        assert signal.getsignal(signal.SIGTERM) is handler
        for fd in ours:
            with pytest.raises(OSError):
                os.fstat(fd)
    finally:
        signal.set_wakeup_fd(before)


# --- Pruning: the App's runner settings and the flags over them ----------------------


def _finished_long_ago(make_manager: Any, pool: Any, db: Any) -> list[str]:
    """Two succeeded runs and a cancelled one, all finished 400 days ago; the succeeded
    ones' ids. Their workflow is not the worker's: pruning goes by status alone."""
    reg, wf = registry(workflow.handle(workflow.Task("a", Out), lambda run: Out("done")))
    mgr = make_manager(reg)
    done = [wf.start(mgr, Inp(n)) for n in range(2)]
    assert all(run.wait(timeout=10) is workflow.Status.SUCCEEDED for run in done)
    with db.transaction():
        waiting = wf.start_tx(db, mgr, Inp(9))
    assert workflow.Admin(pool).cancel(waiting.id).status is workflow.Status.CANCELLED
    db.execute("UPDATE workflow_runs SET finished_at = now() - interval '400 days'")
    return sorted(run.id for run in done)


def _until_the_cancelled_run_is_pruned(app: str, engine_url: str, db: Any, *args: str) -> str:
    """Run a worker of `app` with `args` until no cancelled run is left (its first prune
    is made as it starts), then stop it; its start-up line."""
    proc = WorkerProcess(app, engine_url, *worker_args(*args))
    try:
        started = proc.wait_for_line("workflow: worker started")
        poll(db, "SELECT NOT EXISTS (SELECT FROM workflow_runs WHERE status = 'cancelled')")
        proc.signal(signal.SIGTERM)
        assert proc.wait() == 0, proc.stderr
    finally:
        proc.kill()
    return started


def _left(db: Any) -> list[tuple[str, str]]:
    rows = db.execute("SELECT id::text, status FROM workflow_runs ORDER BY id").fetchall()
    return [(run_id, status) for run_id, status in rows]


def test_keep_succeeded_forever_keeps_what_the_default_would_prune(
    engine_url: str, make_manager: Any, pool: Any, db: Any
) -> None:
    """Without the flag a succeeded run goes after 7 days. With `forever` the worker
    keeps both, and its first prune (made as it starts) still deletes the cancelled run
    past its default 30 days: the pass ran, and it kept the succeeded ones."""
    succeeded = _finished_long_ago(make_manager, pool, db)
    started = _until_the_cancelled_run_is_pruned(
        APP, engine_url, db, "--keep-succeeded", "forever"
    )
    assert "prune=every 300s (succeeded forever, cancelled 30d, parked forever)" in started
    assert _left(db) == [(run_id, "succeeded") for run_id in succeeded]


def test_the_apps_runner_settings_apply_and_a_flag_overrides_the_field_it_names(
    engine_url: str, make_manager: Any, pool: Any, db: Any
) -> None:
    """`objects:KEEPING` keeps succeeded and cancelled runs forever and runs 5 at once;
    `--keep-cancelled 1d` replaces its cancelled retention alone."""
    succeeded = _finished_long_ago(make_manager, pool, db)
    started = _until_the_cancelled_run_is_pruned(
        "tests.worker_apps.objects:KEEPING", engine_url, db, "--keep-cancelled", "1d"
    )
    assert "concurrency=5" in started
    assert "prune=every 300s (succeeded forever, cancelled 1d, parked forever)" in started
    assert _left(db) == [(run_id, "succeeded") for run_id in succeeded]


@pytest.mark.parametrize(
    ("args", "prune_enabled", "interval", "retention"),
    [
        ([], None, None, None),
        (["--no-prune"], False, None, None),
        (["--prune-interval", "60"], None, 60.0, None),
        (
            ["--keep-succeeded", "2w", "--keep-parked", "90d"],
            None,
            None,
            workflow.Retention(
                succeeded=datetime.timedelta(weeks=2),
                cancelled=datetime.timedelta(days=30),
                parked=datetime.timedelta(days=90),
            ),
        ),
        (
            ["--keep-cancelled", "FOREVER"],
            None,
            None,
            workflow.Retention(cancelled=None),
        ),
    ],
    ids=["none", "no-prune", "interval", "ages", "forever"],
)
def test_the_pruning_flags_set_the_runners_fields_and_leave_the_others(
    args: list[str],
    prune_enabled: bool | None,
    interval: float | None,
    retention: workflow.Retention | None,
) -> None:
    options = worker._parser().parse_args(["--app", APP, *args])
    config = worker._runner_config(options, None)
    assert config == workflow.RunnerConfig(
        prune_enabled=prune_enabled, prune_interval=interval, retention=retention
    )


def test_the_flags_replace_the_apps_fields_and_keep_the_rest() -> None:
    base = workflow.RunnerConfig(
        concurrency=5,
        sweep_enabled=False,
        listen=False,
        retention=workflow.Retention(succeeded=None, cancelled=None),
    )
    options = worker._parser().parse_args(
        ["--app", APP, "--concurrency", "7", "--keep-cancelled", "1d"]
    )
    assert worker._runner_config(options, base) == workflow.RunnerConfig(
        concurrency=7,
        sweep_enabled=False,
        listen=False,
        retention=workflow.Retention(succeeded=None, cancelled=datetime.timedelta(days=1)),
    )


def test_no_prune_leaves_the_runnable_without_a_pruner(make_manager: Any) -> None:
    reg, _ = registry(workflow.handle(workflow.Task("a", Out), lambda run: Out("done")))
    mgr = make_manager(reg)
    assert mgr.new_runnable(workflow.RunnerConfig(prune_enabled=False)).pruner is None
    assert mgr.new_runnable(workflow.RunnerConfig()).pruner is not None


def test_an_app_whose_runner_is_not_a_runner_config_is_refused() -> None:
    reg, _ = registry(workflow.handle(workflow.Task("a", Out), lambda run: Out("")))
    with pytest.raises(TypeError, match="runner"):
        workflow.App(reg, runner={"concurrency": 5})  # type: ignore[arg-type]


def test_options_given_as_strings_by_call_command_are_read_as_the_flags_are() -> None:
    """Django's `call_command("workflow_worker", keep_succeeded="2w")` hands options over
    unconverted: an age is still read as `--keep-succeeded 2w` reads it, and a bad one
    is a usage error."""
    options = worker._parser().parse_args(["--app", APP])
    options.keep_succeeded = "2w"
    assert worker._runner_config(options, None) == workflow.RunnerConfig(
        retention=workflow.Retention(succeeded=datetime.timedelta(weeks=2))
    )
    options.keep_succeeded = "soon"
    with pytest.raises(worker.UsageError, match="--help"):
        worker._runner_config(options, None)
