"""Starting `python -m workflow.worker` as a real subprocess and watching its stderr."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .ledger import URL_ENV

ROOT = Path(__file__).resolve().parents[2]
STARTED = "workflow: worker started"


class WorkerProcess:
    """One worker subprocess; its stderr is collected line by line on a thread."""

    def __init__(self, app: str, database_url: str, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if k != "WORKFLOW_DATABASE_URL"}
        env[URL_ENV] = database_url
        env["PYTHONUNBUFFERED"] = "1"
        self.argv = [
            sys.executable,
            "-m",
            "workflow.worker",
            "--app",
            app,
            "--database-url",
            database_url,
            *args,
        ]
        self.proc = subprocess.Popen(
            self.argv,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._eof = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._eof = True
            self._changed.notify_all()

    @property
    def stderr(self) -> str:
        with self._changed:
            return "\n".join(self.lines)

    def wait_for_line(self, text: str, timeout: float = 30.0) -> str:
        """The first stderr line containing `text`; AssertionError after `timeout` or at exit."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if text in line:
                        return line
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    raise AssertionError(
                        f"worker {self.pid} printed no line with {text!r} "
                        f"(exit code {self.proc.poll()}); stderr:\n" + "\n".join(self.lines)
                    )
                self._changed.wait(left)

    def wait_started(self, timeout: float = 30.0) -> None:
        self.wait_for_line(STARTED, timeout)

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL, and reap."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def wait(self, timeout: float = 30.0) -> int:
        """The exit code; the stderr reader has finished too."""
        code = self.proc.wait(timeout)
        self._reader.join(10)
        return code
