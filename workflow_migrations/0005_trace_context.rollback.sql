ALTER TABLE workflow_runs DROP COLUMN tracestate;
ALTER TABLE workflow_runs DROP COLUMN traceparent;
