"""Where a process's claims of a backlog left off, per workflow: the claims' floors.

Every run claimed leaves an entry in `workflow_runs_ready_per_workflow` that no longer
points at a claimable row, at the front of its workflow's range (the front is where
claims take from), until a vacuum removes it. A claim that reads from the front steps
over every one of them: 2.0 ms a claim after 38,500 runs drained, where a backlog's
claims otherwise cost about 0.1 ms (bench/README.md, "Where a drain's time goes, and
claims that start where the last ones left off").

So while a process drains a backlog, its claims of a workflow start at a floor: the
earliest due time among the runs its last full claim took, less `MARGIN`; only a claim
from the front of at least `FULL` runs that took all it asked for makes one. (The 0.1 ms
was measured with the scan bounded at the last claimed run's due time; the floor lies
`MARGIN` earlier, over the entries of the runs that fell due in those 100 ms: about a
thousand more for a backlog started at 10,000 runs a second, some 0.05 ms at the 52 ns
an entry measured. An estimate.) A run still claimable before the floor is one committed
late (its transaction began before the floor and committed after), one whose claim was
let go of without a new due time (a drain's release, a combined write's fallback), or
one a claim skipped because another held its lock and then did not take it (a claim of
several workflows locks up to `limit` of each; a claim that rolled back). Each waits at
most about `SPAN` seconds more (and a claim statement's time): a floor serves that long
from the claim that read from the front and set it, then a claim reads from the front
again, and a claim made from a floor that no longer stands (expired, dropped, or set
anew meanwhile by another thread's claim) neither moves nor makes one. A claim that
comes back short (fewer runs than asked for) drops the floors of its workflows: what is
left may lie before them. Without a backlog claims come back short or ask for fewer than
`FULL` runs, and read from the front, as without floors; and where a backlog's runs were
all due at one moment (started in one transaction, whose `now()` they share) the floor
bounds nothing. No claim takes a run that is not claimable: a floor only narrows where a
claim looks.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Sequence

from workflow.store.rows import ClaimedRun

SPAN = 1.0
"""Seconds a floor serves from the claim that read from the front; then one reads from it again."""

MARGIN = datetime.timedelta(milliseconds=100)
"""How far before the earliest due time of a full claim's runs the next claim starts: runs
committed that much late are still taken in order."""

FULL = 4
"""How many runs a claim from the front must have asked for, and taken, to make a floor: a
backlog's sign. A claim of one run that found one says nothing of a backlog (a worker's
completer claims as many as the finishes it carries, often one under a light load)."""


class Floors:
    """The claims' floors of one process's workflows (thread-safe).

    Each floor belongs to the claim that read from the front and set it (its
    generation): a claim made from a floor moves it only while that floor still
    stands, and never makes one, so a claim that was on its way while a floor expired,
    was dropped or was set anew cannot give it a new second."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._floors: dict[str, tuple[datetime.datetime, float, int]] = {}  # floor, since, gen
        self._made = 0  # generations made

    def of(self, workflows: Sequence[str]) -> list[tuple[datetime.datetime, int] | None]:
        """Where the next claim of each of `workflows` starts: a floor and its generation,
        or None (from the front). Pass the list to `claimed` with the claim's runs."""
        if not self._floors:
            return [None] * len(workflows)
        now = self._clock()
        floors: list[tuple[datetime.datetime, int] | None] = []
        with self._lock:
            for workflow in workflows:
                held = self._floors.get(workflow)
                if held is not None and now - held[1] >= SPAN:
                    del self._floors[workflow]
                    held = None
                floors.append(None if held is None else (held[0], held[2]))
        return floors

    def claimed(
        self,
        workflows: Sequence[str],
        used: Sequence[tuple[datetime.datetime, int] | None],
        runs: Sequence[ClaimedRun],
        limit: int,
    ) -> None:
        """After a claim of up to `limit` runs of `workflows`, made from `used` (`of`),
        that took `runs`."""
        if not self._floors and limit < FULL:  # nothing to drop or move, none to make
            return
        if len(runs) < limit:  # what is left may lie before the floors: read from the front
            if self._floors:
                with self._lock:
                    for workflow in workflows:
                        self._floors.pop(workflow, None)
            return
        first: dict[str, datetime.datetime] = {}
        for run in runs:
            due = run.due_at
            if due is not None and (run.workflow not in first or due < first[run.workflow]):
                first[run.workflow] = due
        now = self._clock()
        with self._lock:
            for workflow, floor in zip(workflows, used, strict=True):
                due = first.get(workflow)
                if due is None:
                    continue
                if floor is None:  # read from the front: a floor of its own, for SPAN
                    if limit < FULL:
                        continue
                    self._made += 1
                    self._floors[workflow] = (due - MARGIN, now, self._made)
                    continue
                held = self._floors.get(workflow)
                if held is not None and held[2] == floor[1]:
                    self._floors[workflow] = (due - MARGIN, held[1], held[2])


def floor_times(
    floors: Sequence[tuple[datetime.datetime, int] | None],
) -> list[datetime.datetime | None]:
    """The floors' times, as a claim statement takes them (None: from the front)."""
    return [None if floor is None else floor[0] for floor in floors]
