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


def _refuse_threads(part: str) -> None:
    """From now on, in this process, a thread whose name holds `part` fails to start as
    in a process out of threads (the real `Thread.start` raises the same)."""
    import threading

    real_start = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        if part in thread.name:
            raise RuntimeError("can't start new thread")
        real_start(thread)

    threading.Thread.start = start  # type: ignore[method-assign]


def no_thread_for_the_poller() -> workflow.Registry:
    """`Three`, in a process where the poller's thread cannot start."""
    from .three_tasks import registry

    _refuse_threads("workflow-poller")
    return registry()


def no_thread_for_the_heartbeat() -> workflow.Registry:
    """`Three`, in a process where the manager's heartbeat thread cannot start."""
    from .three_tasks import registry

    _refuse_threads("workflow-heartbeat")
    return registry()


def no_thread_for_metrics() -> workflow.Registry:
    """`Three`, in a process where the metrics server's thread (prometheus_client's
    `serve_forever`) cannot start."""
    from .three_tasks import registry

    _refuse_threads("serve_forever")
    return registry()


def no_thread_for_the_pool() -> workflow.Registry:
    """`Three`, in a process where the connection pool's threads cannot start (psycopg_pool
    names them after the pool: `workflow-scheduler`, `workflow-worker-0`...)."""
    from .three_tasks import registry

    _refuse_threads("workflow-worker-")
    return registry()
