-- The three indexes as 0012 had them. Each build blocks writes to workflow_runs while it
-- reads the table; on a large table create them beforehand with CREATE INDEX CONCURRENTLY
-- under the same names and definitions: IF NOT EXISTS then keeps them, and one left
-- invalid by a failed concurrent build is dropped and built again here.
DO $$
DECLARE
    invalid text;
BEGIN
    FOR invalid IN
        SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
        WHERE i.indrelid = 'workflow_runs'::regclass AND NOT i.indisvalid
          AND c.relname IN ('workflow_runs_key_due', 'workflow_runs_claimable', 'workflow_runs_ready')
    LOOP
        EXECUTE format('DROP INDEX %I', invalid);
    END LOOP;
END
$$;
CREATE INDEX IF NOT EXISTS workflow_runs_key_due ON workflow_runs (next_retry_at)
    WHERE finished_at IS NULL AND concurrency_key IS NOT NULL AND key_slot IS NULL;
CREATE INDEX IF NOT EXISTS workflow_runs_claimable ON workflow_runs (created_at, id)
    WHERE claim_id IS NULL AND finished_at IS NULL;
CREATE INDEX IF NOT EXISTS workflow_runs_ready ON workflow_runs (next_retry_at, created_at, id)
    WHERE claim_id IS NULL AND finished_at IS NULL
      AND (concurrency_key IS NULL OR key_slot IS NOT NULL);
