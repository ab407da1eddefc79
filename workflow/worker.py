"""`python -m workflow.worker`: one worker process draining runs left in the tables.

    python -m workflow.worker --app PACKAGE.MODULE:FACTORY [--database-url URL]
        [--concurrency N] [--batch-size N] [--poll-interval S] [--no-sweep]
        [--sweep-interval S] [--no-listen] [--log-level LEVEL]

`FACTORY` is a callable returning a `workflow.Registry` or a `workflow.App`
(registry, config, logger), or such an object itself. It is imported and called
here, in the worker process, after the current directory is put on `sys.path`.
The URL defaults to `$WORKFLOW_DATABASE_URL`.

The worker builds a `Manager` over a pool of its own and runs one `Runnable` until
SIGTERM or SIGINT, which drains it (in-flight attempts finish and are recorded,
claims are released) and exits 0; a second signal exits at once. Exit codes: 0
after a drain; 2 for a usage error, a bad `--app` included (no such module or
attribute, or a factory that returns something else); 1 for the rest (the
application's import or factory raising, an unreachable database, an outdated
schema). Each failure is exactly one line on stderr, no traceback.

`--no-listen` is for a transaction-mode pooler (PgBouncer): it also turns off
psycopg's server-side prepared statements (`prepare_threshold=None`), which
PgBouncer before 1.21 cannot carry from one server connection to the next.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import re
import reprlib
import select
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from types import FrameType
from typing import Any, NoReturn

import psycopg
from psycopg_pool import ConnectionPool

from workflow.config import App, Config, RunnerConfig, RunnerSettings, Settings
from workflow.definition import Registry
from workflow.errors import WorkflowError
from workflow.logs import ALERT
from workflow.manager import Manager
from workflow.store import SCHEMA_VERSION, SchemaOutdated, schema_version
from workflow.store.connection import connect_explained, normalize_url

PROG = "python -m workflow.worker"
URL_ENV = "WORKFLOW_DATABASE_URL"

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

_APP_SPEC = re.compile(
    r"^(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<attr>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)$"
)


class _UsageError(Exception):
    """A bad command line: one line on stderr, exit code 2."""


class _Failure(Exception):
    """A failure the user can act on: one line on stderr, exit code 1."""


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors raised (and printed as one line) instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{self.prog}: {message} (see --help)")


def _one_line(text: object) -> str:
    """`text` with every run of whitespace (newlines included) made one space."""
    return " ".join(str(text).split())


def _where(exc: BaseException) -> str:
    """` (at FILE:LINE)` of the innermost frame `exc` was raised from, or ''."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    return f" (at {frames[-1].filename}:{frames[-1].lineno})"


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


def _log_level(text: str) -> int:
    level = LOG_LEVELS.get(text.strip().upper())
    if level is None:
        names = ", ".join(name.lower() for name in LOG_LEVELS)
        raise argparse.ArgumentTypeError(f"unknown level {text!r} (one of {names})")
    return level


def _app_spec(text: str) -> tuple[str, str]:
    match = _APP_SPEC.match(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not PACKAGE.MODULE:FACTORY (e.g. myapp.workflows:registry)"
        )
    return match["module"], match["attr"]


def _parser() -> _Parser:
    parser = _Parser(
        prog=PROG,
        description=(
            "Run one pgworkflow worker: claim runs left in the tables, execute them, sweep "
            "stale claims. SIGTERM or SIGINT drains and exits 0; a second signal exits at once."
        ),
    )
    parser.add_argument(
        "--app",
        required=True,
        type=_app_spec,
        metavar="PACKAGE.MODULE:FACTORY",
        help="a callable returning a workflow.Registry or workflow.App (or such an object)",
    )
    parser.add_argument(
        "--database-url", metavar="URL", help=f"a postgresql:// URL (default: ${URL_ENV})"
    )
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
        "--log-level",
        type=_log_level,
        metavar="LEVEL",
        help="debug, info, warning, error, critical or alert, any case (info)",
    )
    return parser


# The application.


