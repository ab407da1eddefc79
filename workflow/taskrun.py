"""What a handler receives: `TaskRun[In]`, and `new_task_run` for handler unit tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from workflow.definition import Task
from workflow.durations import Duration, seconds
from workflow.errors import Cancelled, OutputMissing

In = TypeVar("In")
Out = TypeVar("Out")


class TaskRun(Generic[In]):
    """One attempt of one task of a run, as its handler sees it.

    Python cannot interrupt a thread: pass `remaining()` to the handler's I/O and
    check `cancelled` in loops.
    """

    def __init__(
        self,
        *,
        run_id: str,
        seq: int,
        input: In,
        outputs: Callable[[Task[Any]], Any],
        attempt: int,
        max_attempts: int,
        deadline: float,
        cancelled: threading.Event,
    ) -> None:
        self._run_id = run_id
        self._seq = seq
        self._input = input
        self._outputs = outputs
        self._attempt = attempt
        self._max_attempts = max_attempts
        self._deadline = deadline
        self._cancelled = cancelled

    @property
    def run_id(self) -> str:
        """The id of the run this task belongs to."""
        return self._run_id

    @property
    def input(self) -> In:
        """The workflow input, decoded."""
        return self._input

    def output(self, task: Task[Out]) -> Out:
        """Decode the recorded output of an earlier task of this run.

        Raises `OutputMissing` when that task recorded none: it has no output
        type, it was skipped, or it has not run yet.
        """
        return self._outputs(task)  # type: ignore[no-any-return]

    @property
    def idempotency_key(self) -> str:
        """`"{run_id}:{seq}"`: stable across retries and resumes; give it to providers."""
        return f"{self._run_id}:{self._seq}"

    @property
    def attempt(self) -> int:
        """This attempt's number, from 1."""
        return self._attempt

    @property
    def last_attempt(self) -> bool:
        """True when a failure of this attempt spends the attempt budget."""
        return self._attempt >= self._max_attempts

    @property
    def deadline(self) -> float:
        """The attempt's deadline, as a `time.monotonic()` value."""
        return self._deadline

    def remaining(self) -> float:
        """Seconds left before the deadline, never negative."""
        return max(0.0, self._deadline - time.monotonic())

    @property
    def cancelled(self) -> threading.Event:
        """Set at the deadline, on a lost claim, on cancellation and on shutdown."""
        return self._cancelled

    def raise_if_cancelled(self) -> None:
        """Raise `Cancelled` when `cancelled` is set; return at once otherwise."""
        if self._cancelled.is_set():
            raise Cancelled(f"task {self.idempotency_key} was cancelled")


def new_task_run(
    input: In,
    *,
    outputs: Mapping[Task[Any], Any] | None = None,
    attempt: int = 1,
    max_attempts: int = 1,
    run_id: str = "test-run",
    timeout: Duration = 60,
) -> TaskRun[In]:
    """A `TaskRun` for a handler unit test: no manager, no database.

    `outputs` maps `Task` objects to decoded values; `deadline` is now plus
    `timeout`. By default a single attempt, so `last_attempt` is true.
    """
    given = dict(outputs or {})

    def lookup(task: Task[Any]) -> Any:
        if task not in given or not task.records:
            raise OutputMissing(f"task {task.name!r} recorded no output")
        return given[task]

    return TaskRun(
        run_id=run_id,
        seq=1,
        input=input,
        outputs=lookup,
        attempt=attempt,
        max_attempts=max_attempts,
        deadline=time.monotonic() + seconds(timeout, "timeout"),
        cancelled=threading.Event(),
    )
