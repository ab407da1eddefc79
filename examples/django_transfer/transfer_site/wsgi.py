"""WSGI entry point: `gunicorn transfer_site.wsgi` (the manager is built per worker, lazily).

With pgworkflow[dashboard] installed, the dashboard answers under /ops/workflow/ (from
this machine only): its Admin and pool are built on its first request in each
process. Django's own admin lists the runs too, at /admin/.
"""

import os
from typing import Any

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "transfer_site.settings")
django_application = get_wsgi_application()
PREFIX = "/ops/workflow"


def _loopback_only(environ: dict[str, Any]) -> str | None:
    return "write" if environ.get("REMOTE_ADDR") in ("127.0.0.1", "::1") else None


try:
    from workflow.contrib.dashboard import make_app
except ImportError:  # pgworkflow[dashboard] is not installed
    application = django_application
else:
    from workflow.contrib.django import get_manager

    dashboard = make_app(lambda: get_manager().pool, authorize=_loopback_only)

    def application(environ: dict[str, Any], start_response: Any) -> Any:
        """Django, with the dashboard mounted at PREFIX."""
        path = environ.get("PATH_INFO", "")
        if path == PREFIX or path.startswith(PREFIX + "/"):
            environ["SCRIPT_NAME"] = environ.get("SCRIPT_NAME", "") + PREFIX
            environ["PATH_INFO"] = path[len(PREFIX):] or "/"
            return dashboard(environ, start_response)
        return django_application(environ, start_response)
