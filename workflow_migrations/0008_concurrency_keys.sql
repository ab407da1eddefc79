-- Per-key ordering and concurrency limits (SPEC 15). Expand-only: nullable
-- columns and partial indexes; workflow_runs_due stays for the claims of the
-- previous release during a rolling deploy, and is dropped one release later.
--
-- A keyed run stores the SHA-256 digest of its key (never the key itself). It holds
-- a slot of its key, 0 to concurrency - 1, from its first claim until it is
-- finished (succeeded, parked or cancelled), through backoffs and sweeps; a keyed
-- run that holds no slot waits for one and is never claimed.
--
-- The indexes are built inside the migration's transaction, which blocks writes to
-- workflow_runs while they build. On a large table create them first with CREATE
-- INDEX CONCURRENTLY under the same names and definitions: IF NOT EXISTS keeps them.

ALTER TABLE workflow_runs ADD COLUMN concurrency_key bytea;
ALTER TABLE workflow_runs ADD COLUMN key_slot smallint;
ALTER TABLE workflow_runs ADD CONSTRAINT workflow_runs_key_slot
    CHECK (key_slot IS NULL OR (concurrency_key IS NOT NULL AND key_slot >= 0)) NOT VALID;

-- The claim: unclaimed, unfinished runs that may run now, by due time. A keyed run
-- waiting for a slot is not in it, so a busy key's backlog costs the claims of
-- every other run nothing. It replaces workflow_runs_due (same columns).
CREATE INDEX IF NOT EXISTS workflow_runs_ready
    ON workflow_runs (next_retry_at, created_at, id)
    WHERE claim_id IS NULL AND finished_at IS NULL
      AND (concurrency_key IS NULL OR key_slot IS NOT NULL);

-- The slots held, one row per (workflow, key, slot): the limit cannot be broken
-- by two claims racing, whatever their processes.
CREATE UNIQUE INDEX IF NOT EXISTS workflow_runs_key_slots
    ON workflow_runs (workflow, concurrency_key, key_slot)
    WHERE key_slot IS NOT NULL;

-- Each key's queue: the keyed runs waiting for a slot, in creation order.
CREATE INDEX IF NOT EXISTS workflow_runs_key_queue
    ON workflow_runs (workflow, concurrency_key, created_at, id)
    WHERE finished_at IS NULL AND concurrency_key IS NOT NULL AND key_slot IS NULL;

-- When the next waiting keyed run started with a delay falls due.
CREATE INDEX IF NOT EXISTS workflow_runs_key_due
    ON workflow_runs (next_retry_at)
    WHERE finished_at IS NULL AND concurrency_key IS NOT NULL AND key_slot IS NULL;
