DROP INDEX IF EXISTS workflow_runs_ready_by_workflow;
