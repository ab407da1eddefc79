DROP TABLE workflow_tasks;
DROP TABLE workflow_runs;
