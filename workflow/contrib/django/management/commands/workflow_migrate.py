"""`manage.py workflow_migrate`: `python -m workflow migrate` on the project's database."""

from __future__ import annotations

from typing import Any

import psycopg
from django.core.management.base import BaseCommand, CommandError, CommandParser

from workflow.contrib.django import conf
from workflow.errors import WorkflowError
from workflow.store import migrate, schema_version


class Command(BaseCommand):
    help = (
        "Apply pgworkflow's schema migrations (its own chain, not Django's) to the database "
        "of WORKFLOW['DATABASE_ALIAS']. Idempotent, safe to run from several processes."
    )
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--database",
            metavar="ALIAS",
            help="the database alias (default: WORKFLOW['DATABASE_ALIAS'], else 'default')",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        alias = options.get("database") or conf.database_alias()
        conninfo, _ = conf.connection_settings(alias)
        try:
            with psycopg.connect(conninfo, autocommit=True) as conn:
                applied = migrate(conn)
                version = schema_version(conn)
        except (psycopg.Error, WorkflowError) as exc:
            raise CommandError(f"workflow: migrate failed: {' '.join(str(exc).split())}") from None
        if not applied:
            self.stdout.write(f"workflow: the database schema is up to date (version {version})")
            return
        for migration_id in applied:
            self.stdout.write(f"workflow: applied {migration_id}")
        self.stdout.write(f"workflow: the database schema is now at version {version}")
