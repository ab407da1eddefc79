"""Flask integration: one pool and one `Manager` per process, built on first use.

    import workflow
    from workflow.contrib.flask import WorkflowExtension, current_manager

    workflow_ext = WorkflowExtension(registry=make_registry())

    def create_app() -> Flask:
        app = Flask(__name__)
        app.config["WORKFLOW_DATABASE_URL"] = os.environ["WORKFLOW_DATABASE_URL"]
        workflow_ext.init_app(app)
        return app

    @bp.post("/transfers")
    def create_transfer():
        run = Transfer.start(current_manager, TransferInput(...))
        return {"id": run.id}, 202

Nothing connects before the first use in a process, so the application may be
imported by Gunicorn's master (`preload_app`) and forked: each worker builds its
own pool and manager on its first request, and one that sees a different process
id than the one it built in builds afresh. Close them in Gunicorn's `worker_exit`
hook with `workflow_ext.close()`; they are also closed at interpreter exit.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, cast

from flask import Flask, current_app, has_app_context
from psycopg_pool import ConnectionPool
from werkzeug.local import LocalProxy

from workflow.app import App
from workflow.config import Config
from workflow.contrib._process import ProcessManager
from workflow.definition import Registry
from workflow.durations import Duration
from workflow.manager import Manager

EXTENSION_NAME = "workflow"
"""The key of this extension in `app.extensions`."""

CONFIG_KEY = "WORKFLOW_DATABASE_URL"
"""The `app.config` key (and environment variable) read for the database URL."""


class WorkflowExtension:
    """Owns one connection pool and one `Manager` per process for a Flask app.

    `registry` holds the workflows the app starts and runs; `config` and `logger`
    are given to the `Manager`. `database_url` defaults to
    `app.config["WORKFLOW_DATABASE_URL"]`, then to `$WORKFLOW_DATABASE_URL`, read
    when the pool is first built. `pool_options` are keyword arguments for
    `psycopg_pool.ConnectionPool` (e.g. `{"max_size": 32}`, or
    `{"kwargs": {"autocommit": True, "prepare_threshold": None}}` behind
    PgBouncer). `on_manager(manager)` is called with each process's manager once
    it is built (`on_manager=workflow.metrics.instrument` exports its metrics);
    what it returns is closed with the manager when it has a `close()`.
    Building nothing until first use is what makes it fork-safe.
    """

    def __init__(
        self,
        app: Flask | None = None,
        *,
        registry: Registry,
        config: Config | None = None,
        database_url: str | None = None,
        logger: logging.Logger | None = None,
        pool_options: Mapping[str, Any] | None = None,
        on_manager: Callable[[Manager], object] | None = None,
    ) -> None:
        if not isinstance(registry, Registry):
            raise TypeError(
                f"WorkflowExtension needs a workflow.Registry, not {type(registry).__name__}"
            )
        self._registry = registry
        self._config = config
        self._database_url = database_url
        self._logger = logger
        self._pool_options = dict(pool_options or {})
        if on_manager is not None and not callable(on_manager):
            raise TypeError(f"on_manager must be callable, not {type(on_manager).__name__}")
        self._on_manager = on_manager
        self._processes: list[ProcessManager] = []
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask) -> None:
        """Register the extension on `app`; connects to nothing.

        Raises `RuntimeError` when it is already registered on `app`.
        """
        if EXTENSION_NAME in app.extensions:
            raise RuntimeError(f"a workflow extension is already registered on {app!r}")

        def conninfo() -> str:
            url = (
                self._database_url
                or app.config.get(CONFIG_KEY)
                or os.environ.get(CONFIG_KEY)
            )
            if not url:
                raise RuntimeError(
                    f"workflow: no database URL for {app.name!r}: set "
                    f"app.config[{CONFIG_KEY!r}] or ${CONFIG_KEY}, or pass "
                    "WorkflowExtension(database_url=...)"
                )
            return str(url)

        process = ProcessManager(
            name=f"workflow-flask-{app.name}",
            conninfo=conninfo,
            app=lambda: App(self._registry, self._config, self._logger),
            pool_options=lambda: self._pool_options,
            on_manager=lambda: self._on_manager,
        )
        app.extensions[EXTENSION_NAME] = process
        self._processes.append(process)

    def _process(self, app: Flask | None) -> ProcessManager:
        if app is None and not has_app_context():
            if len(self._processes) == 1:
                return self._processes[0]
            raise RuntimeError(
                "the workflow extension is registered on "
                f"{len(self._processes)} apps: use it inside an app context, or pass the app"
            )
        target = app if app is not None else current_app
        process = target.extensions.get(EXTENSION_NAME)
        if not any(process is known for known in self._processes):
            raise RuntimeError(
                f"this workflow extension is not registered on {target.name!r}: "
                "call init_app(app)"
            )
        assert isinstance(process, ProcessManager)
        return process

    def get_manager(self, app: Flask | None = None) -> Manager:
        """The manager of `app` (default: the current app, or the only one) in this process.

        The first call in a process builds the pool and the manager: it blocks
        until a connection is open and the schema version is read, and raises
        `workflow.WorkflowError` when the database cannot be reached and
        `workflow.SchemaOutdated` when its schema is behind.
        """
        return self._process(app).manager()

    def get_pool(self, app: Flask | None = None) -> ConnectionPool[Any]:
        """The connection pool of `app` in this process (autocommit connections).

        For `start_tx`: `with pool.connection() as conn, conn.transaction(): ...`.
        Builds the pool and the manager on first use, like `get_manager`.
        """
        return self._process(app).pool()

    @property
    def manager(self) -> Manager:
        """`get_manager()`: this process's manager of the current (or only) app."""
        return self.get_manager()

    @property
    def pool(self) -> ConnectionPool[Any]:
        """`get_pool()`: this process's pool of the current (or only) app."""
        return self.get_pool()

    def close(self, timeout: Duration | None = None) -> None:
        """Close this process's managers (draining them, up to `timeout` each) and pools.

        In-flight fast-path executions finish their attempt and release their
        claims (a worker picks the runs up). Call it from Gunicorn's `worker_exit`
        hook; it runs at interpreter exit too. A later use builds afresh.
        """
        for process in self._processes:
            process.close(timeout)


def _current_manager() -> Manager:
    extension = current_app.extensions.get(EXTENSION_NAME)
    if not isinstance(extension, ProcessManager):
        raise RuntimeError(
            f"no workflow extension on {current_app.name!r}: call "
            "WorkflowExtension(...).init_app(app)"
        )
    return extension.manager()


current_manager = cast(Manager, LocalProxy(_current_manager))
"""The current app's `Manager` in this process (a proxy; needs an app context).

Pass it wherever a manager is taken: `Transfer.start(current_manager, input)`.
"""
