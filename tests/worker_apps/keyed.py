"""A keyed workflow (SPEC 15) whose handler stamps its entry and exit in `key_ledger`.

`Keyed.Transfer` takes `Move(account, n, hold, gate)`: one task that records its entry
(database clock, `clock_timestamp()`), sleeps `hold` seconds on its first attempt
(0.02 s on later ones), and records its exit; so a test can check from the ledger
alone that no two runs of a key overlapped and that a key's runs went in order.

With `gate` set, a first attempt also stays inside until `gate` runs of the same `n`
have entered (or `GATE_TIMEOUT` has passed): a test of keys going on side by side
then does not depend on how fast this machine starts runs.
"""

from __future__ import annotations

import os
import time

import attrs

import workflow

from .ledger import _connections

CREATE_TABLE = """
CREATE TABLE key_ledger (
    run_id     uuid NOT NULL,
    account    text NOT NULL,
    n          integer NOT NULL,
    attempt    integer NOT NULL,
    pid        integer NOT NULL,
    entered_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    left_at    timestamptz
)
"""


@attrs.frozen
class Move:
    account: str
    n: int
    hold: float = 0.05
    gate: int = 0


GATE_TIMEOUT = 60.0


@attrs.frozen
class Moved:
    n: int


Transfer = workflow.Workflow("Keyed.Transfer", Move)
STEP = workflow.Task("keyed.move", Moved)


def _move(run: workflow.TaskRun[Move]) -> Moved:
    move = run.input
    with _connections().connection() as conn:
        conn.execute(
            "INSERT INTO key_ledger (run_id, account, n, attempt, pid) VALUES (%s, %s, %s, %s, %s)",
            (run.run_id, move.account, move.n, run.attempt, os.getpid()),
        )
    time.sleep(move.hold if run.attempt == 1 else 0.02)
    if move.gate and run.attempt == 1:
        _wait_for_gate(move)
    with _connections().connection() as conn:
        conn.execute(
            "UPDATE key_ledger SET left_at = clock_timestamp() "
            "WHERE run_id = %s AND attempt = %s",
            (run.run_id, run.attempt),
        )
    return Moved(move.n)


def _wait_for_gate(move: Move) -> None:
    # A connection for each look, not held while waiting: the pool has four, and twenty
    # runs of a worker may wait here at once.
    deadline = time.monotonic() + GATE_TIMEOUT
    while time.monotonic() < deadline:
        with _connections().connection() as conn:
            row = conn.execute("SELECT count(*) FROM key_ledger WHERE n = %s", (move.n,)).fetchone()
        if row is not None and row[0] >= move.gate:
            return
        time.sleep(0.02)


def registry(concurrency: int = 1) -> workflow.Registry:
    """`Keyed.Transfer`, at most `concurrency` runs of one account at once."""
    reg = workflow.Registry()
    reg.register(
        workflow.define(
            Transfer,
            workflow.handle(STEP, _move),
            concurrency_key=lambda m: m.account,
            concurrency=concurrency,
        )
    )
    return reg


def three() -> workflow.Registry:
    """`Keyed.Transfer` with three runs of one account at once."""
    return registry(3)


STALE_BY_HAND = workflow.Config(
    sweep_max_age=60, default_task_timeout=30, max_in_process_backoff=0.5
)
"""A killed worker's claim is stale after 60 s, which no test waits for: the test ages the
dead claim's heartbeat itself (`UPDATE ... heartbeat_at`) once it has seen the key held, so
the order of "another key runs" and "the sweep comes" never rests on a machine's speed (at
3 s, then 6 s, a newcomer's embedded-server pass saw the sweep come first). An attempt may
last 30 s, so a first attempt told to hold 20 s is still inside when the worker is killed,
however slow the machine."""


def stale_by_hand_app() -> workflow.App:
    return workflow.App(registry(), config=STALE_BY_HAND)
