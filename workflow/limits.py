"""What the schema can carry: the bounds checked before any SQL is sent.

Each is refused up front, by whoever takes the value (the registry for names and
task counts, `start` for idempotency keys), with an error that says the bound.
"""

from __future__ import annotations

MAX_TASKS = 32766
"""The most tasks a workflow may have: a run's position is a `smallint` that reads
`task_count + 1` once every task is done, so 32767 tasks could not finish."""

MAX_NAME_BYTES = 255
"""The longest workflow or task name, in UTF-8 bytes: a name is a wake-up's
payload and part of the idempotency index's entries, both of which are bounded."""

MAX_CONCURRENCY = 1000
"""The largest per-key limit (`define(..., concurrency=N)`): a claim reads each of a
waiting key's N slots, so a limit this high is a queue, not a key."""

MAX_KEY_BYTES = 1024
"""The longest idempotency key, in UTF-8 bytes: it is indexed (with the workflow
name), and an index entry must fit in about a third of a page."""


def text_problem(text: str, max_bytes: int) -> str | None:
    """Why PostgreSQL could not store or index `text`, or None when it can.

    A NUL character (text columns refuse it), a lone surrogate (not valid
    UTF-8), or more than `max_bytes` bytes of UTF-8.
    """
    if "\x00" in text:
        return "contains a NUL character"
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        return "is not valid Unicode (a lone surrogate)"
    if size > max_bytes:
        return f"is {size} bytes long; the most is {max_bytes} (UTF-8)"
    return None
