"""The listener: wakes the poller when a run is started or released elsewhere.

It LISTENs on a dedicated connection (not from the pool: LISTEN is session
state). A lost connection is re-established with backoff and logged, never fatal:
the poll interval stays the safety net.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import psycopg

from workflow.executor import Engine
from workflow.service import Service


class Listener(Service):
    """Calls `notify()` for each wake-up about one of `workflows`, until stopped."""

    name = "workflow-listener"

    def __init__(
        self,
        engine: Engine,
        conninfo: str,
        kwargs: dict[str, Any],
        workflows: Collection[str],
        notify: Callable[[], None],
    ) -> None:
        super().__init__()
        self._engine = engine
        self._conninfo = conninfo
        self._kwargs = {k: v for k, v in kwargs.items() if k != "autocommit"}
        self._workflows = frozenset(workflows)
        self._notify = notify
        self._conn: psycopg.Connection[Any] | None = None

    def _loop(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            try:
                self._conn = self._engine.store.listen_connection(self._conninfo, **self._kwargs)
                if failures:
                    self._engine.logger.warning("workflow: listener: LISTEN re-established")
                failures = 0
                # A run may have been started while the connection was down.
                self._notify()
                while not self._stopping.is_set():
                    for note in self._conn.notifies(timeout=0.5):
                        if not note.payload or note.payload in self._workflows:
                            self._notify()
            except Exception as e:
                if self._stopping.is_set():
                    break
                failures += 1
                delay = min(30.0, 0.2 * 2 ** min(failures, 8))
                self._engine.logger.error(
                    "workflow: listener: LISTEN connection lost (%s); retrying in %.1fs, "
                    "polling meanwhile",
                    e,
                    delay,
                )
                self._sleep(delay)
            finally:
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
