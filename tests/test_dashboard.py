"""The dashboard (SPEC 16) over HTTP: a real waitress server on a free port, a client
with cookies, and the engine's tables behind it.

What it must do: list and filter runs, show a run's timeline, act (cancel, resume,
bulk actions on a parked group) only with a CSRF token and write access, show
nothing to act with when read-only, escape what handlers wrote, follow the mount
prefix, and refuse to listen where other machines reach it without a password.
The browser tests (Chromium) are in `test_dashboard_browser.py`.
"""

from __future__ import annotations

import base64
import http.cookiejar
import re
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import attrs
import psycopg
import pytest
from helpers import ROOT, wait_until

import workflow
from workflow import Status

waitress = pytest.importorskip("waitress")
pytest.importorskip("jinja2")

from workflow.contrib.dashboard import make_app, password_authorizer  # noqa: E402


@attrs.frozen
class Charge:
    card: str
    note: str = ""


CHARGE = workflow.Workflow("Dash.Charge", Charge)
REFUND = workflow.Workflow("Dash.Refund", Charge)
PAY = workflow.Task("dash.pay", str)
DECLINED = set()  # cards whose charge is declined (permanently) until removed


def _pay(run: workflow.TaskRun[Charge]) -> str:
    if run.input.card in DECLINED:
        raise workflow.permanent(workflow.with_code(
            "card.declined", RuntimeError(f"card declined <script>{run.input.note}</script>")
        ))
    return "paid"


def registry() -> workflow.Registry:
    reg = workflow.Registry()
    reg.register(workflow.define(CHARGE, workflow.handle(PAY, _pay)))
    reg.register(workflow.define(REFUND, workflow.handle(workflow.Task("dash.refund", str),
                                                          lambda run: "refunded")))
    return reg


@attrs.define
class Reply:
    status: int
    headers: Any  # an email.message.Message: names compare without case
    body: str


class Client:
    """HTTP with a cookie jar; `csrf()` reads the token of the last page's forms."""

    def __init__(self, base: str, auth: str | None = None) -> None:
        self.base = base
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(
            urllib.request.HTTPCookieProcessor(self.jar), _NoRedirect()
        )
        self.auth = auth
        self.last = ""

    def request(self, method: str, path: str, form: dict[str, str] | None = None,
                headers: dict[str, str] | None = None) -> Reply:
        data = None if form is None else urllib.parse.urlencode(form).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method)
        for name, value in (headers or {}).items():
            req.add_header(name, value)
        if self.auth:
            token = base64.b64encode(self.auth.encode()).decode()
            req.add_header("Authorization", "Basic " + token)
        try:
            with self.opener.open(req, timeout=15) as resp:
                reply = Reply(resp.status, resp.headers, resp.read().decode())
        except urllib.error.HTTPError as e:
            reply = Reply(e.code, e.headers, e.read().decode())
        if method == "GET":
            self.last = reply.body
        return reply

    def get(self, path: str) -> Reply:
        return self.request("GET", path)

    def post(self, path: str, form: dict[str, str] | None = None, **kw: Any) -> Reply:
        return self.request("POST", path, form or {}, **kw)

    def csrf(self) -> str:
        found = re.search(r'name="csrf" value="([^"]+)"', self.last)
        assert found, "no form on the last page"
        return found.group(1)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


@pytest.fixture
def setup(make_manager: Any, pool: Any) -> Iterator[Any]:
    """A manager with a runnable (fast polling), 3 parked charges (code card.declined), one
    succeeded charge and one succeeded refund; (manager, ids of the parked)."""
    DECLINED.clear()
    DECLINED.update({"4000", "4001", "4002"})
    mgr = make_manager(registry())
    parked = [CHARGE.start(mgr, Charge(card, note="x")) for card in ("4000", "4001", "4002")]
    ok = CHARGE.start(mgr, Charge("4242"))
    refund = REFUND.start(mgr, Charge("4242"))
    for run in (*parked, ok, refund):
        run.wait(timeout=10)
    assert [r.status().status for r in parked] == [Status.PARKED] * 3
    runnable = mgr.new_runnable(workflow.RunnerConfig(poll_interval=0.2, listen=False))
    runnable.start()
    yield mgr, [r.id for r in parked], ok.id
    runnable.stop(timeout=10)
    DECLINED.clear()


