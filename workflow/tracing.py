"""OpenTelemetry traces of runs (SPEC 13), when opentelemetry-api is installed.

`start` and `start_tx` store the caller's span context on the run as W3C
trace-context headers (`traceparent`, `tracestate`; never baggage, which can
carry user data): `capture()`. A manager with `Config(tracing=True)` (the
default) subscribes a `Tracing` to its events, which turns them into spans:

- each attempt runs in a span `workflow.task {task}` (attributes
  `workflow.name`, `workflow.run_id`, `workflow.task`, `workflow.task.seq`,
  `workflow.attempt`, `workflow.outcome`), current while the handler runs, so
  the handler's own spans are its children; an exception is recorded on it, and
  what followed a failure (a retry, a park) is an event on it;
- on the fast path the task spans are children of the caller's span (the one
  current at `start`; a start without one is traced like a polled run);
- a run claimed by a poller (a worker, maybe much later, maybe elsewhere) runs
  under a `workflow.run {workflow}` span of kind CONSUMER that starts a trace of
  its own and links to the stored context, as OpenTelemetry's messaging
  conventions advise for work that is processed later.

Park and cancel are span events (`workflow.parked`, `workflow.cancelled`). With
the API but no SDK configured (no tracer provider set), the manager's events have
no subscriber for tracing, so none is built for it: as executions begin, it looks
for a provider at most every `events.LOOK_EVERY` seconds, and subscribes once one
is configured: within about that long of its configuration. An execution that
began before then is not traced.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from workflow.events import (
    AttemptBegan,
    AttemptEnded,
    Event,
    Events,
    ExecutionEnded,
    FinishHandedOver,
    Outcome,
    RunClaimed,
    RunFinished,
)
from workflow.run import Status

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span

try:
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the `otel` extra is not installed
    available = False
else:
    available = True
    _W3C = TraceContextTextMapPropagator()
    _NO_SDK = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)

__all__ = ["Tracing", "available", "capture"]

_INSTRUMENTATION = "workflow"
_FAILED = (Outcome.FAILED, Outcome.TIMED_OUT)


def capture() -> tuple[str | None, str | None]:
    """The calling thread's current span context as (`traceparent`, `tracestate`);
    (None, None) when there is no valid span (or no opentelemetry-api)."""
    if not available:
        return None, None
    if not trace.get_current_span().get_span_context().is_valid:
        return None, None
    carrier: dict[str, str] = {}
    _W3C.inject(carrier)
    return carrier.get("traceparent"), carrier.get("tracestate") or None


def _stored(traceparent: str | None, tracestate: str | None) -> Context | None:
    """The context a stored span context extracts to; None when there is none."""
    if traceparent is None:
        return None
    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    extracted = _W3C.extract(carrier)
    if not trace.get_current_span(extracted).get_span_context().is_valid:
        return None
    return extracted


class _Execution:
    """What one execution of a run has open on its thread."""

    __slots__ = ("parent", "pending", "pending_end", "run_span", "run_token", "task_span",
                 "task_token")

    def __init__(self) -> None:
        self.parent: Context | None = None
        self.run_span: Span | None = None
        self.run_token: object = None
        self.task_span: Span | None = None
        self.task_token: object = None
        self.pending: Span | None = None
        """A failed attempt's span, ended once it is known what followed."""
        self.pending_end = 0


