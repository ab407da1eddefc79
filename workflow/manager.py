"""The manager: one per process, over a connection pool; starts, executes and watches runs."""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import uuid
import weakref
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg_pool import ConnectionPool

from workflow import codec
from workflow.config import Config, RunnerConfig, Settings
from workflow.definition import Definition, Registry, Workflow
from workflow.durations import Duration, seconds
from workflow.errors import ConfigError, EncodeError, RunNotFound, WorkflowError
from workflow.executor import Engine, Job, execute, executing
from workflow.heartbeat import SHUTDOWN, Heartbeat
from workflow.limits import MAX_KEY_BYTES, text_problem
from workflow.run import Failure, Run, RunStatus, Status
from workflow.runthreads import RunThreads
from workflow.sealing import open_document, seal_document
from workflow.store import (
    ClaimedRun,
    Store,
    TaskRow,
    check_schema,
    current_database,
    in_transaction,
)
from workflow.store.connection import connect_explained, normalize_url

if TYPE_CHECKING:
    from workflow.runnable import Runnable

_managers: weakref.WeakSet[Manager] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for manager in list(_managers):
        manager._forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


_RECENT = 4096


class _Completion:
    """How a local execution of a run ended: `wait()` for `set()`, then read `status`.

    A bare lock rather than a `threading.Event`: set once, waited on by the
    (usually one) caller of `run.wait()`, on the hot path of every local run.
    """

    __slots__ = ("_lock", "done", "status")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self.done = False
        self.status: Status | None = None

    def set(self) -> None:
        """Mark the execution ended and wake every waiter (call once)."""
        self.done = True
        self._lock.release()

    def wait(self, timeout: float) -> bool:
        """Block until `set()` or `timeout` seconds; True once it was set."""
        if self.done:
            return True
        if self._lock.acquire(timeout=timeout):
            self._lock.release()  # pass the wake on to the next waiter
            return True
        return self.done


def _array_literal(values: list[str]) -> str:
    """A PostgreSQL array literal of `values`, sent as one text parameter."""
    quoted = (v.replace("\\", "\\\\").replace('"', '\\"') for v in values)
    return "{" + ",".join(f'"{v}"' for v in quoted) + "}"


def _bool_array(flags: list[bool]) -> str:
    """A PostgreSQL boolean array literal, sent as one text parameter."""
    return "{" + ",".join("t" if flag else "f" for flag in flags) + "}"


class _Shape:
    """What every start of one workflow shares, computed once per manager."""

    __slots__ = ("definition", "names", "no_skips", "skips", "tasks")

    def __init__(self, definition: Definition[Any]) -> None:
        steps = definition.steps
        self.definition = definition
        self.skips = any(step.skip is not None for step in steps)
        self.names = _array_literal([step.task.name for step in steps])
        self.no_skips = _bool_array([False] * len(steps))
        self.tasks = self.snapshot([False] * len(steps))

    def snapshot(self, skipped: list[bool]) -> tuple[TaskRow, ...]:
        """The task rows of a run just inserted with these skips."""
        return tuple(
            TaskRow(
                seq=i + 1,
                name=step.task.name,
                skipped=skipped[i],
                attempts=0,
                has_output=False,
                output=None,
                failed_at=None,
            )
            for i, step in enumerate(self.definition.steps)
        )


def _check_key(key: object) -> None:
    """Refuse an idempotency key before any SQL is sent (EncodeError, TypeError)."""
    if not isinstance(key, str) or not key:
        raise TypeError(f"idempotency_key must be a non-empty str, got {key!r}")
    problem = text_problem(key, MAX_KEY_BYTES)
    if problem is not None:
        raise EncodeError(f"idempotency_key {key[:60]!r} {problem}")


