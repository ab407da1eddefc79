-- Cheap task steps (issue 20). A task's step rewrites its run's row (current_seq,
-- heartbeat_at) and its task's row (output, finished_at). PostgreSQL can write such
-- an update as a heap-only tuple (HOT: no new entry in any index, and page pruning
-- reclaims the old version without a vacuum) only when no indexed column changes and
-- the new version fits on the same page. Before this migration every step changed
-- `heartbeat_at`, the key of workflow_runs_claimed, so each one added an entry to
-- every index of workflow_runs; the same went for each heartbeat.
--
-- 1. workflow_runs_claims holds the claimed runs by claim id, and replaces
--    workflow_runs_claimed (by heartbeat). A step keeps its claim id, so its update is
--    HOT; the heartbeat and a claim's recovery after a lost reply look their runs up
--    by claim id; the sweeper reads every claimed run (bounded by the executors'
--    concurrency, never by history) and picks the stale ones by heartbeat.
-- 2. No fillfactor: the default (100) is kept. A step's new version needs room on
--    its page, and page pruning makes that room from the versions earlier steps left
--    (measured: every non-final step of a run HOT, and 97% of the task updates, at
--    100 as at 70), while a reserve below 100 made inserts move on to new pages
--    instead of reusing pruned space: the runs table grew about four times larger.
-- 3. workflow_tasks no longer has a foreign key to workflow_runs: checking it cost a
--    lookup and a row lock of the run for every task row inserted, on every start.
--    Task rows are only ever inserted in the statement that inserts their run. A
--    deletion of runs (a prune, or a person's DELETE) still deletes their tasks, by a
--    trigger that runs once per statement and costs a start nothing; a TRUNCATE of
--    the runs empties the tasks too.
-- 4. workflow_runs_due, the claim index of 0006, is dropped: the claims of 0008 and
--    later read workflow_runs_ready instead, and it cost an entry at every insert of a
--    polled run and at every release. Code older than 0008 still works on this
--    schema, its claims through another index.
--
-- The new index is built first, inside the migration's transaction, which blocks
-- writes to workflow_runs while it builds (reads go on). On a large table create it
-- beforehand without blocking, under the same name and definition (CREATE INDEX
-- CONCURRENTLY ...): IF NOT EXISTS then keeps it. The drops that follow take an
-- exclusive lock on the tables until the migration commits, which is then at once.

CREATE INDEX IF NOT EXISTS workflow_runs_claims
    ON workflow_runs (claim_id) WHERE claim_id IS NOT NULL;

CREATE OR REPLACE FUNCTION workflow_runs_deleted() RETURNS trigger
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    DELETE FROM workflow_tasks t USING gone WHERE t.run_id = gone.id;
    RETURN NULL;
END
$$;

-- A DELETE, not a TRUNCATE: a TRUNCATE of the runs that names the tasks too would
-- find them in use by its own statement.
CREATE OR REPLACE FUNCTION workflow_runs_truncated() RETURNS trigger
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    DELETE FROM workflow_tasks;
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS workflow_runs_deleted ON workflow_runs;
CREATE TRIGGER workflow_runs_deleted AFTER DELETE ON workflow_runs
    REFERENCING OLD TABLE AS gone
    FOR EACH STATEMENT EXECUTE FUNCTION workflow_runs_deleted();

DROP TRIGGER IF EXISTS workflow_runs_truncated ON workflow_runs;
CREATE TRIGGER workflow_runs_truncated AFTER TRUNCATE ON workflow_runs
    FOR EACH STATEMENT EXECUTE FUNCTION workflow_runs_truncated();

ALTER TABLE workflow_tasks DROP CONSTRAINT IF EXISTS workflow_tasks_run_id_fkey;
DROP INDEX IF EXISTS workflow_runs_claimed;
DROP INDEX IF EXISTS workflow_runs_due;
