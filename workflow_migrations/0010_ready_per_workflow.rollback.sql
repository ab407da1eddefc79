DROP INDEX IF EXISTS workflow_runs_ready_per_workflow;
