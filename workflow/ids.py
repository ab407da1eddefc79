"""The ids pgworkflow makes for runs, claims and history events: time-ordered, so that a
start writes where the last start wrote. (A sweep's events, written after a crash, get
ids of the same layout made by the server in the sweep's statement: `sweep` in
store/queries.sql.)

A run's id keys its row (`workflow_runs_pkey`) and leads the keys of its task rows
(`workflow_tasks_pkey`). With random ids each start's entries land on a random leaf
page of those indexes, anywhere in the table's history, and the first change to a
page after each checkpoint writes the whole page (8 KB) to the WAL: on a table with
a million finished runs, a checkpoint every 20 s and one thread running typed 3-task
runs on the fast path, a run wrote 10.3 KB of WAL with random ids and 2.65 KB with
these (bench/README.md, "Time-ordered run ids"). Ids made one after another sort one
after another, and their entries share the rightmost leaf pages. The same holds for claim
ids (`workflow_runs_claims`: with random ones, its full-page images were most of what
was left, 465 bytes a run) and event ids (`workflow_events_pkey`).

The layout is a UUID of version 7 (RFC 9562): the Unix time in milliseconds in the
first 48 bits, then the version, 12 random bits, the variant and 62 random bits.
Written here rather than taken from a library: Python has `uuid.uuid7` only from
3.14, and this is the whole of it. Ids of one millisecond are in random order among
themselves (no counter: the order matters for where entries land, not for anything
a caller reads), and ids made on machines whose clocks differ sort by those clocks.
Runs are listed by their creation time on the database's clock, never by id.

Runs started within about a minute of each other (the same 65.5-second window)
share the first eight characters of their ids, so the short form people read (the
dashboard's links, the demo's lines) is the last eight (`short`): random in these
ids, and in the random ids of runs started before them.
"""

from __future__ import annotations

import os
import time
import uuid

__all__ = ["new_id", "short"]

_VERSION = 0x7 << 76
_VARIANT = 0b10 << 62
_RAND_A = 0xFFF << 64
_RAND_B = (1 << 62) - 1


def new_id() -> uuid.UUID:
    """A new id: this millisecond's, and 74 random bits (`os.urandom`)."""
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")  # 80 bits, 74 used
    return uuid.UUID(
        int=(ms & 0xFFFF_FFFF_FFFF) << 80 | _VERSION | (rand >> 2) & _RAND_A | _VARIANT
        | rand & _RAND_B
    )


def short(run_id: str) -> str:
    """The short form of a run id that people read: its last eight characters."""
    return run_id[-8:]
