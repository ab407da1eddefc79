-- Vacuum the two tables long before PostgreSQL's default (20% of the table dead).
-- Every finished task is an UPDATE, so a busy history of a million runs would
-- otherwise pile up ~200k dead rows before autovacuum, and the claim and sweep
-- index scans would wade through them. Expand-only: storage parameters.

ALTER TABLE workflow_runs SET (autovacuum_vacuum_scale_factor = 0.02,
                               autovacuum_vacuum_threshold = 1000,
                               autovacuum_analyze_scale_factor = 0.02);
ALTER TABLE workflow_tasks SET (autovacuum_vacuum_scale_factor = 0.02,
                                autovacuum_vacuum_threshold = 1000,
                                autovacuum_analyze_scale_factor = 0.02);
