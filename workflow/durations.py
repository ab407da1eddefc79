"""Durations: seconds as int or float, or a `datetime.timedelta`, everywhere."""

from __future__ import annotations

import datetime
import math
from typing import TypeAlias

Duration: TypeAlias = "int | float | datetime.timedelta"


def seconds(value: object, what: str) -> float:
    """`value` in seconds as a float; `TypeError` for anything that is not a duration."""
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        result = float(value)
        if math.isnan(result):
            raise ValueError(f"{what} is NaN; give seconds or a timedelta")
        return result
    raise TypeError(
        f"{what} must be seconds (int or float) or a datetime.timedelta, "
        f"not {type(value).__name__}"
    )
