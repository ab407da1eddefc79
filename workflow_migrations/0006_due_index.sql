-- Delayed starts (SPEC 14): unclaimed, unfinished runs by due time. The poller's
-- claim walks it from the earliest due run and stops at its batch, so runs due
-- next year cost it nothing; the poller's "when is the next one due" is its first
-- entry. Expand-only. Built inside the migration's transaction, which blocks
-- writes to workflow_runs while it builds: on a large table create it first with
-- CREATE INDEX CONCURRENTLY under the same name and definition; IF NOT EXISTS
-- then keeps it.
CREATE INDEX IF NOT EXISTS workflow_runs_due
    ON workflow_runs (next_retry_at, created_at, id)
    WHERE claim_id IS NULL AND finished_at IS NULL;
