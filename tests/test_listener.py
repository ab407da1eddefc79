"""SPEC 6: the listener wakes the poller for the wake-ups of its own workflows.

On a dedicated LISTEN connection: a notification whose payload is one of its
workflows (or empty) wakes the poller, another workflow's does not; a lost
connection is re-established (logged) and wakes the poller once, for what was
started meanwhile.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import psycopg
import pytest
from helpers import Records, wait_until

from workflow.listener import Listener
from workflow.logs import EngineLog
from workflow.store import CHANNEL, Store

pytestmark = pytest.mark.direct(reason="LISTEN needs a session of its own")


class Wakes:
    def __init__(self) -> None:
        self.count = 0
        self.lock = threading.Lock()

    def __call__(self) -> None:
        with self.lock:
            self.count += 1


def listening(db_url: str, pool: Any, logger: logging.Logger, wakes: Wakes) -> Listener:
    listener = Listener(Store(pool), EngineLog(logger), db_url, {}, ["Mine"], wakes)
    listener.start()
    wait_until(lambda: wakes.count >= 1, "the listener's first wake-up (connected)")
    return listener


def test_a_wake_up_for_its_workflow_wakes_the_poller_and_others_do_not(
    db_url: str, db: psycopg.Connection[Any], pool: Any, logs: tuple[logging.Logger, Records]
) -> None:
    wakes = Wakes()
    listener = listening(db_url, pool, logs[0], wakes)
    try:
        base = wakes.count
        db.execute("SELECT pg_notify(%s, 'Theirs')", (CHANNEL,))
        db.execute("SELECT pg_notify(%s, 'Mine')", (CHANNEL,))
        wait_until(lambda: wakes.count == base + 1, "a wake-up for 'Mine'")
        db.execute("SELECT pg_notify(%s, '')", (CHANNEL,))
        wait_until(lambda: wakes.count == base + 2, "a wake-up with no payload")
        db.execute("SELECT pg_notify(%s, 'Theirs')", (CHANNEL,))
        db.execute("SELECT pg_notify(%s, 'Mine')", (CHANNEL,))
        wait_until(lambda: wakes.count == base + 3, "one more for 'Mine' only")
    finally:
        listener.stop(timeout=5)


def test_a_lost_listen_connection_is_re_established_and_wakes_the_poller(
    db_url: str, db: psycopg.Connection[Any], pool: Any, logs: tuple[logging.Logger, Records]
) -> None:
    logger, records = logs
    wakes = Wakes()
    listener = listening(db_url, pool, logger, wakes)
    try:
        base = wakes.count
        db.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND query = 'LISTEN workflow_runs'"
        )
        records.wait_for("LISTEN connection lost")
        records.wait_for("LISTEN re-established")
        wait_until(lambda: wakes.count > base, "the wake-up after reconnecting")
        base = wakes.count
        db.execute("SELECT pg_notify(%s, 'Mine')", (CHANNEL,))
        wait_until(lambda: wakes.count > base, "wake-ups on the new connection")
    finally:
        listener.stop(timeout=5)
