"""Applications for `python -m workflow.worker --app tests.worker_apps.MODULE:FACTORY`.

The worker subprocesses started by `tests/test_workers.py` and
`tests/test_worker_cli.py` import these modules as `tests.worker_apps.*` (run from
the repository root); the tests themselves import them as `worker_apps.*` (pytest
puts `tests/` on `sys.path`) to start runs of the same workflows.

Handlers write one row per execution into the test's own `ledger` table (see
`ledger.py`) through `$WORKER_APPS_DATABASE_URL`, which the test sets.
"""
