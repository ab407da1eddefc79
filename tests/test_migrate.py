"""`workflow.store.migrate` against a real PostgreSQL: idempotence, versions, open
connections, table names, concurrent and killed migrators, and an application's own
yoyo chain in the same database.

Processes that must overlap are made to: the test holds the lock (or a conflicting
uncommitted table) they need, and polls `pg_locks` until they wait on it.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row
from yoyo import get_backend, read_migrations

import workflow
import workflow_migrations
from workflow.errors import WorkflowError
from workflow.store import SCHEMA_VERSION, SchemaOutdated, migrate, schema_version
from workflow.store.migrate import _LOCK_KEY, check_schema

ROOT = Path(__file__).resolve().parent.parent
MIGRATIONS_DIR = Path(workflow_migrations.__file__).parent
DEADLINE = 60.0
"""Seconds a poll waits for another process to reach a state before the test fails."""

_MIGRATE_SNIPPET = (
    "import sys\n"
    "from workflow.store import migrate\n"
    "print(','.join(migrate(sys.argv[1])), flush=True)\n"
)

T = TypeVar("T")


# --- helpers -------------------------------------------------------------------------


def chain_ids() -> list[str]:
    """The ids of the migration files of the chain, in order."""
    return sorted(
        p.name[: -len(".sql")]
        for p in MIGRATIONS_DIR.glob("[0-9][0-9][0-9][0-9]_*.sql")
        if not p.name.endswith(".rollback.sql")
    )


def with_param(url: str, key: str, value: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}{key}={value}"


def wait_until(
    probe: Callable[[], T | None],
    what: str,
    procs: Sequence[subprocess.Popen[str]] = (),
) -> T:
    """Poll `probe` until it returns something other than None; fail after `DEADLINE`.

    Fails at once when one of `procs` has exited: it will never reach the state.
    """
    deadline = time.monotonic() + DEADLINE
    while True:
        result = probe()
        if result is not None:
            return result
        for proc in procs:
            if proc.poll() is not None:
                out, err = proc.communicate()
                pytest.fail(f"waiting for {what}: process exited {proc.returncode}: {out}{err}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def start_migrator(url: str, app_name: str) -> subprocess.Popen[str]:
    """A separate process running `migrate(url)`, its session named `app_name`."""
    return subprocess.Popen(
        [sys.executable, "-c", _MIGRATE_SNIPPET, with_param(url, "application_name", app_name)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    """Subprocesses started by the test; any still running at the end are killed."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def sessions_waiting_on_migrate_lock(conn: psycopg.Connection[Any]) -> set[str]:
    """application_name of every session waiting for the migrators' advisory lock."""
    rows = conn.execute(
        """
        SELECT a.application_name
        FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
        WHERE l.locktype = 'advisory' AND NOT l.granted
          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
          AND l.classid = %s AND l.objid = %s AND l.objsubid = 1
        """,
        (_LOCK_KEY >> 32, _LOCK_KEY & 0xFFFFFFFF),
    ).fetchall()
    return {name for (name,) in rows}


def relations(conn: psycopg.Connection[Any]) -> dict[str, str]:
    """Every relation outside the system schemas: name -> relkind."""
    rows = conn.execute(
        """
        SELECT c.relname, c.relkind::text
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname NOT IN ('pg_catalog', 'information_schema')
          AND n.nspname NOT LIKE 'pg_toast%%' AND n.nspname NOT LIKE 'pg_temp%%'
        """
    ).fetchall()
    return dict(rows)


def tables(conn: psycopg.Connection[Any]) -> set[str]:
    return {name for name, kind in relations(conn).items() if kind in ("r", "p")}


def migration_ids(conn: psycopg.Connection[Any], table: str) -> set[str]:
    rows = conn.execute(f'SELECT migration_id FROM "{table}"').fetchall()
    return {mid for (mid,) in rows}


# --- idempotence and versions ------------------------------------------------------


def test_schema_version_is_the_newest_migration_number() -> None:
    ids = chain_ids()
    assert ids, f"no NNNN_*.sql migration in {MIGRATIONS_DIR}"
    assert max(int(mid[:4]) for mid in ids) == SCHEMA_VERSION
    assert isinstance(SCHEMA_VERSION, int)


