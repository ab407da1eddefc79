"""What-if: measure proposed engine changes without touching the engine.

Applies monkeypatches *in this process only* that mimic changes proposed in
bench/README.md's notes, then runs the paired null/engine comparison
(`bench.engine paired`) with them. Nothing under workflow/ is modified.

    python -m bench.whatif --patch store,lease,steal --tasks 3 --threads 8 --slices 5
    python -m bench.whatif --patch steal --cpu

Patches:
  store     Store._run: getconn()/putconn() in try/finally instead of
            `pool.connection()` (whose `with conn:` calls commit()) plus the
            `_conn()` autocommit dance; retry deadline computed only on failure.
            Falls back to the original path when the connection is not in
            autocommit mode.
  lease     Lease.begin_attempt reuses its `cancelled` Event while it is not set,
            instead of allocating a new Event (Condition + Lock) per attempt.
  executor  the manager's ThreadPoolExecutor replaced by N threads pulling from a
            queue.SimpleQueue (no Future, no _WorkItem, no idle semaphore).
  steal     `wait()` on a run launched here that no pool thread has started yet
            executes it inline on the waiting thread (the pool thread that wakes
            for it finds it taken and goes back to sleep).
"""

from __future__ import annotations

import argparse
import contextlib
import queue
import sys
import threading
from typing import Any

import workflow.heartbeat as heartbeat_mod
import workflow.manager as manager_mod
import workflow.store as store_mod


def patch_store() -> None:
    Store = store_mod.Store
    orig_run = Store._run
    Q = store_mod._Q
    execute = getattr(store_mod, "_execute", None)

    def _run(self: Any, name: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        pool = self._pool
        try:
            conn = pool.getconn()
        except Exception:
            return orig_run(self, name, params)
        if not conn.autocommit:
            pool.putconn(conn)
            return orig_run(self, name, params)
        try:
            if execute is not None:
                return execute(conn, name, params)
            return conn.execute(Q[name], params).fetchall()
        except Exception:
            pool.putconn(conn)
            conn = None
            return orig_run(self, name, params)  # the original retries what it should
        finally:
            if conn is not None:
                pool.putconn(conn)

    Store._run = _run  # type: ignore[method-assign]


def patch_lease() -> None:
    Lease = heartbeat_mod.Lease

    def begin_attempt(self: Any, deadline: float) -> threading.Event:
        with self._lock:
            if self.reason in (heartbeat_mod.LOST, heartbeat_mod.SHUTDOWN):
                event = self.cancelled
            else:
                self.reason = None
                if self.cancelled.is_set():
                    self.cancelled = threading.Event()
                event = self.cancelled
            self.deadline = deadline
        return event

    Lease.begin_attempt = begin_attempt  # type: ignore[method-assign]


class _SimpleExecutor:
    """submit(fn, *args) onto N daemon threads fed by a SimpleQueue."""

    def __init__(self, max_workers: int, thread_name_prefix: str = "") -> None:
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._max = max_workers
        self._idle = 0
        self._lock = threading.Lock()
        self._shutdown = False
        self._prefix = thread_name_prefix

    def _loop(self) -> None:
        get = self._q.get
        while True:
            item = get()
            if item is None:
                return
            with self._lock:
                self._idle -= 1
            fn, args = item
            with contextlib.suppress(BaseException):
                fn(*args)
            with self._lock:
                self._idle += 1

    def submit(self, fn: Any, *args: Any) -> None:
        if self._shutdown:
            raise RuntimeError("cannot schedule new futures after shutdown")
        with self._lock:
            grow = self._idle == 0 and len(self._threads) < self._max
            if grow:
                self._idle += 1
        if grow:
            t = threading.Thread(
                target=self._loop, daemon=True, name=f"{self._prefix}_{len(self._threads)}"
            )
            self._threads.append(t)
            t.start()
        self._q.put((fn, args))

    def shutdown(self, wait: bool = True, **kw: Any) -> None:
        self._shutdown = True
        for _ in self._threads:
            self._q.put(None)


def patch_executor() -> None:
    manager_mod.ThreadPoolExecutor = _SimpleExecutor  # type: ignore[attr-defined,misc]


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
    "store": patch_store,
    "lease": patch_lease,
    "executor": patch_executor,
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
        default="store,lease,steal",
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
