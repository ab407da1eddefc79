"""The handlers' side of the ledger: one `chaos_exec` row per execution, begun and ended.

Each process (worker or starter) writes through its own small autocommit pool on
`$CHAOS_DATABASE_URL`. A write that loses its connection (the server restarting)
is retried for a while: the insert is idempotent (`ON CONFLICT DO NOTHING` on the
execution id) and the end only fills an empty `ended_at`, so a retry after an
unacknowledged commit changes nothing.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

URL_ENV = "CHAOS_DATABASE_URL"
RETRY_FOR = 20.0

_pool: ConnectionPool[Any] | None = None
_pool_lock = threading.Lock()


def _connections() -> ConnectionPool[Any]:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ConnectionPool(
                os.environ[URL_ENV],
                min_size=1,
                max_size=8,
                kwargs={"autocommit": True},
                open=True,
                name="chaos-ledger",
            )
        return _pool


def _write(sql: str, params: tuple[Any, ...]) -> None:
    deadline = time.monotonic() + RETRY_FOR
    delay = 0.05
    while True:
        try:
            with _connections().connection() as conn:
                conn.execute(sql, params)
            return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


def begin(
    exec_id: uuid.UUID,
    run_id: str,
    seq: int,
    attempt: int,
    claim_id: uuid.UUID | None,
    prev_output: str | None,
) -> None:
    """Record that an execution began (database clock), with the claim the database shows."""
    _write(
        "INSERT INTO chaos_exec (exec_id, run_id, seq, attempt, pid, claim_id, claim_at_start, "
        "prev_output) SELECT %s, %s, %s, %s, %s, %s, "
        "(SELECT claim_id FROM workflow_runs WHERE id = %s), %s "
        "ON CONFLICT (exec_id) DO NOTHING",
        (exec_id, run_id, seq, attempt, os.getpid(), claim_id, run_id, prev_output),
    )


def end(exec_id: uuid.UUID, outcome: str) -> None:
    """Record that an execution is about to return (`returned`) or raise (`raised`)."""
    _write(
        "UPDATE chaos_exec SET ended_at = clock_timestamp(), outcome = %s "
        "WHERE exec_id = %s AND ended_at IS NULL",
        (outcome, exec_id),
    )