def test_migrate_twice_is_a_no_op(empty_db_url: str) -> None:
    assert migrate(empty_db_url) == chain_ids()
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        before = (
            tables(conn),
            conn.execute("SELECT count(*) FROM workflow_yoyo_log").fetchone(),
            conn.execute("SELECT count(*) FROM workflow_yoyo_migration").fetchone(),
        )
    assert migrate(empty_db_url) == []
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        after = (
            tables(conn),
            conn.execute("SELECT count(*) FROM workflow_yoyo_log").fetchone(),
            conn.execute("SELECT count(*) FROM workflow_yoyo_migration").fetchone(),
        )
    assert after == before
    assert schema_version(empty_db_url) == SCHEMA_VERSION


def test_migrated_template_clone_is_current(db_url: str) -> None:
    assert schema_version(db_url) == SCHEMA_VERSION
    assert migrate(db_url) == []


def test_version_is_0_on_an_empty_database_and_current_after(empty_db_url: str) -> None:
    assert schema_version(empty_db_url) == 0
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        assert schema_version(conn) == 0
        assert tables(conn) == set()  # reading the version creates nothing
        migrate(conn)
        assert schema_version(conn) == SCHEMA_VERSION
    assert schema_version(empty_db_url) == SCHEMA_VERSION


def test_schema_outdated_names_both_versions_and_the_command() -> None:
    exc = SchemaOutdated(3, 7)
    message = str(exc)
    assert re.search(r"\b3\b", message), message
    assert re.search(r"\b7\b", message), message
    assert "python -m workflow migrate" in message
    assert (exc.found, exc.needed) == (3, 7)
    assert isinstance(exc, WorkflowError)
    assert workflow.SchemaOutdated is SchemaOutdated


def test_check_schema_raises_schema_outdated_until_migrated(empty_db_url: str) -> None:
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        with pytest.raises(SchemaOutdated) as info:
            check_schema(conn)
        assert (info.value.found, info.value.needed) == (0, SCHEMA_VERSION)
        assert "python -m workflow migrate" in str(info.value)
        migrate(conn)
        check_schema(conn)


# --- open connections --------------------------------------------------------------


def holds_migrate_lock(conn: psycopg.Connection[Any]) -> bool:
    row = conn.execute(
        """
        SELECT count(*) FROM pg_locks
        WHERE locktype = 'advisory' AND pid = pg_backend_pid()
          AND classid = %s AND objid = %s AND objsubid = 1
        """,
        (_LOCK_KEY >> 32, _LOCK_KEY & 0xFFFFFFFF),
    ).fetchone()
    assert row is not None
    return bool(row[0])


@pytest.mark.parametrize("autocommit", [False, True])
def test_migrate_on_an_open_connection_leaves_it_open_and_idle(
    empty_db_url: str, autocommit: bool
) -> None:
    with psycopg.connect(empty_db_url, autocommit=autocommit) as conn:
        assert migrate(conn) == chain_ids()
        assert not conn.closed
        assert conn.autocommit is autocommit
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert migrate(conn) == []
        assert conn.autocommit is autocommit
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        # Still usable, and the advisory lock is not left behind.
        assert conn.execute("SELECT count(*) FROM workflow_runs").fetchone() == (0,)
        assert not holds_migrate_lock(conn)
        conn.rollback()
    assert schema_version(empty_db_url) == SCHEMA_VERSION


def test_migrate_refuses_a_connection_inside_a_transaction(empty_db_url: str) -> None:
    with psycopg.connect(empty_db_url) as conn:
        conn.execute("SELECT 1")
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        with pytest.raises(WorkflowError, match="transaction"):
            migrate(conn)
        # The caller's transaction is untouched and still usable.
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        assert conn.autocommit is False
        conn.execute("SELECT 1")
        conn.rollback()
    assert schema_version(empty_db_url) == 0


def test_migrate_refuses_an_explicit_transaction_block(empty_db_url: str) -> None:
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        with conn.transaction(), pytest.raises(WorkflowError):
            migrate(conn)
        assert conn.autocommit is True
    assert schema_version(empty_db_url) == 0


def test_migrate_refuses_a_failed_transaction(empty_db_url: str) -> None:
    with psycopg.connect(empty_db_url) as conn:
        with pytest.raises(psycopg.errors.UndefinedTable):
            conn.execute("SELECT * FROM no_such_table")
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR
        with pytest.raises(WorkflowError):
            migrate(conn)
        conn.rollback()
    assert schema_version(empty_db_url) == 0


