"""`--app` may name a Registry or an App object instead of a factory."""

from __future__ import annotations

import workflow

from . import three_tasks

REGISTRY = three_tasks.registry()
APP = workflow.App(three_tasks.registry(), config=workflow.Config(sweep_max_age=120))
