DROP INDEX IF EXISTS workflow_runs_created;
DROP INDEX IF EXISTS workflow_runs_finished;
ALTER TABLE workflow_runs DROP COLUMN sealed_for;
ALTER TABLE workflow_runs DROP COLUMN forked_from;
DROP TABLE workflow_events;
