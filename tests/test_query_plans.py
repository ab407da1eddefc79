"""The poller's and the sweeper's queries stay index scans as history grows.

A table full of finished runs (plus a handful of claimable and claimed ones) is
analysed, then the store's own statements are EXPLAINed with real parameters. The
claim query must go through the partial index `workflow_runs_ready_per_workflow`, the
sweep through `workflow_runs_claims`, and neither (nor the claim by id) may scan
`workflow_runs` or `workflow_tasks` sequentially: their cost must not grow with the
number of finished runs, nor with the due runs of workflows the claimer does not serve.
A later change to the queries or the indexes that loses this fails here instead of
slowing production down.
"""

from __future__ import annotations

import contextlib
import datetime
import re
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import psycopg.sql
import pytest
from conftest import create_database, drop_database, with_dbname

from workflow.store import _Q, array_literal, step_arrays

FINISHED_RUNS = 20_000
TASKS_PER_RUN = 3


@pytest.fixture(scope="module")
def plan_db(pg_url: str, template_db: str) -> Iterator[psycopg.Connection[Any]]:
    """A migrated database with a long history of finished runs, analysed."""
    name = create_database(pg_url, template_db)
    try:
        with psycopg.connect(with_dbname(pg_url, name), autocommit=True) as conn:
            _fill(conn)
            yield conn
    finally:
        drop_database(pg_url, name)


def _fill(conn: psycopg.Connection[Any]) -> None:
    with conn.transaction():
        # History: finished runs of several workflows, every task done.
        conn.execute(
            """
            INSERT INTO workflow_runs (id, workflow, status, input, task_count, current_seq,
                                       next_retry_at, created_at, finished_at)
            SELECT gen_random_uuid(),
                   (ARRAY['Transfer.Send', 'Invoice.Send', 'Other.Thing'])[1 + i %% 3],
                   (ARRAY['succeeded', 'succeeded', 'parked', 'cancelled'])[1 + i %% 4],
                   jsonb_build_object('n', i),
                   %(tasks)s, %(tasks)s + 1,
                   now() - interval '30 days' + i * interval '1 second',
                   now() - interval '30 days' + i * interval '1 second',
                   now() - interval '30 days' + i * interval '1 second' + interval '5 seconds'
            FROM generate_series(1, %(n)s) AS i
            """,
            {"n": FINISHED_RUNS, "tasks": TASKS_PER_RUN},
        )
        # Live runs: never claimed, released and due, waiting for a retry, claimed
        # (fresh and stale heartbeats).
        conn.execute(
            """
            INSERT INTO workflow_runs (id, workflow, status, input, task_count, current_seq,
                                       claim_id, heartbeat_at, next_retry_at, created_at)
            SELECT gen_random_uuid(), 'Transfer.Send', s.status, '{}'::jsonb, %(tasks)s, 1,
                   CASE WHEN s.claimed THEN gen_random_uuid() END,
                   CASE WHEN s.claimed THEN now() - s.age END,
                   now() + s.retry_in,
                   now() - interval '1 hour' + i * interval '1 second'
            FROM generate_series(1, 5) AS i,
                 (VALUES ('pending', false, interval '0', interval '0'),
                         ('running', false, interval '0', interval '-1 minute'),
                         ('running', false, interval '0', interval '1 hour'),
                         ('running', true, interval '1 second', interval '0'),
                         ('running', true, interval '10 minutes', interval '0'))
                     AS s (status, claimed, age, retry_in)
            """,
            {"tasks": TASKS_PER_RUN},
        )
        conn.execute(
            """
            INSERT INTO workflow_tasks (run_id, seq, name, attempts, output, finished_at)
            SELECT r.id, s.seq, 'task.' || s.seq, 1,
                   CASE WHEN r.finished_at IS NOT NULL THEN '{"ok": true}'::jsonb END,
                   r.finished_at
            FROM workflow_runs r, generate_series(1, %(tasks)s) AS s (seq)
            """,
            {"tasks": TASKS_PER_RUN},
        )
    conn.execute("ANALYZE workflow_runs")
    conn.execute("ANALYZE workflow_tasks")


def _claimable_id(conn: psycopg.Connection[Any]) -> uuid.UUID:
    row = conn.execute(
        "SELECT id FROM workflow_runs WHERE claim_id IS NULL AND finished_at IS NULL LIMIT 1"
    ).fetchone()
    assert row is not None
    result: uuid.UUID = row[0]
    return result


def _claims(n: int) -> list[uuid.UUID]:
    return [uuid.uuid4() for _ in range(n)]


def _no_floors(n: int) -> str:
    """The `floors` of a claim of `n` workflows that reads each from the front."""
    return array_literal([None] * n)


def _plan(conn: psycopg.Connection[Any], name: str, params: dict[str, Any]) -> dict[str, Any]:
    """The JSON plan of the store's statement `name` with `params` bound as literals."""
    sql = psycopg.ClientCursor(conn).mogrify(_Q[name], params)
    row = conn.execute("EXPLAIN (FORMAT JSON) " + sql).fetchone()
    assert row is not None
    plan: dict[str, Any] = row[0][0]["Plan"]
    return plan


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", ()):
        yield from _nodes(child)


