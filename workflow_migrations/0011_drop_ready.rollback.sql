-- Built inside the rollback's transaction, which blocks writes to workflow_runs while it
-- builds: on a large backlog create it first with CREATE INDEX CONCURRENTLY, same name
-- and definition.
CREATE INDEX IF NOT EXISTS workflow_runs_ready
    ON workflow_runs (next_retry_at, created_at, id)
    WHERE claim_id IS NULL AND finished_at IS NULL
      AND (concurrency_key IS NULL OR key_slot IS NOT NULL);
