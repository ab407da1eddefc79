"""A task's step and a heartbeat are heap-only updates (issue 20, migration 0009).

A step rewrites its run's row (current task, heartbeat) and its task's row
(output). PostgreSQL writes such an update without touching any index (HOT) only
when no indexed column changes and the new version fits on its page; otherwise
every index of the table takes a new entry on every step. These tests run the
store's own statements inside a transaction and read that transaction's own
counters (`pg_stat_get_xact_tuples_hot_updated`), so the answer does not depend on
when the statistics are flushed.

Room on the page comes, in use, from page pruning between transactions: the
versions a run's earlier steps left are dead once they commit (measured with
bench/typed.py's own-null: every non-final step of a run HOT, and 97% of the task
updates, with the tables' default fillfactor). Versions made inside one
transaction are not dead yet, so the fixture leaves room on the pages itself, for
the test's own transaction only: what these tests check is that no indexed column
changes.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import psycopg
import pytest
from helpers import insert_claimed_run

from workflow.store import _Q, CHANNEL, step_arrays


def _updates(db: psycopg.Connection[Any], table: str) -> tuple[int, int]:
    """(updates, of which heap-only) of `table` in the current transaction."""
    row = db.execute(
        "SELECT pg_stat_get_xact_tuples_updated(%s::regclass), "
        "pg_stat_get_xact_tuples_hot_updated(%s::regclass)",
        (table, table),
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def _step(run_id: uuid.UUID, claim_id: uuid.UUID, seq: int, finishes: bool) -> dict[str, Any]:
    return {"id": run_id, "claim_id": claim_id, "seq": seq, "output": '{"ref": "x"}',
            "next_seq": seq + 1, "finishes": finishes, "wake_key": True, "channel": CHANNEL}


@pytest.fixture
def tx(db_url: str) -> Any:
    """A connection inside a transaction that is rolled back at the end, with room left
    on the pages it fills."""
    with psycopg.connect(db_url) as conn:
        conn.execute("ALTER TABLE workflow_runs SET (fillfactor = 50)")
        conn.execute("ALTER TABLE workflow_tasks SET (fillfactor = 50)")
        yield conn
        conn.rollback()


def test_a_step_that_does_not_finish_the_run_touches_no_index(tx: psycopg.Connection[Any]) -> None:
    runs = [insert_claimed_run(tx) for _ in range(20)]
    for run_id, claim_id in runs:
        assert tx.execute(_Q["complete_task"], _step(run_id, claim_id, 1, False)).fetchall()
    for run_id, claim_id in runs:
        assert tx.execute(_Q["complete_task"], _step(run_id, claim_id, 2, False)).fetchall()
    assert _updates(tx, "workflow_runs") == (40, 40)
    assert _updates(tx, "workflow_tasks") == (40, 40)


def test_a_heartbeat_touches_no_index(tx: psycopg.Connection[Any]) -> None:
    # Few enough rows that every version made in one transaction fits on their page.
    runs = [insert_claimed_run(tx) for _ in range(5)]
    claims = [claim_id for _, claim_id in runs]
    for _ in range(3):
        assert len(tx.execute(_Q["heartbeat"], {"claims": claims}).fetchall()) == 5
    assert _updates(tx, "workflow_runs") == (15, 15)


def test_a_combined_step_touches_no_index(tx: psycopg.Connection[Any]) -> None:
    runs = [insert_claimed_run(tx) for _ in range(20)]
    steps = [_step(run_id, claim_id, 1, False) for run_id, claim_id in runs]
    rows = tx.execute(_Q["complete_tasks"], step_arrays(steps)).fetchall()
    assert len(rows) == 20
    assert _updates(tx, "workflow_runs") == (20, 20)
    assert _updates(tx, "workflow_tasks") == (20, 20)


def test_deleting_runs_deletes_their_tasks(tx: psycopg.Connection[Any]) -> None:
    """The tasks have no foreign key to their run since 0009 (checking it cost every
    start a lookup and a lock per task); a trigger deletes them with their runs."""
    kept, _ = insert_claimed_run(tx)
    gone = [insert_claimed_run(tx)[0] for _ in range(3)]
    tx.execute("DELETE FROM workflow_runs WHERE id = ANY(%s)", (gone,))
    rows = tx.execute("SELECT DISTINCT run_id FROM workflow_tasks").fetchall()
    assert rows == [(kept,)]


@pytest.mark.parametrize(
    "statement",
    [
        "TRUNCATE workflow_runs CASCADE",  # the history refers to the runs
        "TRUNCATE workflow_runs, workflow_tasks, workflow_events",
    ],
)
def test_a_truncate_of_the_runs_empties_their_tasks(
    tx: psycopg.Connection[Any], statement: str
) -> None:
    insert_claimed_run(tx)
    tx.execute(statement)
    assert tx.execute("SELECT count(*) FROM workflow_tasks").fetchone() == (0,)


def test_the_deletion_trigger_finds_the_tasks_whatever_the_search_path(
    tx: psycopg.Connection[Any],
) -> None:
    gone, _ = insert_claimed_run(tx)
    tx.execute("CREATE SCHEMA elsewhere")
    tx.execute("CREATE TABLE elsewhere.workflow_tasks (run_id uuid)")
    tx.execute("SET LOCAL search_path = elsewhere, public")
    tx.execute("DELETE FROM public.workflow_runs WHERE id = %s", (gone,))
    assert tx.execute("SELECT count(*) FROM public.workflow_tasks").fetchone() == (0,)


def _claim_part(sql: str) -> str:
    """A claim statement's CTEs from `pick` to the end of `claimed`, without the combined
    write's fence."""
    begin = sql.index("pick AS (")
    end = sql.index("r.tracestate, r.concurrency_key\n)", begin)
    return re.sub(r"\n *AND \(SELECT held FROM given\) IS NOT NULL(?=\n)", "", sql[begin:end])


def _step_part(sql: str) -> str:
    """A combined step statement from `step` to the tasks' update, spaced alike (the
    claiming one names that update `done`; its `given` row has the claim's parameters too)."""
    begin = sql.index("), step AS (")
    end = sql.index("WHERE t.run_id = run.id AND t.seq = run.seq", begin)
    return " ".join(sql[begin:end].split()).replace("), done AS (", ")")


def test_the_claiming_combined_step_is_complete_tasks_and_claim_runs_own() -> None:
    """A worker thread's next run claimed with its finish (`complete_tasks_claiming`) is
    chosen and claimed by the very text of the poller's claim (the same order, filters
    and fences), and the steps are written by the very text of `complete_tasks`."""
    claiming = _Q["complete_tasks_claiming"]
    assert _claim_part(claiming) == _claim_part(_Q["claim_runs"])
    floors = "%(workflows)s::text[] AS workflows, %(floors)s::timestamptz[] AS floors"
    assert floors in claiming and floors in _Q["claim_runs"]  # each workflow from its floor
    assert _step_part(claiming) == _step_part(_Q["complete_tasks"])
