"""OpenTelemetry traces (SPEC 13, `workflow.tracing`), read back from the SDK.

On the fast path each attempt's `workflow.task {task}` span is a child of the
span current at `start`, and the handler's own spans are children of it; a run
that a poller claims runs under a CONSUMER span `workflow.run {workflow}` of a
trace of its own, linked to the span context stored at `start_tx`, in this
process and in a real worker subprocess that exports to a file. Attempt numbers,
errors and what followed them (retry, park, cancel) are on the spans;
`Config(tracing=False)` makes none and stores nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import Inp, Out, drain, registry, start_each_in_its_own_transaction, wait_until
from worker_apps import traced
from worker_apps.harness import ROOT, WorkerProcess

import workflow
from workflow import Status
from workflow.events import FinishHandedOver
from workflow.tracing import Tracing

trace = pytest.importorskip("opentelemetry.trace")
sdk_trace = pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry import baggage, context  # noqa: E402
from opentelemetry.sdk.trace.export import (  # noqa: E402
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

A = workflow.Task("a", Out)
B = workflow.Task("b", Out)


class Kept(SpanExporter):
    """Keeps ended spans while a test of this module listens (the provider is global and
    set once per process: other modules' spans are dropped)."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.listening = False
        self.lock = threading.Lock()

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        with self.lock:
            if self.listening:
                self.spans.extend(spans)
        return SpanExportResult.SUCCESS

    def named(self, prefix: str) -> list[Any]:
        with self.lock:
            return [s for s in self.spans if s.name.startswith(prefix)]


_KEPT = Kept()
_PROVIDER: list[Any] = []


@pytest.fixture
def spans() -> Iterator[Kept]:
    if not _PROVIDER:
        provider = sdk_trace.TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(_KEPT))
        trace.set_tracer_provider(provider)
        _PROVIDER.append(provider)
    with _KEPT.lock:
        _KEPT.spans.clear()
        _KEPT.listening = True
    try:
        yield _KEPT
    finally:
        with _KEPT.lock:
            _KEPT.listening = False
            _KEPT.spans.clear()


def tracer() -> Any:
    return trace.get_tracer("tests")


def test_fast_path_task_spans_are_children_of_the_callers_span(
    spans: Kept, make_manager: Any
) -> None:
    def a(run: workflow.TaskRun[Inp]) -> Out:
        with tracer().start_as_current_span("inside the handler"):
            return Out("a")

    reg, wf = registry(workflow.handle(A, a), workflow.handle(B, lambda run: Out("b")))
    mgr = make_manager(reg)
    with tracer().start_as_current_span("request") as request:
        run = wf.start(mgr, Inp(1))
    assert run.wait(timeout=20) is Status.SUCCEEDED
    wait_until(lambda: len(spans.named("workflow.task")) == 2, "both task spans")
    caller = request.get_span_context()
    first, second = sorted(
        spans.named("workflow.task"), key=lambda s: s.attributes["workflow.task.seq"]
    )
    for span, name, seq in ((first, "a", 1), (second, "b", 2)):
        assert span.name == f"workflow.task {name}"
        assert span.context.trace_id == caller.trace_id
        assert span.parent is not None and span.parent.span_id == caller.span_id
        assert dict(span.attributes) == {
            "workflow.name": "W",
            "workflow.run_id": run.id,
            "workflow.task": name,
            "workflow.task.seq": seq,
            "workflow.attempt": 1,
            "workflow.outcome": "succeeded",
        }
    (inside,) = spans.named("inside the handler")
    assert inside.parent is not None and inside.parent.span_id == first.context.span_id
    assert not spans.named("workflow.run"), "the fast path has no CONSUMER span"


def test_a_failure_then_a_park_are_on_the_spans(spans: Kept, make_manager: Any) -> None:
    def fails(run: workflow.TaskRun[Inp]) -> Out:
        if run.attempt == 1:
            raise RuntimeError("flaky provider")
        raise workflow.Permanent("account closed", code="closed")

    reg, wf = registry(workflow.handle(A, fails, backoff_schedule=[0.01]))
    mgr = make_manager(reg)
    assert wf.start(mgr, Inp(1)).wait(timeout=20) is Status.PARKED
    wait_until(lambda: len(spans.named("workflow.task")) == 2, "both attempts' spans")
    first, second = sorted(
        spans.named("workflow.task"), key=lambda s: s.attributes["workflow.attempt"]
    )
    assert first.attributes["workflow.attempt"] == 1
    assert first.attributes["workflow.outcome"] == "failed"
    assert first.status.status_code is trace.StatusCode.ERROR
    assert [e.name for e in first.events] == ["exception", "workflow.retry"]
    assert first.events[0].attributes["exception.message"] == "flaky provider"
    assert first.end_time <= second.start_time, "a failed attempt's span ends when it ended"
    assert second.attributes["workflow.attempt"] == 2
    assert [e.name for e in second.events] == ["exception", "workflow.parked"]