def test_a_failed_migration_leaves_the_connection_idle_and_unlocked(empty_db_url: str) -> None:
    with psycopg.connect(empty_db_url) as conn:
        # A table in the way makes the chain's first CREATE TABLE fail.
        conn.execute("CREATE TABLE workflow_runs (in_the_way int)")
        conn.commit()
        with pytest.raises(psycopg.errors.DuplicateTable):
            migrate(conn)
        assert not conn.closed
        assert conn.autocommit is False
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert not holds_migrate_lock(conn)
        conn.rollback()
        assert schema_version(conn) == 0  # nothing half-recorded
        conn.execute("DROP TABLE workflow_runs")
        conn.commit()
        assert migrate(conn) == chain_ids()
    assert schema_version(empty_db_url) == SCHEMA_VERSION


def test_migrate_accepts_a_connection_with_another_row_factory(empty_db_url: str) -> None:
    with psycopg.connect(empty_db_url, row_factory=dict_row) as conn:
        assert migrate(conn) == chain_ids()
        assert schema_version(conn) == SCHEMA_VERSION
        assert conn.execute("SELECT 1 AS one").fetchone() == {"one": 1}


# --- table names ---------------------------------------------------------------------


YOYO_DEFAULT_TABLES = {"_yoyo_migration", "_yoyo_log", "_yoyo_version", "yoyo_lock"}


def test_only_tables_named_workflow_are_created(empty_db_url: str) -> None:
    migrate(empty_db_url)
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        found = relations(conn)
        created = tables(conn)
    assert {"workflow_runs", "workflow_tasks", "workflow_yoyo_migration"} <= created
    assert not created & YOYO_DEFAULT_TABLES
    assert [name for name in found if "workflow" not in name] == []
    assert [name for name in found if name.startswith("yoyo_tmp")] == []
    bookkeeping = {name for name in created if "yoyo" in name}
    assert bookkeeping <= {
        "workflow_yoyo_migration",
        "workflow_yoyo_log",
        "workflow_yoyo_version",
        "workflow_yoyo_lock",
    }


def test_no_table_without_workflow_in_its_name_is_created_even_briefly(
    empty_db_url: str,
) -> None:
    # yoyo probes for transactional DDL with a table it creates and rolls back; an
    # event trigger reports every CREATE as a notice, which survives the rollback.
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        conn.execute(
            """
            CREATE FUNCTION report_ddl() RETURNS event_trigger LANGUAGE plpgsql AS $$
            DECLARE r record;
            BEGIN
                FOR r IN SELECT * FROM pg_event_trigger_ddl_commands() LOOP
                    RAISE NOTICE 'ddl|%|%', r.command_tag, r.object_identity;
                END LOOP;
            END $$
            """
        )
        conn.execute(
            "CREATE EVENT TRIGGER report_ddl ON ddl_command_end EXECUTE FUNCTION report_ddl()"
        )
        seen: list[tuple[str, str]] = []

        def on_notice(diag: psycopg.errors.Diagnostic) -> None:
            parts = (diag.message_primary or "").split("|")
            if parts[0] == "ddl":
                seen.append((parts[1], parts[2]))

        conn.add_notice_handler(on_notice)
        migrate(conn)
        conn.execute("DROP EVENT TRIGGER report_ddl")

    created = [identity for tag, identity in seen if tag.startswith("CREATE")]
    assert "public.workflow_runs" in created
    assert [identity for identity in created if "workflow" not in identity] == []


# --- concurrency and crashes ---------------------------------------------------------


def test_two_processes_migrating_at_once_both_succeed(
    empty_db_url: str, procs: list[subprocess.Popen[str]]
) -> None:
    names = {f"wf-migrator-{i}-{uuid.uuid4().hex[:8]}" for i in range(2)}
    with psycopg.connect(empty_db_url, autocommit=True) as holder:
        # Hold the lock so that both are inside migrate(), waiting, at the same time.
        holder.execute("SELECT pg_advisory_lock(%s)", (_LOCK_KEY,))
        try:
            procs.extend(start_migrator(empty_db_url, name) for name in sorted(names))
            wait_until(
                lambda: True if sessions_waiting_on_migrate_lock(holder) == names else None,
                "both migrators to wait on the advisory lock",
                procs,
            )
        finally:
            holder.execute("SELECT pg_advisory_unlock(%s)", (_LOCK_KEY,))
    results = [finish(proc) for proc in procs]
    for code, _, err in results:
        assert code == 0, err
    outputs = sorted(out.strip() for _, out, _ in results)
    assert outputs == ["", ",".join(chain_ids())]
    assert schema_version(empty_db_url) == SCHEMA_VERSION
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM workflow_yoyo_migration").fetchone() == (
            len(chain_ids()),
        )


