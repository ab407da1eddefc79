DROP INDEX IF EXISTS workflow_runs_due;
