-- Contract what 0010 expanded (issue 20): drop workflow_runs_ready, the claim index of
-- the 0008 and 0009 releases. The claims of 0010 and later read
-- workflow_runs_ready_per_workflow, and no query of theirs reads this index; it cost
-- an entry at every insert of a run for a poller (`start_tx`, a delayed start, a start
-- the fast path leaves) and at every release of a claim: 48 of the 1,143 bytes of WAL
-- a one-task `start_tx` wrote.
--
-- Code of the 0010 release runs on this schema unchanged. Code of 0008 and 0009 would
-- claim by reading the table: upgrade through the 0010 release, as every contraction
-- asks. The README's KEDA query of those releases reads workflow_runs_claimable instead,
-- which stays one release more (the metrics of 0010 read it too).
--
-- A DROP INDEX takes an exclusive lock on workflow_runs until the migration commits,
-- which is at once.

DROP INDEX IF EXISTS workflow_runs_ready;
