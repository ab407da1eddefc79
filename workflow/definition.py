"""Declaring work: workflows, tasks, steps (a task with its handler) and the registry.

Nothing here touches the database. `Registry.register` is where every rule is
checked, so a bad declaration fails at import time of the application, with a
message naming the workflow, the task and the fix.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

import attrs

from workflow.durations import Duration
from workflow.errors import RegistrationError
from workflow.limits import MAX_CONCURRENCY, MAX_NAME_BYTES, MAX_TASKS, text_problem
from workflow.retry import Backoff, RetryPolicy, policy_of

if TYPE_CHECKING:
    from psycopg import Connection

    from workflow.manager import Manager
    from workflow.run import Run
    from workflow.schedules import Schedule
    from workflow.taskrun import TaskRun

In = TypeVar("In")
Out = TypeVar("Out")



class Workflow(Generic[In]):
    """A named workflow whose runs take an input of type `In`.

    Declare one at module scope: `Transfer = Workflow("Transfer.Send", TransferInput)`.
    """

    def __init__(self, name: str, input_type: type[In]) -> None:
        self.name = name
        self.input_type = input_type

    def __repr__(self) -> str:
        return f"Workflow({self.name!r}, {_type_name(self.input_type)})"

    def start(
        self,
        mgr: Manager,
        input: In,
        *,
        idempotency_key: str | None = None,
        delay: Duration | None = None,
        run_at: datetime.datetime | None = None,
    ) -> Run:
        """Insert a run in its own transaction, then execute it here if there is room.

        Blocks on one database round trip. When `max_local_runs` executions are
        already in flight (or the manager is closing) the run is left for a poller.
        With `idempotency_key`, a second start returns the existing run untouched.
        With `delay` or `run_at` it is due later and not executed here. Raises
        `EncodeError` (nothing written) for an input that cannot be encoded. The
        same as `mgr.start(self, input, ...)`, which documents the rest.
        """
        return mgr.start(
            self, input, idempotency_key=idempotency_key, delay=delay, run_at=run_at
        )

    def start_tx(
        self,
        conn: Connection[Any],
        mgr: Manager,
        input: In,
        *,
        idempotency_key: str | None = None,
        delay: Duration | None = None,
        run_at: datetime.datetime | None = None,
    ) -> Run:
        """Insert a run with the caller's connection, inside the caller's transaction.

        Launches nothing: the run exists if and only if that transaction commits,
        and the first `run.wait()` or a poller claims it (from its due time, with
        `delay` or `run_at`). Raises `EncodeError` before sending any SQL, and
        `WorkflowError` when `conn` is not inside a usable transaction. The same as
        `mgr.start_tx(conn, self, input, ...)`.
        """
        return mgr.start_tx(
            conn, self, input, idempotency_key=idempotency_key, delay=delay, run_at=run_at
        )

    def input(self, mgr: Manager, run_id: str) -> In:
        """Read and decode the stored input of one of this workflow's runs.

        Raises `RunNotFound` for an unknown or malformed id or a run of another
        workflow, and `DecodeError` when the stored input no longer opens. The same
        as `mgr.read_input(self, run_id)`.
        """
        return mgr.read_input(self, run_id)


class Task(Generic[Out]):
    """A named task recording an output of type `Out`.

    `Task("transfer.send")` records nothing (`Task[None]`); `run.output()` of it
    raises `OutputMissing`.
    """

    @overload
    def __init__(self: Task[None], name: str) -> None: ...

    @overload
    def __init__(self, name: str, output_type: type[Out]) -> None: ...

    @overload
    def __init__(self: Task[Any], name: str, output_type: object) -> None: ...

    def __init__(self, name: str, output_type: object = None) -> None:
        self.name = name
        self.output_type: Any = output_type

    @property
    def records(self) -> bool:
        """True when the task was declared with an output type."""
        return self.output_type is not None

    def __repr__(self) -> str:
        if self.output_type is None:
            return f"Task({self.name!r})"
        return f"Task({self.name!r}, {_type_name(self.output_type)})"


@attrs.frozen
class Step(Generic[In]):
    """A task bound to its handler and retry policy; built by `handle()`."""

    task: Task[Any]
    fn: Callable[[TaskRun[In]], Any]
    timeout: Duration | None = None
    max_attempts: int | None = None
    backoff: Backoff | None = None
    backoff_schedule: Sequence[Duration] | None = None
    skip: Callable[[In], bool] | None = None

    def skip_if(self, pred: Callable[[In], bool]) -> Step[In]:
        """This step, skipped when `pred(input)` is true at run creation.

        The predicate is evaluated once, against the plaintext input, when a run
        is created; a skipped task is snapshotted as such and never executed.
        """
        return attrs.evolve(self, skip=pred)


def handle(
    task: Task[Out],
    fn: Callable[[TaskRun[In]], Out],
    *,
    timeout: Duration | None = None,
    max_attempts: int | None = None,
    backoff: Backoff | None = None,
    backoff_schedule: Sequence[Duration] | None = None,
) -> Step[In]:
    """Bind `fn` to `task`, with optional per-task retry settings.

    `timeout` bounds one attempt; `max_attempts` is the attempt budget;
    `backoff` and `backoff_schedule` (exclusive) set the retry delays. Unset
    values fall back to the manager's `Config`. Validation happens in
    `Registry.register`.
    """
    return Step(
        task=task,
        fn=fn,
        timeout=timeout,
        max_attempts=max_attempts,
        backoff=backoff,
        backoff_schedule=None if backoff_schedule is None else tuple(backoff_schedule),
    )


class AnyDefinition:
    """A `Definition` of any input type: what `Registry.register` accepts.

    Not generic on purpose: a `Definition[Any]` parameter would let mypy infer
    `define()`'s input type as `Any` and accept a handler of the wrong input type.
    """

    __slots__ = ()


@attrs.frozen
class Definition(AnyDefinition, Generic[In]):
    """A workflow with its ordered steps; built by `define()`, given to `Registry.register`.

    `concurrency_key` and `concurrency` are `define()`'s: None and None for a
    workflow whose runs have no key.
    """

    workflow: Workflow[In]
    steps: tuple[Step[In], ...]
    concurrency_key: Callable[[In], object] | None = None
    concurrency: int | None = None

    @property
    def limit(self) -> int:
        """The most runs of one key that may hold a claim at once (1 unless given)."""
        return 1 if self.concurrency is None else self.concurrency


def define(
    workflow: Workflow[In],
    *steps: Step[In],
    concurrency_key: Callable[[In], object] | None = None,
    concurrency: int | None = None,
) -> Definition[In]:
    """Pair a workflow with its steps, in execution order.

    With `concurrency_key` (SPEC 15), `concurrency_key(input)` is computed when a
    run starts, from the plaintext input: a `str`, an `int` or a `uuid.UUID`, or
    None for a run with no key. At most `concurrency` runs (default 1) of this
    workflow with the same key hold a claim at once, and runs of one key are
    claimed in creation order. The key is stored as its SHA-256 digest, never as
    text. Validation happens in `Registry.register`.
    """
    return Definition(
        workflow=workflow,
        steps=tuple(steps),
        concurrency_key=concurrency_key,
        concurrency=concurrency,
    )


class Registry:
    """The workflows a process knows how to run.

    Register every workflow before building a `Manager`: the manager freezes
    the registry. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._frozen = False
        self._definitions: dict[str, Definition[Any]] = {}
        self._policies: dict[tuple[str, str], RetryPolicy] = {}
        self._output_types: dict[str, Any] = {}
        self._schedules: dict[str, Schedule[Any]] = {}

    def schedule(self, schedule: Schedule[Any]) -> None:
        """Add a cron `workflow.Schedule` of a workflow registered here.

        Workers built with this registry fire it (SPEC 14). Raises
        `RegistrationError` for a frozen registry, a duplicate schedule name, or a
        workflow not registered in this registry (register it first).
        """
        from workflow.schedules import Schedule

        if not isinstance(schedule, Schedule):
            raise RegistrationError(
                f"schedule() takes a workflow.Schedule, not {type(schedule).__name__}"
            )
        with self._lock:
            if self._frozen:
                raise RegistrationError(
                    f"schedule {schedule.name!r}: the registry is frozen because a Manager "
                    "was built with it; add schedules before building the Manager"
                )
            if schedule.name in self._schedules:
                raise RegistrationError(
                    f"schedule {schedule.name!r} is already registered; schedule names are "
                    "unique"
                )
            definition = self._definitions.get(schedule.workflow.name)
            if (
                definition is None
                or definition.workflow.input_type != schedule.workflow.input_type
            ):
                raise RegistrationError(
                    f"schedule {schedule.name!r}: workflow {schedule.workflow.name!r} is not "
                    "registered in this registry; register(define(...)) it first"
                )
            self._schedules[schedule.name] = schedule

    def schedules(self) -> list[Schedule[Any]]:
        """The registered schedules, in registration order."""
        return list(self._schedules.values())

    def register(self, definition: AnyDefinition) -> None:
        """Validate `definition` and add it.

        Raises `RegistrationError` naming the problem: a frozen registry, a
        duplicate workflow name, zero tasks, an empty or duplicate task name, more
        than 32766 tasks, a name with a NUL or longer than 255 bytes, a bad
        timeout, attempt budget or backoff (infinite or beyond `MAX_SECONDS`
        included), a task name already registered with a different output type, a
        `concurrency_key` that is not callable, or a `concurrency` that is not an
        int from 1 to 1000 or is given without a key.
        """
        if not isinstance(definition, Definition):
            raise RegistrationError(
                "register() takes workflow.define(workflow, *steps), "
                f"not {type(definition).__name__}"
            )
        wf = definition.workflow
        with self._lock:
            if self._frozen:
                raise RegistrationError(
                    f"workflow {wf.name!r}: the registry is frozen because a Manager was "
                    "built with it; register every workflow before building the Manager"
                )
            _check_name(wf.name, "a workflow name")
            _check_concurrency(wf.name, definition)
            if wf.name in self._definitions:
                raise RegistrationError(
                    f"workflow {wf.name!r} is already registered; workflow names are unique"
                )
            if not definition.steps:
                raise RegistrationError(
                    f"workflow {wf.name!r} has no tasks; pass at least one handle(...) to define()"
                )
            if len(definition.steps) > MAX_TASKS:
                raise RegistrationError(
                    f"workflow {wf.name!r} has {len(definition.steps)} tasks; the most a "
                    f"workflow may have is {MAX_TASKS}: split it into workflows that start "
                    "one another"
                )
            policies: dict[tuple[str, str], RetryPolicy] = {}
            new_types: dict[str, Any] = {}
            for step in definition.steps:
                name = _check_step(wf.name, step)
                if (wf.name, name) in policies:
                    raise RegistrationError(
                        f"workflow {wf.name!r}: task {name!r} appears twice; "
                        "task names are unique within a workflow"
                    )
                known = self._output_types.get(name, new_types.get(name, _MISSING))
                if known is not _MISSING and known != step.task.output_type:
                    raise RegistrationError(
                        f"workflow {wf.name!r}: task {name!r} is already registered with "
                        f"output type {_type_name(known)}, not "
                        f"{_type_name(step.task.output_type)}; a task name shared between "
                        "workflows must keep one output type (or rename the task)"
                    )
                new_types[name] = step.task.output_type
                policies[(wf.name, name)] = policy_of(
                    f"workflow {wf.name!r}, task {name!r}",
                    timeout=step.timeout,
                    max_attempts=step.max_attempts,
                    backoff=step.backoff,
                    backoff_schedule=step.backoff_schedule,
                )
            self._definitions[wf.name] = definition
            self._policies.update(policies)
            self._output_types.update(new_types)

    @property
    def frozen(self) -> bool:
        """True once a Manager has been built with this registry."""
        return self._frozen

    def freeze(self) -> None:
        """Refuse further registrations (the Manager calls this)."""
        with self._lock:
            self._frozen = True

    def names(self) -> list[str]:
        """The registered workflow names, in registration order."""
        return list(self._definitions)

    def definition(self, name: str) -> Definition[Any] | None:
        """The definition registered under `name`, or None."""
        return self._definitions.get(name)

    def policy(self, workflow: str, task: str) -> RetryPolicy:
        """The validated retry settings of one registered step (None: the Config's)."""
        return self._policies[(workflow, task)]


