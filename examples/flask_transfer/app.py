"""The Transfer workflow in a Flask app: `POST /transfers` starts a run, `GET` shows it.

    gunicorn -c examples/flask_transfer/gunicorn.conf.py examples.flask_transfer.app:app

The database is `$WORKFLOW_DATABASE_URL`. Runs execute on the fast path of the
Gunicorn worker that served the request; `python -m workflow.worker --app
examples.flask_transfer.worker:registry` finishes whatever a worker process left
behind (a restart, a deploy, a full fast path).
"""

from __future__ import annotations

import os
from threading import Event
from typing import Any

import attrs
from flask import Flask, request

import workflow
from workflow.contrib.flask import WorkflowExtension, current_manager


@attrs.frozen
class TransferInput:
    account: str
    amount_cents: int


@attrs.frozen
class Reserved:
    id: str
    pid: int  # the process that executed the task: the fast path runs it where it started


Transfer = workflow.Workflow("Transfer.Send", TransferInput)
reserve = workflow.Task("transfer.reserve", Reserved)
send = workflow.Task("transfer.send")  # records nothing

# Stands in for the payment provider's response time.
PROVIDER_LATENCY = float(os.environ.get("TRANSFER_PROVIDER_LATENCY", "0.05"))


def provider_send(hold_id: str, *, key: str, timeout: float, cancelled: Event) -> None:
    """A fake payment provider: takes PROVIDER_LATENCY, gives up early on shutdown."""
    if cancelled.wait(min(PROVIDER_LATENCY, timeout)):
        raise workflow.Cancelled(f"sending {hold_id} ({key}) was interrupted")


def do_reserve(run: workflow.TaskRun[TransferInput]) -> Reserved:
    # A real handler asks the provider for a hold, passing run.idempotency_key.
    return Reserved(id=f"hold-{run.idempotency_key}", pid=os.getpid())


def do_send(run: workflow.TaskRun[TransferInput]) -> None:
    hold = run.output(reserve)
    provider_send(
        hold.id, key=run.idempotency_key, timeout=run.remaining(), cancelled=run.cancelled
    )


def make_registry() -> workflow.Registry:
    reg = workflow.Registry()
    reg.register(
        workflow.define(
            Transfer,
            workflow.handle(reserve, do_reserve, max_attempts=8),
            workflow.handle(send, do_send, timeout=30),
        )
    )
    return reg


# Connects to nothing until the first request of each Gunicorn worker.
workflow_ext = WorkflowExtension(registry=make_registry())


def create_app() -> Flask:
    app = Flask(__name__)
    app.config["WORKFLOW_DATABASE_URL"] = os.environ.get("WORKFLOW_DATABASE_URL")
    workflow_ext.init_app(app)

    @app.post("/transfers")
    def start_transfer() -> tuple[dict[str, Any], int]:
        body = request.get_json(force=True)
        try:
            transfer = TransferInput(str(body["account"]), int(body["amount_cents"]))
        except (KeyError, TypeError, ValueError):
            return {"error": "give account and amount_cents"}, 400
        run = Transfer.start(
            current_manager, transfer, idempotency_key=request.headers.get("Idempotency-Key")
        )
        return {"id": run.id, "pid": os.getpid()}, 202

    @app.get("/transfers/<run_id>")
    def show_transfer(run_id: str) -> tuple[dict[str, Any], int]:
        try:
            status = current_manager.run(run_id).status()
        except workflow.RunNotFound:
            return {"error": "no such transfer"}, 404
        failure = status.failure
        return {
            "id": run_id,
            "status": status.status.value,
            "failure": None if failure is None else attrs.asdict(failure),
            "created_at": status.created_at.isoformat(),
            "finished_at": status.finished_at and status.finished_at.isoformat(),
        }, 200

    _mount_dashboard(app)
    return app


def _loopback_only(environ: dict[str, Any]) -> str | None:
    """The example's dashboard access rule: write from this machine, nothing otherwise."""
    return "write" if environ.get("REMOTE_ADDR") in ("127.0.0.1", "::1") else None


def _mount_dashboard(app: Flask) -> None:
    """The dashboard at /ops/workflow, when pgworkflow[dashboard] is installed. Its
    Admin and pool are built on its first request in each Gunicorn worker, never in
    the master."""
    try:
        from werkzeug.middleware.dispatcher import DispatcherMiddleware

        from workflow.contrib.dashboard import make_app
    except ImportError:
        return
    dashboard = make_app(lambda: os.environ["WORKFLOW_DATABASE_URL"], authorize=_loopback_only)
    app.wsgi_app = DispatcherMiddleware(app.wsgi_app, {"/ops/workflow": dashboard})  # type: ignore[method-assign]


app = create_app()
