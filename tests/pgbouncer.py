"""The engine suite behind PgBouncer in transaction mode (SPEC section 6).

`WORKFLOW_TEST_PGBOUNCER=1` turns the mode on. The session fixture in
`conftest.py` then starts Debian's `pgbouncer` (`PgBouncer` below) in front of the
test server: transaction pooling, a loopback port of its own, and a wildcard
database entry, so the per-test scratch databases (created, migrated and
inspected directly on the server) are reachable through it by name.

In the mode the engine's connections go through the bouncer with
`prepare_threshold=None` (`ENGINE_KWARGS`; PgBouncer before 1.21 cannot carry
server-side prepared statements), every runnable is poll-only (`runner_config`,
`worker_args`), and tests that need a PostgreSQL session of their own (marker
`direct`) are skipped.
"""

from __future__ import annotations

import ctypes
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
from psycopg.conninfo import conninfo_to_dict

import workflow

ENV = "WORKFLOW_TEST_PGBOUNCER"
ENABLED = os.environ.get(ENV, "").strip().lower() not in ("", "0", "false", "no", "off")
"""True when the engine suite runs through PgBouncer."""

ENGINE_KWARGS: dict[str, Any] = {"prepare_threshold": None} if ENABLED else {}
"""Connection kwargs of the engine's pools: no server-side prepared statements in the mode."""

# Debian installs the binary in /usr/sbin, which a non-root PATH may lack.
_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin"])


def engine_pool_kwargs(**kwargs: Any) -> dict[str, Any]:
    """Extra `ConnectionPool(...)` arguments for an engine pool.

    `kwargs=` holding the connection kwargs given, plus `prepare_threshold=None`
    in the mode; no argument at all when that is empty.
    """
    merged = {**kwargs, **ENGINE_KWARGS}
    return {"kwargs": merged} if merged else {}


POLL_INTERVAL = 0.5
"""Seconds between polls of a runnable that gave none, in the mode: with no LISTEN to
wake it, the default (30 s) is longer than the tests wait for a pickup."""


def runner_config(**kwargs: Any) -> workflow.RunnerConfig:
    """`workflow.RunnerConfig(**kwargs)`; in the mode poll-only (`listen=False`), polling
    every `POLL_INTERVAL` unless `poll_interval` is given."""
    if ENABLED:
        kwargs["listen"] = False
        kwargs.setdefault("poll_interval", POLL_INTERVAL)
    return workflow.RunnerConfig(**kwargs)


def worker_args(*args: str) -> tuple[str, ...]:
    """`python -m workflow.worker` options `args`; in the mode with `--no-listen` added,
    and `--poll-interval POLL_INTERVAL` unless a poll interval is given."""
    if not ENABLED:
        return args
    extra: list[str] = []
    if "--no-listen" not in args:
        extra.append("--no-listen")
    if "--poll-interval" not in args:
        extra += ["--poll-interval", f"{POLL_INTERVAL:g}"]
    return (*args, *extra)


