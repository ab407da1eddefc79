"""Django integration: the `WORKFLOW` setting, one manager per process, `start_on_commit`.

    INSTALLED_APPS = [..., "workflow.contrib.django"]
    WORKFLOW = {"REGISTRY": "transfers.workflows:registry"}   # see conf.py

    from django.db import transaction
    from workflow.contrib.django import start_on_commit

    with transaction.atomic():
        transfer = Transfer.objects.create(account=account, amount_cents=amount)
        run = start_on_commit(TransferWorkflow, TransferInput(account, amount))

The run is inserted on Django's own connection, inside the current transaction:
it exists if and only if that transaction commits, and on commit this process
executes it on the fast path (or a worker does: `manage.py workflow_worker`).
`manage.py workflow_migrate` creates the tables. The database must use the
psycopg 3 backend.
"""

from __future__ import annotations

from typing import TypeVar

from django.apps import apps as django_apps
from django.core.exceptions import ImproperlyConfigured
from django.db import connections, transaction

from workflow.app import App
from workflow.contrib.django import conf
from workflow.contrib.django.apps import WorkflowConfig
from workflow.definition import Workflow
from workflow.durations import Duration
from workflow.logs import EngineLog
from workflow.manager import Manager
from workflow.run import Run

__all__ = ["close", "get_manager", "start_on_commit", "workflow_app"]

In = TypeVar("In")


def _app_config() -> WorkflowConfig:
    try:
        config = django_apps.get_app_config("workflow")
    except LookupError:
        raise ImproperlyConfigured(
            'add "workflow.contrib.django" to INSTALLED_APPS to use workflow.contrib.django'
        ) from None
    if not isinstance(config, WorkflowConfig):
        raise ImproperlyConfigured(
            f"the app labelled 'workflow' is {config.name!r}, not workflow.contrib.django"
        )
    return config


def workflow_app() -> App:
    """The registry, config and logger the `WORKFLOW` setting names, resolved once.

    `manage.py workflow_worker` runs it by default (`--app
    workflow.contrib.django:workflow_app`).
    """
    return _app_config().workflow_app()


def get_manager() -> Manager:
    """This process's manager, built with its own pool on first use.

    The first call blocks until a connection is open and the schema version is
    read; it raises `workflow.WorkflowError` when the database cannot be reached,
    `workflow.SchemaOutdated` when it is behind (run `manage.py workflow_migrate`)
    and `ImproperlyConfigured` for a bad `WORKFLOW` setting.
    """
    return _app_config().process.manager()


def close(timeout: Duration | None = None) -> None:
    """Close this process's manager (draining it, up to `timeout`) and its pool.

    Happens at interpreter exit too; call it from a server's worker-exit hook
    (Gunicorn: `worker_exit`) to drain in-flight runs before the process ends.
    """
    _app_config().process.close(timeout)


def start_on_commit(
    workflow_: Workflow[In],
    input: In,
    *,
    idempotency_key: str | None = None,
    using: str | None = None,
) -> Run:
    """Start a run inside the current transaction; execute it here once that commits.

    Inserts with `workflow_.start_tx` on Django's own connection for `using`
    (default: `WORKFLOW["DATABASE_ALIAS"]`), inside the current `atomic()` block
    (outside one, in a transaction of its own), so the run exists if and only if
    the transaction commits. `transaction.on_commit` then claims it by id and
    executes it on this process's fast path when there is room; otherwise a
    worker picks it up. On rollback nothing remains and nothing runs.

    Blocks on one or two statements. Raises `workflow.EncodeError` before
    sending any SQL (the transaction stays usable), `TransactionManagementError`
    in a transaction already marked for rollback, and what `get_manager()` raises.
    """
    alias = using or conf.database_alias()
    connection = connections[alias]
    manager = get_manager()

    def insert() -> Run:
        connection.validate_no_broken_transaction()
        connection.ensure_connection()
        run = workflow_.start_tx(
            connection.connection, manager, input, idempotency_key=idempotency_key
        )
        transaction.on_commit(lambda: _kick(manager, run), using=alias)
        return run

    if connection.in_atomic_block:
        return insert()
    with transaction.atomic(using=alias):
        return insert()


def _kick(manager: Manager, run: Run) -> None:
    """Claim `run` by id and execute it on the fast path; a worker gets it otherwise."""
    try:
        manager.kick(run.id)
    except Exception:
        # The transaction has committed: the run is safe in the table, and failing
        # the request now would tell the caller otherwise.
        EngineLog(manager.logger).for_run(run.id).warning(
            "executing it after commit failed; a worker will pick it up", exc_info=True
        )
