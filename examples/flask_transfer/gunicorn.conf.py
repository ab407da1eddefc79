"""Gunicorn settings for the Flask example.

    gunicorn -c examples/flask_transfer/gunicorn.conf.py examples.flask_transfer.app:app

The app is imported once in the master (`preload_app`) and forked into the
workers. That is safe because the workflow extension builds nothing at import:
each worker builds its own pool and Manager on its first request (after the
fork), and `worker_exit` drains and closes them, so in-flight runs record their
attempt and release their claims for a `python -m workflow.worker` to finish.
"""

import os

bind = os.environ.get("GUNICORN_BIND", "127.0.0.1:8000")
workers = int(os.environ.get("GUNICORN_WORKERS", "2"))
worker_class = "sync"
preload_app = True
graceful_timeout = 30


def worker_exit(server, worker):
    from examples.flask_transfer.app import workflow_ext

    workflow_ext.close(timeout=graceful_timeout - 5)
