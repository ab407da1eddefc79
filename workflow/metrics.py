"""Prometheus metrics of a manager (SPEC 13): `instrument(mgr, registry=None)`.

Needs the `metrics` extra (`pip install 'pgworkflow[metrics]'`, prometheus_client).
Counters and histograms are fed from the manager's events, on the thread where
each thing happened (a dictionary lookup and an increment: nothing measurable on
the fast path); gauges are read from the database when a scrape asks, in one
query over partial indexes (`Admin.depth`), cached for `gauge_cache` seconds so
that several scrapers, or a fast one, cannot load the database.

Every name has the prefix `pgworkflow_`; no label carries a run id, so the
number of series stays bounded by workflows x tasks x statuses:

- `runs_started_total{workflow}`: runs inserted by this process (a `start_tx`
  counts when its insert is made, before the caller's commit);
- `runs_finished_total{workflow,status}`: runs that reached `succeeded` or
  `parked` in an execution here, or `cancelled` while one executed here;
- `task_attempts_total{workflow,task,outcome}`: attempts that ended here, by
  outcome (succeeded, failed, timed_out, abandoned, cancelled); an attempt whose
  claim was taken is counted once, as `abandoned`, by the process whose sweep
  released it;
- `task_duration_seconds{workflow,task}`: histogram of those attempts' durations;
- `run_pickup_delay_seconds{workflow}`: histogram of how long a run had been
  claimable when a poller here claimed it (database clock; fast-path claims are
  immediate and not observed);
- gauges, from the database: `runs{workflow,status}` (pending, running, parked),
  `claimable_runs{workflow}`, `oldest_claimable_age_seconds{workflow}`, and
  `stale_claims` (claims whose heartbeat is older than the manager's
  `sweep_max_age`).

Every workflow the manager has registered is reported, with zeros, so that an
alert on `pgworkflow_runs{status="parked"} > 0` has a series to watch from the
first scrape.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from workflow.admin import Admin
from workflow.config import Settings
from workflow.events import (
    AttemptEnded,
    ClaimsSwept,
    Event,
    Outcome,
    RunClaimed,
    RunFinished,
    RunStarted,
)
from workflow.run import Status

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

    from workflow.manager import Manager

try:
    import prometheus_client
    from prometheus_client.core import GaugeMetricFamily
except ImportError:  # the `metrics` extra is not installed
    prometheus_client = None  # type: ignore[assignment]

__all__ = ["Instrumentation", "instrument", "serve"]

PREFIX = "pgworkflow_"
DURATION_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)
PICKUP_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0,
    3600.0,
)
OPEN_STATUSES = (Status.PENDING.value, Status.RUNNING.value, Status.PARKED.value)


def _need_prometheus() -> None:
    if prometheus_client is None:
        raise ImportError(
            "workflow.metrics needs prometheus_client: pip install 'pgworkflow[metrics]'"
        )


class Instrumentation:
    """A manager's metrics in a registry; `close()` stops feeding and unregisters them."""

    def __init__(
        self, mgr: Manager, registry: CollectorRegistry, *, gauge_cache: float = 1.0
    ) -> None:
        _need_prometheus()
        self.registry = registry
        """The registry the metrics are in."""
        self._started = prometheus_client.Counter(
            PREFIX + "runs_started", "Runs inserted by this process.", ["workflow"],
            registry=None,
        )
        self._finished = prometheus_client.Counter(
            PREFIX + "runs_finished",
            "Runs that reached a terminal status in an execution in this process.",
            ["workflow", "status"], registry=None,
        )
        self._attempts = prometheus_client.Counter(
            PREFIX + "task_attempts",
            "Task attempts that ended in this process (or were swept by it), by outcome.",
            ["workflow", "task", "outcome"], registry=None,
        )
        self._duration = prometheus_client.Histogram(
            PREFIX + "task_duration_seconds", "How long task attempts ran.",
            ["workflow", "task"], buckets=DURATION_BUCKETS, registry=None,
        )
        self._pickup = prometheus_client.Histogram(
            PREFIX + "run_pickup_delay_seconds",
            "How long a run had been claimable when a poller in this process claimed it.",
            ["workflow"], buckets=PICKUP_BUCKETS, registry=None,
        )
        self._gauges = _Gauges(mgr, gauge_cache)
        # Registered only once all are built, and all or none: an instrumentation that
        # fails part-way (a closed manager, a name already taken) leaves the registry as
        # it was, so that a later one can register there.
        registered: list[Any] = []
        try:
            for collector in self._collectors():
                registry.register(collector)
                registered.append(collector)
        except BaseException:
            for collector in registered:
                registry.unregister(collector)
            self._gauges.close()
            raise
        # Children looked up once per label set: the hot path is one dict lookup.
        self._attempt_children: dict[tuple[str, str, str], Any] = {}
        self._duration_children: dict[tuple[str, str], Any] = {}
        self._children: dict[tuple[Any, ...], Any] = {}
        self._closed = False
        self._close_lock = threading.Lock()
        self._unsubscribe = mgr.events.subscribe(self._on_event)

    def _collectors(self) -> tuple[Any, ...]:
        return (
            self._started, self._finished, self._attempts, self._duration, self._pickup,
            self._gauges,
        )

    def close(self) -> None:
        """Stop counting and remove every metric of this instrumentation from its registry.

        Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._unsubscribe()
        for collector in self._collectors():
            self.registry.unregister(collector)
        self._gauges.close()

    def _child(self, metric: Any, *labels: str) -> Any:
        # A race may look a child up twice: prometheus_client returns the same one.
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def _on_event(self, event: Event) -> None:
        if isinstance(event, AttemptEnded):
            if event.claim_lost:
                return  # the sweep that took the claim counts it
            key = (event.workflow, event.task, event.outcome.value)
            attempts = self._attempt_children.get(key)
            if attempts is None:
                attempts = self._attempt_children[key] = self._attempts.labels(*key)
            attempts.inc()
            task = (event.workflow, event.task)
            duration = self._duration_children.get(task)
            if duration is None:
                duration = self._duration_children[task] = self._duration.labels(*task)
            duration.observe(event.seconds)
        elif isinstance(event, RunStarted):
            self._child(self._started, event.workflow).inc()
        elif isinstance(event, RunFinished):
            self._child(self._finished, event.workflow, event.status.value).inc()
        elif isinstance(event, RunClaimed):
            if event.waited is not None:
                self._child(self._pickup, event.workflow).observe(max(event.waited, 0.0))
        elif isinstance(event, ClaimsSwept):
            for attempt in event.attempts:
                self._child(
                    self._attempts, attempt.workflow, attempt.task, Outcome.ABANDONED.value
                ).inc()


class _Gauges:
    """The database gauges, read at scrape time through a small cache."""

    def __init__(self, mgr: Manager, cache: float) -> None:
        self._stale_after = Settings.of(mgr.config).sweep_max_age
        self._admin = Admin(mgr.pool, logger=mgr.logger, stale_after=self._stale_after)
        self._workflows = tuple(mgr.registry.names())
        self._cache = cache
        self._lock = threading.Lock()
        self._read_at = -float("inf")
        self._families: list[Metric] = []

    def close(self) -> None:
        self._admin.close()

    def describe(self) -> Iterable[Metric]:
        # Declared, so that registering reads nothing from the database.
        return self._build(())

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            now = time.monotonic()
            if now - self._read_at >= self._cache:
                self._families = self._build(self._admin.depth())
                self._read_at = time.monotonic()
            families = self._families
        yield from families

    def _build(self, depth: Iterable[Any]) -> list[Metric]:
        runs = GaugeMetricFamily(
            PREFIX + "runs", "Runs not finished, and parked runs, by status (database).",
            labels=["workflow", "status"],
        )
        claimable = GaugeMetricFamily(
            PREFIX + "claimable_runs", "Runs a poller could claim now (database).",
            labels=["workflow"],
        )
        oldest = GaugeMetricFamily(
            PREFIX + "oldest_claimable_age_seconds",
            "How long the oldest claimable run has been claimable (database; 0 when none).",
            labels=["workflow"],
        )
        stale = GaugeMetricFamily(
            PREFIX + "stale_claims",
            "Claims whose heartbeat is older than sweep_max_age (database).",
        )
        counts: dict[tuple[str, str], int] = {}
        ready: dict[str, int] = {}
        ages: dict[str, float] = {}
        stale_total = 0
        for workflow in self._workflows:
            ready[workflow] = 0
            ages[workflow] = 0.0
            for status in OPEN_STATUSES:
                counts[workflow, status] = 0
        for row in depth:
            counts[row.workflow, row.status] = counts.get((row.workflow, row.status), 0) + row.runs
            ready[row.workflow] = ready.get(row.workflow, 0) + row.claimable
            if row.oldest_claimable_seconds is not None:
                ages[row.workflow] = max(ages.get(row.workflow, 0.0), row.oldest_claimable_seconds)
            else:
                ages.setdefault(row.workflow, 0.0)
            stale_total += row.stale_claims
        for (workflow, status), count in sorted(counts.items()):
            runs.add_metric([workflow, status], count)
        for workflow, count in sorted(ready.items()):
            claimable.add_metric([workflow], count)
            oldest.add_metric([workflow], ages[workflow])
        stale.add_metric([], stale_total)
        return [runs, claimable, oldest, stale]


def instrument(
    mgr: Manager, registry: CollectorRegistry | None = None, *, gauge_cache: float = 1.0
) -> Instrumentation:
    """Export `mgr`'s metrics (SPEC 13) into `registry` (default: prometheus_client's
    global `REGISTRY`); the returned `Instrumentation`'s `close()` removes them.

    Raises `ImportError` without prometheus_client, and prometheus_client's
    `ValueError` when the registry already holds pgworkflow's metrics (one
    instrumented manager per registry).
    """
    _need_prometheus()
    if registry is None:
        registry = prometheus_client.REGISTRY
    return Instrumentation(mgr, registry, gauge_cache=gauge_cache)


def serve(
    registry: CollectorRegistry, port: int, host: str = "127.0.0.1"
) -> tuple[Any, threading.Thread]:
    """Serve `registry` at `http://host:port/metrics` on a daemon thread (prometheus_client's
    own server); returns `(server, thread)`, and `server.shutdown()` stops it."""
    _need_prometheus()
    server, thread = prometheus_client.start_http_server(port, addr=host, registry=registry)
    return server, thread

