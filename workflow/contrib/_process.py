"""One pool and one `Manager` per process, built on first use: what the integrations share.

A pre-forking server (Gunicorn, uWSGI) imports the application in a parent
process and serves it from forked children, and a manager must not cross a
`fork()`. `ProcessManager` builds nothing until it is first used, and builds
afresh when the process id differs from the one it built in. What the parent
built is left alone in the child: closing it there would stop threads that do
not exist and close sockets the parent still uses. The one exception is what
`workflow.metrics.instrument` returned for the parent's manager: it only holds
names in a metrics registry the child copied, which the child's own manager needs.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import attrs
from psycopg_pool import ConnectionPool, PoolTimeout

from workflow.app import App
from workflow.config import Config, Settings
from workflow.durations import Duration, seconds
from workflow.errors import WorkflowError
from workflow.manager import Manager
from workflow.store.connections import make_pool, open_pool

OPEN_TIMEOUT = 10.0
"""Seconds to wait for the pool's first connection before giving up."""


@attrs.frozen
class _Built:
    pid: int
    pool: ConnectionPool[Any]
    manager: Manager
    hooked: object = None  # what `on_manager`'s callable returned, closed with the manager


class _ForkSafeLock:
    """A lock made new in a forked child: one held by another thread of the parent at
    fork time would stay held forever there."""

    __slots__ = ("__weakref__", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()


_locks: weakref.WeakSet[_ForkSafeLock] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for guard in list(_locks):
        guard.lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _close_at_exit(ref: weakref.ref[ProcessManager]) -> None:
    instance = ref()
    if instance is not None:
        instance.close()


def _release_inherited_metrics(hooked: object) -> None:
    """In a forked child, take the parent's manager's metrics out of the child's copy of
    their registry (touching no connection), so that the child's manager can be
    instrumented there; anything else an `on_manager` callable returned is left alone."""
    metrics = sys.modules.get("workflow.metrics")
    if metrics is not None and isinstance(hooked, metrics.Instrumentation):
        hooked.close()


def pool_size(config: Config | None) -> int:
    """A pool size for a manager's fast path, like the one `Manager(url, ...)` builds."""
    return Settings.of(config if config is not None else Config()).pool_size


class ProcessManager:
    """Builds a pool and a `Manager` on first use in each process; closes them at exit.

    `conninfo` and `app` are called at build time (in the process that will use
    the result), so settings read by them may change until the first request.
    `pool_options` are keyword arguments for `psycopg_pool.ConnectionPool`,
    overriding the defaults (`min_size=1`, a `max_size` sized for the fast path,
    `kwargs={"autocommit": True}`). `on_manager()`, when given, returns a callable
    (or None) that is handed each manager once it is built, in its process: where
    `workflow.metrics.instrument` goes; what that returns is closed with the
    manager when it has a `close()`. When it raises, the manager and its pool
    are closed and the error propagates.
    """

    def __init__(
        self,
        *,
        name: str,
        conninfo: Callable[[], str],
        app: Callable[[], App],
        pool_options: Callable[[], Mapping[str, Any]] | None = None,
        on_manager: Callable[[], Callable[[Manager], object] | None] | None = None,
    ) -> None:
        self._name = name
        self._on_manager = on_manager
        self._conninfo = conninfo
        self._app = app
        self._pool_options = pool_options
        self._guard = _ForkSafeLock()
        _locks.add(self._guard)
        self._built: _Built | None = None
        # Objects inherited from a parent process, kept referenced so that nothing
        # finalizes them in this one.
        self._inherited: list[_Built] = []
        atexit.register(_close_at_exit, weakref.ref(self))

    def _current(self) -> _Built:
        pid = os.getpid()
        built = self._built
        if built is not None and built.pid == pid:
            return built
        with self._guard.lock:
            built = self._built
            if built is not None and built.pid == pid:
                return built
            if built is not None:
                self._inherited.append(built)
                self._built = None
                _release_inherited_metrics(built.hooked)
            self._built = self._build(pid)
            return self._built

    def _build(self, pid: int) -> _Built:
        app = self._app()
        options: dict[str, Any] = dict(self._pool_options() if self._pool_options else {})
        options.setdefault("max_size", pool_size(app.config))
        options.setdefault("name", self._name)
        pool = make_pool(self._conninfo(), **options)
        try:
            try:
                open_pool(pool, OPEN_TIMEOUT)
            except PoolTimeout as exc:
                raise WorkflowError(
                    f"workflow: {self._name}: no connection to the database within "
                    f"{OPEN_TIMEOUT:g}s ({exc}); check the database settings and that the "
                    "server is up"
                ) from exc
            manager = Manager(pool, app.registry, app.config, logger=app.logger)
            hooked: object = None
            try:
                hook = self._on_manager() if self._on_manager is not None else None
                if hook is not None:
                    hooked = hook(manager)
            except BaseException:
                manager.close()
                raise
        except BaseException:
            pool.close()
            raise
        return _Built(pid=pid, pool=pool, manager=manager, hooked=hooked)

    @property
    def built(self) -> bool:
        """True when this process has built its pool and manager (and not closed them)."""
        built = self._built
        return built is not None and built.pid == os.getpid()

    def manager(self) -> Manager:
        """This process's manager, built (with its pool) on first use.

        The first call blocks until the pool holds a connection and the schema
        version is read; it raises `WorkflowError` when the database cannot be
        reached within `OPEN_TIMEOUT` seconds and `workflow.SchemaOutdated` when it
        is behind. A failed build is retried by the next call.
        """
        return self._current().manager

    def pool(self) -> ConnectionPool[Any]:
        """This process's connection pool (autocommit connections), built on first use."""
        return self._current().pool

    def close(self, timeout: Duration | None = None) -> None:
        """Close this process's manager (draining it, up to `timeout`), then what
        `on_manager`'s callable returned when it has a `close()` (the metrics that
        `workflow.metrics.instrument` registered), then the pool.

        Does nothing when this process built nothing; the next use builds afresh.
        Raises `ValueError` for a timeout that is not a finite duration, before
        closing anything.
        """
        limit = None if timeout is None else seconds(timeout, "timeout")
        with self._guard.lock:
            built = self._built
            if built is None or built.pid != os.getpid():
                return
            self._built = None
        try:
            built.manager.close(limit)
        finally:
            try:
                close = getattr(built.hooked, "close", None)
                if callable(close):
                    close()
            finally:
                built.pool.close()
