"""What metrics and traces cost on the fast path (SPEC 13), against the engine without them.

The workload is what users run: `Bench.Order`, an attrs input and three tasks each
returning a small attrs output that the next task reads. Each variant is a
Manager of its own over the same database; from T threads each loops
`run = OrderFlow.start(mgr, order); run.wait()`. The variants alternate in short
slices, their order rotating every round, so each has neighbours under the same
machine load; the printed ratios are runs/s and client CPU per run against the
`off` variant of the same process.

Two processes, because OpenTelemetry's tracer provider is set once per process:

- without an SDK: `off` (`Config(tracing=False)`, no metrics), `metrics`
  (`instrument()` into a private registry, tracing off), `api` (tracing on,
  opentelemetry-api installed, no SDK: what a user who installed the extra but
  configured nothing pays) and `metrics+api`;
- with the SDK (a `TracerProvider` with a `BatchSpanProcessor` into an exporter
  that drops the spans: the recording and batching cost, not an exporter's
  network): `off`, `sdk` and `metrics+sdk`.

    PYTHONPATH=. python bench/observability.py [--threads 1,8] [--rounds 5] [--slice 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

import workflow
from bench.apps import Order, OrderFlow, order_registry
from bench.common import emit, log, scratch_db, slice_loops
from workflow.store import migrate

NO_SDK = ("off", "metrics", "api", "metrics+api")
WITH_SDK = ("off", "sdk", "metrics+sdk")


def _manager(url: str, variant: str) -> workflow.Manager:
    tracing = variant.endswith(("api", "sdk"))
    mgr = workflow.Manager(url, order_registry(), workflow.Config(tracing=tracing))
    if variant.startswith("metrics"):
        from prometheus_client import CollectorRegistry

        from workflow import metrics

        metrics.instrument(mgr, CollectorRegistry())
    return mgr


def _slice(mgr: workflow.Manager, threads: int, seconds: float, base: int) -> tuple[int, float]:
    """Runs finished by `threads` closed loops in `seconds`, and the process CPU per run."""

    def one(i: int, n: int) -> None:
        run = OrderFlow.start(mgr, Order(order_id=n, cents=100 + n % 900))
        if run.wait(timeout=30) is not workflow.Status.SUCCEEDED:
            raise RuntimeError(f"run {run.id} ended {run.status().status}")

    runs, cpu = slice_loops(one, threads, seconds, base)
    return runs, cpu / max(runs, 1)


def measure(url: str, variants: tuple[str, ...], threads: int, rounds: int,
            seconds: float) -> dict[str, Any]:
    managers = {v: _manager(url, v) for v in variants}
    try:
        for v in variants:  # warm each manager's pool and caches
            _slice(managers[v], threads, 0.5, 0)
        rate: dict[str, list[float]] = {v: [] for v in variants}
        cpu: dict[str, list[float]] = {v: [] for v in variants}
        ratios: dict[str, list[float]] = {v: [] for v in variants}
        base = 1
        for r in range(rounds):
            order = variants[r % len(variants):] + variants[: r % len(variants)]
            this_round: dict[str, float] = {}
            for v in order:
                runs, per_run = _slice(managers[v], threads, seconds, base)
                base += 10_000_000
                rate[v].append(runs / seconds)
                cpu[v].append(per_run)
                this_round[v] = runs / seconds
            for v in variants:
                ratios[v].append(this_round[v] / this_round["off"])
        return {
            v: {
                "runs_per_s": statistics.median(rate[v]),
                "cpu_ms_per_run": 1000 * statistics.median(cpu[v]),
                "ratio_vs_off": statistics.median(ratios[v]),
                "ratio_range": [min(ratios[v]), max(ratios[v])],
                "cpu_ratio_vs_off": statistics.median(cpu[v]) / statistics.median(cpu["off"]),
            }
            for v in variants
        }
    finally:
        for mgr in managers.values():
            mgr.close()


class _Dropped:
    """A span exporter that drops everything (the SDK's cost without an exporter's)."""

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _configure_sdk() -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(_Dropped()))  # type: ignore[arg-type]
    trace.set_tracer_provider(provider)


def child(args: argparse.Namespace) -> None:
    url = scratch_db("bench_observability", fresh=True)
    migrate(url)
    variants = WITH_SDK if args.sdk else NO_SDK
    if args.sdk:
        _configure_sdk()
    for threads in args.threads:
        result = measure(url, variants, threads, args.rounds, args.slice)
        emit({"bench": "observability", "sdk": args.sdk, "threads": threads,
              "variants": result})


def _table(lines: list[dict[str, Any]]) -> None:
    print("\nfast path, typed 3-task runs; ratios against `off` in the same process")
    print(f"{'threads':>7}  {'variant':<12} {'runs/s':>8} {'ratio':>6} {'range':>13} "
          f"{'CPU ms/run':>10} {'CPU ratio':>9}")
    for line in lines:
        for variant, r in line["variants"].items():
            low, high = r["ratio_range"]
            print(f"{line['threads']:>7}  {variant:<12} {r['runs_per_s']:>8.0f} "
                  f"{r['ratio_vs_off']:>6.3f} {f'{low:.3f}-{high:.3f}':>13} "
                  f"{r['cpu_ms_per_run']:>10.3f} {r['cpu_ratio_vs_off']:>9.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--slice", type=float, default=2.0)
    parser.add_argument("--sdk", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    lines: list[dict[str, Any]] = []
    for sdk in (False, True):
        log(f"observability: {'with' if sdk else 'without'} the OpenTelemetry SDK")
        argv = [sys.executable, "-m", "bench.observability", "--child",
                "--threads", ",".join(map(str, args.threads)), "--rounds", str(args.rounds),
                "--slice", str(args.slice)] + (["--sdk"] if sdk else [])
        out = subprocess.run(argv, capture_output=True, text=True, check=False,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
        sys.stderr.write(out.stderr)
        if out.returncode != 0:
            raise SystemExit(f"bench/observability.py: the child failed ({out.returncode})")
        for text in out.stdout.splitlines():
            print(text)
            if text.startswith("RESULT "):
                lines.append(json.loads(text[len("RESULT "):]))
    _table(lines)


if __name__ == "__main__":
    main()
