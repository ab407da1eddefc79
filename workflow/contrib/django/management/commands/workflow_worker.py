"""`manage.py workflow_worker`: `python -m workflow.worker` with the project's settings."""

from __future__ import annotations

import argparse
import threading
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from workflow import worker
from workflow.contrib.django import conf
from workflow.store.connections import one_line

DEFAULT_APP = "workflow.contrib.django:workflow_app"
"""The app the command runs without `--app`: the `WORKFLOW` setting's registry and config."""


class Command(BaseCommand):
    help = (
        "Run one pgworkflow worker: claim runs left in the tables, execute them, sweep "
        "stale claims, prune old finished runs. Takes the options of "
        "`python -m workflow.worker`; --app defaults to settings.WORKFLOW, --database-url "
        "to the database of WORKFLOW['DATABASE_ALIAS']. "
        "SIGTERM or SIGINT drains and exits 0; a second signal exits at once."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        # The worker's own options, validators and help, so the two never drift apart.
        worker.add_arguments(
            parser,
            app_required=False,
            app_help=(
                "a callable returning a workflow.Registry or workflow.App (default: "
                "settings.WORKFLOW['REGISTRY'] and ['CONFIG'])"
            ),
            database_url_help=(
                "a postgresql:// URL (default: WORKFLOW['DATABASE_ALIAS']'s settings)"
            ),
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise CommandError("workflow_worker must run in the main thread (it handles signals)")
        namespace = argparse.Namespace(**options)
        if namespace.app is None:
            namespace.app = DEFAULT_APP
        if not namespace.database_url:
            namespace.database_url = conf.connection_settings(conf.database_alias())[0]
        with worker.handling_signals() as signals:
            try:
                worker.serve(namespace, signals)
            except worker.UsageError as exc:
                raise CommandError(one_line(exc), returncode=2) from None
            except worker.CommandFailed as exc:
                raise CommandError(one_line(exc), returncode=1) from None
