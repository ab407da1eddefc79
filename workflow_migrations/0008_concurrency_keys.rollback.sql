DROP INDEX IF EXISTS workflow_runs_key_due;
DROP INDEX IF EXISTS workflow_runs_key_queue;
DROP INDEX IF EXISTS workflow_runs_key_slots;
DROP INDEX IF EXISTS workflow_runs_ready;
ALTER TABLE workflow_runs DROP CONSTRAINT IF EXISTS workflow_runs_key_slot;
ALTER TABLE workflow_runs DROP COLUMN IF EXISTS key_slot;
ALTER TABLE workflow_runs DROP COLUMN IF EXISTS concurrency_key;
