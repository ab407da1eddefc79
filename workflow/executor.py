"""Executing claimed runs, task after task, every write fenced by the claim.

How a claim is fenced: a run's claim id is written when the run is claimed (by
the fast path's insert, a poller's claim or a `wait()` kick) and every later
write of its executor carries `WHERE claim_id = <its claim>`. A write that
matches zero rows means another executor owns the run (a sweeper released the
claim, someone cancelled it): this execution stops at once, touching nothing,
and its handler's `cancelled` is set. The heartbeat (heartbeat.py) keeps the
claim fresh while an attempt is inside its deadline.

Transactions per run: the insert (already claimed on the fast path), then one per
finished task, which records the output and moves the run on (the last one also
finishes it). A 3-task run on the fast path costs 4 transactions. A failed
attempt costs one more (it records the failure and parks or schedules the retry
in the same statement); a shutdown or a long backoff costs one release. Steps
of runs finishing tasks at the same moment share one (group commit); on a
worker, an unkeyed run's last step is handed to the worker's completer (completer.py),
which writes the finishes of many runs in one commit that also claims the runs
taking their place, while the run's thread goes on with another.

An attempt that ran is always counted: whatever the engine fails to record
after it (the database refusing a write, a bug), the attempt is recorded as
failed (parking the run when that spends the budget); when not even that can be
written the claim is left, no longer heartbeated, for a sweeper to release and
count after `sweep_max_age`. So no fault can re-run a handler more often than
its budget allows (SPEC 9, invariant 4).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple, NoReturn

import attrs

from workflow import codec
from workflow.completer import Completer
from workflow.config import Settings
from workflow.definition import Registry, Step, Task
from workflow.durations import wait_in_slices
from workflow.errors import (
    DecodeError,
    EncodeError,
    OutputMissing,
    WorkflowError,
    code_of,
    error_text,
    is_permanent,
)
from workflow.events import (
    AttemptBegan,
    AttemptEnded,
    ClaimLost,
    Events,
    ExecutionEnded,
    FinishHandedOver,
    Outcome,
    RunClaimed,
    RunFinished,
)
from workflow.heartbeat import CANCELLED, LOST, SHUTDOWN, Claim, Heartbeat
from workflow.logs import ALERT, EngineLog
from workflow.retry import Retry
from workflow.run import Status
from workflow.sealing import Cipher, Propagation, open_document
from workflow.store import ClaimedRun, Store, TaskRow
from workflow.taskrun import TaskRun

NO_INPUT: Any = object()
"""`execute(input=...)` left out: the input is decoded from the claimed row."""

FAULT_RETRY_DELAY = 30.0
"""Seconds a run waits after the engine failed on it before any attempt ran (say
the database refused a park): long enough that a fault that repeats cannot spin."""


@attrs.frozen
class Plan:
    """How one task of one registered workflow is executed: its step and its retry rules."""

    step: Step[Any]
    retry: Retry


_executing = threading.local()
"""Per thread, as `current`: (the executor whose execution this thread is inside, its run id)."""


class Executor:
    """Executes claimed runs for one manager; counts them, so that `drain()` can wait for them.

    A run handed to a thread is first `admit()`ted; `execute()` runs it and
    uncounts it at the end (`dismiss()` uncounts one that will not run after
    all). `on_end(run_id, status)` is called at the end of every execution, with
    the terminal status it wrote or None.
    """

    def __init__(
        self,
        *,
        store: Store,
        registry: Registry,
        settings: Settings,
        log: EngineLog,
        heartbeat: Heartbeat,
        events: Events,
        cipher: Cipher | None,
        propagation: Propagation[Any] | None,
        on_end: Callable[[uuid.UUID, Status | None], None],
    ) -> None:
        self.store = store
        self.registry = registry
        self.settings = settings
        self.log = log
        self.heartbeat = heartbeat
        self.events = events
        self.cipher = cipher
        self.propagation = propagation
        self.on_end = on_end
        self.draining = threading.Event()
        """Set by `drain()`: no attempt begins, claims are released."""
        self._plans: dict[str, dict[str, Plan]] = {}
        for name in registry.names():
            definition = registry.definition(name)
            assert definition is not None
            plans = self._plans[name] = {}
            for step in definition.steps:
                retry = registry.policy(name, step.task.name).resolve(settings)
                plans[step.task.name] = Plan(step, retry)
        self._in_flight = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._draining_waiters = 0  # drain() calls waiting for idle: only they are notified

    def plans(self, workflow: str) -> dict[str, Plan]:
        """How each task of `workflow` is executed here, by task name (empty: not registered)."""
        return self._plans.get(workflow, {})

    def admit(self) -> None:
        """Count one execution about to be handed to a thread."""
        with self._lock:
            self._in_flight += 1

    def dismiss(self) -> None:
        """Uncount an admitted execution that will not run (its thread refused it)."""
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0 and self._draining_waiters:
                self._idle.notify_all()

    def execute(
        self,
        run: ClaimedRun,
        *,
        input: Any = NO_INPUT,
        claimed_at: float | None = None,
        follows_key: bool = False,
        claim: Claim | None = None,
        completer: Completer | None = None,
    ) -> bool:
        """Run the admitted claimed `run` from its current task until it finishes, parks,
        or must stop, then uncount it.

        `input` is the decoded input when the caller has it (the fast path);
        `claimed_at` the monotonic time of the claim (default: now); `follows_key`:
        the caller claims the next run of the run's key itself when this ends, so
        its finish or park wakes no poller for it; `claim`: the run's claim, already
        heartbeated since the run was claimed (`hold()`; default: heartbeated from
        now); `completer`: a worker's completer, to which the run's last write is
        handed when its last task succeeds (the completer then ends and uncounts the
        execution, once that write has committed). True when it was handed over.
        Raises nothing of its own (see the module doc for what an unexpected error
        does), but a `SystemExit` or `KeyboardInterrupt` raised by a handler is
        recorded as a failed attempt and then propagates.
        """
        if claim is None:
            claim = self.hold(run)
        execution = _Execution(
            self, run, claim, input, time.monotonic() if claimed_at is None else claimed_at
        )
        execution.wake_key = not follows_key
        execution.completer = completer
        outer = getattr(_executing, "current", None)
        _executing.current = (self, run.id)
        try:
            try:
                self.events.look()
                if self.events.active:
                    self.events.emit(
                        RunClaimed(
                            run.id, run.workflow, run.db_now is None, run.waited,
                            run.traceparent, run.tracestate,
                        )
                    )
                execution.run()
            except (_HandedOver, _Stop):
                pass
            except Exception as e:
                execution.engine_failed(e)
        finally:
            _executing.current = outer
            if not execution.handed:  # else the completer ends it, once its write committed
                execution.end()
        return execution.handed

    def hold(self, run: ClaimedRun) -> Claim:
        """Heartbeat the claim on `run` (admitted, not yet executing) from now on, so it
        is kept until its execution begins; pass it to `execute()`."""
        claim = Claim(run.id, run.claim_id)
        self.heartbeat.add(claim)
        return claim

    def executing_here(self) -> uuid.UUID | None:
        """The run the calling thread executes for this executor (inside a handler), else None."""
        current: tuple[Executor, uuid.UUID] | None = getattr(_executing, "current", None)
        if current is not None and current[0] is self:
            return current[1]
        return None

    def drain(self, timeout: float | None) -> bool:
        """Stop every execution: no attempt begins, in-flight handlers see `cancelled`,
        their claims are released once their attempt is recorded. Blocks until none is
        in flight, or `timeout`; True when none is."""
        self.draining.set()
        for claim in self.heartbeat.claims():
            claim.cancel(SHUTDOWN)
        with self._idle:
            self._draining_waiters += 1
            try:
                return wait_in_slices(
                    lambda slice_: self._idle.wait_for(lambda: self._in_flight == 0, slice_),
                    timeout,
                )
            finally:
                self._draining_waiters -= 1


def refuse_inside_handler(executor: Executor, what: str) -> None:
    """`WorkflowError` when the calling thread is inside a handler `executor` executes.

    For the calls that wait for every execution to end (`close()`, `stop()`, `run()`):
    from inside a handler they would wait for themselves.
    """
    if executor.executing_here() is not None:
        raise WorkflowError(
            f"workflow: {what} was called from inside a handler that this manager is "
            "executing; it waits for every execution to end, that one included, so it "
            "would wait for itself: call it from outside the handler"
        )


class _Stop(Exception):
    """Ends an execution early; the claim has been dealt with."""


class _HandedOver(Exception):
    """Ends an execution's thread: its last write is the completer's now, and so is its end."""


class _Ran(NamedTuple):
    """An attempt whose handler has run and whose outcome is not recorded yet."""

    seq: int
    row: TaskRow
    plan: Plan
    began: float


class _Execution:
    params: dict[str, Any]
    """The last write's parameters, set when it is handed to the completer."""

    def __init__(
        self, executor: Executor, run: ClaimedRun, claim: Claim, input: Any, claimed_at: float
    ) -> None:
        self.executor = executor
        self.run_row = run
        self.claim = claim
        self.given_input = input
        self.claimed_at = claimed_at
        self.run_id = str(run.id)
        self.tasks = list(run.tasks)
        self.outputs: dict[str, TaskRow] = {t.name: t for t in self.tasks}
        self.plans = executor.plans(run.workflow)
        self.decoded: dict[str, Any] = {}
        self.outcome: Status | None = None
        self.unrecorded: _Ran | None = None
        self.wake_key = True  # a keyed run's finish or park wakes the pollers
        self.completer: Completer | None = None  # a worker's, to hand the last write to
        self.handed = False  # whether it was: the completer ends the execution then
        self.handed_at = 0.0  # when (monotonic): the attempt's end, for its duration
        self._log: EngineLog | None = None

    @property
    def log(self) -> EngineLog:
        """The log of this run (built on first use: the success path logs nothing)."""
        if self._log is None:
            self._log = self.executor.log.for_run(self.run_id)
        return self._log

    # The run's life.

    def run(self) -> None:
        input_value = self.open_input()
        restore = self.open_context()
        seq = self.run_row.current_seq
        first = True
        while seq <= len(self.tasks):
            row = self.tasks[seq - 1]
            plan = self.plans.get(row.name)
            if plan is None:
                self.park(
                    row,
                    f"no handler is registered for task {row.name!r} of workflow "
                    f"{self.run_row.workflow!r} (version skew: deploy the code that has it)",
                )
            if row.attempts >= plan.retry.max_attempts:
                self.park(
                    row,
                    f"task {row.name!r} had already spent its {plan.retry.max_attempts} "
                    "attempts when this executor claimed the run (its executors keep dying "
                    "mid-attempt?)",
                )
            if first and row.attempts > 0:
                self.wait_owed_backoff(row, plan)
            first = False
            seq = self.attempt(seq, row, plan, input_value, restore)

    def attempt(
        self,
        seq: int,
        row: TaskRow,
        plan: Plan,
        input_value: Any,
        restore: Callable[[], contextlib.AbstractContextManager[Any]] | None,
    ) -> int:
        """Run one attempt of task `seq`; the seq to go on with."""
        executor = self.executor
        if self.claim.lost:
            raise _Stop
        if executor.draining.is_set():
            self.release()
        timeout = plan.retry.timeout
        began = time.monotonic()
        deadline = began + timeout
        cancelled = self.claim.begin_attempt(deadline)
        executor.heartbeat.watch_deadline(deadline)
        taskrun: TaskRun[Any] = TaskRun(
            run_id=self.run_id,
            seq=seq,
            input=input_value,
            outputs=self.output,
            attempt=row.attempts + 1,
            max_attempts=plan.retry.max_attempts,
            deadline=deadline,
            cancelled=cancelled,
        )
        if executor.events.active:
            executor.events.emit(
                AttemptBegan(
                    self.run_row.id, self.run_row.workflow, row.name, seq, row.attempts + 1
                )
            )
        error: BaseException | None = None
        result: Any = None
        try:
            if restore is None:
                result = plan.step.fn(taskrun)
            else:
                with restore():
                    result = plan.step.fn(taskrun)
        except BaseException as e:
            error = e
        finally:
            self.claim.end_attempt()
        ran = _Ran(seq, row, plan, began)
        if error is not None and not isinstance(error, Exception):
            self.interrupted(ran, error)
        if self.claim.reason in (LOST, CANCELLED):
            if executor.events.active:
                self.attempt_ended(ran, self.gone_outcome(), error)
            raise _Stop
        self.unrecorded = ran
        task = plan.step.task
        document: str | None = None
        plain: Any = None
        if error is None and task.records:
            try:
                document, plain, _ = codec.encode_document(result, task.output_type)
            except EncodeError as e:
                error = e
        if error is None:
            return self.complete(ran, document, plain)
        if executor.draining.is_set() or self.claim.reason == SHUTDOWN:
            # A failure caused by the shutdown does not spend the attempt.
            if executor.events.active:
                self.attempt_ended(ran, Outcome.ABANDONED, error)
            self.release()
        text = error_text(error)
        timed_out = time.monotonic() >= deadline
        if timed_out:
            text = f"timed out after {timeout:g}s: {text}"
        return self.fail(
            ran, text, code_of(error), error,
            permanent=is_permanent(error), may_keep_claim=True, timed_out=timed_out,
        )

    def interrupted(self, ran: _Ran, interrupt: BaseException) -> NoReturn:
        """A handler raised SystemExit, KeyboardInterrupt or the like: record the
        failed attempt, end the execution without its claim, then re-raise it."""
        self.unrecorded = ran
        text = f"the handler raised {type(interrupt).__name__}"
        if str(interrupt):
            text += f": {interrupt}"
        try:
            self.fail(ran, text, None, interrupt, permanent=False, may_keep_claim=False)
        except _Stop:
            pass
        except Exception as e:
            self.engine_failed(e)
        raise interrupt

    def fail(
        self,
        ran: _Ran,
        text: str,
        code: str | None,
        error: BaseException | None,
        *,
        permanent: bool,
        may_keep_claim: bool,
        timed_out: bool = False,
    ) -> int:
        """Count a failed attempt of the task `ran` was on: park, or retry here or later.

        Returns the seq to go on with after an in-process backoff; otherwise
        stops (parked, or the claim released until the retry is due).
        """
        executor = self.executor
        row, retry = ran.row, ran.plan.retry
        attempts = row.attempts + 1
        outcome = Outcome.TIMED_OUT if timed_out else Outcome.FAILED
        if permanent or attempts >= retry.max_attempts:
            why = "failed permanently" if permanent else "failed on its last attempt"
            self.park(
                row,
                text,
                code=code,
                spent=1,
                log=f"task {row.name!r} {why} (attempt {attempts} of {retry.max_attempts})",
                ended=(ran, outcome, error),
            )
        delay = retry.delay(attempts)
        in_process = may_keep_claim and delay <= executor.settings.max_in_process_backoff
        self.log.info(
            "task %r attempt %d of %d failed, retrying in %gs%s: %s",
            row.name, attempts, retry.max_attempts, delay,
            "" if in_process else " (claim released for a poller)", text,
        )
        if not in_process:
            self.claim.leave()
        if not executor.store.fail_task(
            self.run_row.id, self.run_row.claim_id, ran.seq,
            error=text, code=code, attempts=attempts, keep_claim=in_process, delay=delay,
        ):
            self.lost()
        self.unrecorded = None
        if executor.events.active:
            self.attempt_ended(ran, outcome, error)
        if not in_process:
            raise _Stop
        self.tasks[ran.seq - 1] = attrs.evolve(row, attempts=attempts)
        self.sleep(delay)
        return ran.seq

    def complete(self, ran: _Ran, document: str | None, plain: Any) -> int:
        """Record the task's output and move on; the next seq (or stop when finished)."""
        executor = self.executor
        seq, row = ran.seq, ran.row
        next_seq = seq + 1
        while next_seq <= len(self.tasks) and self.tasks[next_seq - 1].skipped:
            next_seq += 1
        finishes = next_seq > len(self.tasks)
        if finishes:
            self.claim.leave()
        if finishes and self.completer is not None and not executor.draining.is_set():
            self.params = executor.store.step_params(
                self.run_row.id, self.run_row.claim_id, seq, document, next_seq
            )
            self.handed_at = time.monotonic()
            try:
                if executor.events.active:
                    executor.events.emit(
                        FinishHandedOver(self.run_row.id, self.run_row.workflow)
                    )
            finally:  # a subscriber's interrupt too: the success is the completer's to write
                self.completer.hand(self)
                self.handed = True
            raise _HandedOver
        matched = executor.store.complete_task(
            self.run_row.id, self.run_row.claim_id, seq, document, next_seq, finishes,
            wake_key=self.wake_key,
        )
        if not matched:
            self.lost()
        self.unrecorded = None
        if document is not None:
            self.tasks[seq - 1] = row.with_output(plain)
            self.outputs[row.name] = self.tasks[seq - 1]
        if executor.events.active:
            self.attempt_ended(ran, Outcome.SUCCEEDED, None)
        if finishes:
            self.finished(Status.SUCCEEDED)
            raise _Stop
        if executor.draining.is_set():
            self.release()
        return next_seq

    def resolve(self, answer: bool | Exception) -> None:
        """The end of an execution whose last write the completer made: `answer` is whether
        its claim matched, or the error that writing it raised (see `complete`, and
        execute's handling of what it raises). On the completer thread that wrote it."""
        try:
            try:
                if isinstance(answer, Exception):
                    raise answer
                if not answer:
                    self.lost()
                ran = self.unrecorded
                self.unrecorded = None
                if ran is not None and self.executor.events.active:
                    self.attempt_ended(ran, Outcome.SUCCEEDED, None)
                self.finished(Status.SUCCEEDED)
            except _Stop:
                pass
            except Exception as e:
                self.engine_failed(e)
        finally:
            self.end()

    def end(self) -> None:
        """The execution is over: stop heartbeating its claim, announce it, tell the
        manager (`on_end`) and uncount it."""
        executor = self.executor
        executor.heartbeat.remove(self.claim)
        try:
            if executor.events.active:
                run = self.run_row
                if self.claim.reason == CANCELLED:
                    executor.events.emit(RunFinished(run.id, run.workflow, Status.CANCELLED))
                executor.events.emit(ExecutionEnded(run.id, run.workflow))
        finally:
            try:
                executor.on_end(self.run_row.id, self.outcome)
            finally:
                executor.dismiss()

    def engine_failed(self, error: Exception) -> None:
        """The engine itself failed (the database refused a write, a bug): never release
        the claim with an attempt that ran left uncounted."""
        ran = self.unrecorded
        if ran is None:
            self.log.error(
                "the engine failed before an attempt ran; releasing the claim for %gs",
                FAULT_RETRY_DELAY, exc_info=error,
            )
            with contextlib.suppress(_Stop):
                self.release(delay=FAULT_RETRY_DELAY)
            return
        self.log.error(
            "task %r: the attempt's outcome could not be recorded; counting it as a failed "
            "attempt",
            ran.row.name, exc_info=error,
        )
        text = f"the attempt's outcome could not be recorded: {type(error).__name__}: {error}"
        try:
            self.fail(ran, text, None, error, permanent=False, may_keep_claim=False)
        except _Stop:
            pass
        except Exception:
            self.log.exception(
                "counting the failed attempt failed too; the claim is left as it is: a "
                "sweeper releases it after sweep_max_age and counts the attempt"
            )

    # What happened, for subscribers.

    def attempt_ended(self, ran: _Ran, outcome: Outcome, error: BaseException | None) -> None:
        """Announce how an attempt ended (callers check `events.active` first: it is hot).
        An attempt whose finish was handed to the completer ended at the hand-over,
        whatever the completer's write does: its duration leaves out the wait for the
        completer's statement."""
        self.executor.events.emit(
            AttemptEnded(
                self.run_row.id, self.run_row.workflow, ran.row.name, ran.seq,
                ran.row.attempts + 1, outcome, (self.handed_at or time.monotonic()) - ran.began,
                error,
                claim_lost=self.claim.reason == LOST,
            )
        )

    def finished(self, status: Status) -> None:
        self.outcome = status
        events = self.executor.events
        if events.active:
            events.emit(RunFinished(self.run_row.id, self.run_row.workflow, status))

    # Inputs, context and outputs.

    def open_input(self) -> Any:
        if self.given_input is not NO_INPUT:
            return self.given_input
        definition = self.executor.registry.definition(self.run_row.workflow)
        assert definition is not None
        first = self.tasks[self.run_row.current_seq - 1]
        try:
            document = open_document(
                self.run_row.input, self.run_row.input_sealed,
                self.run_row.sealed_for or self.run_row.id, self.executor.cipher, "input",
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
        propagation = self.executor.propagation
        run = self.run_row
        if propagation is None or (run.context is None and run.context_sealed is None):
            return None
        first = self.tasks[run.current_seq - 1]
        try:
            # The stored JSON text: "null" is a snapshot too (of an Optional type).
            plain = None if run.context is None else json.loads(run.context)
            document = open_document(
                plain, run.context_sealed, run.sealed_for or run.id, self.executor.cipher,
                "calling context",
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

    def wait_owed_backoff(self, row: TaskRow, plan: Plan) -> None:
        """Before resuming a failed task, wait what its last failure owes (database clock)."""
        if row.failed_at is None or self.run_row.db_now is None:
            return
        due, owed = plan.retry.owed(
            row.attempts, row.failed_at, self.run_row.db_now,
            time.monotonic() - self.claimed_at,
        )
        if owed <= 0:
            return
        if owed > self.executor.settings.max_in_process_backoff:
            self.release(retry_at=due)
        self.sleep(owed)

    def sleep(self, seconds: float) -> None:
        """Sleep between attempts; shutdown or a lost claim cuts it short."""
        self.claim.begin_attempt(float("inf")).wait(seconds)
        self.claim.end_attempt()
        if self.claim.lost:
            raise _Stop
        if self.executor.draining.is_set() or self.claim.reason == SHUTDOWN:
            self.release()

    def park(
        self,
        row: TaskRow,
        text: str,
        *,
        code: str | None = None,
        spent: int = 0,
        log: str | None = None,
        ended: tuple[_Ran, Outcome, BaseException | None] | None = None,
    ) -> NoReturn:
        """Park the run on `row` (fenced) and log it at ALERT; always stops.

        `ended`: the attempt whose failure parks it, announced once recorded.
        """
        attempts = row.attempts + spent
        self.claim.leave()
        if not self.executor.store.park_run(
            self.run_row.id, self.run_row.claim_id, row.seq,
            error=text, code=code, attempts=attempts, spent=spent > 0,
            wake_key=self.wake_key,
        ):
            self.lost()
        self.unrecorded = None
        if ended is not None and self.executor.events.active:
            self.attempt_ended(*ended)
        self.log.log(
            ALERT,
            "parked on task %r after %d attempts: %s",
            row.name, attempts, log + ": " + text if log else text,
        )
        self.finished(Status.PARKED)
        raise _Stop

    def release(
        self, retry_at: datetime.datetime | None = None, *, delay: float | None = None
    ) -> NoReturn:
        """Give the claim up without ending an attempt; always stops."""
        self.claim.leave()
        try:
            released = self.executor.store.release_claim(
                self.run_row.id, self.run_row.claim_id, retry_at, delay=delay
            )
        except Exception:
            self.log.exception("releasing the claim failed; a sweeper will reclaim it")
            raise _Stop from None
        if not released:
            self.lost()
        self.unrecorded = None
        raise _Stop

    def lost(self) -> NoReturn:
        """A fenced write matched nothing: the run was cancelled, or another executor
        owns it. Either way this execution stops, touching nothing; what its attempt
        did is discarded and not counted."""
        cancelled = self.claim.reason == CANCELLED or self.read_cancelled()
        self.claim.cancel(CANCELLED if cancelled else LOST)
        events = self.executor.events
        if self.unrecorded is not None and events.active:
            self.attempt_ended(self.unrecorded, self.gone_outcome(), None)
        self.unrecorded = None
        if cancelled:
            self.log.info("the run was cancelled; stopping (this attempt is not counted)")
        else:
            self.log.warning("claim lost (another executor owns the run); stopping")
            if events.active:
                events.emit(ClaimLost(self.run_row.id, self.run_row.workflow))
        raise _Stop

    def read_cancelled(self) -> bool:
        """Whether the run is cancelled now (one read, on the rare path of a lost write)."""
        try:
            row = self.executor.store.run_status(self.run_row.id)
        except Exception:
            return False
        return row is not None and row.status == Status.CANCELLED.value

    def gone_outcome(self) -> Outcome:
        """How an attempt ends whose claim is gone: CANCELLED with its run, else ABANDONED."""
        return Outcome.CANCELLED if self.claim.reason == CANCELLED else Outcome.ABANDONED
