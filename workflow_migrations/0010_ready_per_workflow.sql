-- The claimable runs by workflow (issue 20). Expand-only: workflow_runs_ready stays for
-- the claims of the previous release during a rolling deploy, and is dropped one
-- release later.
--
-- A poller claims the runs of the workflows its manager registered, and several
-- services may share these tables (SPEC 11). Read through workflow_runs_ready, whose
-- order is the due time alone, a claim stepped over every due run of the workflows it
-- does not serve: another service's backlog, or the runs a renamed workflow left
-- behind, cost every claim of every worker a read of each (~2.5 ms per 10,000 such
-- runs; a worker's drain fell from 5,400 to 2,250 runs/s beside 10,000 of them, and
-- to 490 beside 100,000). The claims now read this index once per workflow they
-- serve, each from its first due run, and take the runs due first among them.
--
-- It holds the runs workflow_runs_ready holds (unclaimed, unfinished, and not a keyed
-- run waiting for a slot), but says "unclaimed and unfinished" as
-- `num_nonnulls(claim_id, finished_at) = 0`, and the claims say it so too: then only
-- this index serves them. Spelt `claim_id IS NULL AND finished_at IS NULL`, the
-- claims could also be read through workflow_runs_ready or workflow_runs_claimable,
-- and on statistics taken before a backlog came the planner chose the latter and
-- sorted the whole backlog at every claim.
--
-- No other index serves the claims of this release: without this one each claim reads
-- the table. So roll the code back before the schema, and an index of this name left
-- invalid by a CREATE INDEX CONCURRENTLY that failed is dropped and built again here.
--
-- The index is built inside the migration's transaction, which blocks writes to
-- workflow_runs while it builds (reads go on); it holds only the runs that may be
-- claimed, so it builds fast unless a backlog is large. Then create it beforehand
-- without blocking, under the same name and definition (CREATE INDEX CONCURRENTLY
-- ...): IF NOT EXISTS keeps it when it is valid.

DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_index i
               JOIN pg_class c ON c.oid = i.indexrelid
               WHERE i.indrelid = 'workflow_runs'::regclass
                 AND c.relname = 'workflow_runs_ready_per_workflow' AND NOT i.indisvalid) THEN
        DROP INDEX workflow_runs_ready_per_workflow;
    END IF;
END
$$;

CREATE INDEX IF NOT EXISTS workflow_runs_ready_per_workflow
    ON workflow_runs (workflow, next_retry_at, created_at, id)
    WHERE num_nonnulls(claim_id, finished_at) = 0
      AND (concurrency_key IS NULL OR key_slot IS NOT NULL);