def _import_app(module_name: str, attr: str) -> App:
    """Import `module_name`, resolve `attr`, call it if needed.

    `_UsageError` (exit 2) when the spec names nothing usable: no such module or
    attribute, or something that is not (and does not return) a Registry or an
    App. `_Failure` (exit 1) when the application's own code fails: its import
    raises, or its factory does.
    """
    spec = f"{module_name}:{attr}"
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise _UsageError(
                f"workflow: --app {spec}: no module named {missing!r} (run from the "
                "project's root directory or put it on PYTHONPATH)"
            ) from None
        raise _Failure(
            f"workflow: --app {spec}: importing {module_name!r} failed: "
            f"{type(exc).__name__}: {_one_line(exc)}{_where(exc)}"
        ) from None
    except Exception as exc:
        raise _Failure(
            f"workflow: --app {spec}: importing {module_name!r} failed: "
            f"{type(exc).__name__}: {_one_line(exc)}{_where(exc)}"
        ) from None
    target: Any = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise _UsageError(
                f"workflow: --app {spec}: module {module_name!r} has no attribute {attr!r}"
            ) from None
    if not isinstance(target, (Registry, App)):
        if not callable(target):
            raise _UsageError(
                f"workflow: --app {spec}: {attr} is {reprlib.repr(target)} (type "
                f"{type(target).__name__}), not a workflow.Registry, a workflow.App, or a "
                "callable returning one"
            )
        try:
            target = target()
        except Exception as exc:
            raise _Failure(
                f"workflow: --app {spec}: {attr}() raised {type(exc).__name__}: "
                f"{_one_line(exc)}{_where(exc)}"
            ) from None
        if not isinstance(target, (Registry, App)):
            raise _UsageError(
                f"workflow: --app {spec}: {attr}() returned {reprlib.repr(target)} "
                f"(type {type(target).__name__}), not a workflow.Registry or a workflow.App"
            )
    app = target if isinstance(target, App) else App(target)
    if not isinstance(app.registry, Registry):
        raise _UsageError(
            f"workflow: --app {spec}: the App's registry is a {type(app.registry).__name__}, "
            "not a workflow.Registry"
        )
    if app.config is not None and not isinstance(app.config, Config):
        raise _UsageError(
            f"workflow: --app {spec}: the App's config is a {type(app.config).__name__}, "
            "not a workflow.Config"
        )
    if app.logger is not None and not isinstance(app.logger, logging.Logger):
        raise _UsageError(
            f"workflow: --app {spec}: the App's logger is a {type(app.logger).__name__}, "
            "not a logging.Logger"
        )
    if not app.registry.names():
        raise _UsageError(f"workflow: --app {spec}: the registry has no workflows registered")
    return app


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


def _database_url(args: argparse.Namespace) -> str:
    url: str | None = args.database_url or os.environ.get(URL_ENV)
    if not url:
        raise _UsageError(f"{PROG}: no database URL: pass --database-url URL or set ${URL_ENV}")
    return normalize_url(url)


def _check_database(url: str) -> None:
    """Connect once and compare schema versions; `_Failure` with one clear line otherwise.

    The manager's pool would retry an unreachable server for its whole open
    timeout; one plain connection fails at once with the server's own reason.
    """
    try:
        with connect_explained(url) as conn:
            found = schema_version(conn)
    except WorkflowError as exc:
        raise _Failure(str(exc)) from None
    except psycopg.Error as exc:
        raise _Failure(f"workflow: cannot read the schema version: {_one_line(exc)}") from None
    if found < SCHEMA_VERSION:
        raise _Failure(_one_line(SchemaOutdated(found, SCHEMA_VERSION)))


def _pool(url: str, config: Config, listen: bool) -> ConnectionPool[Any]:
    """The manager's pool (not open yet), sized as `Manager(url)` sizes the pool it builds.

    Poll-only (`--no-listen`) means a transaction-mode pooler may sit in between:
    no server-side prepared statements then, since a statement prepared on one
    server connection is unknown on the next (or already taken there).
    """
    kwargs: dict[str, Any] = {"autocommit": True}
    if not listen:
        kwargs["prepare_threshold"] = None
    return ConnectionPool(
        url,
        min_size=1,
        max_size=Settings.of(config).pool_size,
        kwargs=kwargs,
        open=False,
        name="workflow",
    )