_MISSING = object()


def _type_name(tp: object) -> str:
    if tp is None:
        return "None (records nothing)"
    return getattr(tp, "__qualname__", None) or repr(tp)


def _check_step(workflow: str, step: object) -> str:
    if not isinstance(step, Step):
        raise RegistrationError(
            f"workflow {workflow!r}: define() takes steps built with handle(task, fn), "
            f"not {type(step).__name__}"
        )
    task = step.task
    if not isinstance(task, Task):
        raise RegistrationError(
            f"workflow {workflow!r}: handle() takes a workflow.Task, not {type(task).__name__}"
        )
    _check_name(task.name, f"workflow {workflow!r}: a task name")
    if not callable(step.fn):
        raise RegistrationError(
            f"workflow {workflow!r}: the handler of task {task.name!r} is not callable"
        )
    return task.name


def _check_concurrency(workflow: str, definition: Definition[Any]) -> None:
    """Refuse a per-key limit the engine could not enforce as written."""
    key, limit = definition.concurrency_key, definition.concurrency
    if key is not None and not callable(key):
        raise RegistrationError(
            f"workflow {workflow!r}: concurrency_key must be a function of the input "
            f"(e.g. lambda i: i.account), not {type(key).__name__}"
        )
    if limit is None:
        return
    if key is None:
        raise RegistrationError(
            f"workflow {workflow!r}: concurrency={limit!r} needs a concurrency_key "
            "(the limit is per key: define(..., concurrency_key=lambda i: i.account, "
            "concurrency=N))"
        )
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise RegistrationError(
            f"workflow {workflow!r}: concurrency must be an int, not {type(limit).__name__}"
        )
    if not 1 <= limit <= MAX_CONCURRENCY:
        raise RegistrationError(
            f"workflow {workflow!r}: concurrency must be from 1 to {MAX_CONCURRENCY} runs "
            f"per key, got {limit}"
        )


def _check_name(name: object, what: str) -> None:
    """Refuse a name PostgreSQL could not store or the schema could not index."""
    if not isinstance(name, str) or not name:
        raise RegistrationError(f"{what} must be a non-empty str, got {name!r}")
    problem = text_problem(name, MAX_NAME_BYTES)
    if problem is not None:
        raise RegistrationError(f"{what} {name[:60]!r} {problem}")
