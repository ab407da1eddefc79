-- The contraction that 0010 and 0011 announced (issue 20): three indexes of workflow_runs
-- that no query of 0011 or later reads, dropped one release after their readers moved.
--
-- - workflow_runs_ready (0008: the claimable runs by due time alone): read by the claims
--   of 0008 and 0009 and by the README's KEDA query until 0010. The claims of 0010 and
--   later read workflow_runs_ready_per_workflow, and since 0011 so do the gauges, `stats`
--   and the README's KEDA query.
-- - workflow_runs_claimable (0001: the unclaimed, unfinished runs by creation): read by
--   the gauges and `stats` of 0010 and by the README's KEDA query until 0010.
-- - workflow_runs_key_due (0008: the keyed runs waiting for a slot, by due time alone):
--   read by next_due's keyed half until 0011, which reads
--   workflow_runs_key_due_per_workflow; the gauges and `stats` read the same runs through
--   workflow_runs_key_queue (the same predicate).
--
-- What they cost: every run inserted for a poller (a `start_tx`, a delayed start, a start
-- the fast path leaves) and every release of a claim added an entry to the first two; a
-- one-task `start_tx` wrote 837 bytes of WAL of its own with both and 659 without
-- (bench/README.md, "The indexes a start pays for"). Every write of a run, the fast path's
-- too, opened them and prepared their predicates.
--
-- Any code older than 0011 still running when this is applied works on, but reads the
-- table where it read these indexes (its claims, next_due, gauges and `stats`), and so
-- does a KEDA scaler still running the README's query of 0010 or earlier. Finish the
-- rollout of code of 0011 or later (and change the scaler's query) first; code of this
-- migration's release starts only on a schema that has it, so from code older than 0011
-- the upgrade goes through a release of 0011 or 0012.
--
-- A DROP INDEX holds the table's ACCESS EXCLUSIVE lock until the migration commits, which
-- follows at once, but waits for it behind any transaction that has touched the table.
-- Where long transactions are common, drop them beforehand without that lock (DROP INDEX
-- CONCURRENTLY ..., one statement each, outside a transaction): IF EXISTS then skips them.

DROP INDEX IF EXISTS workflow_runs_ready;
DROP INDEX IF EXISTS workflow_runs_claimable;
DROP INDEX IF EXISTS workflow_runs_key_due;
