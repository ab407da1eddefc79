"""Durations: seconds as int or float, or a `datetime.timedelta`, everywhere."""

from __future__ import annotations

import datetime
import math
import threading
import time
from collections.abc import Callable
from typing import TypeAlias

Duration: TypeAlias = "int | float | datetime.timedelta"

MAX_SECONDS = float(int(threading.TIMEOUT_MAX))
"""The longest duration accepted anywhere (about 292 years on Linux): the most a
thread can wait for, and far inside what PostgreSQL's intervals and timestamps
carry, so no delay or timeout can overflow either."""


def seconds(value: object, what: str) -> float:
    """`value` in seconds as a float.

    Raises `TypeError` for anything that is not a duration, and `ValueError` for
    NaN, an infinite value, or one beyond `MAX_SECONDS` (for "no limit", the
    caller's API takes None).
    """
    if isinstance(value, datetime.timedelta):
        result = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            result = float(value)
        except OverflowError:
            result = math.inf if value > 0 else -math.inf
    else:
        raise TypeError(
            f"{what} must be seconds (int or float) or a datetime.timedelta, "
            f"not {type(value).__name__}"
        )
    if math.isnan(result):
        raise ValueError(f"{what} is NaN; give seconds or a timedelta")
    if not -MAX_SECONDS <= result <= MAX_SECONDS:
        raise ValueError(
            f"{what} is {value!r}, beyond the {MAX_SECONDS:.0f}s (about 292 years) a duration "
            "may be; for no limit, pass None where the option allows it"
        )
    return result


def time_left(limit: float | None) -> Callable[[], float | None]:
    """A function giving the seconds left of `limit` from now (never below 0), or None
    for no limit: one deadline shared by the several waits of one call."""
    if limit is None:
        return lambda: None
    deadline = time.monotonic() + limit
    return lambda: max(0.0, deadline - time.monotonic())


SIGNAL_SLICE = 1.0
"""The longest a wait that a person may interrupt blocks at a time (`wait_in_slices`)."""


def wait_in_slices(wait: Callable[[float], bool], limit: float | None) -> bool:
    """`wait(limit)` (a `Event.wait` or `Condition.wait_for` shape: True once what it waits
    for holds) in slices of at most `SIGNAL_SLICE` seconds; None waits without limit.

    A signal interrupts a blocked wait only when the kernel delivers it to the waiting
    thread; delivered to another thread of the process (its choice, for a Ctrl-C), the
    main thread runs its Python handler only once it next runs Python. Slices bound that
    to a second."""
    left = time_left(limit)
    while True:
        remaining = left()
        if remaining is not None and remaining <= 0:
            return wait(0.0)
        if wait(SIGNAL_SLICE if remaining is None else min(SIGNAL_SLICE, remaining)):
            return True
