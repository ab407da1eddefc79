"""Integrations with web frameworks, each behind an optional extra.

- `workflow.contrib.flask` (`pip install 'pgworkflow[flask]'`): `WorkflowExtension`,
  an `init_app(app)` extension owning one pool and one `Manager` per process, and
  `current_manager`.
- `workflow.contrib.django` (`pip install 'pgworkflow[django]'`): the `WORKFLOW`
  setting, the app `workflow.contrib.django` (label `workflow`), `start_on_commit`,
  and the management commands `workflow_worker` and `workflow_migrate`.

Both build their pool and manager lazily, on first use in each process, so a
pre-forking server (Gunicorn) never hands a parent's manager to its workers.
"""
