"""Prometheus metrics (SPEC 13, `workflow.metrics`): names, labels and values.

Each metric is read back from a real `CollectorRegistry` after runs that
succeed, fail once and succeed, park, are swept and are cancelled; the gauges
are compared with direct counts in the database; the worker serves `/metrics` on
a port of its own and exits 0 on SIGTERM. No label ever carries a run id.
"""

from __future__ import annotations

import os
import re
import threading
import urllib.request
from typing import Any

import psycopg
import pytest
from helpers import Inp, Out, other_backends, registry, wait_until
from worker_apps.harness import WorkerProcess

import workflow
from workflow import Status

prometheus_client = pytest.importorskip("prometheus_client")
metrics = pytest.importorskip("workflow.metrics")

A = workflow.Task("a", Out)
B = workflow.Task("b", Out)
ALLOWED_LABELS = {"workflow", "task", "outcome", "status", "le"}


def value(reg: Any, name: str, **labels: str) -> float:
    """A sample's value, 0 when the series does not exist."""
    found = reg.get_sample_value(name, labels)
    return 0.0 if found is None else float(found)


def test_a_run_that_fails_once_then_succeeds_is_counted_by_outcome(make_manager: Any) -> None:
    def flaky(run: workflow.TaskRun[Inp]) -> Out:
        if run.attempt == 1:
            raise RuntimeError("once")
        return Out("a")

    reg, wf = registry(
        workflow.handle(A, flaky, backoff_schedule=[0.01]),
        workflow.handle(B, lambda run: Out("b")),
    )
    mgr = make_manager(reg)
    prom = prometheus_client.CollectorRegistry()
    metrics.instrument(mgr, prom)
    assert wf.start(mgr, Inp(1)).wait(timeout=20) is Status.SUCCEEDED
    assert wf.start(mgr, Inp(2)).wait(timeout=20) is Status.SUCCEEDED
    wait_until(
        lambda: value(prom, "pgworkflow_runs_finished_total", workflow="W", status="succeeded")
        == 2,
        "both runs to be counted finished",
    )
    assert value(prom, "pgworkflow_runs_started_total", workflow="W") == 2
    attempts = "pgworkflow_task_attempts_total"
    assert value(prom, attempts, workflow="W", task="a", outcome="failed") == 2
    assert value(prom, attempts, workflow="W", task="a", outcome="succeeded") == 2
    assert value(prom, attempts, workflow="W", task="b", outcome="succeeded") == 2
    duration = "pgworkflow_task_duration_seconds_count"
    assert value(prom, duration, workflow="W", task="a") == 4
    assert value(prom, duration, workflow="W", task="b") == 2
    # The fast path's claim is immediate: no pickup delay observed.
    assert value(prom, "pgworkflow_run_pickup_delay_seconds_count", workflow="W") == 0


def test_a_park_a_timeout_and_a_cancel_are_counted(make_manager: Any, db_url: str) -> None:
    entered = threading.Event()

    def rejects(run: workflow.TaskRun[Inp]) -> Out:
        if run.input.n == 1:
            raise workflow.Permanent("rejected", code="no")
        if run.input.n == 2 and run.attempt == 1:
            run.cancelled.wait(5)
            raise TimeoutError("too slow")
        if run.input.n == 3:
            entered.set()
            run.cancelled.wait(20)
        return Out("x")

    reg, wf = registry(workflow.handle(A, rejects, timeout=0.3, backoff_schedule=[0]))
    mgr = make_manager(reg)
    prom = prometheus_client.CollectorRegistry()
    metrics.instrument(mgr, prom)
    assert wf.start(mgr, Inp(1)).wait(timeout=20) is Status.PARKED
    assert wf.start(mgr, Inp(2)).wait(timeout=20) is Status.SUCCEEDED
    cancelled = wf.start(mgr, Inp(3))
    assert entered.wait(10)
    with workflow.Admin(db_url) as admin:
        admin.cancel(cancelled.id)
    assert cancelled.wait(timeout=20) is Status.CANCELLED
    wait_until(
        lambda: value(prom, "pgworkflow_runs_finished_total", workflow="W", status="cancelled")
        == 1,
        "the cancel to be counted",
    )
    finished = "pgworkflow_runs_finished_total"
    assert value(prom, finished, workflow="W", status="parked") == 1
    assert value(prom, finished, workflow="W", status="succeeded") == 1
    attempts = "pgworkflow_task_attempts_total"
    assert value(prom, attempts, workflow="W", task="a", outcome="failed") == 1
    assert value(prom, attempts, workflow="W", task="a", outcome="timed_out") == 1
    assert value(prom, attempts, workflow="W", task="a", outcome="cancelled") == 1
    assert value(prom, attempts, workflow="W", task="a", outcome="succeeded") == 1