def _scans(plan: dict[str, Any]) -> list[tuple[str, str | None, str | None]]:
    """(node type, relation, index) of every node of the plan that reads a table or index."""
    return [
        (node["Node Type"], node.get("Relation Name"), node.get("Index Name"))
        for node in _nodes(plan)
        if "Relation Name" in node or "Index Name" in node
    ]


def _assert_no_seq_scan(scans: list[tuple[str, str | None, str | None]]) -> None:
    for table in ("workflow_runs", "workflow_tasks"):
        assert ("Seq Scan", table, None) not in scans, f"sequential scan of {table}: {scans}"


def _uses_index(scans: list[tuple[str, str | None, str | None]], index: str) -> bool:
    return any(found == index for _, _, found in scans)

# The claims' index since migration 0010: the ready runs by workflow, then due time.
READY = "workflow_runs_ready_per_workflow"


def test_history_is_in_place(plan_db: psycopg.Connection[Any]) -> None:
    row = plan_db.execute(
        "SELECT count(*) FILTER (WHERE finished_at IS NOT NULL),"
        " count(*) FILTER (WHERE claim_id IS NULL AND finished_at IS NULL),"
        " count(*) FILTER (WHERE claim_id IS NOT NULL)"
        " FROM workflow_runs"
    ).fetchone()
    assert row == (FINISHED_RUNS, 15, 10)


def test_claim_runs_uses_the_ready_index(plan_db: psycopg.Connection[Any]) -> None:
    plan = _plan(
        plan_db,
        "claim_runs",
        {"workflows": ["Transfer.Send"], "floors": _no_floors(1), "limit": 10,
         "claims": _claims(10)},
    )
    scans = _scans(plan)
    assert _uses_index(scans, READY), scans
    _assert_no_seq_scan(scans)


def test_claim_runs_of_several_workflows_uses_the_ready_index(
    plan_db: psycopg.Connection[Any],
) -> None:
    plan = _plan(
        plan_db,
        "claim_runs",
        {"workflows": ["Transfer.Send", "Invoice.Send"], "floors": _no_floors(2), "limit": 100,
         "claims": _claims(100)},
    )
    scans = _scans(plan)
    assert _uses_index(scans, READY), scans
    _assert_no_seq_scan(scans)


@pytest.mark.parametrize("statement", ["claim_runs", "complete_tasks_claiming"])
def test_a_claim_from_a_floor_starts_its_index_scan_at_the_floor(
    plan_db: psycopg.Connection[Any], statement: str
) -> None:
    """A claim of a backlog starts at its floor (workflow/store/floors.py): the floor is a
    bound of the ready index's scan, not a filter applied to the entries before it."""
    floor = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=1)
    params = _params_of(statement, 10)
    params["floors"] = array_literal([floor, None, floor])  # its three workflows
    plan = _plan(plan_db, statement, params)
    ready = [node for node in _nodes(plan) if node.get("Index Name") == READY]
    assert ready, _scans(plan)
    bound = re.compile(r"next_retry_at >= COALESCE\(w(_\d+)?\.floor")
    assert all(bound.search(node.get("Index Cond", "")) for node in ready), ready
    _assert_no_seq_scan(_scans(plan))


def test_claim_run_by_id_is_an_index_lookup(plan_db: psycopg.Connection[Any]) -> None:
    run_id = _claimable_id(plan_db)
    plan = _plan(plan_db, "claim_run", {"id": run_id, "claim_id": uuid.uuid4()})
    scans = _scans(plan)
    assert any(table == "workflow_runs" and index for _, table, index in scans), scans
    _assert_no_seq_scan(scans)


def test_sweep_uses_the_claimed_index(plan_db: psycopg.Connection[Any]) -> None:
    plan = _plan(plan_db, "sweep", {"max_age": 30.0, "limit": 100, "channel": "workflow_runs"})
    scans = _scans(plan)
    assert _uses_index(scans, "workflow_runs_claims"), scans
    _assert_no_seq_scan(scans)


def test_a_combined_step_finds_its_runs_by_id_or_claim(plan_db: psycopg.Connection[Any]) -> None:
    """Group commit: the runs of one combined write are looked up by id or by claim (the
    claimed index holds only the runs claimed now), whatever the history."""
    steps = [{"id": uuid.uuid4(), "claim_id": uuid.uuid4(), "seq": 1, "output": "1",
              "next_seq": 2, "finishes": False, "wake_key": True, "channel": "workflow_runs"}
             for _ in range(8)]
    scans = _scans(_plan(plan_db, "complete_tasks", step_arrays(steps)))
    assert (_uses_index(scans, "workflow_runs_pkey")
            or _uses_index(scans, "workflow_runs_claims")), scans
    assert _uses_index(scans, "workflow_tasks_pkey"), scans
    _assert_no_seq_scan(scans)


def test_a_combined_step_that_claims_reads_the_ready_index(
    plan_db: psycopg.Connection[Any],
) -> None:
    """A worker's finishing steps claiming their threads' next runs: the steps found by id
    or claim, the claim through the ready index, as the poller's."""
    steps = [{"id": uuid.uuid4(), "claim_id": uuid.uuid4(), "seq": 1, "output": "1",
              "next_seq": 2, "finishes": True, "wake_key": True, "channel": "workflow_runs"}
             for _ in range(8)]
    params = step_arrays(steps, ["Transfer.Send"], _claims(8))
    scans = _scans(_plan(plan_db, "complete_tasks_claiming", params))
    assert _uses_index(scans, READY), scans
    assert _uses_index(scans, "workflow_tasks_pkey"), scans
    _assert_no_seq_scan(scans)


