"""Group commit: the task steps that several runs of one process record at the same
moment share one statement and one commit.

A step that arrives while no write is in flight is written at once, alone, by its
own thread (so a lone run, or one thread, waits for nothing more than its own
round trip). Steps that arrive while a write is in flight queue; when that write
ends, the first of them is woken to write the whole queue in one statement (the
others are woken with their answers when it ends). Each step's write is still
fenced by its own claim, and each caller learns whether *its* claim matched.

A combined statement that fails for any reason (a lost connection, a row the
server refuses, a deadlock) is followed by the same steps written one by one, each
first looking for what an earlier try did (`released`), so one bad row cannot fail
another run and a write whose reply was lost is not taken for a lost claim.
Nothing returns to a caller before its step has committed: a run never moves to its
next task on an output that is not durable.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from workflow.logs import EngineLog

__all__ = ["GroupCommit", "combined_params"]

_Params = dict[str, Any]


def combined_params(steps: Sequence[_Params]) -> _Params:
    """The parameters of `complete_tasks` for these `complete_task` parameter sets.

    The steps go in run id order, so that the rows are locked in that order.
    """
    ordered = sorted(steps, key=lambda p: p["id"])
    return {
        "ids": [p["id"] for p in ordered],
        "claims": [p["claim_id"] for p in ordered],
        "seqs": [p["seq"] for p in ordered],
        "outputs": [p["output"] for p in ordered],
        "next_seqs": [p["next_seq"] for p in ordered],
        "finishes": [p["finishes"] for p in ordered],
        "wake_keys": [p["wake_key"] for p in ordered],
        "channel": ordered[0]["channel"],
    }


class _Step:
    """One caller's step: its parameters, its answer, and the latch it waits on."""

    __slots__ = ("batch", "error", "latch", "matched", "params")

    def __init__(self, params: _Params) -> None:
        self.params = params
        self.matched = False
        self.error: BaseException | None = None
        # Set when this step is woken to write a batch (itself first) rather than
        # with its answer.
        self.batch: list[_Step] | None = None
        self.latch = threading.Lock()
        self.latch.acquire()


class GroupCommit:
    """Writes steps alone when nothing else is in flight, and together when it is.

    `single(params, may_have_landed)` writes one step (retrying lost connections
    itself) and says whether its claim matched; `combined(params)` writes several
    in one statement and returns the run ids whose claims matched.
    """

    def __init__(
        self,
        single: Callable[[_Params, bool], bool],
        combined: Callable[[_Params], set[uuid.UUID]],
        log: EngineLog,
    ) -> None:
        self._single = single
        self._combined = combined
        self._log = log
        self._lock = threading.Lock()
        self._busy = False
        self._queue: list[_Step] = []
        self.flushes = 0
        """Statements written (alone or combined), for tests and benchmarks."""
        self.combined_steps = 0
        """Steps that went in a combined statement."""

    @property
    def busy(self) -> bool:
        """Whether a write is in flight (a step arriving now waits and joins the next)."""
        return self._busy

    @property
    def queued(self) -> int:
        """How many steps wait for the write in flight to end."""
        return len(self._queue)

    def write(self, params: _Params) -> bool:
        """Record one step; True when its claim matched. Blocks until it has committed.

        Raises what writing it alone raised (a closed pool, an error of the
        database's that is not a lost connection).
        """
        step = _Step(params)
        with self._lock:
            lead = not self._busy
            if lead:
                self._busy = True
            else:
                self._queue.append(step)
        if lead:
            self._flush([step])
        else:
            step.latch.acquire()
            if step.batch is not None:
                self._flush(step.batch)
        if step.error is not None:
            raise step.error
        return step.matched

    def _flush(self, batch: list[_Step]) -> None:
        """Write `batch` (its first step is the caller's), hand the queue on, wake the rest."""
        try:
            if len(batch) == 1:
                self._alone(batch[0], False)
            else:
                self._together(batch)
        finally:
            with self._lock:
                self.flushes += 1
                following, self._queue = self._queue, []
                if not following:
                    self._busy = False
            if following:
                following[0].batch = following
                following[0].latch.release()
            for step in batch[1:]:
                step.latch.release()

    def _alone(self, step: _Step, may_have_landed: bool) -> None:
        try:
            step.matched = self._single(step.params, may_have_landed)
        except BaseException as e:
            step.error = e

    def _together(self, batch: list[_Step]) -> None:
        try:
            matched = self._combined(combined_params([step.params for step in batch]))
        except BaseException as e:
            if not isinstance(e, Exception):  # an interrupt: no step may pass for written
                for step in batch:
                    step.error = e
                raise
            self._log.warning(
                "a combined write of %d task steps failed (%s); writing them one by one",
                len(batch), e,
            )
            for step in batch:
                self._alone(step, True)
            return
        self.combined_steps += len(batch)
        for step in batch:
            step.matched = step.params["id"] in matched
