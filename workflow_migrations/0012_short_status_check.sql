-- The runs' status check, spelt as one array constant (issue 20): the same rule, in
-- half the text PostgreSQL reads at every write of a run.
--
-- PostgreSQL keeps a table's CHECK constraints as node text, and every INSERT or UPDATE
-- of the table reads that text again and prepares it (PostgreSQL 15, ExecRelCheck), in
-- every execution of a prepared statement too, whichever columns it sets: a fast-path
-- run's start, task steps and finish each pay for every check of workflow_runs.
-- `status IN ('pending', ...)` is stored as an array of five constants, each with its
-- bytes written out one number at a time: 1,234 of the 3,861 characters of the table's
-- checks, folded into one constant again at each execution. Spelt as one text[]
-- constant it stores 645. Measured on the null engine of bench/typed.py (its own
-- statements on these tables; bench/README.md, "The checks PostgreSQL reads at every
-- write"): 0.93x the server CPU a 3-task run from 1 thread, 0.86x from 8.
--
-- NOT VALID: the rule is the one the constraint it replaces held every row to, so no
-- row is read again, and the ALTER holds the table's lock only for the moment it takes
-- to change the catalog. Rows written from now on are checked as before.
ALTER TABLE workflow_runs
    DROP CONSTRAINT workflow_runs_status_check,
    ADD CONSTRAINT workflow_runs_status_check
        CHECK (status = ANY ('{pending,running,succeeded,parked,cancelled}'::text[])) NOT VALID;
