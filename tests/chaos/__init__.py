"""Chaos under load: SIGKILLed workers and a PostgreSQL restart must lose no run.

    python -m tests.chaos [--short] [--minutes N] [--seed S] [--rate R] [--keep-logs]

from the repository root. `--short` (what `tests/test_chaos.py` and CI run) loads
for about 70 s and finishes in under 3 minutes; the long mode loads for `--minutes`
(default 10). See `runner.py` for the scenario, `checks.py` for what is checked and
why the fencing check is sound, `app.py` for the workflow and `starter.py` for the
process that starts runs.
"""
