DROP INDEX IF EXISTS workflow_runs_key_due_per_workflow;