def _parse_id(run_id: str) -> uuid.UUID:
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
    is under `sweep_max_age`. A manager must not cross a `fork()`: build it in
    the child (Gunicorn: in `post_fork`, or lazily on first request).
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
        self._settings = Settings.of(self._config)
        self._logger = logger or logging.getLogger("workflow")
        self._registry = registry
        self._forked = False
        self._closed = False
        registry.freeze()
        self._check_timeouts()
        self._shapes: dict[str, _Shape] = {}
        for name in registry.names():
            definition = registry.definition(name)
            assert definition is not None
            self._shapes[name] = _Shape(definition)
        if isinstance(db, str):
            url = normalize_url(db)
            # One plain connection first: it fails at once with the server's own
            # reason, where a pool would retry quietly for its whole timeout.
            with connect_explained(url) as conn:
                check_schema(conn)
                self._dbname = conn.info.dbname
                self._database = current_database(conn)
            self._pool: ConnectionPool[Any] = ConnectionPool(
                url,
                min_size=1,
                max_size=self._settings.pool_size,
                kwargs={"autocommit": True},
                open=False,
                name="workflow",
            )
            self._owns_pool = True
            self._pool.open(wait=True, timeout=30.0)
            self._store = Store(self._pool, self._logger, keep_warm=True)
        elif isinstance(db, ConnectionPool):
            self._pool = db
            self._owns_pool = False
            self._store = Store(self._pool, self._logger)
            self._dbname, self._database = self._store.check_schema()
        else:
            raise TypeError(
                "Manager needs a psycopg_pool.ConnectionPool or a connection string, "
                f"not {type(db).__name__}"
            )
        self._draining = threading.Event()
        self._threads = RunThreads(self._settings.max_local_runs, "workflow-run", self._logger)
        # Fast-path executions in flight, at most max_local_runs; a plain lock on the
        # hot path, a Condition on it only for close() to wait for zero.
        self._in_flight = 0
        self._in_flight_lock = threading.Lock()
        self._all_done = threading.Condition(self._in_flight_lock)
        self._runnables: weakref.WeakSet[Runnable] = weakref.WeakSet()
        # Local executions and how recent ones ended, so wait() on a run executed
        # here costs no query; waiters on runs executed elsewhere poll.
        self._local: dict[uuid.UUID, _Completion] = {}
        self._recent: collections.OrderedDict[uuid.UUID, _Completion] = collections.OrderedDict()
        self._waiters: weakref.WeakValueDictionary[uuid.UUID, threading.Event] = (
            weakref.WeakValueDictionary()
        )
        self._completion_lock = threading.Lock()
        self._heartbeat = Heartbeat(self._store, self._settings.heartbeat_interval, self._logger)
        self._engine = Engine(
            store=self._store,
            registry=registry,
            settings=self._settings,
            logger=self._logger,
            heartbeat=self._heartbeat,
            cipher=self._config.cipher,
            propagation=self._config.context,
            draining=self._draining,
            finished=self._finished,
            steps={
                name: {step.task.name: step for step in shape.definition.steps}
                for name, shape in self._shapes.items()
            },
        )
        self._heartbeat.start()
        _managers.add(self)

    def _check_timeouts(self) -> None:
        settings = self._settings
        for name in self._registry.names():
            definition = self._registry.definition(name)
            assert definition is not None
            for step in definition.steps:
                policy = self._registry.policy(name, step.task.name)
                timeout = policy.timeout or settings.task_timeout
                if timeout + settings.max_in_process_backoff >= settings.sweep_max_age:
                    raise ConfigError(
                        f"workflow {name!r}, task {step.task.name!r}: timeout {timeout:g}s + "
                        f"max_in_process_backoff {settings.max_in_process_backoff:g}s must be "
                        f"under sweep_max_age {settings.sweep_max_age:g}s, or a sweeper could "
                        "reclaim a run whose executor is still inside a legitimate attempt"
                    )

    def _check_usable(self, *, runnable: bool = False) -> None:
        """Raise `WorkflowError` when this manager cannot serve a call now.

        After `fork()` nothing works in the child. After `close()`, a manager
        that owned its pool has nothing to work with; one over a borrowed pool
        still inserts and reads (the rows wait for a poller), but runs no worker.
        """
        if self._forked:
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

    def _refuse_inside_handler(self, what: str) -> None:
        """`WorkflowError` when the calling thread is inside a handler this manager executes."""
        if executing(self._engine) is not None:
            raise WorkflowError(
                f"workflow: {what} was called from inside a handler that this manager is "
                "executing; it waits for every execution to end, that one included, so it "
                "would wait for itself: call it from outside the handler"
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

    # Starting runs.

    def _start(
        self,
        wf: Workflow[Any],
        input: Any,
        *,
        idempotency_key: str | None,
        conn: psycopg.Connection[Any] | None = None,
    ) -> Run:
        self._check_usable()
        shape = self._shapes.get(wf.name)
        if shape is None:
            raise WorkflowError(
                f"workflow {wf.name!r} is not registered with this manager; register it "
                "before building the Manager"
            )
        if idempotency_key is not None:
            _check_key(idempotency_key)
        if conn is not None:
            if not isinstance(conn, psycopg.Connection):
                raise TypeError(
                    f"start_tx() needs a psycopg.Connection, not {type(conn).__name__}"
                )
            in_transaction(conn)
            self._check_same_database(conn)
        run_id = uuid.uuid4()
        # Fast-path handlers get `stored_input`, decoded from what is stored: never
        # the caller's object, which the caller may go on changing.
        input_text, _, stored_input = codec.encode_document(input, wf.input_type)
        cipher = self._config.cipher
        input_plain, input_sealed = seal_document(input_text, run_id, cipher)
        context_plain = context_sealed = None
        if self._config.context is not None:
            context_plain, context_sealed = seal_document(
                self._config.context.capture_document(), run_id, cipher
            )
        if idempotency_key is not None:
            existing = self._store.find_idempotent_run(conn, wf.name, idempotency_key)
            if existing is not None:
                return Run(self, str(existing))
        steps = shape.definition.steps
        if shape.skips:
            skipped = [bool(step.skip(input)) if step.skip else False for step in steps]
            current = next((i + 1 for i, s in enumerate(skipped) if not s), len(steps) + 1)
            skipped_literal = _bool_array(skipped)
        else:
            skipped, current, skipped_literal = None, 1, shape.no_skips
        all_skipped = current > len(steps)
        fast = conn is None and not all_skipped and self._try_slot()
        claim_id = uuid.uuid4() if fast else None
        params = {
            "id": run_id,
            "workflow": wf.name,
            "status": "succeeded" if all_skipped else ("running" if fast else "pending"),
            "idempotency_key": idempotency_key,
            "input": input_plain,
            "input_sealed": input_sealed,
            "context": context_plain,
            "context_sealed": context_sealed,
            "task_count": len(steps),
            "current_seq": current,
            "claim_id": claim_id,
            "names": shape.names,
            "skipped": skipped_literal,
            "wake": not fast and not all_skipped,
        }
        try:
            inserted = self._store.insert_run(conn, params)
        except psycopg.errors.LockNotAvailable as e:
            if fast:
                self._release_slot()
            raise WorkflowError(
                f"workflow {wf.name!r}: idempotency key {idempotency_key!r} is held by a "
                "transaction still open (a start_tx() of this key not committed yet, maybe "
                "on this very thread): commit or roll back that transaction first"
            ) from e
        except BaseException:
            if fast:
                self._release_slot()
            raise
        if inserted is None:
            if fast:
                self._release_slot()
            assert idempotency_key is not None
            existing = self._store.find_idempotent_run(conn, wf.name, idempotency_key)
            if existing is None:
                raise WorkflowError(
                    f"workflow {wf.name!r}: idempotency key {idempotency_key!r} collided with "
                    "a run that is not visible yet (started in a transaction still open)"
                )
            return Run(self, str(existing))
        if fast:
            assert claim_id is not None
            claimed = ClaimedRun(
                id=run_id,
                workflow=wf.name,
                claim_id=claim_id,
                input=None,
                input_sealed=None,
                context=context_plain,
                context_sealed=context_sealed,
                current_seq=current,
                db_now=None,
                tasks=shape.tasks if skipped is None else shape.snapshot(skipped),
            )
            self._launch(Job(run=claimed, input=stored_input))
        return Run(self, str(run_id), run_id)

    def _check_same_database(self, conn: psycopg.Connection[Any]) -> None:
        """`WorkflowError` unless `conn` is on this manager's database.

        The connection's own name costs nothing to read; only when it differs
        (another alias of the same database, say) is the server asked.
        """
        if conn.info.dbname == self._dbname:
            return
        theirs = current_database(conn)
        if theirs != self._database:
            raise WorkflowError(
                f"workflow: start_tx() got a connection to database {theirs!r}, but this "
                f"manager's runs live in database {self._database!r}: start the run on a "
                "connection to that database (or build the Manager on this one)"
            )

    # Fast-path executions.

    def _try_slot(self) -> bool:
        if self._draining.is_set() or self._forked:
            return False
        with self._in_flight_lock:
            if self._in_flight >= self._settings.max_local_runs:
                return False
            self._in_flight += 1
        return True

    def _release_slot(self) -> None:
        with self._in_flight_lock:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._all_done.notify_all()

    def _launch(self, job: Job) -> None:
        """Execute `job` on the fast-path pool; the caller holds a slot."""
        self._executing(job.run.id)
        try:
            self._threads.submit(self._execute_in_slot, job)
        except RuntimeError:
            self._release_slot()
            self._store.release_claim(job.run.id, job.run.claim_id)
            self._finished(job.run.id, None)

    def _execute_in_slot(self, job: Job) -> None:
        try:
            execute(self._engine, job)
        finally:
            self._release_slot()

    def _executing(self, run_id: uuid.UUID) -> None:
        with self._completion_lock:
            self._local.setdefault(run_id, _Completion())

    def _finished(self, run_id: uuid.UUID, status: Status | None) -> None:
        with self._completion_lock:
            completion = self._local.pop(run_id, None)
            if status is not None:
                completion = completion or _Completion()
                completion.status = status
                self._recent[run_id] = completion
                while len(self._recent) > _RECENT:
                    self._recent.popitem(last=False)
            waiter = self._waiters.get(run_id)
        if completion is not None:
            completion.set()
        if waiter is not None:
            waiter.set()

    # Watching runs.

    def run(self, run_id: str) -> Run:
        """A handle on an existing run; `RunNotFound` for an unknown or malformed id.

        Blocks on one query.
        """
        self._check_usable()
        self._status_row(run_id)
        return Run(self, run_id)

    def _status_row(self, run_id: str) -> Any:
        row = self._store.run_status(_parse_id(run_id))
        if row is None:
            raise RunNotFound(f"no run has id {run_id!r}")
        return row

    def _status(self, run_id: str) -> RunStatus:
        self._check_usable()
        row = self._status_row(run_id)
        status = Status(row.status)
        failure = None
        if status is Status.PARKED:
            failure = Failure(
                task=row.task or "",
                error=row.error or "",
                code=row.error_code,
                attempts=row.attempts or 0,
            )
        return RunStatus(
            status=status, failure=failure, created_at=row.created_at, finished_at=row.finished_at
        )

    def _wait(
        self, run_id: str, timeout: Duration | None, key: uuid.UUID | None = None
    ) -> Status:
        limit = None if timeout is None else seconds(timeout, "timeout")
        self._check_usable()
        if key is None:
            key = _parse_id(run_id)
        if executing(self._engine) == key:
            raise WorkflowError(
                f"workflow: wait() on run {run_id} from inside one of its own handlers: its "
                "own run cannot end before the handler returns"
            )
        deadline = None if limit is None else time.monotonic() + limit

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        waiter: threading.Event | None = None
        while True:
            with self._completion_lock:
                local = self._local.get(key) or self._recent.get(key)
            if local is not None and not local.done:
                # Executing here: its end wakes us at once. Still read the database
                # every second: a hung local attempt may have been swept and the
                # run finished by another executor.
                remaining = left()
                if local.wait(1.0 if remaining is None else min(1.0, remaining)):
                    continue
                status = self._status(run_id).status
                if status.terminal:
                    return status
                if left() == 0.0:
                    return Status.RUNNING
                continue
            if local is not None and local.status is not None:
                return local.status
            if waiter is None:
                # Registered before the status read, so an end here after it wakes us.
                with self._completion_lock:
                    waiter = self._waiters.get(key)
                    if waiter is None:
                        waiter = self._waiters[key] = threading.Event()
                continue
            waiter.clear()  # before the read: an end after the read must stay seen
            row = self._status_row(run_id)
            status = Status(row.status)
            if status.terminal:
                return status
            # Claim only a run that is claimable now (no round trip otherwise), and
            # never one of a workflow this manager cannot execute: several services
            # may share the tables.
            if (
                row.claimable
                and self._registry.definition(row.workflow) is not None
                and self._kick(key)
            ):
                continue
            remaining = left()
            if remaining is not None and remaining <= 0:
                return Status.RUNNING
            waiter.wait(1.0 if remaining is None else min(1.0, remaining))

    def _kick(self, run_id: uuid.UUID) -> bool:
        """Claim and execute `run_id` here when it is claimable now and there is room."""
        if not self._try_slot():
            return False
        try:
            claimed = self._store.claim_run(run_id, uuid.uuid4())
        except BaseException:
            self._release_slot()
            raise
        if claimed is None or self._registry.definition(claimed.workflow) is None:
            if claimed is not None:
                self._store.release_claim(claimed.id, claimed.claim_id)
            self._release_slot()
            return False
        self._launch(Job(run=claimed))
        return True

    def _read_input(self, wf: Workflow[Any], run_id: str) -> Any:
        self._check_usable()
        key = _parse_id(run_id)
        row = self._store.run_input(key)
        if row is None or row[0] != wf.name:
            raise RunNotFound(f"no run of workflow {wf.name!r} has id {run_id!r}")
        document = open_document(row[1], row[2], key, self._config.cipher, "input")
        return codec.decode(document, wf.input_type, redact=row[2] is not None)

    # Workers and shutdown.

    def new_runnable(self, config: RunnerConfig | None = None) -> Runnable:
        """A poller and sweeper over this manager; call `run()` or `start()` on it.

        Raises `WorkflowError` after `close()` or in a forked child.
        """
        from workflow.runnable import Runnable

        self._check_usable(runnable=True)
        runnable = Runnable(self, config or RunnerConfig())
        self._runnables.add(runnable)
        return runnable

    def _drain(self, timeout: float | None) -> bool:
        """Stop launches, cancel in-flight attempts, await them; True when all ended.

        In a forked child there is nothing to await: the executions are the parent's.
        """
        self._draining.set()
        if self._forked:
            return True
        for lease in self._heartbeat.leases():
            lease.cancel(SHUTDOWN)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._all_done:
            while self._in_flight > 0:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._all_done.wait(left)
        # Executions claimed by this manager's workers are in flight too.
        for runnable in list(self._runnables):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not runnable._poller.wait_idle(left):
                return False
        return True

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
        if self._closed:
            return
        if not self._forked:
            self._refuse_inside_handler("close()")
        deadline = None if limit is None else time.monotonic() + limit

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        if not self._forked:
            for runnable in list(self._runnables):
                runnable.stop(left())
        if not self._drain(left()):
            self._logger.warning(
                "workflow: close() timed out with executions in flight; their claims will be "
                "swept after sweep_max_age"
            )
        self._closed = True
        self._threads.shutdown(wait=False)
        if not self._forked:
            self._heartbeat.stop()
        self._store.close(forked=self._forked)
        if self._owns_pool and not self._forked:
            self._pool.close()

    def __enter__(self) -> Manager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
