"""A module whose own import fails: a missing dependency, not a missing module."""

from __future__ import annotations

import a_dependency_that_is_not_installed  # type: ignore[import-not-found]  # noqa: F401


def registry() -> None:
    raise AssertionError("never reached")