def find_binary() -> str | None:
    """The `pgbouncer` executable, or None when it is not installed."""
    return shutil.which("pgbouncer", path=_SEARCH_PATH)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` that has the child sent SIGTERM when the thread starting it ends.

    Linux only (`prctl(PR_SET_PDEATHSIG)`): a pytest killed outright leaves no
    pgbouncer behind. It runs after the switch to another user, which would
    otherwise clear the setting.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig, sigterm = 1, int(signal.SIGTERM)

    def set_parent_death_signal() -> None:
        prctl(pr_set_pdeathsig, sigterm)

    return set_parent_death_signal


def _quote_ini(value: str) -> str:
    """A value for a libpq-style `key=value` string in pgbouncer.ini."""
    if value and all(c.isalnum() or c in "._-/" for c in value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


class PgBouncer:
    """One `pgbouncer` process in front of `server_url`'s server, for one test session.

    `start()` writes its config, user list, log and pid files into a fresh temp
    directory (owned by the `postgres` OS user when run as root: pgbouncer refuses
    to run as root, so it is started as that user), waits until it accepts
    connections and returns. `url(dbname)` is a URL of any database of the server
    through it. `stop()` ends the process (by its pid) and removes the directory.
    """

    def __init__(self, server_url: str, binary: str) -> None:
        params = conninfo_to_dict(server_url)
        self.binary = binary
        self.user = str(params.get("user") or pwd.getpwuid(os.getuid()).pw_name)
        self._password = str(params.get("password") or "")
        self._server_host = str(params.get("host") or "")
        self._server_port = str(params.get("port") or "5432")
        self.port = 0
        self.dir: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    # Configuration.

    def _ini(self, directory: Path) -> str:
        target = f"port={self._server_port}"
        if self._server_host:
            target = f"host={_quote_ini(self._server_host)} {target}"
        return "\n".join(
            [
                "[databases]",
                # Any database name a client asks for, on the real server, as the client's user.
                f"* = {target}",
                "",
                "[pgbouncer]",
                "listen_addr = 127.0.0.1",
                f"listen_port = {self.port}",
                "unix_socket_dir =",
                "pool_mode = transaction",
                "auth_type = trust",
                f"auth_file = {directory / 'userlist.txt'}",
                f"admin_users = {self.user}",
                # Engine pools, worker subprocesses and their ledgers, for one test at a time.
                "max_client_conn = 1000",
                "default_pool_size = 40",
                "min_pool_size = 0",
                "reserve_pool_size = 0",
                # Scratch databases come and go: do not keep their server connections long.
                "server_idle_timeout = 15",
                "autodb_idle_timeout = 60",
                "server_login_retry = 1",
                "query_wait_timeout = 60",
                # psycopg sends none of these today; harmless, and what poolers in front of
                # drivers usually need.
                "ignore_startup_parameters = extra_float_digits,options",
                f"logfile = {directory / 'pgbouncer.log'}",
                f"pidfile = {directory / 'pgbouncer.pid'}",
                "log_connections = 0",
                "log_disconnections = 0",
                "",
            ]
        )

    def _userlist(self) -> str:
        def q(s: str) -> str:
            return '"' + s.replace('"', '""') + '"'

        # trust: the user must still be listed; the password (if the server URL had
        # one) is what pgbouncer logs in to the server with.
        return f"{q(self.user)} {q(self._password)}\n"

    # Life cycle.

    def start(self, timeout: float = 30.0) -> None:
        as_root = os.geteuid() == 0
        run_as: pwd.struct_passwd | None = None
        if as_root:
            try:
                run_as = pwd.getpwnam("postgres")
            except KeyError:
                raise RuntimeError(
                    "pgbouncer refuses to run as root, and there is no `postgres` OS user "
                    "to run it as"
                ) from None
        self.dir = Path(tempfile.mkdtemp(prefix="workflow-test-pgbouncer-"))
        last_error = ""
        for _ in range(5):
            self.port = _free_port()
            ini = self.dir / "pgbouncer.ini"
            ini.write_text(self._ini(self.dir))
            (self.dir / "userlist.txt").write_text(self._userlist())
            if run_as is not None:
                for path in (self.dir, *self.dir.iterdir()):
                    os.chown(path, run_as.pw_uid, run_as.pw_gid)
            user: dict[str, Any] = {}
            if run_as is not None:
                user = {"user": run_as.pw_uid, "group": run_as.pw_gid, "extra_groups": []}
            self.proc = subprocess.Popen(
                [self.binary, "-q", str(ini)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,  # Ctrl-C in the terminal is for pytest, not for it
                preexec_fn=_die_with_parent(),
                **user,
            )
            last_error = self._wait_ready(timeout)
            if not last_error:
                return
            self._end_process()
            if "Address already in use" not in last_error:
                break
        log = self.log_tail()
        self._remove_dir()
        raise RuntimeError(f"pgbouncer did not start: {last_error}\n{log}")

    def _wait_ready(self, timeout: float) -> str:
        """'' once a query through the bouncer works; else why not."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        error = "timed out"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr
                stderr = err.read().decode(errors="replace") if err is not None else ""
                return f"exited with code {self.proc.returncode}: {stderr.strip()}"
            try:
                with psycopg.connect(
                    self.url("postgres"), autocommit=True, connect_timeout=2, prepare_threshold=None
                ) as conn:
                    conn.execute("SELECT 1")
                return ""
            except psycopg.Error as exc:
                error = str(exc).strip()
                if "Address already in use" in self.log_tail():
                    return "Address already in use"
            time.sleep(0.1)
        return error

    def url(self, dbname: str) -> str:
        """A URL of database `dbname` of the server, through the bouncer."""
        return f"postgresql://{quote(self.user, safe='')}@127.0.0.1:{self.port}/{quote(dbname)}"

    def url_for(self, server_url: str) -> str:
        """`server_url` (a database of the server) through the bouncer."""
        dbname = conninfo_to_dict(server_url).get("dbname") or "postgres"
        return self.url(dbname)

    def log_tail(self, lines: int = 40) -> str:
        if self.dir is None:
            return ""
        try:
            text = (self.dir / "pgbouncer.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _end_process(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # immediate shutdown
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()

    def _remove_dir(self) -> None:
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def stop(self) -> None:
        self._end_process()
        self._remove_dir()