@pytest.mark.parametrize("statement", ["claimed_runs", "heartbeat"])
def test_finding_runs_by_claim_reads_only_the_claimed_runs(
    plan_db: psycopg.Connection[Any], statement: str
) -> None:
    """The heartbeat, and a claim's retry after a lost reply, look runs up by claim id."""
    plan = _plan(plan_db, statement, {"claims": _claims(10)})
    scans = _scans(plan)
    assert _uses_index(scans, "workflow_runs_claims"), scans
    _assert_no_seq_scan(scans)


@pytest.mark.parametrize("statement", ["released", "inserted_run"])
def test_recognising_an_earlier_try_is_a_primary_key_lookup(
    plan_db: psycopg.Connection[Any], statement: str
) -> None:
    plan = _plan(plan_db, statement, {"id": _claimable_id(plan_db), "claim_id": uuid.uuid4()})
    scans = _scans(plan)
    assert _uses_index(scans, "workflow_runs_pkey"), scans
    _assert_no_seq_scan(scans)


def test_a_prune_batch_reads_the_finished_index_only(plan_db: psycopg.Connection[Any]) -> None:
    """SPEC 12: each prune batch is an index scan whose cost does not grow with what is kept."""
    plan = _plan(plan_db, "prune_runs", {"status": "succeeded", "older_than": 86400.0,
                                         "limit": 1000})
    scans = _scans(plan)
    assert _uses_index(scans, "workflow_runs_finished"), scans
    _assert_no_seq_scan(scans)


def test_listing_runs_newest_first_reads_the_created_index(
    plan_db: psycopg.Connection[Any],
) -> None:
    params = {"statuses": None, "workflow": None, "since": None, "until": None,
              "task": None, "match_code": False, "code": None,
              "after_at": None, "after_id": None, "limit": 51}
    scans = _scans(_plan(plan_db, "list_runs", params))
    assert _uses_index(scans, "workflow_runs_created"), scans
    _assert_no_seq_scan(scans)


def test_queue_stats_read_only_unfinished_parked_and_recent_runs(
    plan_db: psycopg.Connection[Any],
) -> None:
    scans = _scans(_plan(plan_db, "queue_stats", {"stale_after": 600.0}))
    _assert_reads_the_open_runs_through_the_claims_and_keys_indexes(scans)
    assert _uses_index(scans, "workflow_runs_claims"), scans
    assert _uses_index(scans, "workflow_runs_finished"), scans
    _assert_no_seq_scan(scans)


def test_the_metrics_gauges_read_only_open_and_parked_runs(
    plan_db: psycopg.Connection[Any],
) -> None:
    """SPEC 13: the scrape's one query reads the partial indexes, never the history."""
    scans = _scans(_plan(plan_db, "queue_gauges", {"stale_after": 600.0}))
    _assert_reads_the_open_runs_through_the_claims_and_keys_indexes(scans)
    assert _uses_index(scans, "workflow_runs_claims"), scans
    assert _uses_index(scans, "workflow_runs_finished"), scans
    _assert_no_seq_scan(scans)


def _assert_reads_the_open_runs_through_the_claims_and_keys_indexes(
    scans: list[tuple[str, str | None, str | None]],
) -> None:
    """The open, unclaimed runs read as two disjoint parts: those that may be claimed (the
    claims' index) and the keyed runs waiting for a slot (workflow_runs_key_queue). The
    gauges and `stats` of 0010 read workflow_runs_claimable, which 0013 dropped."""
    assert _uses_index(scans, READY), scans
    assert _uses_index(scans, "workflow_runs_key_queue"), scans


MILLION = 1_000_000


def _readme() -> str:
    return (Path(__file__).resolve().parent.parent / "README.md").read_text("utf-8")


def readme_keda_query() -> str:
    """The KEDA scaler query as the README gives it (between its marker comments)."""
    match = re.search(r"-- keda: claimable backlog\n(.*?);", _readme(), flags=re.S)
    assert match is not None, "the README's KEDA query (marked `-- keda: claimable backlog`)"
    return match.group(1)


def test_the_readme_keda_trigger_runs_the_query_the_readme_gives() -> None:
    """The scaler's YAML (what a reader copies) is the SQL block the plan test runs."""
    match = re.search(r'^\s*query: "(.*)"$', _readme(), flags=re.M)
    assert match is not None, "the README's KEDA trigger (`query: \"...\"`)"
    assert match.group(1).split() == readme_keda_query().split()


