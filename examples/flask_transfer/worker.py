"""The worker's factory: `python -m workflow.worker --app examples.flask_transfer.worker:registry`.

It imports only the workflow declarations and handlers, never starts the web app's
manager, and returns a fresh registry for the worker's own manager.
"""

from __future__ import annotations

import workflow
from examples.flask_transfer.app import make_registry


def registry() -> workflow.Registry:
    return make_registry()