def test_a_migrator_killed_mid_way_does_not_block_the_next(
    empty_db_url: str, procs: list[subprocess.Popen[str]]
) -> None:
    doomed_name = f"wf-doomed-{uuid.uuid4().hex[:8]}"
    next_name = f"wf-next-{uuid.uuid4().hex[:8]}"
    with (
        psycopg.connect(empty_db_url) as blocker,
        psycopg.connect(empty_db_url, autocommit=True) as watch,
    ):
        # An uncommitted table of the same name: the migrator's CREATE TABLE waits
        # for this transaction, inside its own migration, holding the advisory lock.
        blocker.execute("CREATE TABLE workflow_runs (in_the_way int)")
        doomed = start_migrator(empty_db_url, doomed_name)
        procs.append(doomed)

        def stuck_mid_migration() -> int | None:
            row = watch.execute(
                """
                SELECT a.pid FROM pg_stat_activity a
                WHERE a.application_name = %s
                  AND %s = ANY(pg_blocking_pids(a.pid))
                  AND EXISTS (SELECT 1 FROM pg_locks l
                              WHERE l.pid = a.pid AND l.locktype = 'advisory'
                                AND l.granted AND l.objid = %s)
                """,
                (doomed_name, blocker.info.backend_pid, _LOCK_KEY & 0xFFFFFFFF),
            ).fetchone()
            return None if row is None else int(row[0])

        doomed_pid = wait_until(stuck_mid_migration, "the migrator to block mid-way", procs)
        doomed.send_signal(signal.SIGKILL)
        assert doomed.wait(timeout=60) == -signal.SIGKILL

        # The next migrator queues behind the dead one's server session, which still
        # holds the lock (unless the server has already noticed its client is gone).
        nxt = start_migrator(empty_db_url, next_name)
        procs.append(nxt)

        def next_queued_or_lock_gone() -> bool | None:
            if next_name in sessions_waiting_on_migrate_lock(watch):
                return True
            alive = watch.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (doomed_pid,)
            ).fetchone()
            return True if alive == (0,) else None

        wait_until(next_queued_or_lock_gone, "the next migrator to queue", [nxt])
        # Unblocked, the dead migrator's session finds its client gone and ends,
        # rolling back its half-done migration and releasing the advisory lock.
        blocker.rollback()

    code, out, err = finish(nxt)
    assert code == 0, err
    assert out.strip() == ",".join(chain_ids())
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        assert schema_version(conn) == SCHEMA_VERSION
        assert migrate(conn) == []
        columns = conn.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'workflow_runs'"
        ).fetchall()
        assert ("in_the_way",) not in columns
        assert ("claim_id",) in columns


# --- an application's own yoyo chain ---------------------------------------------------


APP_CHAIN = {
    # Numbered above ours, so a version read from yoyo's default tables would show.
    "9001_app_accounts.sql": "CREATE TABLE app_accounts (id int PRIMARY KEY);\n",
    "9002_app_accounts_name.sql": (
        "-- depends: 9001_app_accounts\nALTER TABLE app_accounts ADD COLUMN name text;\n"
    ),
}


def apply_app_chain(url: str, directory: Path) -> list[str]:
    """Apply the application's chain the way an application would: plain yoyo."""
    backend = get_backend(re.sub(r"^postgres(ql)?://", "postgresql+psycopg://", url))
    try:
        with backend.lock():
            pending = backend.to_apply(read_migrations(str(directory)))
            backend.apply_migrations(pending)
            return [m.id for m in pending]
    finally:
        backend.connection.close()


