"""The Django app `workflow.contrib.django` (label `workflow`): one manager per process."""

from __future__ import annotations

import types
from typing import Any

from django.apps import AppConfig

from workflow.app import App
from workflow.contrib._process import ProcessManager
from workflow.contrib.django import conf


class WorkflowConfig(AppConfig):
    """Builds the pool and `Manager` lazily, on first use in each process.

    Add `"workflow.contrib.django"` to `INSTALLED_APPS` and set `WORKFLOW`.
    `ready()` resolves `WORKFLOW["REGISTRY"]` (so a bad setting fails at startup)
    and connects to nothing: a pre-forking server (Gunicorn) may import the
    project in its master. The manager is closed at interpreter exit, or by
    `workflow.contrib.django.close()`.
    """

    name = "workflow.contrib.django"
    label = "workflow"
    verbose_name = "pgworkflow"

    def __init__(self, app_name: str, app_module: types.ModuleType | None) -> None:
        super().__init__(app_name, app_module)
        self._app: App | None = None
        self.process = ProcessManager(
            name="workflow-django",
            conninfo=lambda: conf.connection_settings(conf.database_alias())[0],
            app=self.workflow_app,
            pool_options=self._pool_options,
            on_manager=conf.on_manager,
        )

    def ready(self) -> None:
        self.workflow_app()
        conf.on_manager()  # a bad ON_MANAGER fails at startup too

    def workflow_app(self) -> App:
        """The registry and config of the `WORKFLOW` setting, resolved once."""
        if self._app is None:
            self._app = conf.app()
        return self._app

    @staticmethod
    def _pool_options() -> dict[str, Any]:
        return {"kwargs": conf.connection_settings(conf.database_alias())[1]}
