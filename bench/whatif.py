"""What-if: measure a proposed engine change without touching the engine.

Applies a monkeypatch *in this process only*, then runs the paired null/engine
comparison (`bench.engine paired`) with it, or (`--cpu`) sequential runs from one
thread, printing client CPU and wall time per run. Nothing under workflow/ is
modified.

    python -m bench.whatif --patch steal --tasks 3 --threads 8 --slices 5
    python -m bench.whatif --patch none --cpu

Patches (the earlier store, lease and executor patches are now in the engine):
  steal     `wait()` on a run launched here that no pool thread has started yet
            executes it inline on the waiting thread (the pool thread that wakes
            for it finds it taken and goes back to sleep). Not adopted: handlers
            would run on the caller's thread (its thread-locals, its signals,
            past a `wait(timeout)`), and the pool thread is woken all the same.
"""

from __future__ import annotations

import argparse
import sys
import threading
from typing import Any

import workflow.manager as manager_mod


def patch_steal() -> None:
    """`wait()` on a locally launched run that no pool thread has started yet runs it
    inline on the waiting thread (whoever takes the job's lock first executes it)."""
    Manager = manager_mod.Manager
    orig_wait = Manager._wait

    def _launch(self: Any, job: Any) -> None:
        self._executing(job.run.id)
        pending = self.__dict__.setdefault("_bench_pending", {})
        token = (job, threading.Lock())
        pending[job.run.id] = token
        try:
            self._threads.submit(lambda t: _take(self, t), token)
        except RuntimeError:
            pending.pop(job.run.id, None)
            self._release_slot()
            self._store.release_claim(job.run.id, job.run.claim_id)
            self._finished(job.run.id, None)

    def _take(self: Any, token: Any) -> None:
        job, lock = token
        if lock.acquire(blocking=False):
            self._bench_pending.pop(job.run.id, None)
            self._execute_in_slot(job)

    def _wait(self: Any, run_id: str, timeout: Any, key: Any = None) -> Any:
        pending = self.__dict__.get("_bench_pending")
        if pending:
            if key is None:
                try:
                    key = manager_mod._parse_id(run_id)
                except Exception:
                    key = None
            token = pending.pop(key, None) if key is not None else None
            if token is not None and token[1].acquire(blocking=False):
                self._execute_in_slot(token[0])
        return orig_wait(self, run_id, timeout, key)

    Manager._launch = _launch  # type: ignore[method-assign]
    Manager._wait = _wait  # type: ignore[method-assign]


PATCHES = {
    "steal": patch_steal,
}


def sequential_cpu(tasks: int, runs: int, reps: int) -> None:
    """`reps` batches of `runs` sequential start()+wait() from one thread: the best
    batch's client CPU and wall time per run (less noisy than throughput)."""
    import time

    import workflow
    from bench import apps
    from bench.engine import prepare

    mgr = workflow.Manager(prepare("bench_engine"), apps.registry())
    wf = apps.WORKFLOWS[tasks]
    for i in range(200):
        wf.start(mgr, apps.BenchInput(i)).wait()
    best_cpu = best_wall = float("inf")
    for _ in range(reps):
        c0, t0 = time.process_time(), time.perf_counter()
        for i in range(runs):
            wf.start(mgr, apps.BenchInput(i)).wait()
        best_cpu = min(best_cpu, (time.process_time() - c0) / runs)
        best_wall = min(best_wall, (time.perf_counter() - t0) / runs)
    mgr.close()
    print(
        f"sequential {tasks}-task: client CPU {best_cpu * 1000:.3f} ms/run, "
        f"wall {best_wall * 1000:.3f} ms/run (best of {reps} x {runs})"
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description="engine.py paired (or --cpu: sequential CPU per run) with patches"
    )
    p.add_argument(
        "--patch",
        default="steal",
        help="comma-separated: " + ", ".join(PATCHES) + " (or 'none')",
    )
    p.add_argument(
        "--cpu",
        action="store_true",
        help="instead of paired: sequential runs from one thread, CPU per run",
    )
    args, rest = p.parse_known_args()
    names = [] if args.patch == "none" else [n for n in args.patch.split(",") if n]
    for name in names:
        PATCHES[name]()
    if args.cpu:
        sequential_cpu(3, 600, 3)
        return
    from bench import engine

    sys.argv = ["bench.engine", "paired", *rest]
    engine.main()


if __name__ == "__main__":
    main()