@pytest.fixture(scope="module")
def million_db(pg_url: str, template_db: str) -> Iterator[psycopg.Connection[Any]]:
    """A migrated database with a million finished runs (no tasks: the query reads runs
    only) and a few open ones, analysed."""
    name = create_database(pg_url, template_db)
    try:
        with psycopg.connect(with_dbname(pg_url, name), autocommit=True) as conn:
            conn.execute(
                """
                INSERT INTO workflow_runs (id, workflow, status, input, task_count, current_seq,
                                           next_retry_at, created_at, finished_at)
                SELECT gen_random_uuid(),
                       (ARRAY['Transfer.Send', 'Invoice.Send'])[1 + i %% 2],
                       'succeeded', '{}'::jsonb, 3, 4,
                       now() - interval '60 days' + i * interval '1 second',
                       now() - interval '60 days' + i * interval '1 second',
                       now() - interval '60 days' + i * interval '2 second'
                FROM generate_series(1, %(n)s) AS i
                """,
                {"n": MILLION},
            )
            conn.execute(
                """
                INSERT INTO workflow_runs (id, workflow, status, input, task_count, current_seq,
                                           next_retry_at)
                SELECT gen_random_uuid(), 'Transfer.Send', 'pending', '{}'::jsonb, 3, 1,
                       now() + (i - 5) * interval '1 minute'
                FROM generate_series(1, 10) AS i
                """
            )
            conn.execute("ANALYZE workflow_runs")
            yield conn
    finally:
        drop_database(pg_url, name)


@pytest.mark.slow
def test_the_readme_keda_query_is_an_index_scan_with_a_million_finished_runs(
    million_db: psycopg.Connection[Any],
) -> None:
    query = readme_keda_query()
    row = million_db.execute(query).fetchone()
    assert row is not None and row[0] == 5, "due now or earlier: 5 of the 10 open runs"
    explained = million_db.execute("EXPLAIN (FORMAT JSON) " + query).fetchone()
    assert explained is not None
    scans = _scans(explained[0][0]["Plan"])
    assert _uses_index(scans, READY), scans
    _assert_no_seq_scan(scans)


DELAYED_RUNS = 100_000


@pytest.fixture(scope="module")
def delayed_db(pg_url: str, template_db: str) -> Iterator[psycopg.Connection[Any]]:
    """A migrated database with 100k runs due next year, created before 20 runs due now
    (so a claim in creation order would walk past all of them), analysed."""
    name = create_database(pg_url, template_db)
    try:
        with psycopg.connect(with_dbname(pg_url, name), autocommit=True) as conn:
            conn.execute(
                """
                INSERT INTO workflow_runs (id, workflow, status, input, task_count, current_seq,
                                           next_retry_at, created_at)
                SELECT gen_random_uuid(), 'Transfer.Send', 'pending', '{}'::jsonb, 1, 1,
                       now() + interval '1 year' + i * interval '1 second',
                       now() - interval '1 day' + i * interval '1 ms'
                FROM generate_series(1, %(n)s) AS i
                """,
                {"n": DELAYED_RUNS},
            )
            _due_now_with_tasks(conn)
            yield conn
    finally:
        drop_database(pg_url, name)


def _due_now_with_tasks(conn: psycopg.Connection[Any]) -> None:
    """Add 20 unkeyed runs due a minute ago, give every run one task, and analyse."""
    conn.execute(
        """
        INSERT INTO workflow_runs (id, workflow, status, input, task_count, current_seq,
                                   next_retry_at, created_at)
        SELECT gen_random_uuid(), 'Transfer.Send', 'pending', '{}'::jsonb, 1, 1,
               now() - interval '1 minute', now() - interval '1 minute'
        FROM generate_series(1, 20)
        """
    )
    conn.execute(
        "INSERT INTO workflow_tasks (run_id, seq, name) SELECT id, 1, 'task.1' FROM workflow_runs"
    )
    conn.execute("ANALYZE workflow_runs")
    conn.execute("ANALYZE workflow_tasks")


def _buffers(plan: dict[str, Any]) -> int:
    return int(plan.get("Shared Hit Blocks", 0)) + int(plan.get("Shared Read Blocks", 0))


@pytest.mark.slow
def test_the_claim_never_visits_the_runs_due_next_year(
    delayed_db: psycopg.Connection[Any],
) -> None:
    """SPEC 14: the claim's cost does not grow with the delayed runs waiting."""
    params = {"workflows": ["Transfer.Send"], "floors": _no_floors(1), "limit": 10,
              "claims": _claims(10)}
    scans = _scans(_plan(delayed_db, "claim_runs", params))
    assert _uses_index(scans, READY), scans
    _assert_no_seq_scan(scans)
    sql = psycopg.ClientCursor(delayed_db).mogrify(_Q["claim_runs"], params)
    with delayed_db.transaction(force_rollback=True):
        row = delayed_db.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql).fetchone()
    assert row is not None
    plan = row[0][0]["Plan"]
    # 10 runs and their tasks, read and locked: a few dozen pages, not the 100k runs'.
    assert _buffers(plan) < 400, _buffers(plan)


@pytest.mark.slow
def test_the_next_due_time_is_one_index_probe(delayed_db: psycopg.Connection[Any]) -> None:
    scans = _scans(_plan(delayed_db, "next_due", {"workflows": ["Transfer.Send"]}))
    assert _uses_index(scans, READY), scans
    _assert_no_seq_scan(scans)


# Per-key limits (SPEC 15): a busy key's backlog costs the other claims nothing, and the
# keyed claim reads each waiting key, not each waiting run.

BUSY_KEYS = 200
WAITING_PER_KEY = 100


