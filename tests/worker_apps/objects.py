"""`--app` may name a Registry or an App object instead of a factory."""

from __future__ import annotations

import workflow

from . import three_tasks

REGISTRY = three_tasks.registry()
APP = workflow.App(three_tasks.registry(), config=workflow.Config(sweep_max_age=120))

# Keeps succeeded and cancelled runs forever, 5 runs at once: the worker's flags
# override these fields one by one.
KEEPING = workflow.App(
    three_tasks.registry(),
    runner=workflow.RunnerConfig(
        concurrency=5, retention=workflow.Retention(succeeded=None, cancelled=None)
    ),
)
