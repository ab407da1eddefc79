ALTER TABLE workflow_runs RESET (autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold,
                                 autovacuum_analyze_scale_factor);
ALTER TABLE workflow_tasks RESET (autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold,
                                  autovacuum_analyze_scale_factor);