@pytest.fixture(scope="module")
def keyed_db(pg_url: str, template_db: str) -> Iterator[psycopg.Connection[Any]]:
    """A migrated database where 200 keys each have a run holding their slot and 100 runs
    waiting (20k in all, created before everything else), 5 keys with a free slot and 3
    runs waiting each, and 20 unkeyed runs due now; analysed."""
    name = create_database(pg_url, template_db)
    try:
        with psycopg.connect(with_dbname(pg_url, name), autocommit=True) as conn:
            conn.execute(
                """
                INSERT INTO workflow_runs (id, workflow, status, input, task_count, current_seq,
                                           next_retry_at, created_at, concurrency_key, key_slot,
                                           claim_id, heartbeat_at)
                SELECT gen_random_uuid(), 'Transfer.Send', 'running', '{}'::jsonb, 1, 1,
                       now() - interval '2 days', now() - interval '2 days',
                       sha256(k::text::bytea), 0, gen_random_uuid(), now()
                FROM generate_series(1, %(keys)s) AS k
                """,
                {"keys": BUSY_KEYS},
            )
            conn.execute(
                """
                INSERT INTO workflow_runs (id, workflow, status, input, task_count, current_seq,
                                           next_retry_at, created_at, concurrency_key)
                SELECT gen_random_uuid(), 'Transfer.Send', 'pending', '{}'::jsonb, 1, 1,
                       now() - interval '1 day', now() - interval '1 day' + i * interval '1 ms',
                       sha256((i %% %(keys)s + 1)::text::bytea)
                FROM generate_series(1, %(n)s) AS i
                """,
                {"keys": BUSY_KEYS, "n": BUSY_KEYS * WAITING_PER_KEY},
            )
            conn.execute(
                """
                INSERT INTO workflow_runs (id, workflow, status, input, task_count, current_seq,
                                           next_retry_at, created_at, concurrency_key)
                SELECT gen_random_uuid(), 'Transfer.Send', 'pending', '{}'::jsonb, 1, 1,
                       now() - interval '1 hour', now() - interval '1 hour' + i * interval '1 ms',
                       sha256(('free' || i % 5)::bytea)
                FROM generate_series(1, 15) AS i
                """
            )
            _due_now_with_tasks(conn)
            yield conn
    finally:
        drop_database(pg_url, name)


def _analyzed(conn: psycopg.Connection[Any], name: str, params: dict[str, Any]) -> tuple[
    dict[str, Any], list[Any]
]:
    """The EXPLAIN ANALYZE plan of statement `name` and the rows it returned (rolled back)."""
    sql = psycopg.ClientCursor(conn).mogrify(_Q[name], params)
    with conn.transaction(force_rollback=True):
        rows = conn.execute(sql).fetchall()
    with conn.transaction(force_rollback=True):
        row = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql).fetchone()
    assert row is not None
    return row[0][0]["Plan"], rows


@pytest.mark.slow
def test_the_claim_of_ready_runs_never_visits_a_busy_keys_backlog(
    keyed_db: psycopg.Connection[Any],
) -> None:
    """20k keyed runs waiting, due before any other: the ready claim skips them all."""
    params = {"workflows": ["Transfer.Send"], "floors": _no_floors(1), "limit": 10,
              "claims": _claims(10)}
    scans = _scans(_plan(keyed_db, "claim_runs", params))
    assert _uses_index(scans, READY), scans
    _assert_no_seq_scan(scans)
    plan, rows = _analyzed(keyed_db, "claim_runs", params)
    assert len({row[0] for row in rows}) == 10
    print(f"\nready claim past 20k keyed runs waiting: {_buffers(plan)} pages")
    assert _buffers(plan) < 400, _buffers(plan)


@pytest.mark.slow
def test_the_keyed_claim_reads_each_waiting_key_once_not_each_waiting_run(
    keyed_db: psycopg.Connection[Any],
) -> None:
    """205 keys with runs waiting (200 busy, 5 free), all read (`visit` above 205): the
    claim takes the 5 free keys' oldest runs, reading a few pages per key, not the 20k
    runs waiting behind the busy ones."""
    params = {
        "workflows": ["Transfer.Send"], "limits": [1], "limit": 10, "claims": _claims(10),
        "start": bytes(32), "visit": 300,
    }
    scans = _scans(_plan(keyed_db, "claim_key_heads", params))
    _assert_no_seq_scan(scans)
    assert _uses_index(scans, "workflow_runs_key_queue"), scans
    plan, rows = _analyzed(keyed_db, "claim_key_heads", params)
    claimed = {row[0] for row in rows}
    assert len(claimed) == 5  # one per free key: the busy keys' runs wait
    print(f"\nkeyed claim, all 205 keys read: {_buffers(plan)} pages")
    # Per key: a probe of the queue, of the slots, and of its head. 205 keys: well
    # under the ~20 pages per key a walk of their runs would read.
    assert _buffers(plan) < 20 * (BUSY_KEYS + 5), _buffers(plan)


@pytest.mark.slow
def test_a_keyed_claim_reads_at_most_visit_keys_from_where_it_starts(
    keyed_db: psycopg.Connection[Any],
) -> None:
    """With `visit` 16 it reads 16 keys, wrapping round past the last digest: its cost is
    bounded whatever the number of busy keys."""
    params = {
        "workflows": ["Transfer.Send"], "limits": [1], "limit": 10, "claims": _claims(10),
        "start": b"\xff" * 31 + b"\x00", "visit": 16,
    }
    plan, _ = _analyzed(keyed_db, "claim_key_heads", params)
    print(f"\nkeyed claim, 16 keys read: {_buffers(plan)} pages")
    # The whole walk of the 205 keys reads about 2,000 pages (the test above).
    assert _buffers(plan) < 20 * 16 * 2, _buffers(plan)


