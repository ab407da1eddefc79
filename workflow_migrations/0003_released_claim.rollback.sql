ALTER TABLE workflow_runs DROP COLUMN released_claim;