def test_the_runs_page_tells_apart_runs_started_the_same_moment(
    setup: Any, wsgi_server: Any
) -> None:
    # Run ids are time-ordered (tests/test_run_ids.py): runs started within a minute of
    # each other share their first eight characters, so a short form shows the last.
    mgr, parked, ok = setup
    page = Client(wsgi_server(make_app(mgr.pool))).get("/")
    shown = re.findall(r'<a href="[^"]*/runs/([0-9a-f-]{36})">([^<]*)</a>', page.body)
    assert len(shown) == 5 and {run_id for run_id, _ in shown} >= {*parked, ok}
    assert len({text for _, text in shown}) == 5, shown
    assert all(run_id.endswith(text) and len(text) == 8 for run_id, text in shown)


def test_the_runs_page_lists_counts_and_filters(setup: Any, wsgi_server: Any) -> None:
    mgr, _, ok = setup
    client = Client(wsgi_server(make_app(mgr.pool)))
    page = client.get("/")
    assert page.status == 200
    assert 'id="count-parked"><span class="status parked">parked</span> <b>3</b>' in page.body
    assert page.body.count('class="run"') == 5
    assert "(succeeded and cancelled: the last 24 hours)" in page.body  # from Admin.stats
    succeeded = '<span class="status succeeded">succeeded</span> <b>2</b>'
    assert 'id="count-succeeded">' + succeeded in page.body
    in_range = client.get("/?since=1h")  # counted over the creation-time range
    assert 'id="count-parked"><span class="status parked">parked</span> <b>3</b>' in in_range.body
    assert "the last 24 hours" not in in_range.body
    only = client.get("/?status=parked")
    assert only.body.count('class="run"') == 3 and ok not in only.body
    by_workflow = client.get("/?workflow=Dash.Refund")
    assert by_workflow.body.count('class="run"') == 1
    assert client.get("/?status=nope").status == 400
    assert client.get("/?since=yesterday").status == 400


def test_a_run_page_shows_the_timeline_and_escapes_what_handlers_wrote(
    setup: Any, wsgi_server: Any
) -> None:
    mgr, parked, _ = setup
    client = Client(wsgi_server(make_app(mgr.pool)))
    page = client.get(f"/runs/{parked[0]}")
    assert page.status == 200
    assert 'id="failure-code">card.declined<' in page.body
    assert 'data-state="current"' in page.body
    assert "<script>" not in page.body
    assert "&lt;script&gt;x&lt;/script&gt;" in page.body
    assert "&#34;card&#34;: &#34;4000&#34;" in page.body  # the input, escaped
    assert 'id="resume"' in page.body and 'id="cancel"' in page.body
    confirm = client.get(f"/runs/{parked[0]}/confirm?action=resume")
    assert 'id="confirm"' in confirm.body and "fresh attempt budget" in confirm.body
    assert client.get("/runs/not-a-run").status == 404
    headers = page.headers
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    assert headers["X-Frame-Options"] == "DENY"


def test_resume_with_the_forms_token_runs_the_parked_run_to_success(
    setup: Any, wsgi_server: Any, db: psycopg.Connection[Any]
) -> None:
    mgr, parked, _ = setup
    client = Client(wsgi_server(make_app(mgr.pool)))
    client.get(f"/runs/{parked[0]}/confirm?action=resume")
    DECLINED.discard("4000")  # the cause is fixed
    done = client.post(f"/runs/{parked[0]}/resume", {"csrf": client.csrf()})
    assert done.status == 303
    assert done.headers["Location"].startswith(f"/runs/{parked[0]}?done=")
    wait_until(lambda: mgr.status(parked[0]).status is Status.SUCCEEDED, "the resumed run")
    history = db.execute(
        "SELECT kind, actor FROM workflow_events WHERE run_id = %s ORDER BY at", (parked[0],)
    ).fetchall()
    assert ("resumed", "dashboard") in history


def test_a_post_without_the_token_or_from_another_site_is_refused(
    setup: Any, wsgi_server: Any
) -> None:
    mgr, parked, _ = setup
    base = wsgi_server(make_app(mgr.pool))
    client = Client(base)
    client.get(f"/runs/{parked[0]}/confirm?action=cancel")
    assert client.post(f"/runs/{parked[0]}/cancel").status == 403
    assert client.post(f"/runs/{parked[0]}/cancel", {"csrf": "forged"}).status == 403
    stranger = Client(base)  # no cookie: no token can match
    assert stranger.post(f"/runs/{parked[0]}/cancel", {"csrf": client.csrf()}).status == 403
    other_site = client.post(f"/runs/{parked[0]}/cancel", {"csrf": client.csrf()},
                             headers={"Origin": "http://evil.example"})
    assert other_site.status == 403
    assert mgr.status(parked[0]).status is Status.PARKED


