-- The keyed runs waiting for a slot, by workflow, then due time (issue 20). Expand-only:
-- workflow_runs_key_due, the same runs by due time alone, stays for the previous code
-- during a rolling deploy and is dropped one release later.
--
-- An idle poller asks when its next run falls due (next_due). Its keyed half, the first
-- keyed run still to come that waits for a slot, read workflow_runs_key_due in due
-- order and filtered on the workflow, so it stepped over every such run of workflows the
-- poller does not serve (another service's delayed keyed runs, due before its own). Read
-- through this index, each workflow the poller serves is one probe, as the unkeyed half
-- is since 0010.
--
-- It holds the runs workflow_runs_key_due holds, but says "unfinished and holding no
-- slot" as `num_nonnulls(finished_at, key_slot) = 0`, and next_due says it so too: then
-- only this index serves it. Spelt as key_due's predicate is, next_due could be read
-- through key_due, and was, with statistics in which the poller's workflows are common
-- (their history) though none of their keyed runs wait: the planner expected a match
-- among the first entries and stepped over every other workflow's, as before.
--
-- Each keyed run that waits for a slot (a keyed `start_tx`, a keyed start the fast path
-- cannot claim, a resumed keyed run) adds an entry here as well as to
-- workflow_runs_key_due until that one is dropped; no other run is in either. No other
-- index serves the next_due of this release: without this one it reads the table, once
-- per workflow each time a poller is idle. So roll the code back before the schema.
--
-- The index is built inside the migration's transaction, which blocks writes to
-- workflow_runs while it builds (reads go on); it holds only keyed runs waiting for a
-- slot, so it builds fast unless such a backlog is large. Then create it beforehand
-- without blocking, under the same name and definition (CREATE INDEX CONCURRENTLY ...):
-- IF NOT EXISTS keeps it when it is valid, and one left invalid by a failed concurrent
-- build is dropped and built again here.

DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_index i
               JOIN pg_class c ON c.oid = i.indexrelid
               WHERE i.indrelid = 'workflow_runs'::regclass
                 AND c.relname = 'workflow_runs_key_due_per_workflow' AND NOT i.indisvalid) THEN
        DROP INDEX workflow_runs_key_due_per_workflow;
    END IF;
END
$$;

CREATE INDEX IF NOT EXISTS workflow_runs_key_due_per_workflow
    ON workflow_runs (workflow, next_retry_at)
    WHERE num_nonnulls(finished_at, key_slot) = 0 AND concurrency_key IS NOT NULL;
