-- The three indexes as 0012 had them. Each build blocks writes to workflow_runs while it
-- reads the table; on a large table create them beforehand with CREATE INDEX CONCURRENTLY
-- under the same names and definitions: IF NOT EXISTS then keeps them.
CREATE INDEX IF NOT EXISTS workflow_runs_key_due ON workflow_runs (next_retry_at)
    WHERE finished_at IS NULL AND concurrency_key IS NOT NULL AND key_slot IS NULL;
CREATE INDEX IF NOT EXISTS workflow_runs_claimable ON workflow_runs (created_at, id)
    WHERE claim_id IS NULL AND finished_at IS NULL;
CREATE INDEX IF NOT EXISTS workflow_runs_ready ON workflow_runs (next_retry_at, created_at, id)
    WHERE claim_id IS NULL AND finished_at IS NULL
      AND (concurrency_key IS NULL OR key_slot IS NOT NULL);
