"""`python -m workflow dashboard`: the dashboard alone, on waitress.

waitress is a production WSGI server in pure Python (threads, no C build, any
platform), small and well kept: what a console for a handful of people needs.
The stdlib `wsgiref` serves one request at a time.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from typing import Any

from workflow.errors import ConfigError

PASSWORD_ENV = "WORKFLOW_DASHBOARD_PASSWORD"
"""The environment variable a password may come from (never the command line)."""


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) only reaches this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def read_password(path: str | None) -> str | None:
    """The password from `path` (its first line) or else `$WORKFLOW_DASHBOARD_PASSWORD`."""
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                password = f.readline().rstrip("\r\n")
        except OSError as e:
            raise ConfigError(f"workflow: cannot read the password file {path!r}: {e}") from None
        if not password:
            raise ConfigError(f"workflow: the password file {path!r} is empty")
        return password
    return os.environ.get(PASSWORD_ENV) or None


def check_bind(host: str, *, guarded: bool) -> None:
    """`ConfigError` for a host that other machines reach when nothing guards the app."""
    if not guarded and not is_loopback(host):
        raise ConfigError(
            f"workflow: the dashboard would listen on {host!r}, reachable from other "
            f"machines, with no password: set one with --password-file or ${PASSWORD_ENV}, "
            "or mount make_app(..., authorize=...) in your own project"
        )


def serve(app: Any, host: str, port: int, *, threads: int = 8) -> None:  # pragma: no cover
    """Serve `app` until interrupted (waitress)."""
    import waitress  # type: ignore[import-untyped]

    waitress.serve(app, host=host, port=port, threads=threads, ident="pgworkflow")
