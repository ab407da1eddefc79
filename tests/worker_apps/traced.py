"""A two-task workflow for trace tests, and a worker app that exports its spans.

`registry()` is for the test process (no SDK configured here). `traced_app()`,
the worker's factory, configures the OpenTelemetry SDK in the worker process with
a span processor that writes each ended span as one JSON line to the file named
by `$WORKFLOW_TEST_SPANS`, then returns the same registry.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from typing import Any

import attrs

import workflow


@attrs.frozen
class Order:
    n: int


Traced = workflow.Workflow("Traced.Order", Order)
reserve = workflow.Task("traced.reserve", int)
send = workflow.Task("traced.send", int)


def _reserve(run: workflow.TaskRun[Order]) -> int:
    return run.input.n


def _send(run: workflow.TaskRun[Order]) -> int:
    return run.output(reserve) + 1


def registry() -> workflow.Registry:
    reg = workflow.Registry()
    reg.register(
        workflow.define(Traced, workflow.handle(reserve, _reserve), workflow.handle(send, _send))
    )
    return reg


def traced_app() -> workflow.Registry:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import (
        SimpleSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    path = os.environ["WORKFLOW_TEST_SPANS"]
    lock = threading.Lock()

    class Lines(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            with lock, open(path, "a", encoding="utf-8") as out:
                for span in spans:
                    out.write(json.dumps(_plain(span)) + "\n")
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(Lines()))
    trace.set_tracer_provider(provider)
    return registry()


def _plain(span: Any) -> dict[str, Any]:
    context = span.get_span_context()
    return {
        "name": span.name,
        "kind": span.kind.name,
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent": None if span.parent is None else f"{span.parent.span_id:016x}",
        "links": [
            {"trace_id": f"{link.context.trace_id:032x}", "span_id": f"{link.context.span_id:016x}"}
            for link in span.links
        ],
        "attributes": dict(span.attributes or {}),
        "events": [event.name for event in span.events],
        "status": span.status.status_code.name,
    }
