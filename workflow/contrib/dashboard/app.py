"""The dashboard's WSGI application: routes, access, CSRF, and the pages' data.

Every read and action goes through `workflow.Admin`. A request is answered with a
page rendered from `templates/` (Jinja2, autoescaped), a 303 redirect after an
action, or an error page (400 bad input, 401/403 access or CSRF, 404 not found,
405 method, 409 not possible now).
"""

from __future__ import annotations

import base64
import datetime
import hmac
import http
import json
import secrets
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import attrs
import jinja2
from psycopg_pool import ConnectionPool

from workflow import ids
from workflow.admin import ANY_CODE, Admin, RunSummary
from workflow.errors import NotResumable, RunNotFound, ScheduleNotFound, WorkflowError
from workflow.run import Status

Access = Literal["write", "read"]
"""What a request may do: "write" (see and act) or "read" (see only)."""

Authorize = Callable[[dict[str, Any]], "Access | None"]
"""An `authorize(environ)` hook: the request's access, or None to refuse it."""

StartResponse = Callable[..., Any]

CSRF_COOKIE = "workflow_csrf"
"""The cookie holding the CSRF token; every form carries the same value."""

PAGE_SIZE = 50
PARKED_SCAN = 1000
"""The most parked runs the inbox groups (newest first); it says when there are more."""

REFRESH_SECONDS = 5
"""How often the pages that show live state reload themselves."""

SINCE = {"1h": datetime.timedelta(hours=1), "24h": datetime.timedelta(days=1),
         "7d": datetime.timedelta(days=7), "": None}

_STATUSES = [s.value for s in Status]


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, headers: Iterable[tuple[str, str]] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = list(headers)


@attrs.frozen
class _Request:
    method: str
    path: str
    query: dict[str, str]
    form: dict[str, str]
    base: str
    access: Access
    csrf: str
    new_csrf: bool
    origin: str
    host: str


@attrs.frozen
class _Group:
    """Parked runs of one workflow, task and failure code (the inbox's rows)."""

    workflow: str
    task: str | None
    code: str | None
    runs: list[RunSummary]
    oldest: datetime.datetime
    newest: datetime.datetime
    error: str
    query: str

    @property
    def count(self) -> int:
        return len(self.runs)


def password_authorizer(password: str, *, user: str = "admin") -> Authorize:
    """An `authorize` hook for HTTP Basic authentication with one password: "write" for
    `user` with `password`, None (refused) otherwise. Compared in constant time."""
    if not password:
        raise ValueError("the dashboard password must not be empty")
    expected = f"{user}:{password}".encode()

    def authorize(environ: dict[str, Any]) -> Access | None:
        header = environ.get("HTTP_AUTHORIZATION", "")
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "basic":
            return None
        try:
            given = base64.b64decode(value.strip(), validate=True)
        except ValueError:
            return None
        return "write" if hmac.compare_digest(given, expected) else None

    authorize.basic_realm = "pgworkflow"  # type: ignore[attr-defined]
    return authorize


