"""The manager: one per process, over a connection pool; starts, executes and watches runs.

It builds and owns the parts (store.py, heartbeat.py, executor.py, fastpath.py,
starting.py, waiting.py), answers the public calls (`Workflow.start` and the like
are one-line sugar over its methods), and closes them in order. A manager must
not cross a `fork()`: in the child every call raises `WorkflowError`.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import uuid
import weakref
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from psycopg_pool import ConnectionPool

from workflow import codec, tracing
from workflow.config import Config, RunnerConfig, RunnerSettings, Settings
from workflow.definition import Registry, Workflow
from workflow.durations import Duration, seconds, time_left
from workflow.errors import ConfigError, RunNotFound, WorkflowError
from workflow.events import Events
from workflow.executor import Executor, refuse_inside_handler
from workflow.fastpath import FastPath, ForkState
from workflow.heartbeat import Heartbeat
from workflow.logs import EngineLog
from workflow.retry import check_against_sweep
from workflow.run import Run, RunStatus, Status
from workflow.sealing import open_document
from workflow.starting import Starter
from workflow.store import Store, check_schema, current_database
from workflow.store.connections import connect_explained, make_pool, normalize_url, open_pool
from workflow.waiting import Endings, read_status, run_status, wait

if TYPE_CHECKING:
    from workflow.runnable import Runnable

In = TypeVar("In")

_forks: weakref.WeakSet[ForkState] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for state in list(_forks):
        state.forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def _parse_id(run_id: str | uuid.UUID) -> uuid.UUID:
    if isinstance(run_id, uuid.UUID):
        return run_id
    try:
        return uuid.UUID(run_id)
    except (TypeError, ValueError, AttributeError):
        raise RunNotFound(f"no run has id {run_id!r}") from None


class Manager:
    """Starts runs, executes them on a local thread pool, and watches them.

    `db` is a `psycopg_pool.ConnectionPool` (borrowed, never closed here) or a
    connection string (the manager builds and owns a pool). Construction
    freezes `registry`, reads the schema version and raises
    `workflow.store.SchemaOutdated` when the database is behind, `WorkflowError`
    with the server's reason when a connection string is malformed or its
    database cannot be reached (within the connect timeout, 10 s by default),
    and `ConfigError` unless every task's timeout plus `max_in_process_backoff`
    is under `sweep_max_age`. A construction that fails leaves nothing behind: the
    pool it built is closed, a borrowed one left as it was. A manager must not
    cross a `fork()`: build it in the child (Gunicorn: in `post_fork`, or lazily
    on first request).
    """

    def __init__(
        self,
        db: ConnectionPool[Any] | str,
        registry: Registry,
        config: Config | None = None,
        *,
        logger: logging.Logger | None = None,
    ) -> None:
        if not isinstance(registry, Registry):
            raise TypeError(f"Manager needs a workflow.Registry, not {type(registry).__name__}")
        self._config = config if config is not None else Config()
        if not isinstance(self._config, Config):
            raise ConfigError(f"Manager needs a workflow.Config, not {type(config).__name__}")
        self._settings = settings = Settings.of(self._config)
        self._logger = logger or logging.getLogger("workflow")
        self._log = log = EngineLog(self._logger)
        self._registry = registry
        self._fork = ForkState()
        self._closed = False
        self._close_lock = threading.Lock()
        registry.freeze()
        for name in registry.names():  # ConfigError before any connection is made
            definition = registry.definition(name)
            assert definition is not None
            for step in definition.steps:
                retry = registry.policy(name, step.task.name).resolve(settings)
                check_against_sweep(f"workflow {name!r}, task {step.task.name!r}", retry, settings)
        # A failure from here on (no thread to start, a pool that cannot fill) must
        # not leave the pool this manager opened behind: a retry would add another.
        owned: ConnectionPool[Any] | None = None
        try:
            if isinstance(db, str):
                url = normalize_url(db)
                # One plain connection first: it fails at once with the server's own
                # reason, where a pool would retry quietly for its whole timeout.
                with connect_explained(url) as conn:
                    check_schema(conn)
                    database = conn.info.dbname, current_database(conn)
                self._pool: ConnectionPool[Any] = make_pool(url, max_size=settings.pool_size)
                self._owns_pool = True
                owned = self._pool
                open_pool(self._pool, 30.0)
                self._store = Store(self._pool, self._logger, keep_warm=True)
            elif isinstance(db, ConnectionPool):
                self._pool = db
                self._owns_pool = False
                self._store = Store(self._pool, self._logger)
                database = self._store.check_schema()
            else:
                raise TypeError(
                    "Manager needs a psycopg_pool.ConnectionPool or a connection string, "
                    f"not {type(db).__name__}"
                )
            self._events = Events(log)
            tracing_on = settings.tracing and tracing.available
            self._tracing = tracing.Tracing(self._events) if tracing_on else None
            self._heartbeat = Heartbeat(self._store, settings.heartbeat_interval, log)
            self._endings = Endings()
            self._executor = Executor(
                store=self._store,
                registry=registry,
                settings=settings,
                log=log,
                heartbeat=self._heartbeat,
                events=self._events,
                cipher=self._config.cipher,
                propagation=self._config.context,
                on_end=self._endings.ended,
            )
            self._fastpath = FastPath(
                self._executor, self._endings, settings.max_local_runs, self._fork
            )
            self._starter = Starter(
                registry, self._config, self._store, self._fastpath, self._events, database,
                capture=tracing.capture if tracing_on else None,
            )
            self._runnables: weakref.WeakSet[Runnable] = weakref.WeakSet()
            self._heartbeat.start()
            _forks.add(self._fork)
        except BaseException:
            if owned is not None:
                owned.close()
            raise

    def _check_usable(self, *, runnable: bool = False) -> None:
        """Raise `WorkflowError` when this manager cannot serve a call now.

        After `fork()` nothing works in the child. After `close()`, a manager
        that owned its pool has nothing to work with; one over a borrowed pool
        still inserts and reads (the rows wait for a poller), but runs no worker.
        """
        if self._fork.forked:
            raise WorkflowError(
                "workflow: this Manager was built before os.fork() and cannot be used in the "
                "child; build the Manager after the fork (Gunicorn: in post_fork, or lazily "
                "on the first request)"
            )
        if self._closed and (runnable or self._owns_pool):
            raise WorkflowError(
                "workflow: the manager is closed (its threads and connections are released); "
                "build a new Manager"
            )


    @property
    def registry(self) -> Registry:
        """The (frozen) registry this manager runs."""
        return self._registry

    @property
    def config(self) -> Config:
        """The configuration this manager was built with."""
        return self._config

    @property
    def logger(self) -> logging.Logger:
        """The logger the engine writes to."""
        return self._logger

    @property
    def pool(self) -> ConnectionPool[Any]:
        """The connection pool this manager works through (its own, or the one lent to
        it): for `workflow.Admin(mgr.pool)` and instrumentation in the same process."""
        return self._pool

    @property
    def events(self) -> Events:
        """What happens in this manager's engine, for instrumentation to `subscribe()` to."""
        return self._events

    # Starting runs.

    def start(
        self,
        workflow: Workflow[In],
        input: In,
        *,
        idempotency_key: str | None = None,
        delay: Duration | None = None,
        run_at: datetime.datetime | None = None,
    ) -> Run:
        """Insert a run of `workflow` in its own transaction, then execute it here if there is room.

        `Workflow.start(mgr, input)` is this. Blocks on one database round trip
        (a second one when the idempotency key already exists). When
        `max_local_runs` executions are already in flight, or the manager is
        closing, the run is left for a poller. With `idempotency_key`, a second
        start returns the existing run untouched. With `delay` (seconds or a
        timedelta, from now by the database clock) or `run_at` (an aware
        datetime; one in the past is due at once) the run is PENDING until then
        and is not executed here: from its due time a poller, or a `wait()` kick,
        claims it. Raises `EncodeError` (nothing written) for an input or key that
        cannot be stored, `TypeError`/`ValueError` for a bad `delay` or `run_at`
        (both given, a naive datetime, a negative delay), `WorkflowError` for a
        workflow not registered here, a closed or forked manager, or a key held
        for more than 5 s by a transaction still open.
        """
        self._check_usable()
        run_id, _ = self._starter.start(
            workflow, input, idempotency_key=idempotency_key, delay=delay, run_at=run_at
        )
        return Run(self, str(run_id), run_id)

    def start_tx(
        self,
        conn: psycopg.Connection[Any],
        workflow: Workflow[In],
        input: In,
        *,
        idempotency_key: str | None = None,
        delay: Duration | None = None,
        run_at: datetime.datetime | None = None,
    ) -> Run:
        """Insert a run of `workflow` with the caller's connection, inside its open transaction.

        `Workflow.start_tx(conn, mgr, input)` is this. Launches nothing: the run
        exists if and only if that transaction commits, and the first
        `run.wait()` or a poller claims it (from its due time, with `delay` or
        `run_at` as `start` says). Blocks on one statement in the caller's
        transaction. Raises `EncodeError`, `TypeError` or `ValueError` before
        sending any SQL (the transaction stays usable), and `WorkflowError` when
        `conn` is not inside a usable transaction or is on another database than
        this manager's.
        """
        self._check_usable()
        run_id, _ = self._starter.start(
            workflow, input, idempotency_key=idempotency_key, conn=conn, delay=delay,
            run_at=run_at,
        )
        return Run(self, str(run_id), run_id)

    # Watching runs.

    def run(self, run_id: str) -> Run:
        """A handle on an existing run; `RunNotFound` for an unknown or malformed id.

        Blocks on one query.
        """
        self._check_usable()
        key = _parse_id(run_id)
        read_status(self._store, key, run_id)
        return Run(self, run_id, key)

    def status(self, run_id: str | uuid.UUID) -> RunStatus:
        """A run's status, failure and times: one database read.

        `run.status()` is this. Raises `RunNotFound` for an unknown or malformed id.
        """
        self._check_usable()
        return run_status(read_status(self._store, _parse_id(run_id), run_id))

    def wait(self, run_id: str | uuid.UUID, timeout: Duration | None = None) -> Status:
        """Block until the run is terminal and return its status; see `Run.wait`.

        `run.wait()` is this. Raises `ValueError` for a timeout that is not a
        finite duration, `RunNotFound` for an unknown run, and `WorkflowError`
        from inside one of the run's own handlers.
        """
        limit = None if timeout is None else seconds(timeout, "timeout")
        self._check_usable()
        return wait(
            _parse_id(run_id),
            run_id,
            limit,
            endings=self._endings,
            store=self._store,
            executor=self._executor,
            fastpath=self._fastpath,
        )

    def kick(self, run_id: str | uuid.UUID) -> bool:
        """Claim the run and execute it here, on the fast path, if it is claimable now.

        For a run started with `start_tx`, once its transaction has committed:
        it then starts at once instead of waiting for a poller. True when it was
        claimed; False when it is not claimable now (claimed elsewhere, not due,
        finished, waiting for a slot of its concurrency key), not a workflow of
        this manager, or there is no room (a poller takes it). Blocks on one statement.
        """
        self._check_usable()
        return self._fastpath.kick(_parse_id(run_id))

    def read_input(self, workflow: Workflow[In], run_id: str) -> In:
        """Read and decode the stored input of one of `workflow`'s runs.

        `Workflow.input(mgr, run_id)` is this. Raises `RunNotFound` for an
        unknown or malformed id or a run of another workflow, and `DecodeError`
        when the stored input no longer opens (naming no value when it was sealed).
        """
        self._check_usable()
        key = _parse_id(run_id)
        row = self._store.run_input(key)
        if row is None or row[0] != workflow.name:
            raise RunNotFound(f"no run of workflow {workflow.name!r} has id {run_id!r}")
        document = open_document(row[1], row[2], row[3] or key, self._config.cipher, "input")
        value: In = codec.decode(document, workflow.input_type, redact=row[2] is not None)
        return value

    # Workers and shutdown.

    def new_runnable(self, config: RunnerConfig | None = None) -> Runnable:
        """A poller, sweeper, pruner, scheduler and listener over this manager; call
        `run()` or `start()` on it.

        Raises `WorkflowError` after `close()` or in a forked child.
        """
        from workflow.runnable import Runnable

        self._check_usable(runnable=True)
        pool = self._pool
        conninfo = pool.conninfo() if callable(pool.conninfo) else pool.conninfo
        kwargs = pool.kwargs() if callable(pool.kwargs) else pool.kwargs
        runnable = Runnable(
            self._executor,
            RunnerSettings.of(config or RunnerConfig()),
            conninfo=conninfo,
            kwargs=dict(kwargs or {}),
            check=lambda: self._check_usable(runnable=True),
            start_tx=self.start_tx,
        )
        self._runnables.add(runnable)
        return runnable

    def close(self, timeout: Duration | None = None) -> None:
        """Drain and release: blocks until in-flight executions end (or `timeout`).

        Stops this manager's runnables first. No new fast-path launches;
        in-flight handlers see `cancelled`; a success is recorded, a failure
        caused by the shutdown is not counted, claims are released for immediate
        re-claim. Then the heartbeat stops and an owned pool is closed. With a
        borrowed pool `start` still inserts afterwards; the rows wait for a
        poller; every other call raises `WorkflowError`. `timeout` bounds the
        whole call, runnables included. Idempotent; in a forked child it waits
        for nothing (the executions are the parent's). Raises `ValueError` for a
        timeout that is not a finite duration, and `WorkflowError` when called
        from inside a handler this manager executes.
        """
        limit = None if timeout is None else seconds(timeout, "timeout")
        forked = self._fork.forked
        if not forked:
            refuse_inside_handler(self._executor, "close()")
        with self._close_lock:
            if self._closed:
                return
            left = time_left(limit)

            if not forked:
                for runnable in list(self._runnables):
                    runnable.stop(left())
                if not self._executor.drain(left()):
                    self._log.warning(
                        "close() timed out with executions in flight; their claims will be "
                        "swept after sweep_max_age"
                    )
            self._closed = True
            # Whatever raises on the way (a ^C in a join), the pool is still closed.
            try:
                self._fastpath.shutdown()
                if not forked:  # it may wait on a lock: within what the timeout left
                    self._heartbeat.stop(left())
            finally:
                try:
                    self._store.close(forked=forked)
                finally:
                    if self._owns_pool and not forked:
                        self._pool.close()

    def __enter__(self) -> Manager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
