DROP TRIGGER IF EXISTS workflow_runs_truncated ON workflow_runs;
DROP TRIGGER IF EXISTS workflow_runs_deleted ON workflow_runs;
DROP FUNCTION IF EXISTS workflow_runs_truncated();
DROP FUNCTION IF EXISTS workflow_runs_deleted();
DELETE FROM workflow_tasks t WHERE NOT EXISTS (SELECT FROM workflow_runs r WHERE r.id = t.run_id);
ALTER TABLE workflow_tasks ADD CONSTRAINT workflow_tasks_run_id_fkey
    FOREIGN KEY (run_id) REFERENCES workflow_runs (id) ON DELETE CASCADE;
CREATE INDEX IF NOT EXISTS workflow_runs_due
    ON workflow_runs (next_retry_at, created_at, id)
    WHERE claim_id IS NULL AND finished_at IS NULL;
CREATE INDEX IF NOT EXISTS workflow_runs_claimed
    ON workflow_runs (heartbeat_at) WHERE claim_id IS NOT NULL;
DROP INDEX IF EXISTS workflow_runs_claims;
