-- The claim that last let go of a run by its own write (a finish, a park, a failure
-- released for a poller, a release). A write retried after its reply was lost (a
-- cut connection, a failover) finds its claim already gone; this column tells it
-- that its own earlier try is what let go, so it neither reports "claim lost" nor
-- skips the ALERT of its park. A claim clears it; nothing indexes it, so setting
-- it costs no index entry. Expand-only: a nullable column.

ALTER TABLE workflow_runs ADD COLUMN released_claim uuid;