def test_read_only_shows_no_action_and_refuses_every_post(setup: Any, wsgi_server: Any) -> None:
    mgr, parked, _ = setup
    client = Client(wsgi_server(make_app(mgr.pool, read_only=True)))
    for path in ("/", f"/runs/{parked[0]}", "/parked", "/schedules", "/health"):
        page = client.get(path)
        assert page.status == 200, path
        assert "<form" not in page.body or 'method="get"' in page.body, path
        assert 'method="post"' not in page.body, path
        assert "read-only" in page.body
    assert "Resume all" not in client.get("/parked").body
    assert client.post(f"/runs/{parked[0]}/cancel", {"csrf": "x"}).status == 403
    assert mgr.status(parked[0]).status is Status.PARKED


def test_the_parked_inbox_groups_and_bulk_cancels_after_a_confirmation(
    setup: Any, wsgi_server: Any, make_manager: Any
) -> None:
    mgr, parked, _ = setup
    DECLINED.add("5000")
    other = CHARGE.start(mgr, Charge("5000"))
    assert other.wait(timeout=10) is Status.PARKED
    client = Client(wsgi_server(make_app(mgr.pool)))
    inbox = client.get("/parked")
    assert inbox.body.count('class="group"') == 1  # one workflow, task and code
    assert "<b>4</b>" in inbox.body
    link = re.search(r'href="([^"]+action=cancel[^"]*)"', inbox.body)
    assert link
    confirm = client.get(link.group(1).replace("&amp;", "&"))
    assert "Cancel 4 parked runs?" in confirm.body
    fields = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', confirm.body))
    done = client.post("/parked/cancel", {**fields, "reason": "duplicate charges"})
    assert done.status == 303 and "cancelled+4+run" in done.headers["Location"]
    assert {mgr.status(i).status for i in (*parked, other.id)} == {Status.CANCELLED}
    assert "Nothing is parked." in client.get("/parked").body


def test_a_bulk_action_matches_the_code_it_names_and_no_other(
    make_manager: Any, pool: Any
) -> None:
    """Admin's task and code filters, which the inbox's groups use: code None matches the
    failures without a code only."""
    DECLINED.clear()
    reg = workflow.Registry()
    flow = workflow.Workflow("Dash.Codes", Charge)

    def fail(run: workflow.TaskRun[Charge]) -> str:
        error = RuntimeError("no")
        raise workflow.permanent(
            error if run.input.card == "none" else workflow.with_code(run.input.card, error)
        )

    reg.register(workflow.define(flow, workflow.handle(workflow.Task("dash.codes", str), fail)))
    mgr = make_manager(reg)
    runs = {card: flow.start(mgr, Charge(card)) for card in ("a", "b", "none")}
    for run in runs.values():
        assert run.wait(timeout=10) is Status.PARKED
    admin = workflow.Admin(pool)
    assert admin.count(status="parked", workflow="Dash.Codes") == 3
    assert admin.count(status="parked", workflow="Dash.Codes", code="a") == 1
    assert admin.count(status="parked", workflow="Dash.Codes", code=None) == 1
    assert admin.count(status="parked", workflow="Dash.Codes", task="dash.codes") == 3
    assert admin.count(status="parked", workflow="Dash.Codes", task="other") == 0
    assert admin.cancel_matching(status="parked", workflow="Dash.Codes", code=None) == 1
    assert runs["none"].status().status is Status.CANCELLED
    assert runs["a"].status().status is Status.PARKED


def test_schedules_and_health_pages(
    setup: Any, wsgi_server: Any, db: psycopg.Connection[Any]
) -> None:
    mgr, _, _ = setup
    db.execute(
        "INSERT INTO workflow_schedules (name, workflow, cron, timezone, catchup, next_tick) "
        "VALUES ('dash.nightly', 'Dash.Charge', '0 3 * * *', 'UTC', 'latest', now() + '1 day')"
    )
    client = Client(wsgi_server(make_app(mgr.pool)))
    page = client.get("/schedules")
    assert "dash.nightly" in page.body and "active" in page.body
    assert client.post("/schedules/dash.nightly/pause", {"csrf": client.csrf()}).status == 303
    assert db.execute(
        "SELECT paused FROM workflow_schedules WHERE name = 'dash.nightly'"
    ).fetchone() == (True,)
    assert client.post("/schedules/nope/pause", {"csrf": client.csrf()}).status == 404
    health = client.get("/health")
    assert health.status == 200 and "Dash.Charge" in health.body
    assert '<svg id="throughput"' in health.body
    assert "(5 in all)" in health.body  # 3 parked, 2 succeeded, in the last hour
    assert health.body.count("<rect ") >= 3


