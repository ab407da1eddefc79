-- Back to 0011's spelling; NOT VALID as in 0012 (every row already meets the rule), where
-- 0011's constraint was validated.
ALTER TABLE workflow_runs
    DROP CONSTRAINT workflow_runs_status_check,
    ADD CONSTRAINT workflow_runs_status_check
        CHECK (status IN ('pending', 'running', 'succeeded', 'parked', 'cancelled')) NOT VALID;
