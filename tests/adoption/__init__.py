"""Helpers for the adoption tests: real servers (Gunicorn, Django) as subprocesses."""

from __future__ import annotations

import importlib
import os

import pytest


def require(*modules: str) -> None:
    """Skip the calling test module when a module is missing; fail instead under `$CI`."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            message = f"{name} is not installed: pip install -e '.[test]'"
            if os.environ.get("CI"):
                pytest.fail(message, pytrace=False)
            pytest.skip(message, allow_module_level=True)
