"""The listener: wakes the poller when a run is started or released elsewhere, and the
heartbeat when a run is cancelled (so its handler sees `cancelled` at once).

It LISTENs on a dedicated connection (not from the pool: LISTEN is session
state). A lost connection is re-established with backoff and logged, never fatal:
the poll interval stays the safety net.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import psycopg

from workflow.logs import EngineLog
from workflow.service import Service
from workflow.store import CANCELS, Store


class Listener(Service):
    """Calls `wake()` for each wake-up about one of `workflows`, and `cancelled(run_id)`
    for each cancellation, until stopped."""

    name = "workflow-listener"

    def __init__(
        self,
        store: Store,
        log: EngineLog,
        conninfo: str,
        kwargs: dict[str, Any],
        workflows: Collection[str],
        wake: Callable[[], None],
        cancelled: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__()
        self._store = store
        self._log = log
        self._conninfo = conninfo
        self._kwargs = {k: v for k, v in kwargs.items() if k != "autocommit"}
        self._workflows = frozenset(workflows)
        self._wake_poller = wake
        self._cancelled = cancelled
        self._conn: psycopg.Connection[Any] | None = None

    def _loop(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            try:
                self._conn = self._store.listen_connection(self._conninfo, **self._kwargs)
                if failures:
                    self._log.warning("listener: LISTEN re-established")
                failures = 0
                # A run may have been started while the connection was down.
                self._wake_poller()
                while not self._stopping.is_set():
                    for note in self._conn.notifies(timeout=0.5):
                        if note.channel == CANCELS:
                            if self._cancelled is not None:
                                self._cancelled(note.payload)
                        elif not note.payload or note.payload in self._workflows:
                            self._wake_poller()
            except Exception as e:
                if self._stopping.is_set():
                    break
                failures += 1
                delay = min(30.0, 0.2 * 2 ** min(failures, 8))
                self._log.error(
                    "listener: LISTEN connection lost (%s); retrying in %.1fs, polling meanwhile",
                    e,
                    delay,
                )
                self._sleep(delay)
            finally:
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