@pytest.mark.parametrize("ours_first", [True, False], ids=["ours-first", "app-first"])
def test_an_application_yoyo_chain_applies_alongside_ours(
    empty_db_url: str, tmp_path: Path, ours_first: bool
) -> None:
    for filename, body in APP_CHAIN.items():
        (tmp_path / filename).write_text(body)
    app_ids = sorted(name[: -len(".sql")] for name in APP_CHAIN)

    if ours_first:
        assert migrate(empty_db_url) == chain_ids()
        assert apply_app_chain(empty_db_url, tmp_path) == app_ids
    else:
        assert apply_app_chain(empty_db_url, tmp_path) == app_ids
        assert schema_version(empty_db_url) == 0
        assert migrate(empty_db_url) == chain_ids()

    assert schema_version(empty_db_url) == SCHEMA_VERSION
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        assert migration_ids(conn, "workflow_yoyo_migration") == set(chain_ids())
        assert migration_ids(conn, "_yoyo_migration") == set(app_ids)
        created = tables(conn)
        assert {"app_accounts", "workflow_runs", "workflow_tasks"} <= created
        assert "_yoyo_migration" in created

    # Both chains are up to date from either side, and neither sees the other's.
    assert migrate(empty_db_url) == []
    assert apply_app_chain(empty_db_url, tmp_path) == []
    assert schema_version(empty_db_url) == SCHEMA_VERSION


# Migrations that build an index no other serves, and rebuild it when a failed `CREATE INDEX
# CONCURRENTLY` (their headers suggest building it so) left it invalid: (migration, index,
# its columns, its predicate).
REBUILDING = [
    ("0010_ready_per_workflow", "workflow_runs_ready_per_workflow",
     "(workflow, next_retry_at, created_at, id)", "num_nonnulls(claim_id, finished_at) = 0"),
    ("0011_key_due_per_workflow", "workflow_runs_key_due_per_workflow",
     "(workflow, next_retry_at)", "num_nonnulls(finished_at, key_slot) = 0"),
]


@pytest.mark.parametrize(("migration", "index", "columns", "predicate"), REBUILDING)
def test_a_migration_rebuilds_its_index_left_invalid_by_a_failed_concurrent_build(
    empty_db_url: str, migration: str, index: str, columns: str, predicate: str
) -> None:
    """The queries that read such an index have no other to read: one of its name that is
    invalid is not kept by IF NOT EXISTS, but dropped and built again."""
    migrate(empty_db_url)
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        conn.execute(f"DROP INDEX {index}")
        conn.execute(
            "INSERT INTO workflow_runs (id, workflow, status, input, task_count, current_seq)"
            " SELECT gen_random_uuid(), 'W', 'pending', '{}', 1, 1 FROM generate_series(1, 2)"
        )
        with pytest.raises(psycopg.errors.UniqueViolation):  # fails, leaving it invalid
            conn.execute(f"CREATE UNIQUE INDEX CONCURRENTLY {index} ON workflow_runs (workflow)")
        conn.execute("DELETE FROM workflow_yoyo_migration WHERE migration_id = %s", (migration,))
    assert migrate(empty_db_url) == [migration]
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT i.indisvalid, pg_get_indexdef(i.indexrelid) FROM pg_index i"
            " WHERE i.indexrelid = %s::regclass",
            (index,),
        ).fetchone()
    assert row is not None and row[0] is True
    assert columns in row[1]
    assert predicate in row[1]


# Every index of workflow_runs and what reads it. An index no query reads still costs an
# entry at every insert or non-HOT update of the rows it holds.
RUN_INDEXES = {
    "workflow_runs_pkey": "every lookup by run id",
    "workflow_runs_idempotency": "start with an idempotency key",
    "workflow_runs_claims": "heartbeat, sweep, a claim's recovery after a lost reply",
    "workflow_runs_ready_per_workflow": "the claims (0010), next_due, gauges, stats, KEDA",
    "workflow_runs_key_slots": "per-key limits: the slots held",
    "workflow_runs_key_queue": "per-key limits: the runs waiting for a slot; gauges, stats",
    "workflow_runs_key_due_per_workflow": "next_due's keyed half (0011)",
    "workflow_runs_finished": "prune, stats and gauges of finished runs",
    "workflow_runs_created": "listing newest first",
}