def test_a_sweep_counts_the_abandoned_attempt_and_a_poller_its_pickup_delay(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)
    prom = prometheus_client.CollectorRegistry()
    metrics.instrument(mgr, prom)
    with db.transaction():
        run = wf.start_tx(db, mgr, Inp(1))
    # A claim whose executor died an hour ago, on a run created two hours ago.
    db.execute(
        "UPDATE workflow_runs SET claim_id = gen_random_uuid(), created_at = now() - "
        "interval '2 hours', heartbeat_at = now() - interval '1 hour' WHERE id = %s",
        (run.id,),
    )
    runnable = mgr.new_runnable(workflow.RunnerConfig(listen=False, poll_interval=0.1))
    assert runnable.sweeper is not None and runnable.sweeper.sweep() == 1
    attempts = "pgworkflow_task_attempts_total"
    assert value(prom, attempts, workflow="W", task="a", outcome="abandoned") == 1
    runnable.start()
    try:
        assert run.wait(timeout=20) is Status.SUCCEEDED
    finally:
        runnable.stop()
    assert value(prom, attempts, workflow="W", task="a", outcome="succeeded") == 1
    # Claimable again since the sweep (not since its creation), claimed by the poller.
    assert value(prom, "pgworkflow_run_pickup_delay_seconds_count", workflow="W") == 1
    assert value(prom, "pgworkflow_run_pickup_delay_seconds_sum", workflow="W") < 3600
    assert value(prom, "pgworkflow_runs_finished_total", workflow="W", status="succeeded") == 1


def _count(db: psycopg.Connection[Any], where: str) -> int:
    row = db.execute(f"SELECT count(*) FROM workflow_runs WHERE {where}").fetchone()
    assert row is not None
    return int(row[0])


def test_the_gauges_match_a_direct_count(make_manager: Any, db: psycopg.Connection[Any]) -> None:
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    quiet = workflow.Workflow("Quiet", Inp)
    reg.register(workflow.define(quiet, workflow.handle(B, lambda run: Out("y"))))
    mgr = make_manager(reg)
    prom = prometheus_client.CollectorRegistry()
    metrics.instrument(mgr, prom, gauge_cache=0)
    with db.transaction():
        runs = [wf.start_tx(db, mgr, Inp(i)) for i in range(6)]
    db.execute(
        "UPDATE workflow_runs SET created_at = now() - interval '90 seconds', "
        "next_retry_at = now() - interval '60 seconds' WHERE id = %s",
        (runs[0].id,),
    )
    db.execute(  # waiting out a backoff: open, not claimable
        "UPDATE workflow_runs SET next_retry_at = now() + interval '1 hour', status = 'running' "
        "WHERE id = %s",
        (runs[1].id,),
    )
    db.execute(  # parked
        "UPDATE workflow_runs SET status = 'parked', finished_at = now() WHERE id = %s",
        (runs[2].id,),
    )
    db.execute(  # a stale claim and a fresh one
        "UPDATE workflow_runs SET claim_id = gen_random_uuid(), status = 'running', "
        "heartbeat_at = now() - interval '1 hour' WHERE id = %s",
        (runs[3].id,),
    )
    db.execute(
        "UPDATE workflow_runs SET claim_id = gen_random_uuid(), status = 'running', "
        "heartbeat_at = now() WHERE id = %s",
        (runs[4].id,),
    )
    for status in ("pending", "running", "parked"):
        where = f"workflow = 'W' AND status = '{status}'"
        if status != "parked":
            where += " AND finished_at IS NULL"
        assert value(prom, "pgworkflow_runs", workflow="W", status=status) == _count(db, where)
    claimable = _count(db, "claim_id IS NULL AND finished_at IS NULL AND next_retry_at <= now()")
    assert claimable == 2
    assert value(prom, "pgworkflow_claimable_runs", workflow="W") == claimable
    age = value(prom, "pgworkflow_oldest_claimable_age_seconds", workflow="W")
    assert 59 < age < 600, "claimable since its due time, not since its creation"
    assert value(prom, "pgworkflow_stale_claims") == 1
    # A registered workflow with nothing open is reported, with zeros.
    assert prom.get_sample_value("pgworkflow_runs", {"workflow": "Quiet", "status": "parked"}) == 0
    assert prom.get_sample_value("pgworkflow_claimable_runs", {"workflow": "Quiet"}) == 0


