"""The dashboard (SPEC 16): see and steer runs in a browser.

`make_app(db, authorize=None, read_only=False)` is a WSGI application over
`workflow.Admin`: it adds no SQL of its own. Mount it under any prefix of a Flask
or Django project, or serve it alone with `python -m workflow dashboard`
(waitress). Pages are rendered on the server by Jinja2 with autoescaping, work
offline (no script, no CDN) and refresh themselves; every action is a POST that
carries a CSRF token. Needs `pip install 'pgworkflow[dashboard]'`.
"""

from __future__ import annotations

from workflow.contrib.dashboard.app import Access, Dashboard, make_app, password_authorizer

__all__ = ["Access", "Dashboard", "make_app", "password_authorizer"]