class Tracing:
    """Spans from a manager's events; `close()` unsubscribes."""

    def __init__(self, events: Events) -> None:
        if not available:
            raise RuntimeError("workflow.tracing needs opentelemetry-api (pgworkflow[otel])")
        self._tracer = trace.get_tracer(_INSTRUMENTATION)
        self._local = threading.local()
        # Executions whose last write a worker's completer makes: their contexts are
        # detached on the handler's thread (FinishHandedOver) and their spans ended
        # from the completer's, which finds them here.
        self._handed: dict[uuid.UUID, _Execution] = {}
        self._events = events
        self._lock = threading.Lock()
        self._closed = False
        self._unsubscribe: Callable[[], None] | None = None
        self._stop_looking: Callable[[], None] | None = None
        if not self._look():
            with self._lock:  # a look from another thread waits for the stop to be kept
                self._stop_looking = events.watch(self._look)

    def close(self) -> None:
        """Stop making spans."""
        with self._lock:
            self._closed = True
            for stop in (self._stop_looking, self._unsubscribe):
                if stop is not None:
                    stop()
            self._stop_looking = self._unsubscribe = None

    def _look(self) -> bool:
        """Subscribe to the events once a tracer provider (an SDK) is configured (the API
        sets one only once: it stays); whether subscribed (or closed)."""
        with self._lock:
            if self._closed or self._unsubscribe is not None:
                return True
            if isinstance(trace.get_tracer_provider(), _NO_SDK):
                return False
            self._unsubscribe = self._events.subscribe(self._on_event)
            if self._stop_looking is not None:
                self._stop_looking()
                self._stop_looking = None
            return True

    def _executions(self) -> dict[uuid.UUID, _Execution]:
        executions: dict[uuid.UUID, _Execution] | None = getattr(self._local, "runs", None)
        if executions is None:
            executions = self._local.runs = {}
        return executions

    def _find(self, run_id: uuid.UUID, *, pop: bool = False) -> _Execution | None:
        """The execution of `run_id`: this thread's, or one handed to a completer."""
        executions = self._executions()
        execution = executions.pop(run_id, None) if pop else executions.get(run_id)
        if execution is None and self._handed:
            with self._lock:
                execution = (
                    self._handed.pop(run_id, None) if pop else self._handed.get(run_id)
                )
        return execution

    def _handed_over(self, event: FinishHandedOver) -> None:
        """Detach the run's contexts from the handler's thread, which is done with it; the
        spans end on the completer thread that writes its finish."""
        execution = self._executions().pop(event.run_id, None)
        if execution is None:
            return
        self._detach(execution.task_token)
        self._detach(execution.run_token)
        execution.task_token = execution.run_token = None
        with self._lock:
            self._handed[event.run_id] = execution

    def _on_event(self, event: Event) -> None:
        if isinstance(event, AttemptBegan):
            self._attempt_began(event)
        elif isinstance(event, AttemptEnded):
            self._attempt_ended(event)
        elif isinstance(event, RunClaimed):
            self._claimed(event)
        elif isinstance(event, RunFinished):
            self._finished(event)
        elif isinstance(event, ExecutionEnded):
            self._ended(event)
        elif isinstance(event, FinishHandedOver):
            self._handed_over(event)

    def _claimed(self, event: RunClaimed) -> None:
        execution = _Execution()
        self._executions()[event.run_id] = execution
        stored = _stored(event.traceparent, event.tracestate)
        if event.fast and stored is not None:
            execution.parent = stored
            return
        # Claimed by a poller, or a fast-path start that had no span: the run gets a
        # span of its own, so that its tasks share one trace.
        links = []
        if stored is not None:
            links.append(trace.Link(trace.get_current_span(stored).get_span_context()))
        span = self._tracer.start_span(
            f"workflow.run {event.workflow}",
            context=otel_context.Context(),
            kind=trace.SpanKind.CONSUMER,
            links=links,
            attributes={"workflow.name": event.workflow, "workflow.run_id": str(event.run_id)},
        )
        execution.run_span = span
        execution.parent = trace.set_span_in_context(span, otel_context.Context())
        execution.run_token = otel_context.attach(execution.parent)

    def _attempt_began(self, event: AttemptBegan) -> None:
        execution = self._executions().get(event.run_id)
        if execution is None:
            return
        if execution.pending is not None:
            self._end_pending(execution, "workflow.retry")
        span = self._tracer.start_span(
            f"workflow.task {event.task}",
            context=execution.parent,
            attributes={
                "workflow.name": event.workflow,
                "workflow.run_id": str(event.run_id),
                "workflow.task": event.task,
                "workflow.task.seq": event.seq,
                "workflow.attempt": event.attempt,
            },
        )
        execution.task_span = span
        execution.task_token = otel_context.attach(trace.set_span_in_context(span))

    def _attempt_ended(self, event: AttemptEnded) -> None:
        execution = self._find(event.run_id)
        if execution is None or execution.task_span is None:
            return
        span = execution.task_span
        execution.task_span = None
        self._detach(execution.task_token)
        execution.task_token = None
        span.set_attribute("workflow.outcome", event.outcome.value)
        if event.error is not None:
            span.record_exception(event.error)
        if event.outcome in _FAILED:
            span.set_status(trace.Status(trace.StatusCode.ERROR, type(event.error).__name__))
            execution.pending = span
            execution.pending_end = time.time_ns()
            return
        if event.outcome is Outcome.CANCELLED:
            span.add_event("workflow.cancelled")
        elif event.outcome is Outcome.ABANDONED:
            span.add_event("workflow.abandoned", {"workflow.claim_lost": event.claim_lost})
        span.end()

    def _finished(self, event: RunFinished) -> None:
        execution = self._find(event.run_id)
        if execution is None:
            return
        name = {Status.PARKED: "workflow.parked", Status.CANCELLED: "workflow.cancelled"}.get(
            event.status
        )
        if name is not None and execution.pending is not None:
            self._end_pending(execution, name)
        if execution.run_span is not None:
            if name is not None:
                execution.run_span.add_event(name)
            execution.run_span.set_attribute("workflow.status", event.status.value)

    def _ended(self, event: ExecutionEnded) -> None:
        execution = self._find(event.run_id, pop=True)
        if execution is None:
            return
        if execution.task_span is not None:  # an attempt whose end was never announced
            self._detach(execution.task_token)
            execution.task_span.end()
        if execution.pending is not None:  # failed, claim released until the retry is due
            self._end_pending(execution, "workflow.retry")
        if execution.run_span is not None:
            self._detach(execution.run_token)
            execution.run_span.end()

    @staticmethod
    def _end_pending(execution: _Execution, name: str) -> None:
        span = execution.pending
        assert span is not None
        execution.pending = None
        span.add_event(name, timestamp=execution.pending_end)
        span.end(end_time=execution.pending_end)

    @staticmethod
    def _detach(token: Any) -> None:
        if token is not None:
            otel_context.detach(token)