class Dashboard:
    """The WSGI application `make_app` returns (call it with `environ, start_response`)."""

    def __init__(
        self,
        admin: Callable[[], Admin],
        *,
        authorize: Authorize | None,
        read_only: bool,
        owns: bool,
    ) -> None:
        self._build = admin
        self._admin: Admin | None = None
        self._lock = threading.Lock()
        self.authorize = authorize
        self.read_only = read_only
        self._owns = owns
        self._templates = jinja2.Environment(
            loader=jinja2.PackageLoader("workflow.contrib.dashboard", "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
        )
        self._templates.filters["ago"] = _ago
        self._templates.filters["when"] = _when
        self._templates.filters["short"] = ids.short

    @property
    def admin(self) -> Admin:
        """The `Admin` behind every page, built on first use (so that a pre-forking
        server's master, which imports the application, opens no connection)."""
        admin = self._admin
        if admin is None:
            with self._lock:
                if self._admin is None:
                    self._admin = self._build()
                admin = self._admin
        return admin

    def close(self) -> None:
        """Close the Admin (and its pool) when `make_app` built it."""
        if self._owns and self._admin is not None:
            self._admin.close()

    # WSGI.

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterator[bytes]:
        try:
            request = self._request(environ)
            status, headers, body = self._route(request)
            if request.new_csrf:
                headers.append(("Set-Cookie", _csrf_cookie(request)))
        except _HTTPError as e:
            status, headers, body = e.status, e.headers, self._error_page(environ, e)
        reason = http.HTTPStatus(status).phrase
        headers = [
            *headers,
            ("X-Content-Type-Options", "nosniff"),
            ("X-Frame-Options", "DENY"),
            ("Referrer-Policy", "same-origin"),
            ("Content-Security-Policy",
             "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; "
             "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"),
            ("Cache-Control", "no-store"),
        ]
        start_response(f"{status} {reason}", headers)
        return iter([body])

    def _request(self, environ: dict[str, Any]) -> _Request:
        access = self._access(environ)
        method = environ.get("REQUEST_METHOD", "GET").upper()
        query = _pairs(environ.get("QUERY_STRING", ""))
        form: dict[str, str] = {}
        if method == "POST":
            try:
                length = int(environ.get("CONTENT_LENGTH") or 0)
            except ValueError:
                raise _HTTPError(400, "bad Content-Length") from None
            if length > 64 * 1024:
                raise _HTTPError(413, "the form is too large")
            form = _pairs(environ["wsgi.input"].read(length).decode("utf-8", "replace"))
        cookie = _cookies(environ.get("HTTP_COOKIE", "")).get(CSRF_COOKIE, "")
        new = len(cookie) < 32
        return _Request(
            method=method,
            path=environ.get("PATH_INFO", "") or "/",
            query=query,
            form=form,
            base=environ.get("SCRIPT_NAME", "").rstrip("/"),
            access=access,
            csrf=secrets.token_urlsafe(32) if new else cookie,
            new_csrf=new,
            origin=environ.get("HTTP_ORIGIN", ""),
            host=environ.get("HTTP_HOST", ""),
        )

    def _access(self, environ: dict[str, Any]) -> Access:
        access: Access | None = "write"
        if self.authorize is not None:
            access = self.authorize(environ)
            if access not in ("write", "read", None):
                raise _HTTPError(
                    500, f"authorize() returned {access!r}, not 'write', 'read' or None"
                )
        if access is None:
            realm = getattr(self.authorize, "basic_realm", None)
            if realm:
                raise _HTTPError(401, "sign in to see the dashboard",
                                 [("WWW-Authenticate", f'Basic realm="{realm}"')])
            raise _HTTPError(403, "you may not see this dashboard")
        return "read" if self.read_only else access

    def _route(self, r: _Request) -> tuple[int, list[tuple[str, str]], bytes]:
        parts = [urllib.parse.unquote(p) for p in r.path.strip("/").split("/") if p]
        if r.method == "POST":
            self._check_post(r)
            return self._act(r, parts)
        if r.method not in ("GET", "HEAD"):
            raise _HTTPError(405, f"{r.method} is not allowed", [("Allow", "GET, POST")])
        if not parts:
            return self._page(r, "runs.html", self._runs(r), refresh=True)
        if parts == ["parked"]:
            return self._page(r, "parked.html", self._parked(), refresh=True)
        if parts == ["parked", "confirm"]:
            return self._page(r, "confirm.html", self._confirm(r))
        if parts == ["schedules"]:
            return self._page(r, "schedules.html", {"schedules": self.admin.schedules()},
                              refresh=True)
        if parts == ["health"]:
            return self._page(r, "health.html", self._health(), refresh=True)
        if len(parts) == 2 and parts[0] == "runs":
            return self._page(r, "run.html", self._run(parts[1]), refresh=True)
        if len(parts) == 3 and parts[0] == "runs" and parts[2] == "confirm":
            action = r.query.get("action", "")
            if action not in ("resume", "cancel"):
                raise _HTTPError(400, "the action must be resume or cancel")
            return self._page(r, "confirm_run.html", {**self._run(parts[1]), "action": action})
        raise _HTTPError(404, "no such page")

    def _check_post(self, r: _Request) -> None:
        if r.access != "write":
            raise _HTTPError(403, "this dashboard is read-only")
        if r.origin and r.host and urllib.parse.urlsplit(r.origin).netloc != r.host:
            raise _HTTPError(403, "a form of another site cannot act here")
        token = r.form.get("csrf", "")
        if r.new_csrf or not token or not hmac.compare_digest(token, r.csrf):
            raise _HTTPError(403, "the form's CSRF token is missing or wrong: reload the page")

    # Pages.

    def _page(
        self, r: _Request, name: str, data: dict[str, Any], *, refresh: bool = False
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        template = self._templates.get_template(name)
        body = template.render(
            base=r.base, csrf=r.csrf, can_act=r.access == "write", read_only=self.read_only,
            refresh=REFRESH_SECONDS if refresh else None, done=r.query.get("done"),
            page=name.removesuffix(".html"), **data,
        ).encode()
        return 200, [("Content-Type", "text/html; charset=utf-8")], body

    def _error_page(self, environ: dict[str, Any], e: _HTTPError) -> bytes:
        template = self._templates.get_template("error.html")
        return template.render(
            base=environ.get("SCRIPT_NAME", "").rstrip("/"), status=e.status,
            reason=http.HTTPStatus(e.status).phrase, message=e.message, refresh=None,
            page="error", can_act=False, read_only=self.read_only, done=None, csrf="",
        ).encode()

    def _runs(self, r: _Request) -> dict[str, Any]:
        status = r.query.get("status") or None
        if status is not None and status not in _STATUSES:
            raise _HTTPError(400, f"unknown status {status!r}")
        workflow = r.query.get("workflow") or None
        since_key = r.query.get("since", "")
        if since_key not in SINCE:
            raise _HTTPError(400, f"unknown time range {since_key!r}")
        since = SINCE[since_key]
        try:
            page = self.admin.runs(status=status, workflow=workflow, since=since,
                                   limit=PAGE_SIZE, after=r.query.get("after") or None)
        except ValueError as e:
            raise _HTTPError(400, str(e)) from None
        if since is None:
            counts, day = self._open_counts(workflow), True
        else:  # bounded by the creation-time range, through workflow_runs_created
            counts = {s: self.admin.count(status=s, workflow=workflow, since=since)
                      for s in _STATUSES}
            day = False
        keep = {"status": status or "", "workflow": workflow or "", "since": since_key}
        return {
            "runs": page.items, "next": page.next, "counts": counts, "filters": keep,
            "statuses": _STATUSES, "ranges": list(SINCE), "query": _query, "day": day,
        }

    def _open_counts(self, workflow: str | None) -> dict[str, int]:
        """Per status from `Admin.stats` (index-bounded, whatever the history): every run
        pending, running or parked, and those succeeded or cancelled in the last day."""
        counts = dict.fromkeys(_STATUSES, 0)
        for w in self.admin.stats().workflows:
            if workflow is not None and w.workflow != workflow:
                continue
            counts["pending"] += w.pending
            counts["running"] += w.running
            counts["parked"] += w.parked
            counts["succeeded"] += w.succeeded_last_day
            counts["cancelled"] += w.cancelled_last_day
        return counts

    def _run(self, run_id: str) -> dict[str, Any]:
        try:
            detail = self.admin.run(run_id)
        except RunNotFound as e:
            raise _HTTPError(404, str(e)) from None
        status = detail.status
        resumable = status is Status.PARKED or (
            status is Status.CANCELLED and any(t.state != "done" and t.state != "skipped"
                                               for t in detail.tasks)
        )
        shown = detail.input if isinstance(detail.input, str) else json.dumps(
            detail.input, indent=2, ensure_ascii=False, sort_keys=True)
        return {
            "run": detail, "input_text": shown,
            "can_cancel": status not in (Status.SUCCEEDED, Status.CANCELLED),
            "can_resume": resumable,
        }

    def _parked(self) -> dict[str, Any]:
        page = self.admin.runs(status=Status.PARKED, limit=PARKED_SCAN)
        groups: dict[tuple[str, str | None, str | None], list[RunSummary]] = {}
        for run in page.items:
            failure = run.failure
            key = (run.workflow, run.task, None if failure is None else failure.code)
            groups.setdefault(key, []).append(run)
        rows = [
            _Group(
                workflow=wf, task=task, code=code, runs=runs,
                oldest=min(run.finished_at or run.created_at for run in runs),
                newest=max(run.finished_at or run.created_at for run in runs),
                error=runs[0].failure.error if runs[0].failure else "",
                query=_query({"workflow": wf, "task": task or "",
                              "code": "" if code is None else code,
                              "nocode": "1" if code is None else ""}),
            )
            for (wf, task, code), runs in groups.items()
        ]
        rows.sort(key=lambda g: (-g.count, g.workflow, g.task or ""))
        return {"groups": rows, "truncated": page.next is not None, "scan": PARKED_SCAN}

    def _matching(self, values: dict[str, str]) -> dict[str, Any]:
        """The parked group a bulk action names: workflow, task, and code (or none)."""
        workflow = values.get("workflow") or None
        if workflow is None:
            raise _HTTPError(400, "a bulk action needs a workflow")
        code: Any = ANY_CODE
        if values.get("nocode"):
            code = None
        elif values.get("code"):
            code = values["code"]
        return {"status": Status.PARKED, "workflow": workflow,
                "task": values.get("task") or None, "code": code}

    def _confirm(self, r: _Request) -> dict[str, Any]:
        action = r.query.get("action", "")
        if action not in ("resume", "cancel"):
            raise _HTTPError(400, "the action must be resume or cancel")
        filters = self._matching(r.query)
        count = self.admin.count(**filters)
        return {"action": action, "count": count, "filters": filters,
                "fields": {k: r.query.get(k, "") for k in ("workflow", "task", "code", "nocode")}}

    def _health(self) -> dict[str, Any]:
        stats = self.admin.stats()
        minutes = self.admin.throughput(60).minutes
        peak = max((s + p + c for _, s, p, c in minutes), default=0)
        return {"stats": stats.workflows, "stale_after": stats.stale_after,
                "minutes": minutes, "peak": peak,
                "finished": sum(s + p + c for _, s, p, c in minutes)}

    # Actions (POST).

    def _act(self, r: _Request, parts: list[str]) -> tuple[int, list[tuple[str, str]], bytes]:
        admin = self.admin
        reason = r.form.get("reason") or None
        try:
            if len(parts) == 3 and parts[0] == "runs" and parts[2] in ("cancel", "resume"):
                if parts[2] == "cancel":
                    admin.cancel(parts[1], reason=reason, actor="dashboard")
                else:
                    admin.resume(parts[1], reason=reason, actor="dashboard")
                return self._redirect(r, f"/runs/{urllib.parse.quote(parts[1])}",
                                      f"{parts[2]}d" if parts[2] == "resume" else "cancelled")
            if len(parts) == 2 and parts[0] == "parked" and parts[1] in ("cancel", "resume"):
                filters = self._matching(r.form)
                act = admin.resume_matching if parts[1] == "resume" else admin.cancel_matching
                changed = act(**filters, reason=reason, actor="dashboard")
                verb = "resumed" if parts[1] == "resume" else "cancelled"
                return self._redirect(r, "/parked", f"{verb} {changed} run(s)")
            if len(parts) == 3 and parts[0] == "schedules" and parts[2] in (
                "pause", "resume", "trigger"
            ):
                name, verb = parts[1], parts[2]
                {"pause": admin.pause_schedule, "resume": admin.resume_schedule,
                 "trigger": admin.trigger_schedule}[verb](name)
                done = {"pause": "paused", "resume": "resumed", "trigger": "triggered"}[verb]
                return self._redirect(r, "/schedules", f"{name}: {done}")
        except (RunNotFound, ScheduleNotFound) as e:
            raise _HTTPError(404, str(e)) from None
        except NotResumable as e:
            raise _HTTPError(409, str(e)) from None
        except (ValueError, WorkflowError) as e:
            raise _HTTPError(400, str(e)) from None
        raise _HTTPError(404, "no such action")

    @staticmethod
    def _redirect(r: _Request, path: str, done: str) -> tuple[int, list[tuple[str, str]], bytes]:
        location = f"{r.base}{path}?{urllib.parse.urlencode({'done': done})}"
        return 303, [("Location", location), ("Content-Type", "text/plain")], b""


def make_app(
    db: Admin | ConnectionPool[Any] | str | Callable[[], ConnectionPool[Any] | str],
    *,
    authorize: Authorize | None = None,
    read_only: bool = False,
) -> Dashboard:
    """The dashboard as a WSGI application over `db`: an `Admin`, a pool, a URL, or a
    function returning a pool or a URL (called on the first request: for a pool a
    pre-forking server builds in each worker).

    The `Admin` is built on the first request (read `app.admin` to build it now);
    with a pool or a URL it is this app's, closed by `app.close()`.
    `authorize(environ)` returns "write", "read" or None (refused: 403, or 401 with
    a Basic challenge for `password_authorizer`); without it every request may act.
    `read_only` shows no action and refuses every POST. Mount it under any prefix:
    links follow `SCRIPT_NAME`.
    """
    if authorize is not None and not callable(authorize):
        raise TypeError(f"authorize must be a function of the WSGI environ, not {authorize!r}")
    if isinstance(db, Admin):
        admin = db
        return Dashboard(lambda: admin, authorize=authorize, read_only=read_only, owns=False)
    if isinstance(db, (ConnectionPool, str)):
        source: ConnectionPool[Any] | str = db
        return Dashboard(lambda: Admin(source), authorize=authorize, read_only=read_only,
                         owns=True)
    if not callable(db):
        raise TypeError(
            "make_app() takes an Admin, a ConnectionPool, a URL or a function returning one "
            f"of the last two, not {type(db).__name__}"
        )
    factory = db
    return Dashboard(lambda: Admin(factory()), authorize=authorize, read_only=read_only,
                     owns=True)


def _pairs(text: str) -> dict[str, str]:
    return dict(urllib.parse.parse_qsl(text, keep_blank_values=True))


def _cookies(header: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for part in header.split(";"):
        name, _, value = part.strip().partition("=")
        if name:
            found[name] = value
    return found


def _csrf_cookie(r: _Request) -> str:
    path = r.base or "/"
    return f"{CSRF_COOKIE}={r.csrf}; Path={path}; HttpOnly; SameSite=Strict"


def _query(values: dict[str, str]) -> str:
    return urllib.parse.urlencode({k: v for k, v in values.items() if v})


def _ago(when: datetime.datetime | None) -> str:
    if when is None:
        return "-"
    seconds = (datetime.datetime.now(datetime.timezone.utc) - when).total_seconds()
    if seconds < 0:
        return "in " + _span(-seconds)
    return _span(seconds) + " ago"


def _span(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    if seconds < 86400:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def _when(when: datetime.datetime | None) -> str:
    return "-" if when is None else when.astimezone(datetime.timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S UTC")