def test_the_runs_table_has_the_indexes_its_readers_need(empty_db_url: str) -> None:
    """Each index of workflow_runs is here for a reader named above: one added or dropped
    is a decision to make here too."""
    migrate(empty_db_url)
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        names = {name for (name,) in conn.execute(
            "SELECT indexrelid::regclass::text FROM pg_index"
            " WHERE indrelid = 'workflow_runs'::regclass"
        )}
    assert names == set(RUN_INDEXES)


# PostgreSQL reads a table's CHECK constraints back from node text, and prepares them, at
# every INSERT or UPDATE of it (PostgreSQL 15's ExecRelCheck), prepared statements
# included. A list of constants spelt `IN (...)` or `ARRAY[...]` is stored as an array
# expression of one constant each (their bytes written out one number at a time), folded
# into one constant again at each execution: until 0012 the status check was that, 1,234
# of the 3,861 characters of workflow_runs' checks (bench/README.md, "The checks
# PostgreSQL reads at every write"). One array constant (`'{...}'::text[]`) is the same
# rule at a fraction of the cost.


def test_the_runs_checks_hold_no_array_to_fold_at_every_write_and_keep_their_rules(
    empty_db_url: str,
) -> None:
    migrate(empty_db_url)
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        checks = dict(conn.execute(
            "SELECT conname, conbin::text FROM pg_constraint WHERE contype = 'c'"
            " AND conrelid IN ('workflow_runs'::regclass, 'workflow_tasks'::regclass)"
        ).fetchall())
        assert "workflow_runs_status_check" in checks
        assert [name for name, text in checks.items() if "{ARRAYEXPR" in text] == []
        assert checks["workflow_runs_status_check"].count("{CONST") == 1
        insert = (
            "INSERT INTO workflow_runs (id, workflow, status, input, task_count, current_seq)"
            " VALUES (gen_random_uuid(), 'W', %s, '{}', 1, 1)"
        )
        for status in ("pending", "running", "succeeded", "parked", "cancelled"):
            conn.execute(insert, (status,))
        with pytest.raises(psycopg.errors.CheckViolation, match="workflow_runs_status_check"):
            conn.execute(insert, ("done",))
        with pytest.raises(psycopg.errors.CheckViolation, match="workflow_runs_status_check"):
            conn.execute("UPDATE workflow_runs SET status = 'Pending'")
        with pytest.raises(psycopg.errors.NotNullViolation):
            conn.execute(insert, (None,))


# Each rule of workflow_runs refuses a row that breaks it, by insert and by update, under
# its constraint's name; the rows beside them are the shapes the engine writes.

_A_RUN = {"workflow": "W", "status": "pending", "input": "{}", "task_count": 1, "current_seq": 1}
_NOW = "2026-12-07T00:00:00Z"
RUN_ROWS: list[tuple[str | None, dict[str, Any]]] = [
    # (the constraint the row breaks, or None; the columns that differ from _A_RUN)
    *((None, {"status": status})
      for status in ("pending", "running", "succeeded", "parked", "cancelled")),
    (None, {"input": None, "input_sealed": b"sealed"}),
    (None, {"context": "{}"}),
    (None, {"context_sealed": b"sealed"}),
    (None, {"claim_id": uuid.uuid4(), "heartbeat_at": _NOW}),
    (None, {"concurrency_key": b"k"}),
    (None, {"concurrency_key": b"k", "key_slot": 0}),
    ("workflow_runs_status_check", {"status": "done"}),
    ("workflow_runs_status_check", {"status": "Pending"}),
    ("workflow_runs_task_count_check", {"task_count": 0}),
    ("workflow_runs_one_input", {"input": None}),
    ("workflow_runs_one_input", {"input_sealed": b"sealed"}),
    ("workflow_runs_one_context", {"context": "{}", "context_sealed": b"sealed"}),
    ("workflow_runs_claim_heartbeat", {"claim_id": uuid.uuid4()}),
    ("workflow_runs_claim_heartbeat", {"heartbeat_at": _NOW}),
    ("workflow_runs_key_slot", {"key_slot": 0}),
    ("workflow_runs_key_slot", {"concurrency_key": b"k", "key_slot": -1}),
]


