DROP TABLE workflow_schedules;
