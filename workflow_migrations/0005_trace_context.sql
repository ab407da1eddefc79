-- Traces (SPEC 13): the span context of the code that started a run, as W3C
-- trace-context headers (`traceparent`, `tracestate`; never baggage, which can
-- carry user data), so the process that executes the run, maybe much later and on
-- another machine, can link its spans to the request that started it. NULL when
-- tracing is off or the caller had no span. Expand-only: nullable columns, no
-- index, so the per-task updates do not change.
ALTER TABLE workflow_runs ADD COLUMN traceparent text;
ALTER TABLE workflow_runs ADD COLUMN tracestate text;
