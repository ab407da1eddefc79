-- The claimable runs by workflow (issue 20). Expand-only: workflow_runs_ready stays for
-- the claims of the previous release during a rolling deploy, and is dropped one
-- release later.
--
-- A poller claims the runs of the workflows its manager registered, and several
-- services may share these tables (SPEC 6). Read through workflow_runs_ready, whose
-- order is the due time alone, a claim stepped over every due run of the workflows it
-- does not serve: another service's backlog, or the runs a renamed workflow left
-- behind, cost every claim of every worker a read of each (~2.5 ms per 10,000 such
-- runs; a worker's drain fell from 5,400 to 2,250 runs/s beside 10,000 of them, and
-- to 490 beside 100,000). The claims now read this index once per workflow they
-- serve, each from its first due run, and take the runs due first among them.
--
-- The index is built inside the migration's transaction, which blocks writes to
-- workflow_runs while it builds (reads go on); it holds only the runs that may be
-- claimed, so it builds fast unless a backlog is large. Then create it beforehand
-- without blocking, under the same name and definition (CREATE INDEX CONCURRENTLY
-- ...): IF NOT EXISTS keeps it.

CREATE INDEX IF NOT EXISTS workflow_runs_ready_by_workflow
    ON workflow_runs (workflow, next_retry_at, created_at, id)
    WHERE claim_id IS NULL AND finished_at IS NULL
      AND (concurrency_key IS NULL OR key_slot IS NOT NULL);
