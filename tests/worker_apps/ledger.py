"""The test's own record of handler executions, written by the handlers themselves.

One `start` row per handler invocation (run, seq, attempt, worker pid, database
time), so a test can count executions; some handlers add an `end` row saying
whether they saw `cancelled` set.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from psycopg_pool import ConnectionPool

import workflow

URL_ENV = "WORKER_APPS_DATABASE_URL"

CREATE_TABLE = """
CREATE TABLE ledger (
    run_id    uuid NOT NULL,
    seq       integer NOT NULL,
    attempt   integer NOT NULL,
    pid       integer NOT NULL,
    event     text NOT NULL,
    cancelled boolean NOT NULL,
    at        timestamptz NOT NULL DEFAULT now()
)
"""

_pool: ConnectionPool[Any] | None = None
_pool_lock = threading.Lock()


def _connections() -> ConnectionPool[Any]:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ConnectionPool(
                os.environ[URL_ENV],
                min_size=1,
                max_size=4,
                # No server-side prepared statements: the tests may point this at
                # PgBouncer in transaction mode ($WORKFLOW_TEST_PGBOUNCER).
                kwargs={"autocommit": True, "prepare_threshold": None},
                open=True,
                name="ledger",
            )
        return _pool


def record(run: workflow.TaskRun[Any], seq: int, event: str = "start") -> None:
    """Add one ledger row for this attempt of task `seq` of `run`, at the database's now()."""
    with _connections().connection() as conn:
        conn.execute(
            "INSERT INTO ledger (run_id, seq, attempt, pid, event, cancelled) "
            "VALUES (%s, %s, %s, %s, %s, %s)",
            (run.run_id, seq, run.attempt, os.getpid(), event, run.cancelled.is_set()),
        )