def test_an_authorize_hook_and_a_password_guard_every_page(setup: Any, wsgi_server: Any) -> None:
    mgr, parked, _ = setup
    def authorize(environ: dict[str, Any]) -> Any:
        return environ.get("HTTP_X_ROLE") or None

    base = wsgi_server(make_app(mgr.pool, authorize=authorize))
    assert Client(base).get("/").status == 403
    reader = Client(base)
    reply = reader.request("GET", f"/runs/{parked[0]}", headers={"X-Role": "read"})
    assert reply.status == 200 and 'method="post"' not in reply.body
    guarded = wsgi_server(make_app(mgr.pool, authorize=password_authorizer("s3cret")))
    refused = Client(guarded).get("/")
    assert refused.status == 401 and refused.headers["WWW-Authenticate"].startswith("Basic")
    assert Client(guarded, auth="admin:wrong").get("/").status == 401
    assert Client(guarded, auth="admin:s3cret").get("/").status == 200


def test_mounted_under_a_prefix_its_links_and_redirects_follow_it(
    setup: Any, wsgi_server: Any
) -> None:
    mgr, parked, _ = setup
    dashboard = make_app(mgr.pool)

    def mounted(environ: dict[str, Any], start_response: Any) -> Any:
        path = environ.get("PATH_INFO", "")
        if not path.startswith("/ops"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"the application's own page"]
        environ["SCRIPT_NAME"], environ["PATH_INFO"] = "/ops", path[len("/ops"):] or "/"
        return dashboard(environ, start_response)

    client = Client(wsgi_server(mounted))
    page = client.get("/ops/")
    assert f'href="/ops/runs/{parked[1]}"' in page.body
    client.get(f"/ops/runs/{parked[1]}/confirm?action=cancel")
    done = client.post(f"/ops/runs/{parked[1]}/cancel", {"csrf": client.csrf()})
    assert done.headers["Location"].startswith(f"/ops/runs/{parked[1]}?done=")


def test_the_command_refuses_a_host_other_machines_reach_without_a_password(
    db_url: str, tmp_path: Any
) -> None:
    env = {"PATH": "/usr/bin:/bin", "WORKFLOW_DATABASE_URL": db_url}
    refused = subprocess.run(
        [sys.executable, "-m", "workflow", "dashboard", "--host", "0.0.0.0", "--port", "0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=30,
    )
    assert refused.returncode == 1
    assert "reachable from other machines, with no password" in refused.stderr
    empty = tmp_path / "password"
    empty.write_text("\n")
    no_password = subprocess.run(
        [sys.executable, "-m", "workflow", "dashboard", "--host", "0.0.0.0",
         "--password-file", str(empty)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=30,
    )
    assert no_password.returncode == 1 and "is empty" in no_password.stderr


def test_the_command_serves_the_dashboard_on_loopback(db_url: str) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"PATH": "/usr/bin:/bin", "WORKFLOW_DATABASE_URL": db_url}
    proc = subprocess.Popen(
        [sys.executable, "-m", "workflow", "dashboard", "--port", str(port), "--read-only"],
        cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    assert r.status == 200 and "read-only" in r.read().decode()
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                assert time.monotonic() < deadline
                time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_dashboard_sends_no_sql_of_its_own() -> None:
    """Every read and action goes through workflow.Admin: no statement in its sources."""
    sources = sorted((ROOT / "workflow" / "contrib" / "dashboard").rglob("*.py"))
    assert sources
    words = re.compile(r"\b(SELECT|INSERT|UPDATE|DELETE)\s|\.execute\(|psycopg\.connect|cursor\(")
    offenders = [
        f"{path.name}:{n}" for path in sources
        for n, line in enumerate(path.read_text("utf-8").splitlines(), 1) if words.search(line)
    ]
    assert not offenders, offenders
