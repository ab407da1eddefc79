"""Opening one plain connection from a URL: for migrations, checks and admin work."""

from __future__ import annotations

import os
import re
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from workflow.errors import WorkflowError

CONNECT_TIMEOUT = 10
"""Seconds to wait for the server, unless the URL or `$PGCONNECT_TIMEOUT` says otherwise."""


def normalize_url(url: str) -> str:
    """`url` with the SQLAlchemy/yoyo spelling (`postgresql+psycopg://`) made plain."""
    return re.sub(r"^postgres(?:ql)?\+psycopg2?://", "postgresql://", url)


def connect(url: str) -> psycopg.Connection[Any]:
    """An autocommit connection to `url`, giving up after `CONNECT_TIMEOUT` by default.

    Raises `psycopg.Error` for a malformed URL or an unreachable server.
    """
    params: dict[str, Any] = conninfo_to_dict(normalize_url(url))
    if "connect_timeout" not in params and "PGCONNECT_TIMEOUT" not in os.environ:
        params["connect_timeout"] = CONNECT_TIMEOUT
    return psycopg.connect(**params, autocommit=True)


def connect_explained(url: str) -> psycopg.Connection[Any]:
    """`connect(url)`, raising `WorkflowError` with one line saying why it failed.

    A malformed URL: "invalid database URL: ..."; an unreachable server, a missing
    database or a refused login: "cannot connect to the database: " and the
    server's own reason. The psycopg error is kept as the cause.
    """
    try:
        conninfo_to_dict(normalize_url(url))
    except psycopg.Error as e:
        raise WorkflowError(f"workflow: invalid database URL: {one_line(e)}") from e
    try:
        return connect(url)
    except psycopg.Error as e:
        raise WorkflowError(f"workflow: cannot connect to the database: {one_line(e)}") from e


def one_line(text: object) -> str:
    """`text` with every run of whitespace (newlines included) made one space."""
    return " ".join(str(text).split())
