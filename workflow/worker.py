"""`python -m workflow.worker`: one worker process draining runs left in the tables.

    python -m workflow.worker --app PACKAGE.MODULE:FACTORY [--database-url URL]
        [--concurrency N] [--batch-size N] [--poll-interval S] [--no-sweep]
        [--sweep-interval S] [--no-listen] [--no-prune] [--prune-interval S]
        [--keep-succeeded AGE] [--keep-cancelled AGE] [--keep-parked AGE]
        [--log-level LEVEL] [--metrics-port PORT [--metrics-host HOST]]

`FACTORY` is a callable returning a `workflow.Registry` or a `workflow.App`
(registry, config, logger, runner), or such an object itself
(`workflow.app.load_app`). It is imported and called here, in the worker process,
after the current directory is put on `sys.path`. The URL defaults to
`$WORKFLOW_DATABASE_URL`.

The runnable's settings are the App's `runner` (a `RunnerConfig`; every default
without one), with each flag given replacing the field it names. The worker prunes
finished runs by default (`workflow.Retention`: succeeded after 7 days, cancelled
after 30, parked kept): `--keep-succeeded`, `--keep-cancelled` and `--keep-parked`
take an age (`90s`, `30m`, `24h`, `7d`, `2w`) or `forever`, and `--no-prune` turns
pruning off in this worker. A `--no-...` flag turns off what the runner turned on;
nothing here turns on what the runner turned off.

The worker builds a `Manager` over a pool of its own and runs one `Runnable` until
SIGTERM or SIGINT, which drains it (runnable.py says what a drain does) and exits
0; a second signal exits at once. Exit codes: 0 after a drain; 2 for a usage
error, a bad `--app` included (no such module or attribute, or a factory that
returns something else); 1 for the rest (the application's import or factory
raising, an unreachable database, an outdated schema, a thread that cannot
start). Each failure is exactly one line on stderr, no traceback.

`--metrics-port` serves Prometheus metrics (`workflow.metrics`, the `metrics`
extra) at `http://HOST:PORT/metrics`, on 127.0.0.1 unless `--metrics-host` says
otherwise (`0.0.0.0` in a container whose port is scraped from outside); port 0
takes a free port, named in the log line "metrics at ...".

`--no-listen` (or an App's runner with `listen=False`) is for a transaction-mode
pooler (PgBouncer): it also turns off psycopg's server-side prepared statements
(`prepare_threshold=None`), which PgBouncer before 1.21 cannot carry from one
server connection to the next.

Another command can wrap this one (Django's `manage.py workflow_worker` does):
`add_arguments(parser)` adds these options to its parser, and `serve(options,
signals)` runs the worker inside `handling_signals()`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import os
import select
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

import attrs
import psycopg

from workflow._cli import (
    CommandFailed,
    Parser,
    UsageError,
    add_database_url,
    database_url,
    parse_span,
    run,
)
from workflow.app import App, AppFailed, AppNotFound, load_app, parse_spec
from workflow.config import Config, RunnerConfig, RunnerSettings, Settings
from workflow.durations import seconds
from workflow.errors import ConfigError, ThreadNotStarted, WorkflowError
from workflow.logs import ALERT, EngineLog
from workflow.manager import Manager
from workflow.store import SCHEMA_VERSION, SchemaOutdated, schema_version
from workflow.store.connections import connect_explained, make_pool, one_line, open_pool

__all__ = [
    "CommandFailed",
    "Signals",
    "UsageError",
    "add_arguments",
    "handling_signals",
    "main",
    "serve",
]

PROG = "python -m workflow.worker"

LOG_FORMAT = "%(asctime)s %(levelname)s [%(name)s] %(message)s"
LOG_LEVELS = {
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARNING": logging.WARNING,
    "WARN": logging.WARNING,
    "ERROR": logging.ERROR,
    "CRITICAL": logging.CRITICAL,
    "FATAL": logging.CRITICAL,
    "ALERT": ALERT,
}


# The command line.


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


_UNSET: Any = object()
"""A `--keep-*` flag not given (None is `forever`)."""


def _retention_age(text: str) -> datetime.timedelta | None:
    """An age as `parse_span` reads it, or None for `forever`."""
    if text.strip().lower() == "forever":
        return None
    return parse_span(text)


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port from 0 to 65535, got {value}")
    return value


def _log_level(text: str) -> int:
    level = LOG_LEVELS.get(text.strip().upper())
    if level is None:
        names = ", ".join(name.lower() for name in LOG_LEVELS)
        raise argparse.ArgumentTypeError(f"unknown level {text!r} (one of {names})")
    return level


def _app_spec(text: str) -> str:
    try:
        parse_spec(text)
    except AppNotFound as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip()


def add_arguments(
    parser: argparse.ArgumentParser,
    *,
    app_help: str | None = None,
    app_required: bool = True,
    database_url_help: str | None = None,
) -> None:
    """Add the worker's options to `parser` (another command that wraps this one uses it).

    `app_required=False` and the helps let the wrapper supply its own defaults
    for `--app` and `--database-url`.
    """
    parser.add_argument(
        "--app",
        required=app_required,
        type=_app_spec,
        metavar="PACKAGE.MODULE:FACTORY",
        help=app_help
        or "a callable returning a workflow.Registry or workflow.App (or such an object)",
    )
    add_database_url(parser, database_url_help)
    parser.add_argument(
        "--concurrency", type=_positive_int, metavar="N", help="runs executed at once (4)"
    )
    parser.add_argument(
        "--batch-size", type=_positive_int, metavar="N", help="runs claimed per query (10)"
    )
    parser.add_argument(
        "--poll-interval",
        type=_positive_seconds,
        metavar="S",
        help="seconds between polls when idle (30)",
    )
    parser.add_argument(
        "--no-sweep",
        dest="sweep",
        action="store_false",
        help="do not release stale claims (another worker must)",
    )
    parser.add_argument(
        "--sweep-interval",
        type=_positive_seconds,
        metavar="S",
        help="seconds between sweeps of stale claims (60)",
    )
    parser.add_argument(
        "--no-listen",
        dest="listen",
        action="store_false",
        help=(
            "poll only, no LISTEN, no server-side prepared statements (behind a "
            "transaction-mode pooler such as PgBouncer)"
        ),
    )
    parser.add_argument(
        "--no-prune",
        dest="prune",
        action="store_false",
        default=None,
        help="do not delete finished runs past their retention (another worker, or "
        "`python -m workflow prune`, must)",
    )
    parser.add_argument(
        "--prune-interval",
        type=_positive_seconds,
        metavar="S",
        help="seconds between prunes of finished runs (300)",
    )
    for status, default in (("succeeded", "7d"), ("cancelled", "30d"), ("parked", "forever")):
        parser.add_argument(
            f"--keep-{status}",
            type=_retention_age,
            default=_UNSET,
            metavar="AGE",
            help=f"how long a {status} run is kept before it is pruned: 90s, 30m, 24h, 7d, "
            f"2w or forever ({default})",
        )
    parser.add_argument(
        "--log-level",
        type=_log_level,
        metavar="LEVEL",
        help="debug, info, warning, error, critical or alert, any case (info)",
    )
    parser.add_argument(
        "--metrics-port",
        type=_port,
        metavar="PORT",
        help="serve Prometheus metrics at /metrics on this port (0: any free port; "
        "needs pgworkflow[metrics])",
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="HOST",
        help="the address the metrics port binds (127.0.0.1; 0.0.0.0 for every interface)",
    )


def _parser() -> Parser:
    parser = Parser(
        prog=PROG,
        description=(
            "Run one pgworkflow worker: claim runs left in the tables, execute them, sweep "
            "stale claims, prune old finished runs. Each flag replaces the setting it names "
            "in the app's runner (a workflow.App's RunnerConfig), whose defaults are shown. "
            "SIGTERM or SIGINT drains and exits 0; a second signal exits at once."
        ),
    )
    add_arguments(parser)
    return parser


def _configure_logging(level: int | None) -> None:
    """Log to stderr for a terminal, unless the application configured logging itself."""
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        root.addHandler(handler)
        root.setLevel(logging.INFO if level is None else level)
    elif level is not None:
        root.setLevel(level)


# The database.


def _check_database(url: str) -> None:
    """Connect once and compare schema versions; `CommandFailed` with one clear line otherwise.

    The manager's pool would retry an unreachable server for its whole open
    timeout; one plain connection fails at once with the server's own reason.
    """
    try:
        with connect_explained(url) as conn:
            found = schema_version(conn)
    except WorkflowError as exc:
        raise CommandFailed(str(exc)) from None
    except psycopg.Error as exc:
        raise CommandFailed(f"workflow: cannot read the schema version: {one_line(exc)}") from None
    if found < SCHEMA_VERSION:
        raise CommandFailed(one_line(SchemaOutdated(found, SCHEMA_VERSION)))


# Signals.


class Signals:
    """SIGTERM and SIGINT: the first asks for a drain, a second exits at once.

    The handler only records the signal: Python wakes the main thread through a
    wake-up pipe, so `wait()` never takes a lock a handler could also want.
    """

    HANDLED = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: int | None = None
        self._installed = False
        self._previous: dict[int, Any] = {}
        self._read_fd = -1
        self._write_fd = -1
        self._previous_wakeup_fd = -1
        self._wakeup_set = False

    def install(self) -> None:
        """Install the handlers. Raises `ValueError` off the main thread (Python
        handles signals only there), having changed nothing."""
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("Signals.install() must be called from the main thread")
        self._read_fd, self._write_fd = os.pipe()
        self._installed = True
        try:
            os.set_blocking(self._write_fd, False)
            self._previous_wakeup_fd = signal.set_wakeup_fd(self._write_fd)
            self._wakeup_set = True
            for signum in self.HANDLED:
                self._previous[signum] = signal.signal(signum, self._handle)
        except BaseException:
            self.uninstall()
            raise

    def uninstall(self) -> None:
        """Restore the previous handlers and close the pipe."""
        if not self._installed:
            return
        self._installed = False
        if self._wakeup_set:
            # First: Python writes every signal to this fd, so the pipe is closed only
            # once it no longer does (a signal meanwhile still runs our handler).
            try:
                signal.set_wakeup_fd(self._previous_wakeup_fd)
            except (OSError, ValueError):  # the previous one was closed meanwhile
                signal.set_wakeup_fd(-1)
            self._wakeup_set = False
        try:
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)
            self._previous.clear()
        finally:
            os.close(self._read_fd)
            os.close(self._write_fd)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            name = signal.Signals(signum).name
            os.write(2, f"workflow: worker: second signal ({name}): exiting at once\n".encode())
            os._exit(130 if signum == signal.SIGINT else 1)
        self.received = signum

    def wait(self) -> str:
        """Block until the first SIGTERM or SIGINT; its name."""
        while self.received is None:
            # The timeout only bounds the (unlikely) case where the pipe wakes this
            # thread before the Python-level handler has run.
            ready, _, _ = select.select([self._read_fd], [], [], 1.0)
            if ready:
                os.read(self._read_fd, 64)
        return signal.Signals(self.received).name


@contextlib.contextmanager
def handling_signals() -> Iterator[Signals]:
    """SIGTERM and SIGINT handled for the block (`Signals`); call it in the main thread."""
    signals = Signals()
    signals.install()
    try:
        yield signals
    finally:
        signals.uninstall()


# The worker.


def _runner_config(options: argparse.Namespace, base: RunnerConfig | None) -> RunnerConfig:
    """`base` (the App's `runner`, or every default) with each flag given in its place.

    A `--no-...` flag turns off what `base` turned on; nothing here turns on what
    `base` turned off. `UsageError` for pruning settings beside `--no-prune`, and for
    settings `RunnerConfig` refuses (an age longer than a duration may be)."""
    config = base or RunnerConfig()
    try:
        kept = {
            status: _retention_age(age) if isinstance(age, str) else age  # call_command's
            for status in ("succeeded", "cancelled", "parked")
            if (age := getattr(options, f"keep_{status}")) is not _UNSET
        }
    except argparse.ArgumentTypeError as exc:
        raise UsageError(f"{PROG}: {exc} (see --help)") from None
    if options.prune is False and (kept or options.prune_interval is not None):
        raise UsageError(
            f"{PROG}: --no-prune turns pruning off: --prune-interval and --keep-... "
            "would do nothing (see --help)"
        )
    given = {
        "poll_interval": options.poll_interval,
        "batch_size": options.batch_size,
        "concurrency": options.concurrency,
        "sweep_interval": options.sweep_interval,
        "prune_interval": options.prune_interval,
        # The --no-... flags: False when given, else left to `base`.
        "sweep_enabled": False if options.sweep is False else None,
        "listen": False if options.listen is False else None,
        "prune_enabled": False if options.prune is False else None,
    }
    try:
        if kept:
            given["retention"] = attrs.evolve(RunnerSettings.of(config).retention, **kept)
        return attrs.evolve(config, **{k: v for k, v in given.items() if v is not None})
    except ConfigError as exc:
        raise UsageError(f"{PROG}: {exc} (see --help)") from None


def _age(value: object) -> str:
    """A retention age as the start-up line shows it: `7d`, `36h`, `90s`, or `forever`."""
    if value is None:
        return "forever"
    age = seconds(value, "age")  # a Duration: Retention checked it
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if age >= size and age % size == 0:
            return f"{age / size:.0f}{unit}"
    return f"{age:.0f}s" if age >= 1000 else f"{age:g}s"


def _describe(config: RunnerConfig, app: App) -> str:
    s = RunnerSettings.of(config)
    sweep = f"every {s.sweep_interval:g}s" if s.sweep_enabled else "off"
    kept = s.retention
    prune = (
        f"every {s.prune_interval:g}s (succeeded {_age(kept.succeeded)}, cancelled "
        f"{_age(kept.cancelled)}, parked {_age(kept.parked)})"
        if s.prune_enabled
        else "off"
    )
    return (
        f"concurrency={s.concurrency}, batch_size={s.batch_size}, "
        f"poll_interval={s.poll_interval:g}s, sweep={sweep}, prune={prune}, "
        f"listen={'on' if s.listen else 'off'}, pid={os.getpid()}, "
        f"workflows={', '.join(app.registry.names())}"
    )


def _load(spec: str) -> App:
    try:
        return load_app(spec)
    except AppNotFound as exc:
        raise UsageError(str(exc)) from None
    except AppFailed as exc:
        raise CommandFailed(str(exc)) from None


class _Metrics:
    """The worker's `/metrics` port: the manager's metrics in prometheus_client's global
    registry (beside its process and platform collectors), served on a thread."""

    def __init__(self, manager: Manager, host: str, port: int) -> None:
        try:
            from workflow import metrics

            self._instrumentation = metrics.instrument(manager)
        except ImportError as exc:
            raise CommandFailed(f"workflow: --metrics-port: {exc}") from None
        try:
            self._server, _ = metrics.serve(self._instrumentation.registry, port, host)
        except (OSError, RuntimeError) as exc:  # RuntimeError: its thread cannot start
            self._instrumentation.close()
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise CommandFailed(
                f"workflow: --metrics-port: cannot serve on {host}:{port}: {reason}"
            ) from None
        bound_host, bound_port = self._server.server_address[:2]
        self.url = f"http://{bound_host}:{bound_port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._instrumentation.close()


def _cannot_start(exc: BaseException) -> CommandFailed:
    """`exc` as the worker's one line."""
    text = str(exc)
    if not text.startswith("workflow: "):
        text = f"workflow: cannot start the worker: {text}"
    return CommandFailed(text)


def serve(options: argparse.Namespace, signals: Signals) -> int:
    """Run the worker the options of `add_arguments` describe, until `signals` get one.

    Loads the app, merges the flags over its runner settings, checks the database,
    builds a Manager over a pool of its own and runs one Runnable; on the first
    signal drains it and returns 0. Raises `UsageError` (exit 2: a bad `--app`, no
    database URL, runner settings that `RunnerConfig` refuses) and `CommandFailed`
    (exit 1: an application that fails to load, an unreachable database, an
    outdated schema, a config the manager refuses, a thread that cannot start),
    each one line.
    """
    url = database_url(options.database_url, PROG)
    app = options.app if isinstance(options.app, App) else _load(options.app)
    runner_config = _runner_config(options, app.runner)
    _configure_logging(options.log_level)
    _check_database(url)
    config = app.config or Config()
    # Without LISTEN the worker may be behind a transaction-mode pooler: no
    # server-side prepared statements either (whether the flag or the App said so).
    prepared = RunnerSettings.of(runner_config).listen
    pool = make_pool(url, max_size=Settings.of(config).pool_size, prepared=prepared)
    try:
        open_pool(pool, 30.0)
        manager = Manager(pool, app.registry, app.config, logger=app.logger)
    except (psycopg.Error, WorkflowError) as exc:  # a thread that cannot start included
        pool.close()
        raise _cannot_start(exc) from None
    log = EngineLog(manager.logger)
    exporter: _Metrics | None = None
    try:
        if options.metrics_port is not None:
            exporter = _Metrics(manager, options.metrics_host, options.metrics_port)
            log.info("metrics at %s", exporter.url)
        runnable = manager.new_runnable(runner_config)
        if signals.received is None:
            try:
                runnable.start()
            except ThreadNotStarted as exc:  # what had started is stopped
                raise _cannot_start(exc) from None
            log.info("worker started: %s", _describe(runner_config, app))
        name = signals.wait()
        log.info(
            "worker draining on %s: no new claims; in-flight attempts finish and are "
            "recorded, claims are released (send another signal to exit at once)",
            name,
        )
        runnable.stop()
    finally:
        if exporter is not None:
            exporter.close()
        manager.close()
        pool.close()
    log.info("worker stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the worker with `argv` (default: `sys.argv[1:]`); the exit code.

    Call it from the main thread: it blocks until SIGTERM or SIGINT, then drains
    and returns 0 (a second signal ends the process at once, with status 130
    after SIGINT, 1 after SIGTERM). Returns 2 for a usage error (a bad `--app`
    included), 1 for an application that fails to load, an unreachable database,
    an outdated schema or a thread that cannot start, each after one line on stderr.
    """
    if threading.current_thread() is not threading.main_thread():
        print(f"{PROG}: main() must run in the main thread (it handles signals)", file=sys.stderr)
        return 2
    with handling_signals() as signals:
        return run(lambda: serve(_parser().parse_args(argv), signals))


if __name__ == "__main__":
    sys.exit(main())
