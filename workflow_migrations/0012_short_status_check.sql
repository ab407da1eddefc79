-- The runs' status check, spelt as one array constant (issue 20): the same rule, which
-- PostgreSQL no longer has to fold from five constants at every write of a run.
--
-- PostgreSQL keeps a table's CHECK constraints as node text, and every INSERT or UPDATE
-- of the table reads that text back and prepares it (PostgreSQL 15, ExecRelCheck), in
-- every execution of a prepared statement too, whichever columns it sets: a fast-path
-- run's start, task steps and finish each pay for every check of workflow_runs.
-- `status IN ('pending', ...)` is stored as an array expression of five constants,
-- each with its bytes written out one number at a time (1,234 of the 3,861 characters
-- of the table's checks), and is folded into one constant again at each execution.
-- Spelt as one text[] constant it is 645 characters and needs no folding. Measured on
-- the null engine of bench/typed.py (its own statements on these tables; medians of six
-- alternating rounds; bench/README.md, "The checks PostgreSQL reads at every write"):
-- 0.95x the server CPU a 3-task run from 1 thread and from 8.
--
-- NOT VALID: the rule is the one the constraint it replaces held every row to, so no
-- row is read again. The ALTER still takes the table's ACCESS EXCLUSIVE lock for the
-- moment the catalog change takes, and waits for it behind any transaction that has
-- touched the table: behind a long one, every write queues behind the migration. Run
-- it with a lock_timeout (PGOPTIONS='-c lock_timeout=5s') and retry if that is a risk.
ALTER TABLE workflow_runs
    DROP CONSTRAINT workflow_runs_status_check,
    ADD CONSTRAINT workflow_runs_status_check
        CHECK (status = ANY ('{pending,running,succeeded,parked,cancelled}'::text[])) NOT VALID;
