"""Executing one claimed run, task after task, every write fenced by the claim.

Transactions per run: the insert (already claimed on the fast path), then one per
finished task, which records the output and moves the run on (the last one also
completes it). A 3-task run on the fast path costs 4 transactions. A failed
attempt costs one more (it records the failure, and parks or schedules the retry
in the same statement); a shutdown or a long backoff costs one release.

A write that matches zero rows means another executor owns the run: this one
stops at once, touching nothing.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import attrs

from workflow import codec
from workflow.config import Settings
from workflow.definition import Registry, RetryPolicy, Step, Task
from workflow.errors import (
    DecodeError,
    EncodeError,
    OutputMissing,
    code_of,
    error_text,
    is_permanent,
)
from workflow.heartbeat import LOST, SHUTDOWN, Heartbeat, Lease
from workflow.logs import ALERT
from workflow.run import Status
from workflow.sealing import Cipher, Propagation, open_document
from workflow.store import ClaimedRun, Store, TaskRow
from workflow.taskrun import TaskRun

_NO_INPUT = object()


@attrs.frozen
class Engine:
    """What an execution needs from its manager."""

    store: Store
    registry: Registry
    settings: Settings
    logger: logging.Logger
    heartbeat: Heartbeat
    cipher: Cipher | None
    propagation: Propagation[Any] | None
    draining: threading.Event
    finished: Callable[[uuid.UUID, Status | None], None]
    steps: Mapping[str, Mapping[str, Step[Any]]]
    """Per registered workflow name: its steps by task name."""


@attrs.frozen
class Job:
    """A claimed run to execute; `input` is set on the fast path (already in memory)."""

    run: ClaimedRun
    claimed_at: float = attrs.field(factory=time.monotonic)
    input: Any = _NO_INPUT


class _Stop(Exception):
    """Ends an execution early; the claim has been dealt with."""


FAULT_RETRY_DELAY = 30.0
"""Seconds a run waits after the engine failed on it before any attempt ran (say
the database refused a park): long enough that a fault that repeats cannot spin."""


@attrs.frozen
class _Ran:
    """An attempt whose handler has run and whose outcome is not recorded yet."""

    seq: int
    row: TaskRow
    max_attempts: int
    policy: RetryPolicy


_executing = threading.local()
"""Per thread: the engine whose execution this thread is inside, and its run id."""


def executing(engine: Engine) -> uuid.UUID | None:
    """The run the calling thread is executing for `engine` (inside a handler), else None."""
    if getattr(_executing, "engine", None) is engine:
        run_id: uuid.UUID = _executing.run_id
        return run_id
    return None


def delay_after(policy: RetryPolicy, settings: Settings, attempts: int) -> float:
    """Seconds to wait before the attempt after `attempts` ended attempts.

    Exponential: `min(base * 2**(attempts-1), max)`. The exponent is capped first
    (a float power overflows past 2**1023), and a float product saturates to
    infinity rather than raising, so a task retried forever keeps its capped
    delay however many attempts it has spent.
    """
    if policy.schedule is not None:
        return policy.schedule[max(min(attempts, len(policy.schedule)), 1) - 1]
    base = policy.backoff_base if policy.backoff_base is not None else settings.backoff_base
    cap = policy.backoff_max if policy.backoff_max is not None else settings.backoff_max
    exponent = min(max(attempts - 1, 0), 1023)
    return min(base * 2.0**exponent, cap)


def execute(engine: Engine, job: Job) -> None:
    """Run `job` from its current task until it finishes, parks, or must stop.

    Raises nothing of its own. An unexpected error is logged, and an attempt that
    ran is counted (or parks the run) even then: a claim is never released with
    an attempt that ran left uncounted, so a fault that repeats cannot re-run a
    handler more often than its budget allows. When not even that can be
    written, the claim is left as it is, no longer heartbeated, for a sweeper
    to release after `sweep_max_age`, counting the attempt. A `SystemExit` or
    `KeyboardInterrupt` raised by a handler is recorded as a failed attempt and
    then propagates. Calls `engine.finished(run_id, status)` at the end, with the
    terminal status this execution wrote, or None when it stopped without one.
    """
    lease = Lease(job.run.id, job.run.claim_id)
    engine.heartbeat.add(lease)
    execution = _Execution(engine, job, lease)
    outer = getattr(_executing, "engine", None), getattr(_executing, "run_id", None)
    _executing.engine, _executing.run_id = engine, job.run.id
    try:
        execution.run()
    except _Stop:
        pass
    except Exception as e:
        execution.engine_failed(e)
    finally:
        _executing.engine, _executing.run_id = outer
        engine.heartbeat.remove(lease)
        engine.finished(job.run.id, execution.outcome)


class _Execution:
    def __init__(self, engine: Engine, job: Job, lease: Lease) -> None:
        self.engine = engine
        self.job = job
        self.run_row = job.run
        self.lease = lease
        self.run_id = str(job.run.id)
        self.extra = {"run_id": self.run_id}
        self.steps = engine.steps.get(job.run.workflow, {})
        self.tasks = list(job.run.tasks)
        self.outputs: dict[str, TaskRow] = {t.name: t for t in self.tasks}
        self.decoded: dict[str, Any] = {}
        self.outcome: Status | None = None
        self.unrecorded: _Ran | None = None

    # The run's life.

    def run(self) -> None:
        input_value = self.open_input()
        restore = self.open_context()
        seq = self.run_row.current_seq
        first = True
        while seq <= len(self.tasks):
            row = self.tasks[seq - 1]
            step = self.steps.get(row.name)
            if step is None:
                self.park(
                    row,
                    f"no handler is registered for task {row.name!r} of workflow "
                    f"{self.run_row.workflow!r} (version skew: deploy the code that has it)",
                )
            policy = self.engine.registry.policy(self.run_row.workflow, row.name)
            max_attempts = policy.max_attempts or self.engine.settings.max_attempts
            if row.attempts >= max_attempts:
                self.park(
                    row,
                    f"task {row.name!r} had already spent its {max_attempts} attempts when "
                    "this executor claimed the run (its executors keep dying mid-attempt?)",
                )
            if first and row.attempts > 0:
                self.wait_owed_backoff(row, policy)
            first = False
            seq = self.attempt(seq, row, step, policy, max_attempts, input_value, restore)

    def attempt(
        self,
        seq: int,
        row: TaskRow,
        step: Step[Any],
        policy: RetryPolicy,
        max_attempts: int,
        input_value: Any,
        restore: Callable[[], contextlib.AbstractContextManager[Any]] | None,
    ) -> int:
        """Run one attempt of task `seq`; the seq to go on with."""
        engine = self.engine
        if self.lease.lost:
            raise _Stop
        if engine.draining.is_set():
            self.release()
        timeout = policy.timeout or engine.settings.task_timeout
        deadline = time.monotonic() + timeout
        cancelled = self.lease.begin_attempt(deadline)
        engine.heartbeat.watch_deadline(deadline)
        taskrun: TaskRun[Any] = TaskRun(
            run_id=self.run_id,
            seq=seq,
            input=input_value,
            outputs=self.output,
            attempt=row.attempts + 1,
            max_attempts=max_attempts,
            deadline=deadline,
            cancelled=cancelled,
        )
        error: BaseException | None = None
        result: Any = None
        try:
            if restore is None:
                result = step.fn(taskrun)
            else:
                with restore():
                    result = step.fn(taskrun)
        except BaseException as e:
            error = e
        finally:
            self.lease.end_attempt()
        if error is not None and not isinstance(error, Exception):
            self.interrupted(seq, row, max_attempts, policy, error)
        if self.lease.lost:
            raise _Stop
        self.unrecorded = _Ran(seq, row, max_attempts, policy)
        task = step.task
        document: str | None = None
        plain: Any = None
        if error is None and task.records:
            try:
                document, plain, _ = codec.encode_document(result, task.output_type)
            except EncodeError as e:
                error = e
        if error is None:
            return self.complete(seq, row, document, plain)
        if engine.draining.is_set() or self.lease.reason == SHUTDOWN:
            # A failure caused by the shutdown does not spend the attempt.
            self.release()
        text = error_text(error)
        if time.monotonic() >= deadline:
            text = f"timed out after {timeout:g}s: {text}"
        return self.fail(
            seq, row, text, code_of(error), max_attempts, policy,
            permanent=is_permanent(error), may_keep_claim=True,
        )

    def interrupted(
        self, seq: int, row: TaskRow, max_attempts: int, policy: RetryPolicy,
        interrupt: BaseException,
    ) -> NoReturn:
        """A handler raised SystemExit, KeyboardInterrupt or the like: record the
        failed attempt, end the execution without its claim, then re-raise it."""
        self.unrecorded = _Ran(seq, row, max_attempts, policy)
        text = f"the handler raised {type(interrupt).__name__}"
        if str(interrupt):
            text += f": {interrupt}"
        try:
            self.fail(seq, row, text, None, max_attempts, policy,
                      permanent=False, may_keep_claim=False)
        except _Stop:
            pass
        except Exception as e:
            self.engine_failed(e)
        raise interrupt

    def fail(
        self,
        seq: int,
        row: TaskRow,
        text: str,
        code: str | None,
        max_attempts: int,
        policy: RetryPolicy,
        *,
        permanent: bool,
        may_keep_claim: bool,
    ) -> int:
        """Count a failed attempt of task `seq`: park, or retry here or later.

        Returns the seq to go on with after an in-process backoff; otherwise
        stops (parked, or the claim released until the retry is due).
        """
        engine = self.engine
        attempts = row.attempts + 1
        if permanent or attempts >= max_attempts:
            why = "failed permanently" if permanent else "failed on its last attempt"
            self.park(
                row,
                text,
                code=code,
                spent=1,
                log=f"task {row.name!r} {why} (attempt {attempts} of {max_attempts})",
            )
        delay = delay_after(policy, engine.settings, attempts)
        in_process = may_keep_claim and delay <= engine.settings.max_in_process_backoff
        engine.logger.info(
            "workflow: run %s: task %r attempt %d of %d failed, retrying in %gs%s: %s",
            self.run_id, row.name, attempts, max_attempts, delay,
            "" if in_process else " (claim released for a poller)", text,
            extra=self.extra,
        )
        if not engine.store.fail_task(
            self.run_row.id, self.run_row.claim_id, seq,
            error=text, code=code, attempts=attempts, spent=True, park=False,
            keep_claim=in_process, delay=delay,
        ):
            self.lost()
        self.unrecorded = None
        if not in_process:
            raise _Stop
        self.tasks[seq - 1] = attrs.evolve(row, attempts=attempts)
        self.sleep(delay)
        return seq

    def complete(self, seq: int, row: TaskRow, document: str | None, plain: Any) -> int:
        """Record task `seq`'s output and move on; the next seq (or stop when done)."""
        engine = self.engine
        next_seq = seq + 1
        while next_seq <= len(self.tasks) and self.tasks[next_seq - 1].skipped:
            next_seq += 1
        done = next_seq > len(self.tasks)
        if not engine.store.complete_task(
            self.run_row.id, self.run_row.claim_id, seq, document, next_seq, done
        ):
            self.lost()
        self.unrecorded = None
        if document is not None:
            self.tasks[seq - 1] = attrs.evolve(row, has_output=True, output=plain)
            self.outputs[row.name] = self.tasks[seq - 1]
        if done:
            self.outcome = Status.SUCCEEDED
            raise _Stop
        if engine.draining.is_set():
            self.release()
        return next_seq

    def engine_failed(self, error: Exception) -> None:
        """The engine itself failed (the database refused a write, a bug): never release
        the claim with an attempt that ran left uncounted."""
        engine = self.engine
        ran = self.unrecorded
        if ran is None:
            engine.logger.error(
                "workflow: run %s: the engine failed before an attempt ran; releasing the "
                "claim for %gs",
                self.run_id, FAULT_RETRY_DELAY, exc_info=error, extra=self.extra,
            )
            with contextlib.suppress(_Stop):
                self.release(delay=FAULT_RETRY_DELAY)
            return
        engine.logger.error(
            "workflow: run %s: task %r: the attempt's outcome could not be recorded; "
            "counting it as a failed attempt",
            self.run_id, ran.row.name, exc_info=error, extra=self.extra,
        )
        text = f"the attempt's outcome could not be recorded: {type(error).__name__}: {error}"
        try:
            self.fail(ran.seq, ran.row, text, None, ran.max_attempts, ran.policy,
                      permanent=False, may_keep_claim=False)
        except _Stop:
            pass
        except Exception:
            engine.logger.exception(
                "workflow: run %s: counting the failed attempt failed too; the claim is left "
                "as it is: a sweeper releases it after sweep_max_age and counts the attempt",
                self.run_id, extra=self.extra,
            )

    # Inputs, context and outputs.

    def open_input(self) -> Any:
        if self.job.input is not _NO_INPUT:
            return self.job.input
        definition = self.engine.registry.definition(self.run_row.workflow)
        assert definition is not None
        first = self.tasks[self.run_row.current_seq - 1]
        try:
            document = open_document(
                self.run_row.input, self.run_row.input_sealed, self.run_row.id,
                self.engine.cipher, "input",
            )
            # Sealed means no value may reach the error text (it is stored and logged).
            return codec.decode(
                document, definition.workflow.input_type,
                redact=self.run_row.input_sealed is not None,
            )
        except DecodeError as e:
            self.park(first, f"the run's input no longer opens: {e}")

    def open_context(self) -> Callable[[], contextlib.AbstractContextManager[Any]] | None:
        """What each attempt enters to restore the calling context; None: nothing."""
        propagation = self.engine.propagation
        run = self.run_row
        if propagation is None or (run.context is None and run.context_sealed is None):
            return None
        first = self.tasks[run.current_seq - 1]
        try:
            # The stored JSON text: "null" is a snapshot too (of an Optional type).
            plain = None if run.context is None else json.loads(run.context)
            document = open_document(
                plain, run.context_sealed, run.id, self.engine.cipher, "calling context"
            )
            snapshot = propagation.decode_snapshot(
                document, redact=run.context_sealed is not None
            )
        except DecodeError as e:
            self.park(first, f"the run's calling context no longer opens: {e}")
        return lambda: propagation.propagator.restore(snapshot)

    def output(self, task: Task[Any]) -> Any:
        if task.name in self.decoded:
            return self.decoded[task.name]
        row = self.outputs.get(task.name)
        if row is None or not row.has_output or not task.records:
            raise OutputMissing(
                f"task {task.name!r} recorded no output in run {self.run_id} "
                "(skipped, not run yet, or declared without an output type)"
            )
        value = codec.decode(row.output, task.output_type)
        self.decoded[task.name] = value
        return value

    # Waiting, parking, releasing.

    def wait_owed_backoff(self, row: TaskRow, policy: RetryPolicy) -> None:
        """Before resuming a failed task, wait what its last failure owes (database clock)."""
        if row.failed_at is None or self.run_row.db_now is None:
            return
        due = row.failed_at + datetime.timedelta(
            seconds=delay_after(policy, self.engine.settings, row.attempts)
        )
        elapsed = time.monotonic() - self.job.claimed_at
        owed = (due - self.run_row.db_now).total_seconds() - elapsed
        if owed <= 0:
            return
        if owed > self.engine.settings.max_in_process_backoff:
            self.release(retry_at=due)
        self.sleep(owed)

    def sleep(self, seconds: float) -> None:
        """Sleep between attempts; shutdown or a lost claim cuts it short."""
        self.lease.begin_attempt(float("inf")).wait(seconds)
        self.lease.end_attempt()
        if self.lease.lost:
            raise _Stop
        if self.engine.draining.is_set() or self.lease.reason == SHUTDOWN:
            self.release()

    def park(
        self,
        row: TaskRow,
        text: str,
        *,
        code: str | None = None,
        spent: int = 0,
        log: str | None = None,
    ) -> NoReturn:
        """Park the run on `row` (fenced) and log it at ALERT; always stops."""
        attempts = row.attempts + spent
        if not self.engine.store.fail_task(
            self.run_row.id, self.run_row.claim_id, row.seq,
            error=text, code=code, attempts=attempts, spent=spent > 0, park=True,
            keep_claim=False, delay=0.0,
        ):
            self.lost()
        self.unrecorded = None
        self.engine.logger.log(
            ALERT,
            "workflow: run %s parked on task %r after %d attempts: %s",
            self.run_id, row.name, attempts, log + ": " + text if log else text,
            extra=self.extra,
        )
        self.outcome = Status.PARKED
        raise _Stop

    def release(
        self, retry_at: datetime.datetime | None = None, *, delay: float | None = None
    ) -> NoReturn:
        """Give the claim up without ending an attempt; always stops."""
        try:
            released = self.engine.store.release_claim(
                self.run_row.id, self.run_row.claim_id, retry_at, delay=delay
            )
        except Exception:
            self.engine.logger.exception(
                "workflow: run %s: releasing the claim failed; a sweeper will reclaim it",
                self.run_id, extra=self.extra,
            )
            raise _Stop from None
        if not released:
            self.lost()
        self.unrecorded = None
        raise _Stop

    def lost(self) -> NoReturn:
        """A fenced write matched nothing: another executor owns the run."""
        self.lease.cancel(LOST)
        self.unrecorded = None
        self.engine.logger.warning(
            "workflow: run %s: claim lost (another executor owns the run); stopping",
            self.run_id, extra=self.extra,
        )
        raise _Stop