def test_a_cancel_is_an_event_on_the_attempts_span(
    spans: Kept, make_manager: Any, db_url: str
) -> None:
    entered = threading.Event()

    def waits(run: workflow.TaskRun[Inp]) -> Out:
        entered.set()
        run.cancelled.wait(20)
        return Out("late")

    reg, wf = registry(workflow.handle(A, waits))
    mgr = make_manager(reg)
    run = wf.start(mgr, Inp(1))
    assert entered.wait(10)
    with workflow.Admin(db_url) as admin:
        admin.cancel(run.id)
    assert run.wait(timeout=20) is Status.CANCELLED
    wait_until(lambda: spans.named("workflow.task"), "the attempt's span")
    (span,) = spans.named("workflow.task")
    assert span.attributes["workflow.outcome"] == "cancelled"
    assert [e.name for e in span.events] == ["workflow.cancelled"]


def _stored(db: psycopg.Connection[Any], run_id: str) -> tuple[str | None, str | None]:
    row = db.execute(
        "SELECT traceparent, tracestate FROM workflow_runs WHERE id = %s", (run_id,)
    ).fetchone()
    assert row is not None
    return row[0], row[1]


def test_a_polled_run_runs_under_a_consumer_span_linked_to_its_start(
    spans: Kept, make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    reg, wf = registry(
        workflow.handle(A, lambda run: Out("a")), workflow.handle(B, lambda run: Out("b"))
    )
    mgr = make_manager(reg)
    state = trace.TraceState([("vendor", "value")])
    parent = trace.NonRecordingSpan(
        trace.SpanContext(
            0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, is_remote=True,
            trace_flags=trace.TraceFlags(1), trace_state=state,
        )
    )
    token = context.attach(
        baggage.set_baggage("user.email", "someone@example.com", trace.set_span_in_context(parent))
    )
    try:
        with tracer().start_as_current_span("request") as request, db.transaction():
            run = wf.start_tx(db, mgr, Inp(1))
    finally:
        context.detach(token)
    caller = request.get_span_context()
    traceparent, tracestate = _stored(db, run.id)
    assert traceparent == f"00-{caller.trace_id:032x}-{caller.span_id:016x}-01"
    assert tracestate == "vendor=value", "the trace state, and never the baggage"
    runnable = mgr.new_runnable(workflow.RunnerConfig(listen=False, poll_interval=0.1))
    runnable.start()
    try:
        assert run.wait(timeout=20) is Status.SUCCEEDED
    finally:
        runnable.stop()
    wait_until(lambda: spans.named("workflow.run"), "the CONSUMER span")
    (consumer,) = spans.named("workflow.run")
    assert consumer.name == "workflow.run W"
    assert consumer.kind is trace.SpanKind.CONSUMER
    assert consumer.parent is None and consumer.context.trace_id != caller.trace_id
    assert [(link.context.trace_id, link.context.span_id) for link in consumer.links] == [
        (caller.trace_id, caller.span_id)
    ]
    assert consumer.attributes["workflow.run_id"] == run.id
    tasks = spans.named("workflow.task")
    assert len(tasks) == 2
    assert all(t.parent is not None and t.parent.span_id == consumer.context.span_id for t in tasks)


def test_a_workers_runs_end_their_spans_from_the_completers_thread(
    spans: Kept, make_manager: Any, db: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A worker thread hands each run's finish to the completer and goes on with the next
    run: the run's contexts are detached on the thread that attached them (none is left
    behind there, none is detached elsewhere, which OpenTelemetry logs as an error), and
    its spans end once the finish has committed, each task's under its own run's."""
    seen: list[Any] = []

    def handler(run: workflow.TaskRun[Inp]) -> Out:
        seen.append(trace.get_current_span().get_span_context().span_id)
        return Out("a")

    reg, wf = registry(workflow.handle(A, handler))
    mgr = make_manager(reg)
    runs = []
    for n in range(4):
        with db.transaction():
            runs.append(wf.start_tx(db, mgr, Inp(n)))
    runnable = mgr.new_runnable(
        workflow.RunnerConfig(listen=False, poll_interval=0.1, concurrency=1, batch_size=1)
    )
    with caplog.at_level("ERROR", logger="opentelemetry"):
        runnable.start()
        try:  # read from the database: wait() could claim a run itself
            wait_until(lambda: db.execute(
                "SELECT count(*) = 4 FROM workflow_runs WHERE status = 'succeeded'"
            ).fetchone()[0], "every run to succeed")
        finally:
            runnable.stop()
        wait_until(lambda: len(spans.named("workflow.run")) == 4, "every CONSUMER span")
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry")]
    consumers = {s.context.span_id: s for s in spans.named("workflow.run")}
    tasks = spans.named("workflow.task")
    assert len(tasks) == 4
    assert {t.parent.span_id for t in tasks} == set(consumers)
    assert sorted(seen) == sorted(t.context.span_id for t in tasks)
    assert all(c.parent is None for c in consumers.values())


def test_a_subscriber_raising_on_a_hand_over_ahead_of_tracing_leaves_no_span_open(
    spans: Kept, make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    """A subscriber ahead of tracing that raises `SystemExit` as a worker thread hands a
    run's finish to the completer: tracing still hears of the hand-over, so the run's
    spans end from the completer's thread once the finish has committed."""
    reg, wf = registry(workflow.handle(A, lambda run: Out("a")))
    mgr = make_manager(reg, config=workflow.Config(tracing=False))

    def exits(event: Any) -> None:
        if isinstance(event, FinishHandedOver):
            raise SystemExit(3)

    mgr.events.subscribe(exits)
    traced_here = Tracing(mgr.events)  # subscribed after `exits`
    try:
        runs = start_each_in_its_own_transaction(db, wf, mgr, 2)
        drain(db, mgr, runs, poll_interval=0.1, concurrency=1, batch_size=1)
        wait_until(lambda: len(spans.named("workflow.run")) == 2, "both CONSUMER spans", timeout=5)
        assert len(spans.named("workflow.task")) == 2
    finally:
        traced_here.close()


def test_tracing_off_makes_no_span_and_stores_no_context(
    spans: Kept, make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    reg, wf = registry(workflow.handle(A, lambda run: Out("a")))
    mgr = make_manager(reg, config=workflow.Config(tracing=False))
    with tracer().start_as_current_span("request"):
        run = wf.start(mgr, Inp(1))
        with db.transaction():
            later = wf.start_tx(db, mgr, Inp(2))
    assert run.wait(timeout=20) is Status.SUCCEEDED
    assert _stored(db, run.id) == (None, None) == _stored(db, later.id)
    assert not spans.named("workflow.")


def test_a_fast_path_start_without_a_span_gets_a_run_span_of_its_own(
    spans: Kept, make_manager: Any
) -> None:
    reg, wf = registry(
        workflow.handle(A, lambda run: Out("a")), workflow.handle(B, lambda run: Out("b"))
    )
    mgr = make_manager(reg)
    assert wf.start(mgr, Inp(1)).wait(timeout=20) is Status.SUCCEEDED
    wait_until(lambda: spans.named("workflow.run"), "the run's span")
    (run_span,) = spans.named("workflow.run")
    assert run_span.links == () or list(run_span.links) == []
    tasks = spans.named("workflow.task")
    assert len(tasks) == 2
    assert {t.context.trace_id for t in tasks} == {run_span.context.trace_id}


def test_a_start_without_a_span_stores_nothing(
    spans: Kept, make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    reg, wf = registry(workflow.handle(A, lambda run: Out("a")))
    mgr = make_manager(reg)
    with db.transaction():
        run = wf.start_tx(db, mgr, Inp(1))
    assert _stored(db, run.id) == (None, None)


def test_a_worker_subprocess_links_its_consumer_span_to_the_request(
    spans: Kept, make_manager: Any, db: psycopg.Connection[Any], engine_url: str,
    tmp_path: Path,
) -> None:
    mgr = make_manager(traced.registry())
    with tracer().start_as_current_span("request") as request, db.transaction():
        run = traced.Traced.start_tx(db, mgr, traced.Order(41))
    caller = request.get_span_context()
    out = tmp_path / "spans.jsonl"
    os.environ["WORKFLOW_TEST_SPANS"] = str(out)
    try:
        worker = WorkerProcess("tests.worker_apps.traced:traced_app", engine_url,
                               "--poll-interval", "0.2")
    finally:
        del os.environ["WORKFLOW_TEST_SPANS"]
    try:
        worker.wait_started()
        # Not run.wait(): a wait kicks an unclaimed run and executes it here.
        wait_until(
            lambda: db.execute(
                "SELECT status FROM workflow_runs WHERE id = %s", (run.id,)
            ).fetchone() == ("succeeded",),
            "the worker to finish the run",
        )
        worker.terminate()
        assert worker.wait(timeout=20) == 0, worker.stderr
    finally:
        worker.kill()
    exported = [json.loads(line) for line in out.read_text().splitlines()]
    (consumer,) = [s for s in exported if s["name"] == "workflow.run Traced.Order"]
    assert consumer["kind"] == "CONSUMER" and consumer["parent"] is None
    assert consumer["links"] == [
        {"trace_id": f"{caller.trace_id:032x}", "span_id": f"{caller.span_id:016x}"}
    ]
    assert consumer["attributes"]["workflow.run_id"] == run.id
    tasks = sorted(
        (s for s in exported if s["name"].startswith("workflow.task")),
        key=lambda s: s["attributes"]["workflow.task.seq"],
    )
    assert [s["name"] for s in tasks] == [
        "workflow.task traced.reserve", "workflow.task traced.send"
    ]
    assert all(s["parent"] == consumer["span_id"] for s in tasks)
    assert all(s["trace_id"] == consumer["trace_id"] for s in tasks)
    assert [s["attributes"]["workflow.attempt"] for s in tasks] == [1, 1]


@pytest.mark.parametrize(
    "blocked", ["opentelemetry", "prometheus_client"], ids=["without otel", "without prometheus"]
)
def test_the_library_works_without_the_extras(blocked: str, db_url: str) -> None:
    script = f"""
import sys
sys.modules[{blocked!r}] = None  # an import of it fails, as if not installed
import workflow
from workflow import tracing
from tests.worker_apps import traced
assert tracing.available is ({blocked!r} != "opentelemetry")
with workflow.Manager({db_url!r}, traced.registry()) as mgr:
    run = traced.Traced.start(mgr, traced.Order(1))
    assert run.wait(timeout=20) is workflow.Status.SUCCEEDED, run.status()
    try:
        from workflow import metrics
        metrics.instrument(mgr)
    except ImportError as e:
        assert {blocked!r} == "prometheus_client" and "pgworkflow[metrics]" in str(e), e
    else:
        assert {blocked!r} != "prometheus_client"
print("ok")
"""
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


@pytest.fixture
def look_clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The monotonic clock `Events.look` reads (workflow.events only), set by the test."""
    import time
    import types

    from workflow import events as events_module

    clock = [100.0]
    monkeypatch.setattr(events_module, "time", types.SimpleNamespace(
        monotonic=lambda: clock[0], time_ns=time.time_ns))
    return clock


def _events() -> Any:
    import logging

    from workflow.events import Events
    from workflow.logs import EngineLog

    return Events(EngineLog(logging.getLogger("test.tracing")))


def test_without_an_sdk_no_event_is_built_for_tracing_until_a_provider_is_set(
    monkeypatch: pytest.MonkeyPatch, look_clock: list[float]
) -> None:
    """With the API and no SDK, tracing used to subscribe anyway: every execution built
    and dispatched its events, and every claim asked the API for its provider (which
    reads the environment). Now the events stay inactive; as executions begin
    (`Events.look`), the provider is looked for at most every `LOOK_EVERY` seconds,
    and once one is set tracing subscribes and stops looking."""
    from workflow import tracing
    from workflow.events import LOOK_EVERY

    provider: list[Any] = [trace.NoOpTracerProvider()]
    looks: list[float] = []

    def get_tracer_provider() -> Any:
        looks.append(look_clock[0])
        return provider[0]

    monkeypatch.setattr(tracing.trace, "get_tracer_provider", get_tracer_provider)
    events = _events()
    traced = tracing.Tracing(events)
    assert len(looks) == 2, looks  # the API's get_tracer, then tracing's own look
    looks.clear()
    assert not events.active
    events.look()
    events.look()
    look_clock[0] += LOOK_EVERY / 2
    events.look()
    assert looks == [100.0] and not events.active, looks  # one look in the first second
    provider[0] = sdk_trace.TracerProvider()
    events.look()
    assert not events.active  # not time yet
    look_clock[0] += LOOK_EVERY / 2
    events.look()
    assert events.active  # the next second's look found it, and subscribed
    look_clock[0] += 1000
    events.look()
    assert len(looks) == 2, looks  # found once, never looked for again
    traced.close()
    assert not events.active


def test_a_tracer_closed_before_any_sdk_stops_looking(
    monkeypatch: pytest.MonkeyPatch, look_clock: list[float]
) -> None:
    from workflow import tracing

    monkeypatch.setattr(tracing.trace, "get_tracer_provider", trace.NoOpTracerProvider)
    events = _events()
    tracing.Tracing(events).close()
    monkeypatch.setattr(tracing.trace, "get_tracer_provider", sdk_trace.TracerProvider)
    look_clock[0] += 1000
    events.look()
    assert not events.active