def test_each_of_the_runs_rules_refuses_a_row_that_breaks_it_under_its_name(
    empty_db_url: str,
) -> None:
    """Every row of RUN_ROWS is taken or refused, by insert and by update, naming the
    constraint it breaks; a NULL status is refused by its NOT NULL constraint."""
    migrate(empty_db_url)
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        def insert(columns: dict[str, Any]) -> str:
            run = {"id": uuid.uuid4(), **_A_RUN, **columns}
            conn.execute(sql.SQL("INSERT INTO workflow_runs ({}) VALUES ({})").format(
                sql.SQL(", ").join(map(sql.Identifier, run)),
                sql.SQL(", ").join(sql.Placeholder() * len(run))), list(run.values()))
            return str(run["id"])

        checks = {name for (name,) in conn.execute(
            "SELECT conname FROM pg_constraint"
            " WHERE contype = 'c' AND conrelid = 'workflow_runs'::regclass"
        )}
        assert checks == {broken for broken, _ in RUN_ROWS if broken}, "a rule without a row here"
        for broken, columns in RUN_ROWS:
            if broken is None:
                insert(columns)
                continue
            with pytest.raises(psycopg.errors.CheckViolation, match=broken) as refused:
                insert(columns)
            assert refused.value.diag.constraint_name == broken
            assert refused.value.diag.table_name == "workflow_runs"
            run_id = insert({})
            with pytest.raises(psycopg.errors.CheckViolation, match=broken) as refused:
                update = sql.SQL("UPDATE workflow_runs SET ({}) = ROW({}) WHERE id = %s")
                conn.execute(update.format(
                    sql.SQL(", ").join(map(sql.Identifier, columns)),
                    sql.SQL(", ").join(sql.Placeholder() * len(columns))),
                    [*columns.values(), run_id])
            assert refused.value.diag.constraint_name == broken
            assert refused.value.diag.table_name == "workflow_runs"
        with pytest.raises(psycopg.errors.NotNullViolation):
            insert({"status": None})


# The indexes 0013 dropped, as 0012 had them (pg_get_indexdef on PostgreSQL 15 and 18).
DROPPED_BY_0013 = {
    "workflow_runs_ready": "USING btree (next_retry_at, created_at, id) WHERE ((claim_id IS NULL)"
    " AND (finished_at IS NULL) AND ((concurrency_key IS NULL) OR (key_slot IS NOT NULL)))",
    "workflow_runs_claimable": "USING btree (created_at, id) WHERE ((claim_id IS NULL)"
    " AND (finished_at IS NULL))",
    "workflow_runs_key_due": "USING btree (next_retry_at) WHERE ((finished_at IS NULL)"
    " AND (concurrency_key IS NOT NULL) AND (key_slot IS NULL))",
}


def test_0013_drops_the_global_claim_indexes_and_its_rollback_brings_them_back(
    empty_db_url: str,
) -> None:
    """The contraction of 0010 and 0011: the three indexes no query of 0011 or later reads
    are gone, and the rollback (for code older than 0011) builds them as they were, one
    left invalid by a failed concurrent build too."""
    migrate(empty_db_url)

    def defs(conn: psycopg.Connection[Any]) -> dict[str, str]:
        return {
            name: indexdef.split(" ON public.workflow_runs ")[1]
            for name, indexdef in conn.execute(
                "SELECT indexname, indexdef FROM pg_indexes"
                " WHERE tablename = 'workflow_runs' AND indexname = ANY(%s)",
                (list(DROPPED_BY_0013),),
            )
        }

    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        assert defs(conn) == {}
        conn.execute(
            "INSERT INTO workflow_runs (id, workflow, status, input, task_count, current_seq)"
            " SELECT gen_random_uuid(), 'W', 'pending', '{}', 1, 1 FROM generate_series(1, 2)"
        )
        with pytest.raises(psycopg.errors.UniqueViolation):  # fails, leaving it invalid
            conn.execute(
                "CREATE UNIQUE INDEX CONCURRENTLY workflow_runs_ready ON workflow_runs (workflow)"
            )
        conn.execute(
            (MIGRATIONS_DIR / "0013_drop_global_claim_indexes.rollback.sql").read_text("utf-8")
        )
        assert defs(conn) == DROPPED_BY_0013
        invalid = conn.execute(
            "SELECT count(*) FROM pg_index WHERE indrelid = 'workflow_runs'::regclass"
            " AND NOT indisvalid"
        ).fetchone()
        assert invalid == (0,)
        conn.execute((MIGRATIONS_DIR / "0013_drop_global_claim_indexes.sql").read_text("utf-8"))
        assert defs(conn) == {}
