"""The fast path: executing a run in the process that started it, right away.

At most `max_local_runs` executions at once (a slot each), fewer while the process
cannot start that many threads (`RunThreads.capacity`); when they are all taken, or
the manager is draining, a run is left for a poller. A run the fast
path takes was inserted already claimed by this process (or claimed by id: a
`wait()` kick, or `Manager.kick` after a commit), so it costs no claim of its own.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

from workflow import ids
from workflow.executor import NO_INPUT, Executor
from workflow.runthreads import RunThreads
from workflow.store import ClaimedRun
from workflow.waiting import Endings


class ForkState:
    """Whether this object's process is a fork of the one that built it (set in the child)."""

    __slots__ = ("__weakref__", "forked")

    def __init__(self) -> None:
        self.forked = False


class FastPath:
    """Slots, threads and launches of the executions this process starts itself."""

    def __init__(
        self, executor: Executor, endings: Endings, size: int, fork: ForkState
    ) -> None:
        self._executor = executor
        self._endings = endings
        self._size = size
        self._fork = fork
        self._threads = RunThreads(size, "workflow-run", executor.log)
        self._in_flight = 0
        self._lock = threading.Lock()

    def try_slot(self) -> bool:
        """Take a slot for one execution; False when full, draining or forked."""
        if self._executor.draining.is_set() or self._fork.forked:
            return False
        room = min(self._size, self._threads.capacity)  # fewer: out of threads
        with self._lock:
            if self._in_flight >= room:
                return False
            self._in_flight += 1
        return True

    def release_slot(self) -> None:
        """Give back a slot taken by `try_slot` for a run that will not be launched."""
        with self._lock:
            self._in_flight -= 1

    def launch(self, run: ClaimedRun, input: Any = NO_INPUT) -> bool:
        """Execute `run` on the fast path's threads; the caller holds a slot. False when
        no thread took it (shut down since the slot was taken, or no thread could
        start): its claim is then released, and the slot given back.

        An interrupt (Ctrl-C, a SystemExit) that lands here before a thread took the run
        does the same before it goes on up; one that lands after leaves the run to its
        thread. (An interrupt comes between two bytecodes: one that lands right inside
        the executor's count, before `admitted` is set, still leaves it counted.)"""
        job = _Job(run, input)
        try:
            self._endings.executing(run.id)
            self._executor.admit()
            job.admitted = True
            self._threads.submit(self._execute, job)
        except RuntimeError:
            self._take_back(job, quietly=False)
            return False
        except BaseException:
            self._take_back(job, quietly=True)
            raise
        return True

    def abandon(self, run_id: uuid.UUID, claim_id: uuid.UUID, *, quietly: bool = True) -> None:
        """Give back the slot and the claim of a run inserted or claimed for this fast path
        and never launched, so that a poller or a `wait()` claims it at once. A claim that
        never landed is released by nothing. `quietly` (after an interrupt): one try, and
        a failure is logged, not raised (a sweeper releases the claim once it is stale)."""
        self.release_slot()
        try:
            self._executor.store.release_claim(run_id, claim_id, once=quietly)
        except Exception:
            if not quietly:
                raise
            self._executor.log.exception(
                "could not release the claim of run %s after an interrupt; a sweeper "
                "releases it once it is stale", run_id,
            )

    def _take_back(self, job: _Job, *, quietly: bool) -> None:
        """`launch` failed: undo what it did, unless a thread took `job` after all."""
        with self._lock:
            if job.taken:
                return
            job.dropped = True  # a thread that finds it queued passes it by
        if job.admitted:
            self._executor.dismiss()
        try:
            self.abandon(job.run.id, job.run.claim_id, quietly=quietly)
        finally:  # a waiter must not wait on an execution that never began
            self._endings.abandoned(job.run.id)

    def kick(self, run_id: uuid.UUID) -> bool:
        """Claim `run_id` by id and execute it here, if it is claimable now and there is room.

        True when it was claimed and launched (False when no thread could take it: the
        claim is released again). Blocks on one statement.
        """
        if not self.try_slot():
            return False
        executor = self._executor
        claim_id = ids.new_id()
        try:
            claimed = executor.store.claim_run(run_id, claim_id)
        except Exception:
            self.release_slot()
            raise
        except BaseException:
            # An interrupt (Ctrl-C in the wait() that kicked), maybe raised as the
            # claim's reply came: the claim may be ours, for nobody to execute.
            self.abandon(run_id, claim_id)
            raise
        if claimed is None or executor.registry.definition(claimed.workflow) is None:
            if claimed is not None:
                executor.store.release_claim(claimed.id, claimed.claim_id)
            self.release_slot()
            return False
        return self.launch(claimed)

    def shutdown(self) -> None:
        """Refuse new launches; the threads stop after what is queued."""
        self._threads.shutdown(wait=False)

    def _execute(self, job: _Job) -> None:
        with self._lock:
            if job.dropped:
                return
            job.taken = True
        try:
            self._executor.execute(job.run, input=job.input)
        finally:
            self.release_slot()


class _Job:
    """A run handed to the fast path's threads; `taken` by one, or `dropped` by a launch
    that an interrupt ended first (under `FastPath._lock`)."""

    __slots__ = ("admitted", "dropped", "input", "run", "taken")

    def __init__(self, run: ClaimedRun, input: Any) -> None:
        self.run = run
        self.input = input
        self.admitted = False  # counted by the executor: `launch` got that far
        self.taken = False
        self.dropped = False
