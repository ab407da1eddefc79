"""Flask under real Gunicorn (sync workers, two pre-forked processes): `contrib.flask`.

The example app (examples/flask_transfer) is served by `gunicorn` as a
subprocess on a free loopback port, against the test's database, with no worker
process running: every run that completes was executed on the fast path of a
Gunicorn worker. `Reserved.pid` records the process that executed `reserve`;
the view returns the process that served the request; they must match. After
SIGTERM to Gunicorn no claim is left. With sends still in flight at SIGTERM, the
drain releases their claims without counting the attempt, and `python -m
workflow.worker` with the example's factory finishes them. Last, the extension
itself: a manager built before `os.fork()` is rebuilt in the child, which leaves
the parent's alone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest
from adoption import require
from adoption.servers import ServerProcess, child_env, free_port, http, wait_until_serving
from worker_apps.harness import WorkerProcess

import workflow

require("flask", "gunicorn")

pytestmark = pytest.mark.slow

REQUESTS = 200
IN_FLIGHT = 20
CONFIG = "examples/flask_transfer/gunicorn.conf.py"
APP = "examples.flask_transfer.app:app"
WORKER_APP = "examples.flask_transfer.worker:registry"


def _gunicorn_argv() -> list[str]:
    from gunicorn.config import KNOWN_SETTINGS

    argv = [sys.executable, "-m", "gunicorn", "-c", CONFIG]
    argv += ["--workers", "2", "--worker-class", "sync"]
    # Recent Gunicorn opens a control socket at a fixed path under $HOME; test runs
    # in parallel would fight over it.
    if any(setting.name == "control_socket_disable" for setting in KNOWN_SETTINGS):
        argv.append("--no-control-socket")
    return [*argv, APP]


Serve = Callable[[str], tuple[ServerProcess, str]]


@pytest.fixture
def serve(db_url: str) -> Iterator[Serve]:
    """`serve(latency)`: Gunicorn with the Flask example on the test's database.

    `latency` is the fake provider's time to send, in seconds. Returns the
    process and the base URL once both workers answer; stops it afterwards.
    """
    servers: list[ServerProcess] = []

    def start(latency: str) -> tuple[ServerProcess, str]:
        port = free_port()
        env = child_env(
            WORKFLOW_DATABASE_URL=db_url,
            GUNICORN_BIND=f"127.0.0.1:{port}",
            TRANSFER_PROVIDER_LATENCY=latency,
        )
        server = ServerProcess(_gunicorn_argv(), env=env)
        servers.append(server)
        base = f"http://127.0.0.1:{port}"
        server.wait_for_lines("Booting worker with pid", count=2)
        wait_until_serving(f"{base}/transfers/none", server)
        return server, base

    yield start
    for server in servers:
        if server.proc.poll() is None:
            server.terminate()
            try:
                server.wait(40)
            except subprocess.TimeoutExpired:
                server.kill()


def _start_transfers(base: str, count: int, first: int = 0) -> list[tuple[str, int]]:
    """POST `count` transfers, 8 at a time; the (run id, serving pid) of each."""

    def post(i: int) -> tuple[str, int]:
        transfer = {"account": f"acct-{i}", "amount_cents": i}
        status, body = http("POST", f"{base}/transfers", transfer)
        assert status == 202, (status, body)
        return body["id"], body["pid"]

    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(post, range(first, first + count)))


def _statuses(db: psycopg.Connection[Any]) -> dict[str, str]:
    return {str(i): s for i, s in db.execute("SELECT id, status FROM workflow_runs").fetchall()}


def _wait_all(db: psycopg.Connection[Any], ids: list[str], status: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        current = _statuses(db)
        left = [i for i in ids if current.get(i) != status]
        if not left:
            return
        if time.monotonic() > deadline:
            counts: dict[str | None, int] = {}
            for i in left:
                counts[current.get(i)] = counts.get(current.get(i), 0) + 1
            raise AssertionError(f"{len(left)} runs are not {status}: {counts}")
        time.sleep(0.1)


def _booted(server: ServerProcess) -> set[int]:
    lines = server.wait_for_lines("Booting worker with pid", 2)
    return {int(line.rsplit(":", 1)[1]) for line in lines}


def test_runs_started_under_gunicorn_complete_on_the_fast_path_of_their_worker(
    serve: Serve, db: psycopg.Connection[Any]
) -> None:
    server, base = serve("0.02")

    started = _start_transfers(base, REQUESTS)
    ids = [run_id for run_id, _ in started]
    assert len(set(ids)) == REQUESTS
    _wait_all(db, ids, "succeeded", timeout=60)

    executed = {
        str(run_id): int(pid)
        for run_id, pid in db.execute(
            "SELECT run_id, (output->>'pid')::int FROM workflow_tasks WHERE seq = 1"
        ).fetchall()
    }
    served = dict(started)
    wrong = {i: (served[i], executed.get(i)) for i in ids if executed.get(i) != served[i]}
    assert not wrong, f"runs executed elsewhere than the process that served them: {wrong}"
    assert set(served.values()) == _booted(server), "both Gunicorn workers served requests"
    # The example mounts the dashboard at /ops/workflow (pgworkflow[dashboard]).
    with urllib.request.urlopen(f"{base}/ops/workflow/runs/{ids[0]}", timeout=10) as page:
        assert page.status == 200 and "succeeded" in page.read().decode()

    server.terminate()
    assert server.wait(60) == 0, server.output
    claimed = db.execute("SELECT count(*) FROM workflow_runs WHERE claim_id IS NOT NULL")
    assert claimed.fetchone() == (0,)
    assert "Traceback" not in server.output, server.output


def test_sigterm_drains_in_flight_runs_and_a_worker_finishes_them(
    serve: Serve, db: psycopg.Connection[Any], db_url: str
) -> None:
    # Sends take 30 s: every run is inside its send when SIGTERM arrives.
    server, base = serve("30")
    started = _start_transfers(base, IN_FLIGHT)
    ids = [run_id for run_id, _ in started]
    _wait_until_reserved(db, ids)

    server.terminate()
    assert server.wait(60) == 0, server.output
    rows = db.execute(
        "SELECT r.status, r.claim_id, r.current_seq, t.attempts FROM workflow_runs r "
        "JOIN workflow_tasks t ON t.run_id = r.id AND t.seq = 2"
    ).fetchall()
    # Drained: claims released, the interrupted send not counted as an attempt.
    assert rows == [("running", None, 2, 0)] * IN_FLIGHT, server.output

    worker = WorkerProcess(WORKER_APP, db_url, "--poll-interval", "1")
    try:
        worker.wait_started()
        _wait_all(db, ids, "succeeded", timeout=60)
        worker.signal(signal.SIGTERM)
        assert worker.wait() == 0, worker.stderr
    finally:
        worker.kill()
    # The worker carried on from the recorded reserve: its output is the Gunicorn worker's.
    served = dict(started)
    reserved_by = dict(
        (str(run_id), int(pid))
        for run_id, pid in db.execute(
            "SELECT run_id, (output->>'pid')::int FROM workflow_tasks WHERE seq = 1"
        ).fetchall()
    )
    assert reserved_by == served


def _wait_until_reserved(db: psycopg.Connection[Any], ids: list[str], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        (done,) = db.execute(
            "SELECT count(*) FROM workflow_tasks WHERE seq = 1 AND output IS NOT NULL "
            "AND run_id = ANY(%s::uuid[])",
            (ids,),
        ).fetchone() or (0,)
        if done == len(ids):
            return
        assert time.monotonic() < deadline, f"{done} of {len(ids)} runs reserved"
        time.sleep(0.05)


Echo = workflow.Workflow("fork.Echo", str)
executed_by = workflow.Task("fork.executed_by", int)


def _echo_registry() -> workflow.Registry:
    reg = workflow.Registry()
    reg.register(workflow.define(Echo, workflow.handle(executed_by, lambda run: os.getpid())))
    return reg


def test_the_extension_rebuilds_its_manager_after_fork_and_leaves_the_parents_alone(
    db_url: str, db: psycopg.Connection[Any]
) -> None:
    from flask import Flask

    from workflow.contrib.flask import WorkflowExtension

    ext = WorkflowExtension(Flask("fork"), registry=_echo_registry(), database_url=db_url)
    try:
        parent = ext.manager
        assert Echo.start(parent, "before").wait(timeout=30) is workflow.Status.SUCCEEDED
        pid = os.fork()
        if pid == 0:  # the child: report through the exit code only
            code = 1
            try:
                child = ext.manager
                ok = child is not parent and Echo.start(child, "child").wait(timeout=30)
                code = 0 if ok is workflow.Status.SUCCEEDED else 2
                ext.close(timeout=10)
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        # The child neither used nor closed what the parent built.
        assert ext.manager is parent
        assert Echo.start(parent, "after").wait(timeout=30) is workflow.Status.SUCCEEDED
        pids = [p for (p,) in db.execute("SELECT (output::text)::int FROM workflow_tasks")]
        assert sorted(pids) == sorted([os.getpid(), pid, os.getpid()])
    finally:
        ext.close(timeout=10)
