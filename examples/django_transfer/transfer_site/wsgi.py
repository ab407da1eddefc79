"""WSGI entry point: `gunicorn transfer_site.wsgi` (the manager is built per worker, lazily)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "transfer_site.settings")
application = get_wsgi_application()
