"""Real server subprocesses, their output collected on a thread, and plain HTTP with urllib."""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request
from typing import Any

from helpers import OutputProcess


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


class ServerProcess(OutputProcess):
    """A server subprocess whose stdout and stderr (merged) are collected line by line."""


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
