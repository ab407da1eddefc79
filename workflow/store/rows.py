"""The rows the store reads back: frozen values, one class per shape a statement returns."""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Sequence
from typing import Any

import attrs


@attrs.frozen
class TaskRow:
    """One task of a claimed run's snapshot."""

    seq: int
    name: str
    skipped: bool
    attempts: int
    has_output: bool
    output: Any
    failed_at: datetime.datetime | None


@attrs.frozen
class ClaimedRun:
    """A run this process now holds a claim on, with its whole task snapshot.

    `db_now` is the database clock at the claim (None for a run inserted already
    claimed by the fast path, which has no failure to wait out).
    """

    id: uuid.UUID
    workflow: str
    claim_id: uuid.UUID
    input: Any
    input_sealed: bytes | None
    context: str | None
    context_sealed: bytes | None
    current_seq: int
    db_now: datetime.datetime | None
    tasks: tuple[TaskRow, ...]


@attrs.frozen
class StatusRow:
    """A run's status as `run_status` reads it (task fields: the task it is on)."""

    workflow: str
    status: str
    created_at: datetime.datetime
    finished_at: datetime.datetime | None
    task: str | None
    error: str | None
    error_code: str | None
    attempts: int | None
    claimable: bool


def claimed_runs(rows: Sequence[tuple[Any, ...]]) -> list[ClaimedRun]:
    """The claim statements' rows (one per task, grouped by run) as `ClaimedRun`s."""
    runs: list[ClaimedRun] = []
    tasks: list[TaskRow] = []
    for i, row in enumerate(rows):
        tasks.append(TaskRow(*row[9:]))
        if i + 1 == len(rows) or rows[i + 1][0] != row[0]:
            runs.append(
                ClaimedRun(
                    id=row[0],
                    workflow=row[1],
                    claim_id=row[2],
                    input=row[3],
                    input_sealed=row[4],
                    context=row[5],
                    context_sealed=row[6],
                    current_seq=row[7],
                    db_now=row[8],
                    tasks=tuple(tasks),
                )
            )
            tasks = []
    return runs