@pytest.mark.slow
def test_the_claim_of_one_keys_next_run_is_a_few_index_probes(
    keyed_db: psycopg.Connection[Any],
) -> None:
    """What a worker runs after each keyed run: no walk of the open runs (by primary key)."""
    key = keyed_db.execute("SELECT sha256(('free' || 1)::bytea)").fetchone()
    assert key is not None
    params = {
        "workflow": "Transfer.Send", "concurrency_key": key[0], "concurrency": 1,
        "claim_id": uuid.uuid4(), "claims": _claims(1),
    }
    scans = _scans(_plan(keyed_db, "claim_key_head", params))
    _assert_no_seq_scan(scans)
    assert not _uses_index(scans, READY), scans
    plan, rows = _analyzed(keyed_db, "claim_key_head", params)
    assert len({row[0] for row in rows}) == 1
    print(f"\none key's next run: {_buffers(plan)} pages")
    assert _buffers(plan) < 60, _buffers(plan)


@pytest.mark.slow
def test_the_next_due_time_skips_keyed_runs_waiting_for_their_key(
    keyed_db: psycopg.Connection[Any],
) -> None:
    scans = _scans(_plan(keyed_db, "next_due", {"workflows": ["Transfer.Send"]}))
    _assert_no_seq_scan(scans)
    row = keyed_db.execute(_Q["next_due"], {"workflows": ["Transfer.Send"]}).fetchone()
    assert row is not None
    # The unkeyed runs, due a minute ago, not the keyed ones waiting since a day.
    assert -70 < row[0] < -50, row


YOUNG_RUNS = 3_000


def _insert_backlog(conn: psycopg.Connection[Any], n: int) -> None:
    """`n` pending one-task runs of Transfer.Send, created in the last hour."""
    conn.execute(
        """
        WITH run AS (
            INSERT INTO workflow_runs (id, workflow, status, input, task_count, current_seq,
                                       created_at)
            SELECT gen_random_uuid(), 'Transfer.Send', 'pending', jsonb_build_object('n', i),
                   1, 1, now() - interval '1 hour' + i * interval '1 millisecond'
            FROM generate_series(1, %(n)s) AS i
            RETURNING id
        )
        INSERT INTO workflow_tasks (run_id, seq, name) SELECT id, 1, 'task.1' FROM run
        """,
        {"n": n},
    )


@pytest.fixture(scope="module")
def young_db(pg_url: str, template_db: str) -> Iterator[psycopg.Connection[Any]]:
    """A young database: a backlog of runs inserted moments ago, 16 of them claimed, and
    no statistics yet (autovacuum has not been round: here it never comes)."""
    name = create_database(pg_url, template_db)
    try:
        with psycopg.connect(with_dbname(pg_url, name), autocommit=True) as conn:
            conn.execute("ALTER TABLE workflow_runs SET (autovacuum_enabled = false)")
            conn.execute("ALTER TABLE workflow_tasks SET (autovacuum_enabled = false)")
            with conn.transaction():
                _insert_backlog(conn, YOUNG_RUNS)
                conn.execute(
                    "UPDATE workflow_runs SET status = 'running', claim_id = gen_random_uuid(), "
                    "heartbeat_at = now() WHERE id IN "
                    "(SELECT id FROM workflow_runs ORDER BY created_at LIMIT 16)"
                )
            yield conn
    finally:
        drop_database(pg_url, name)


STALE_RUNS = 30_000


@pytest.fixture(scope="module")
def stale_db(pg_url: str, template_db: str) -> Iterator[psycopg.Connection[Any]]:
    """A young table with a large backlog: 30,000 runs inserted moments ago and no statistics
    (the tables' own say never analysed; the indexes', taken as the migration built them,
    say empty), as a worker first sees a new install's first backlog."""
    name = create_database(pg_url, template_db)
    try:
        with psycopg.connect(with_dbname(pg_url, name), autocommit=True) as conn:
            conn.execute("ALTER TABLE workflow_runs SET (autovacuum_enabled = false)")
            conn.execute("ALTER TABLE workflow_tasks SET (autovacuum_enabled = false)")
            _insert_backlog(conn, STALE_RUNS)
            yield conn
    finally:
        drop_database(pg_url, name)


@pytest.mark.parametrize("statement", ["complete_tasks", "complete_tasks_claiming"])
def test_a_combined_step_on_a_young_table_does_not_read_every_run(
    young_db: psycopg.Connection[Any], statement: str
) -> None:
    """A worker's combined finishing steps on a backlog inserted moments ago, before any
    statistics of it exist (as on a new install, or a table that grew faster than
    autovacuum came round): its runs are looked up by id, not found by reading the
    whole table (which an estimate of a few hundred rows made look cheaper, and which
    on 3,000 runs cost ~0.9 ms a statement, most of the worker's server time)."""
    row = young_db.execute(
        "SELECT reltuples FROM pg_class WHERE relname = 'workflow_runs'"
    ).fetchone()
    assert row is not None and row[0] < YOUNG_RUNS, "the table must have no statistics yet"
    claimed = young_db.execute(
        "SELECT id, claim_id FROM workflow_runs WHERE claim_id IS NOT NULL LIMIT 8"
    ).fetchall()
    steps = [{"id": run_id, "claim_id": claim_id, "seq": 1, "output": "1", "next_seq": 2,
              "finishes": True, "wake_key": True, "channel": "workflow_runs"}
             for run_id, claim_id in claimed]
    if statement == "complete_tasks":
        params = step_arrays(steps)
    else:
        params = step_arrays(steps, ["Transfer.Send"], _claims(8))
    scans = _scans(_plan(young_db, statement, params))
    _assert_no_seq_scan(scans)


