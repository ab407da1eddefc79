"""Factories a worker must refuse with one clear line (tests/test_worker_cli.py)."""

from __future__ import annotations

import workflow


def not_a_registry() -> int:
    return 42


def explodes() -> workflow.Registry:
    raise RuntimeError("the factory could not read its settings")


def app_with_a_bad_registry() -> workflow.App:
    return workflow.App("not a registry")  # type: ignore[arg-type]


NOT_CALLABLE = "a string"


def inconsistent_timeouts() -> workflow.App:
    """Task timeout 60 s (default) + in-process backoff 5 s is not under sweep_max_age 3 s."""
    from .three_tasks import registry

    return workflow.App(registry(), config=workflow.Config(sweep_max_age=3))
