-- Operating runs (SPEC 12): the history of what went wrong and what people did,
-- forks, retention and listing. Expand-only: a table, nullable columns, indexes.
--
-- The two indexes are built inside the migration's transaction, which blocks
-- writes to workflow_runs while they build. On a large table create them first,
-- without blocking, under the same names (CREATE INDEX CONCURRENTLY ... with the
-- definitions below): IF NOT EXISTS then keeps them.

-- One row per failed attempt, sweep, park, cancel, resume and fork: written in the
-- statement that makes the change, never on the success path. `id` is chosen by
-- the client for what a person does (so a retried cancel recognises its own row).
CREATE TABLE workflow_events (
    id          uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    run_id      uuid NOT NULL REFERENCES workflow_runs (id) ON DELETE CASCADE,
    at          timestamptz NOT NULL DEFAULT now(),
    kind        text NOT NULL
                CHECK (kind IN ('failed', 'swept', 'parked', 'cancelled', 'resumed', 'forked')),
    seq         smallint,
    attempt     integer,
    error       text,
    error_code  text,
    actor       text,
    reason      text,
    -- A fork: the run it made (on the original's 'forked' event).
    other_run   uuid
);
CREATE INDEX workflow_events_run ON workflow_events (run_id, at);

-- A fork records the run it was forked from; its sealed documents were sealed for
-- `sealed_for` (the first run of the chain), so they open for it.
ALTER TABLE workflow_runs ADD COLUMN forked_from uuid;
ALTER TABLE workflow_runs ADD COLUMN sealed_for uuid;

-- Retention: finished runs by status, oldest first. Unfinished runs are not in it.
CREATE INDEX IF NOT EXISTS workflow_runs_finished
    ON workflow_runs (status, finished_at)
    WHERE finished_at IS NOT NULL;

-- Listing: newest first, keyset-paginated. created_at never changes, so the
-- per-task updates never touch this index.
CREATE INDEX IF NOT EXISTS workflow_runs_created ON workflow_runs (created_at, id);