def test_the_gauges_are_read_once_per_cache_period(
    make_manager: Any, db: psycopg.Connection[Any]
) -> None:
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)
    cached = prometheus_client.CollectorRegistry()
    metrics.instrument(mgr, cached, gauge_cache=3600)
    fresh = prometheus_client.CollectorRegistry()
    metrics.instrument(mgr, fresh, gauge_cache=0)
    assert value(cached, "pgworkflow_claimable_runs", workflow="W") == 0
    with db.transaction():
        wf.start_tx(db, mgr, Inp(1))
    assert value(fresh, "pgworkflow_claimable_runs", workflow="W") == 1
    assert value(cached, "pgworkflow_claimable_runs", workflow="W") == 0, (
        "a scrape within the cache period reads nothing from the database"
    )


def test_no_label_carries_a_run_id_and_every_spec_metric_is_there(make_manager: Any) -> None:
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)
    prom = prometheus_client.CollectorRegistry()
    metrics.instrument(mgr, prom)
    assert wf.start(mgr, Inp(1)).wait(timeout=20) is Status.SUCCEEDED
    wait_until(
        lambda: value(prom, "pgworkflow_runs_finished_total", workflow="W", status="succeeded")
        == 1,
        "the run to be counted",
    )
    names = set()
    for family in prom.collect():
        names.add(family.name)
        for sample in family.samples:
            assert set(sample.labels) <= ALLOWED_LABELS, sample
            for label in sample.labels.values():
                assert not re.fullmatch(r"[0-9a-f-]{36}", label), sample
    assert names == {
        "pgworkflow_runs_started",
        "pgworkflow_runs_finished",
        "pgworkflow_task_attempts",
        "pgworkflow_task_duration_seconds",
        "pgworkflow_run_pickup_delay_seconds",
        "pgworkflow_runs",
        "pgworkflow_claimable_runs",
        "pgworkflow_oldest_claimable_age_seconds",
        "pgworkflow_stale_claims",
    }


def test_closing_the_instrumentation_removes_its_metrics_and_a_second_one_is_refused(
    make_manager: Any,
) -> None:
    reg, _ = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)
    prom = prometheus_client.CollectorRegistry()
    instrumentation = metrics.instrument(mgr, prom)
    with pytest.raises(ValueError, match="Duplicated"):
        metrics.instrument(mgr, prom)
    instrumentation.close()
    assert list(prom.collect()) == []
    metrics.instrument(mgr, prom).close()


def test_the_worker_serves_metrics_on_its_port_and_exits_0_on_sigterm(
    engine_url: str, db: psycopg.Connection[Any]
) -> None:
    worker = WorkerProcess(
        "tests.worker_apps.three_tasks:registry", engine_url, "--metrics-port", "0",
        "--poll-interval", "0.2",
    )
    try:
        line = worker.wait_for_line("metrics at http://")
        url = line.split("metrics at ", 1)[1].strip()
        worker.wait_started()
        wait_until(lambda: b"pgworkflow_claimable_runs" in _get(url), "the metrics page")
        page = _get(url).decode()
        assert 'pgworkflow_runs{status="parked",workflow="Ledger.Three"} 0.0' in page
        assert "process_cpu_seconds_total" in page or "python_info" in page
        worker.terminate()
        assert worker.wait(timeout=20) == 0, worker.stderr
        assert "Traceback" not in worker.stderr
    finally:
        worker.kill()


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as response:
        body: bytes = response.read()
        return body


