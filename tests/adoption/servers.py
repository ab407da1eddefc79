"""Real server subprocesses, their output collected on a thread, and plain HTTP with urllib."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment without any workflow URL, plus `extra`."""
    drop = ("WORKFLOW_DATABASE_URL", "DATABASE_URL")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


class ServerProcess:
    """A subprocess whose stdout and stderr (merged) are collected line by line."""

    def __init__(self, argv: Sequence[str], *, env: dict[str, str], cwd: Path = ROOT) -> None:
        self.argv = list(argv)
        self.proc = subprocess.Popen(
            self.argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
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
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._eof = True
            self._changed.notify_all()

    @property
    def output(self) -> str:
        with self._changed:
            return "\n".join(self.lines)

    def wait_for_lines(self, text: str, count: int = 1, timeout: float = 30.0) -> list[str]:
        """The first `count` output lines containing `text`; AssertionError on timeout or exit."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = [line for line in self.lines if text in line]
                if len(found) >= count:
                    return found[:count]
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    raise AssertionError(
                        f"{self.argv[:4]} printed {len(found)} of {count} lines with {text!r} "
                        f"(exit code {self.proc.poll()}); output:\n{self.output}"
                    )
                self._changed.wait(left)

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 60.0) -> int:
        """The exit code, once the output has been read to its end."""
        code = self.proc.wait(timeout)
        self._reader.join(10)
        return code

    def kill(self) -> None:
        """SIGKILL this process (not its children), and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def http(
    method: str, url: str, body: Any = None, *, timeout: float = 30.0
) -> tuple[int, Any]:
    """(status, decoded JSON body) of one request; error statuses are returned, not raised."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw or b"null")
        except ValueError:
            return exc.code, raw.decode(errors="replace")


def wait_until_serving(url: str, server: ServerProcess, timeout: float = 30.0) -> None:
    """Poll `url` until the server answers anything, or fail with its output."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            http("GET", url, timeout=2)
            return
        except (urllib.error.URLError, ConnectionError, OSError):
            if server.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"{server.argv[:4]} is not serving {url} (exit code {server.proc.poll()}); "
                    f"output:\n{server.output}"
                ) from None
            time.sleep(0.1)
