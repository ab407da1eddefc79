"""Applying the `workflow_migrations` yoyo chain, reading the database's version, and
creating or dropping a scratch database (the demo's).

yoyo is used as a library with three changes: every bookkeeping table carries
our prefix (`workflow_yoyo_*`), so the application's own yoyo chain never sees
ours; the whole apply runs under a PostgreSQL advisory lock, which dies with its
session, so a migrator killed half-way never wedges the next one; and yoyo's
probe table for transactional DDL is never created (PostgreSQL has it); and a
migration's steps commit in the same transaction as its bookkeeping row.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import pq, sql
from psycopg.rows import tuple_row
from yoyo import read_migrations
from yoyo.backends.core.postgresql import PostgresqlPsycopgBackend
from yoyo.connections import parse_uri

import workflow_migrations
from workflow.errors import WorkflowError
from workflow.store.connections import connect

SCHEMA_VERSION = 13
"""The number of the newest migration in the chain this code was built with."""

TABLE_PREFIX = "workflow_yoyo_"
MIGRATION_TABLE = TABLE_PREFIX + "migration"

# pg_advisory_lock key shared by every migrator of this chain ("pgwf" in ASCII).
_LOCK_KEY = 0x70677766


class SchemaOutdated(WorkflowError):
    """The database's schema is behind the version this code needs."""

    def __init__(self, found: int, needed: int) -> None:
        super().__init__(
            f"workflow: the database schema is at version {found}, this code needs "
            f"{needed}: run `python -m workflow migrate` (or workflow.store.migrate(url))"
        )
        self.found = found
        self.needed = needed


class _Backend(PostgresqlPsycopgBackend):  # type: ignore[misc]
    """yoyo's psycopg 3 backend on a connection we own, with prefixed tables."""

    log_table = TABLE_PREFIX + "log"
    lock_table = TABLE_PREFIX + "lock"
    version_table = TABLE_PREFIX + "version"

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._given = conn
        super().__init__(parse_uri("postgresql+psycopg:///"), MIGRATION_TABLE)
        self.has_transactional_ddl = True

    def connect(self, dburi: Any) -> psycopg.Connection[Any]:
        return self._given

    def _check_transactional_ddl(self) -> bool:
        return True

    def create_lock_table(self) -> None:
        # lock() is the advisory lock below: yoyo's lock table is never needed.
        pass

    def cursor(self) -> psycopg.Cursor[tuple[Any, ...]]:
        # yoyo reads rows by position, whatever row factory the caller's connection has.
        return self._given.cursor(row_factory=tuple_row)

    @contextmanager
    def lock(self, timeout: int = 10) -> Iterator[None]:
        # The caller holds the advisory lock for the whole apply.
        yield

    def apply_one(self, migration: Any, force: bool = False, mark: bool = True) -> None:
        # yoyo applies the steps on a second connection and records them in a later
        # transaction; a kill in between would leave a migration applied but
        # unrecorded. Here the steps and their record commit together.
        self.ensure_internal_schema_updated()
        with self.transaction():
            migration.process_steps(self, "apply", force=force)
            self.log_migration(migration, "apply")
            if mark:
                self.mark_one(migration, log=False)


def migrate(url_or_conn: str | psycopg.Connection[Any]) -> list[str]:
    """Apply every migration of the chain not yet applied; return their ids.

    Takes a `postgresql://` URL or an open psycopg connection that is not inside a
    transaction (the connection is left open and idle). Idempotent, and safe from
    several processes at once: they serialise on an advisory lock. Blocks while
    another process migrates. Raises `WorkflowError` for a connection inside a
    transaction, and psycopg's errors for an unreachable database.
    """
    if isinstance(url_or_conn, str):
        with connect(url_or_conn) as conn:
            return _migrate(conn)
    conn = url_or_conn
    if conn.info.transaction_status != pq.TransactionStatus.IDLE:
        raise WorkflowError(
            "workflow: migrate() needs a connection outside any transaction; commit or "
            "roll back first (it runs its own transactions on it)"
        )
    saved = conn.autocommit
    conn.autocommit = True
    try:
        return _migrate(conn)
    finally:
        if conn.info.transaction_status == pq.TransactionStatus.IDLE:
            conn.autocommit = saved


def _migrate(conn: psycopg.Connection[Any]) -> list[str]:
    conn.execute("SELECT pg_advisory_lock(%s)", (_LOCK_KEY,))
    try:
        backend = _Backend(conn)
        backend.init_database()
        chain = read_migrations(os.path.dirname(workflow_migrations.__file__))
        migrations = chain.__class__([m for m in chain if re.match(r"\d+_", m.id)])
        pending = backend.to_apply(migrations)
        backend.apply_migrations(pending)
        return [m.id for m in pending]
    finally:
        if conn.info.transaction_status != pq.TransactionStatus.IDLE:
            conn.rollback()
        conn.execute("SELECT pg_advisory_unlock(%s)", (_LOCK_KEY,))


def schema_version(url_or_conn: str | psycopg.Connection[Any]) -> int:
    """The highest migration number the bookkeeping records as applied; 0 when none."""
    if isinstance(url_or_conn, str):
        with connect(url_or_conn) as conn:
            return schema_version(conn)
    cur = url_or_conn.cursor(row_factory=tuple_row)
    row = cur.execute("SELECT to_regclass(%s) IS NOT NULL", (MIGRATION_TABLE,)).fetchone()
    if row is None or not row[0]:
        return 0
    ids = cur.execute(f"SELECT migration_id FROM {MIGRATION_TABLE}").fetchall()
    numbers = [int(m.group(1)) for (mid,) in ids if (m := re.match(r"(\d+)_", mid))]
    return max(numbers, default=0)


def check_schema(conn: psycopg.Connection[Any]) -> None:
    """Raise `SchemaOutdated` when the database is behind `SCHEMA_VERSION`."""
    found = schema_version(conn)
    if found < SCHEMA_VERSION:
        raise SchemaOutdated(found, SCHEMA_VERSION)


def create_database(conn: psycopg.Connection[Any], name: str) -> bool:
    """Create database `name` (autocommit `conn`); False when the role may not."""
    try:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    except psycopg.errors.InsufficientPrivilege:
        return False
    return True


def drop_database(conn: psycopg.Connection[Any], name: str) -> None:
    """Drop database `name` if it exists, ending its sessions (autocommit `conn`)."""
    force = " WITH (FORCE)" if conn.info.server_version >= 130000 else ""
    conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}" + force).format(sql.Identifier(name)))