@pytest.mark.parametrize("port", ["70000", "-1", "http"])
def test_a_bad_metrics_port_is_a_usage_error(port: str) -> None:
    from test_worker_cli import one_line, run_worker

    proc = run_worker("--app", "tests.worker_apps.three_tasks:registry", "--metrics-port", port)
    assert "--metrics-port" in one_line(proc, 2)


def test_a_metrics_server_whose_thread_cannot_start_is_one_line_and_exit_1(
    db_url: str,
) -> None:
    from test_worker_cli import one_line, run_worker

    proc = run_worker(
        "--app", "tests.worker_apps.bad:no_thread_for_metrics", "--database-url", db_url,
        "--metrics-port", "0",
    )
    line = one_line(proc, 1)
    assert line.startswith("workflow: --metrics-port: cannot serve on 127.0.0.1:0: ")
    assert "can't start new thread" in line


def test_the_keda_query_the_stats_command_and_the_gauge_agree(
    make_manager: Any, db: psycopg.Connection[Any], db_url: str
) -> None:
    from test_query_plans import readme_keda_query

    reg, wf = registry(workflow.handle(A, lambda run: Out("x")), name="Transfer.Send")
    mgr = make_manager(reg)
    prom = prometheus_client.CollectorRegistry()
    metrics.instrument(mgr, prom, gauge_cache=0)
    with db.transaction():
        runs = [wf.start_tx(db, mgr, Inp(i)) for i in range(4)]
    db.execute(
        "UPDATE workflow_runs SET next_retry_at = now() + interval '1 hour' WHERE id = %s",
        (runs[0].id,),
    )
    row = db.execute(readme_keda_query()).fetchone()
    assert row == (3,)
    assert value(prom, "pgworkflow_claimable_runs", workflow="Transfer.Send") == 3
    with workflow.Admin(db_url) as admin:
        (stats,) = admin.stats().workflows
    assert stats.claimable == 3


def instrumented_extension(db_url: str) -> tuple[Any, Any, Any]:
    """A Flask extension whose `on_manager` instruments each manager into a registry of
    its own; the extension, its workflow and the registry."""
    flask = pytest.importorskip("flask")
    from workflow.contrib.flask import WorkflowExtension

    prom = prometheus_client.CollectorRegistry()
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    ext = WorkflowExtension(
        flask.Flask("metrics"), registry=reg, database_url=db_url,
        on_manager=lambda mgr: metrics.instrument(mgr, prom),
    )
    return ext, wf, prom


def test_the_flask_extension_hands_each_manager_to_on_manager_and_closes_what_it_returned(
    db_url: str,
) -> None:
    # on_manager=metrics.instrument registers the metrics; a close that left them
    # registered (and fed by a closed manager) would make the next build's
    # instrument() fail for good with prometheus_client's "Duplicated timeseries".
    ext, wf, prom = instrumented_extension(db_url)
    try:
        assert wf.start(ext.get_manager(), Inp(1)).wait(timeout=20) is Status.SUCCEEDED
        assert value(prom, "pgworkflow_runs_started_total", workflow="W") == 1
        ext.close()
        assert [family.name for family in prom.collect()] == []
        assert wf.start(ext.get_manager(), Inp(2)).wait(timeout=20) is Status.SUCCEEDED
        assert value(prom, "pgworkflow_runs_started_total", workflow="W") == 1
    finally:
        ext.close()


def test_a_forked_child_instruments_its_own_manager_in_the_registry_it_copied(
    db_url: str,
) -> None:
    # Gunicorn with --preload: the parent used the extension, so its metrics are in
    # the registry each child inherits; the child's manager must get its own there.
    ext, wf, prom = instrumented_extension(db_url)
    try:
        parent = ext.get_manager()
        assert wf.start(parent, Inp(1)).wait(timeout=20) is Status.SUCCEEDED
        pid = os.fork()
        if pid == 0:  # the child: report through the exit code only
            code = 1
            try:
                child = ext.get_manager()
                ok = wf.start(child, Inp(2)).wait(timeout=20) is Status.SUCCEEDED
                counted = value(prom, "pgworkflow_runs_started_total", workflow="W") == 1
                code = 0 if ok and counted else 2
                ext.close(timeout=10)
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert ext.get_manager() is parent  # the parent's metrics are its own still
        assert value(prom, "pgworkflow_runs_started_total", workflow="W") == 1
    finally:
        ext.close(timeout=10)