# One plan per connection: the statements run on every step, finish or claim of a
# loaded process are planned once, not at every execution.

PLANNED_ONCE = ["complete_tasks", "complete_tasks_claiming", "claim_runs"]
BACKLOG_RUNS = 5_000


@pytest.fixture(scope="module")
def backlog_db(pg_url: str, template_db: str) -> Iterator[psycopg.Connection[Any]]:
    """A backlog of claimable runs with a history behind it, analysed: the table of a loaded
    worker (a claim of a few runs then looks far cheaper, planned for its limit, than one
    planned without it)."""
    name = create_database(pg_url, template_db)
    try:
        with psycopg.connect(with_dbname(pg_url, name), autocommit=True) as conn:
            _fill(conn)
            _insert_backlog(conn, BACKLOG_RUNS)
            conn.execute("ANALYZE workflow_runs")
            conn.execute("ANALYZE workflow_tasks")
            yield conn
    finally:
        drop_database(pg_url, name)


def _params_of(statement: str, size: int) -> dict[str, Any]:
    """Parameters of `statement` for `size` steps or claims (steps of runs that do not exist:
    they match nothing, and the plan is the same)."""
    workflows = ["Transfer.Send", "Invoice.Send", "Other.Thing"]  # a registry of three
    if statement == "claim_runs":
        return {"workflows": workflows, "floors": _no_floors(len(workflows)), "limit": size,
                "claims": _claims(size)}
    steps = [{"id": uuid.uuid4(), "claim_id": uuid.uuid4(), "seq": 1, "output": "1",
              "next_seq": 2, "finishes": True, "wake_key": True} for _ in range(size)]
    if statement == "complete_tasks":
        return step_arrays(steps)
    return step_arrays(steps, workflows, _claims(size))