# Signals.


class _Signals:
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

    def install(self) -> None:
        """Install the handlers; the caller is the main thread."""
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._previous_wakeup_fd = signal.set_wakeup_fd(self._write_fd)
        for signum in self.HANDLED:
            self._previous[signum] = signal.signal(signum, self._handle)
        self._installed = True

    def uninstall(self) -> None:
        """Restore the previous handlers and close the pipe."""
        if not self._installed:
            return
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        os.close(self._read_fd)
        os.close(self._write_fd)
        self._installed = False

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
def _signals() -> Iterator[_Signals]:
    signals = _Signals()
    signals.install()
    try:
        yield signals
    finally:
        signals.uninstall()


# The worker.


def _runner_config(args: argparse.Namespace) -> RunnerConfig:
    return RunnerConfig(
        poll_interval=args.poll_interval,
        batch_size=args.batch_size,
        concurrency=args.concurrency,
        sweep_enabled=args.sweep,
        sweep_interval=args.sweep_interval,
        listen=args.listen,
    )


def _describe(config: RunnerConfig, app: App) -> str:
    s = RunnerSettings.of(config)
    sweep = f"every {s.sweep_interval:g}s" if s.sweep_enabled else "off"
    return (
        f"concurrency={s.concurrency}, batch_size={s.batch_size}, "
        f"poll_interval={s.poll_interval:g}s, sweep={sweep}, "
        f"listen={'on' if s.listen else 'off'}, pid={os.getpid()}, "
        f"workflows={', '.join(app.registry.names())}"
    )


def _serve(args: argparse.Namespace, signals: _Signals) -> int:
    url = _database_url(args)
    module_name, attr = args.app
    app = _import_app(module_name, attr)
    _configure_logging(args.log_level)
    _check_database(url)
    runner_config = _runner_config(args)
    pool = _pool(url, app.config or Config(), args.listen)
    try:
        pool.open(wait=True, timeout=30.0)
        manager = Manager(pool, app.registry, app.config, logger=app.logger)
    except (psycopg.Error, WorkflowError) as exc:
        pool.close()
        text = str(exc)
        if not text.startswith("workflow: "):
            text = f"workflow: cannot start the worker: {text}"
        raise _Failure(text) from None
    logger = manager.logger
    try:
        runnable = manager.new_runnable(runner_config)
        if signals.received is None:
            runnable.start()
            logger.info("workflow: worker started: %s", _describe(runner_config, app))
        name = signals.wait()
        logger.info(
            "workflow: worker draining on %s: no new claims; in-flight attempts finish and "
            "are recorded, claims are released (send another signal to exit at once)",
            name,
        )
        runnable.stop()
    finally:
        manager.close()
        pool.close()
    logger.info("workflow: worker stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the worker with `argv` (default: `sys.argv[1:]`); the exit code.

    Call it from the main thread: it blocks until SIGTERM or SIGINT, then drains
    and returns 0 (a second signal ends the process at once, with status 130
    after SIGINT, 1 after SIGTERM). Returns 2 for a usage error (a bad `--app`
    included), 1 for an application that fails to load, an unreachable database
    or an outdated schema, each after one line on stderr.
    """
    if threading.current_thread() is not threading.main_thread():
        print(f"{PROG}: main() must run in the main thread (it handles signals)", file=sys.stderr)
        return 2
    with _signals() as signals:
        try:
            args = _parser().parse_args(argv)
            return _serve(args, signals)
        except _UsageError as exc:
            print(_one_line(exc), file=sys.stderr)
            return 2
        except _Failure as exc:
            print(_one_line(exc), file=sys.stderr)
            return 1
        except SystemExit as exc:  # --help
            return exc.code if isinstance(exc.code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