def test_a_close_with_a_bad_timeout_closes_nothing(db_url: str) -> None:
    flask = pytest.importorskip("flask")
    from workflow.contrib.flask import WorkflowExtension

    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    ext = WorkflowExtension(flask.Flask("bad-timeout"), registry=reg, database_url=db_url)
    try:
        mgr = ext.get_manager()
        with pytest.raises(ValueError):
            ext.close(timeout=float("inf"))
        assert ext.get_manager() is mgr
        assert wf.start(mgr, Inp(1)).wait(timeout=20) is Status.SUCCEEDED
    finally:
        ext.close(timeout=10)


def test_an_instrumentation_that_cannot_be_built_leaves_its_registry_as_it_was(
    db_url: str,
) -> None:
    prom = prometheus_client.CollectorRegistry()
    reg, _ = registry(workflow.handle(A, lambda run: Out("x")))
    closed = workflow.Manager(db_url, reg)
    closed.close()
    with pytest.raises(workflow.WorkflowError):
        metrics.instrument(closed, prom)
    assert [family.name for family in prom.collect()] == []
    with workflow.Manager(db_url, reg) as mgr:
        metrics.instrument(mgr, prom).close()


def test_a_failing_on_manager_closes_what_it_built(
    db_url: str, db: psycopg.Connection[Any]
) -> None:
    flask = pytest.importorskip("flask")
    from workflow.contrib.flask import WorkflowExtension

    def broken(mgr: workflow.Manager) -> None:
        raise RuntimeError("the hook failed")

    reg, _ = registry(workflow.handle(A, lambda run: Out("x")))
    ext = WorkflowExtension(flask.Flask("broken"), registry=reg, database_url=db_url,
                            on_manager=broken)
    with pytest.raises(RuntimeError, match="the hook failed"):
        ext.get_manager()
    wait_until(lambda: other_backends(db) == 0, "the pool it built to be closed")
    with pytest.raises(TypeError, match="on_manager must be callable"):
        WorkflowExtension(registry=reg, on_manager="workflow.metrics:instrument")  # type: ignore[arg-type]


def test_keyed_runs_waiting_for_a_slot_are_open_but_not_claimable(
    make_manager: Any, db: psycopg.Connection[Any], db_url: str
) -> None:
    """The gauges and `stats` read the open runs in two parts (those that may be claimed,
    and the keyed runs waiting for a slot): each run is counted once, in its status."""
    from test_query_plans import readme_keda_query

    keyed = workflow.Workflow("Transfer.Send", Inp)
    reg = workflow.Registry()
    reg.register(workflow.define(keyed, workflow.handle(A, lambda run: Out("x")),
                                 concurrency_key=lambda i: "acct", concurrency=1))
    mgr = make_manager(reg)
    prom = prometheus_client.CollectorRegistry()
    metrics.instrument(mgr, prom, gauge_cache=0)
    with db.transaction():
        runs = [keyed.start_tx(db, mgr, Inp(i)) for i in range(4)]
    db.execute(  # the key's slot given to the first run: it may be claimed now
        "UPDATE workflow_runs SET key_slot = 0 WHERE id = %s", (runs[0].id,)
    )
    db.execute(  # the last run cancelled: finished, in no open count
        "UPDATE workflow_runs SET status = 'cancelled', finished_at = now() WHERE id = %s",
        (runs[3].id,),
    )
    assert value(prom, "pgworkflow_runs", workflow="Transfer.Send", status="pending") == 3
    assert value(prom, "pgworkflow_runs", workflow="Transfer.Send", status="cancelled") == 0
    assert value(prom, "pgworkflow_claimable_runs", workflow="Transfer.Send") == 1
    with workflow.Admin(db_url) as admin:
        (stats,) = admin.stats().workflows
    assert (stats.pending, stats.running, stats.claimable) == (3, 0, 1)
    assert db.execute(readme_keda_query()).fetchone() == (1,)