@contextlib.contextmanager
def _prepared(
    conn: psycopg.Connection[Any], statement: str
) -> Iterator[Callable[[dict[str, Any]], str]]:
    """`statement` prepared on `conn` as `probe` (deallocated after); yields what makes the
    text of `EXECUTE probe (...)` for a set of parameters."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    text = re.sub(r"%\((\w+)\)s", number, _Q[statement])
    conn.execute(f"PREPARE probe AS {text}")
    try:
        yield lambda params: "EXECUTE probe ({})".format(", ".join(
            psycopg.sql.Literal(params[name]).as_string(conn) for name in names
        ))
    finally:
        conn.execute("DEALLOCATE probe")  # a rollback does not undo a PREPARE


def _generic_plan(conn: psycopg.Connection[Any], statement: str,
                  params: dict[str, Any]) -> dict[str, Any]:
    """The plan PostgreSQL caches for `statement` without its parameters' values (the one a
    connection keeps once it stops planning each execution), shown for `params`."""
    with _prepared(conn, statement) as execute, conn.transaction(force_rollback=True):
        conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        row = conn.execute("EXPLAIN (FORMAT JSON) " + execute(params)).fetchone()
    assert row is not None
    plan: dict[str, Any] = row[0][0]["Plan"]
    return plan


@pytest.mark.server(14, "pg_prepared_statements.generic_plans")
@pytest.mark.parametrize("statement", PLANNED_ONCE)
def test_a_combined_write_or_claim_keeps_one_plan_on_a_table_with_statistics(
    backlog_db: psycopg.Connection[Any], statement: str
) -> None:
    """PostgreSQL plans a prepared statement for its parameters five times, then keeps a plan
    made without them when that one is estimated no dearer. With the steps' arrays and the
    claim's limit visible to the planner it never was (a batch of 2 looks cheaper than the
    10 a plan without values assumes), so every execution was planned anew: 0.5-1.1 ms of
    planning against 0.3-1.7 ms of execution, on each step, finish or claim of a loaded
    process. Each execution here is rolled back: the claims claim nothing for good."""
    with _prepared(backlog_db, statement) as execute:
        for size in (1, 2, 1, 3, 2, 1, 2, 16, 4, 2, 1, 8):  # small first, as at 2-8 threads
            with backlog_db.transaction(force_rollback=True):
                backlog_db.execute(execute(_params_of(statement, size))).fetchall()
        row = backlog_db.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE name = 'probe'"
        ).fetchone()
    assert row == (7, 5), f"{row[0] if row else 0} generic plans, {row[1] if row else 0} custom"


@pytest.mark.parametrize("statement", PLANNED_ONCE)
@pytest.mark.parametrize("database", ["plan_db", "backlog_db", "young_db", "stale_db"])
def test_the_plan_kept_finds_runs_by_index(
    request: pytest.FixtureRequest, statement: str, database: str
) -> None:
    """The plan kept without the parameters' values reads no table whole, on a long
    history with statistics, on a backlog with statistics, and on a backlog inserted moments
    ago without any: it estimates one step or claim (a LIMIT it cannot read is a tenth of
    its input), so the runs are found by primary key, and the claim goes through the ready
    index, workflow by workflow. (On a young table of 30,000 runs, the claim of migration
    0010's first text read workflow_runs_claimable, by creation, since dropped, and sorted
    every run waiting at every claim: 1.2 ms of server CPU a job.)"""
    conn: psycopg.Connection[Any] = request.getfixturevalue(database)
    scans = _scans(_generic_plan(conn, statement, _params_of(statement, 16)))
    _assert_no_seq_scan(scans)
    if statement != "complete_tasks":
        assert _uses_index(scans, READY), scans


# Other workflows' backlogs (SPEC 11: several services may share the tables): a claim reads
# only the runs of the workflows it serves, however many runs of others are due before them.

FOREIGN_RUNS = 20_000
FOREIGN_STATEMENTS = ["claim_runs", "complete_tasks_claiming", "next_due"]


@pytest.fixture(scope="module")
def foreign_db(pg_url: str, template_db: str) -> Iterator[psycopg.Connection[Any]]:
    """The history of `plan_db`, and 20k runs of a workflow nobody here serves (another
    service's backlog, or the runs a renamed workflow left behind), all due, created a day
    before everything else, and 20k keyed runs of it started with a delay, due within the
    hour, waiting for their key; analysed."""
    name = create_database(pg_url, template_db)
    try:
        with psycopg.connect(with_dbname(pg_url, name), autocommit=True) as conn:
            _fill(conn)
            conn.execute(
                """
                WITH run AS (
                    INSERT INTO workflow_runs (id, workflow, status, input, task_count,
                                               current_seq, next_retry_at, created_at)
                    SELECT gen_random_uuid(), 'Other.Service', 'pending', '{}'::jsonb, 1, 1,
                           now() - interval '1 day' + i * interval '1 millisecond',
                           now() - interval '1 day' + i * interval '1 millisecond'
                    FROM generate_series(1, %(n)s) AS i
                    RETURNING id
                )
                INSERT INTO workflow_tasks (run_id, seq, name) SELECT id, 1, 'task.1' FROM run
                """,
                {"n": FOREIGN_RUNS},
            )
            conn.execute(
                """
                WITH run AS (
                    INSERT INTO workflow_runs (id, workflow, status, input, task_count,
                                               current_seq, next_retry_at, created_at,
                                               concurrency_key)
                    SELECT gen_random_uuid(), 'Other.Service', 'pending', '{}'::jsonb, 1, 1,
                           now() + interval '1 minute' + i * interval '100 microseconds',
                           now() - interval '1 day', sha256((i %% 100)::text::bytea)
                    FROM generate_series(1, %(n)s) AS i
                    RETURNING id
                )
                INSERT INTO workflow_tasks (run_id, seq, name) SELECT id, 1, 'task.1' FROM run
                """,
                {"n": FOREIGN_RUNS},
            )
            conn.execute("ANALYZE workflow_runs")
            conn.execute("ANALYZE workflow_tasks")
            yield conn
    finally:
        drop_database(pg_url, name)


def _foreign_params(statement: str) -> dict[str, Any]:
    if statement == "next_due":
        return {"workflows": ["Transfer.Send", "Invoice.Send", "Other.Thing"]}
    return _params_of(statement, 10)  # steps of no run, 10 claims


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["custom", "generic"])
@pytest.mark.parametrize("statement", FOREIGN_STATEMENTS)
def test_a_claim_never_reads_the_due_runs_of_workflows_it_does_not_serve(
    foreign_db: psycopg.Connection[Any], statement: str, plan: str
) -> None:
    """A worker's claims (its poller's, its completer's) and its next due time, with 20k runs
    of another workflow due before its own, and 20k keyed runs of it started with a delay
    (which the next due time's keyed half read, in due order, until migration 0011): a few
    dozen pages, not the other's 20k runs.
    Reading them cost every claim of every worker ~2.5 ms per 10k such runs: a drain of
    10k runs fell from 5,400 to 2,250 runs/s beside 10k due runs of another workflow, and
    to 490 beside 100k."""
    params = _foreign_params(statement)
    if plan == "custom":
        explained, rows = _analyzed(foreign_db, statement, params)
    else:
        with _prepared(foreign_db, statement) as execute:
            with foreign_db.transaction(force_rollback=True):
                rows = foreign_db.execute(execute(params)).fetchall()
            with foreign_db.transaction(force_rollback=True):
                foreign_db.execute("SET LOCAL plan_cache_mode = force_generic_plan")
                row = foreign_db.execute(
                    "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + execute(params)
                ).fetchone()
        assert row is not None
        explained = row[0][0]["Plan"]
    _assert_no_seq_scan(_scans(explained))
    if statement == "next_due":  # the released run of Transfer.Send due a minute ago
        assert rows[0][0] is not None and -70 < rows[0][0] < -50, rows
    else:  # the 10 claimable runs of Transfer.Send, none of the other's
        if statement == "complete_tasks_claiming":  # claimed rows: step false, id, workflow
            rows = [r[1:] for r in rows if not r[0]]
        assert {r[1] for r in rows} == {"Transfer.Send"}, rows
        assert len({r[0] for r in rows}) == 10, rows
    print(f"\n{statement}, {plan} plan: {_buffers(explained)} pages")
    assert _buffers(explained) < 300, _buffers(explained)
