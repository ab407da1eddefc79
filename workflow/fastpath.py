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
        start): its claim is then released, and the slot given back."""
        executor = self._executor
        self._endings.executing(run.id)
        executor.admit()
        try:
            self._threads.submit(self._execute, (run, input))
        except RuntimeError:
            executor.dismiss()
            self.release_slot()
            try:
                executor.store.release_claim(run.id, run.claim_id)
            finally:  # a waiter must not wait on an execution that never began
                self._endings.abandoned(run.id)
            return False
        return True

    def kick(self, run_id: uuid.UUID) -> bool:
        """Claim `run_id` by id and execute it here, if it is claimable now and there is room.

        True when it was claimed and launched (False when no thread could take it: the
        claim is released again). Blocks on one statement.
        """
        if not self.try_slot():
            return False
        executor = self._executor
        try:
            claimed = executor.store.claim_run(run_id, uuid.uuid4())
        except BaseException:
            self.release_slot()
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

    def _execute(self, job: tuple[ClaimedRun, Any]) -> None:
        run, input = job
        try:
            self._executor.execute(run, input=input)
        finally:
            self.release_slot()
