"""What a worker runs: `App` (a registry with its Config), found by `load_app("pkg.mod:factory")`.

The worker CLI's `--app`, `manage.py workflow_worker` and the Django setting
`WORKFLOW["REGISTRY"]` all name an application the same way: `PACKAGE.MODULE:NAME`,
where NAME is a `Registry`, an `App`, or a callable returning one.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import reprlib
import sys
import traceback
from typing import Any

import attrs

from workflow.config import Config, RunnerConfig
from workflow.definition import Registry
from workflow.errors import WorkflowError
from workflow.store.connections import one_line


@attrs.frozen
class App:
    """What a worker's `--app` factory may return when workers need more than a registry.

    `registry` is required. `config` (cipher, propagator, timeouts) and `logger`
    are optional, so workers run with the same settings as the web processes.
    `runner` is the worker's own `RunnerConfig` (concurrency, polling, sweeping,
    pruning and retention), kept in code beside the registry; the worker command's
    flags override the fields they name.
    """

    registry: Registry
    config: Config | None = None
    logger: logging.Logger | None = None
    runner: RunnerConfig | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(attrs.validators.instance_of(RunnerConfig)),
    )


class AppNotFound(WorkflowError, ValueError):
    """The spec names nothing usable: no such module or attribute, or not (and not
    returning) a Registry or an App. For a command line, a usage error."""


class AppFailed(WorkflowError):
    """The application's own code failed while loading: its import, or its factory, raised."""


_SPEC = re.compile(
    r"^(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<attr>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)$"
)


def parse_spec(text: str) -> tuple[str, str]:
    """(module, attribute) of `PACKAGE.MODULE:NAME`; `AppNotFound` for anything else."""
    match = _SPEC.match(text.strip())
    if match is None:
        raise AppNotFound(
            f"{text!r} is not PACKAGE.MODULE:FACTORY (e.g. myapp.workflows:registry)"
        )
    return match["module"], match["attr"]


def load_app(spec: str) -> App:
    """Import the application `spec` names and return it as an `App`.

    The current directory is put on `sys.path` first (as `python -m` would).
    NAME may be a `Registry`, an `App`, or a callable returning one. Raises
    `AppNotFound` when the spec names nothing usable (including an App whose
    registry has no workflows) and `AppFailed` when the application's own code
    raises; each message is one line saying which and where.
    """
    module_name, attr = parse_spec(spec)
    spec = f"{module_name}:{attr}"
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise AppNotFound(
                f"workflow: --app {spec}: no module named {missing!r} (run from the "
                "project's root directory or put it on PYTHONPATH)"
            ) from None
        raise AppFailed(
            f"workflow: --app {spec}: importing {module_name!r} failed: "
            f"{type(exc).__name__}: {one_line(exc)}{_where(exc)}"
        ) from None
    except Exception as exc:
        raise AppFailed(
            f"workflow: --app {spec}: importing {module_name!r} failed: "
            f"{type(exc).__name__}: {one_line(exc)}{_where(exc)}"
        ) from None
    target: Any = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise AppNotFound(
                f"workflow: --app {spec}: module {module_name!r} has no attribute {attr!r}"
            ) from None
    if not isinstance(target, (Registry, App)):
        if not callable(target):
            raise AppNotFound(
                f"workflow: --app {spec}: {attr} is {reprlib.repr(target)} (type "
                f"{type(target).__name__}), not a workflow.Registry, a workflow.App, or a "
                "callable returning one"
            )
        try:
            target = target()
        except Exception as exc:
            raise AppFailed(
                f"workflow: --app {spec}: {attr}() raised {type(exc).__name__}: "
                f"{one_line(exc)}{_where(exc)}"
            ) from None
        if not isinstance(target, (Registry, App)):
            raise AppNotFound(
                f"workflow: --app {spec}: {attr}() returned {reprlib.repr(target)} "
                f"(type {type(target).__name__}), not a workflow.Registry or a workflow.App"
            )
    app = target if isinstance(target, App) else App(target)
    if not isinstance(app.registry, Registry):
        raise AppNotFound(
            f"workflow: --app {spec}: the App's registry is a {type(app.registry).__name__}, "
            "not a workflow.Registry"
        )
    if app.config is not None and not isinstance(app.config, Config):
        raise AppNotFound(
            f"workflow: --app {spec}: the App's config is a {type(app.config).__name__}, "
            "not a workflow.Config"
        )
    if app.logger is not None and not isinstance(app.logger, logging.Logger):
        raise AppNotFound(
            f"workflow: --app {spec}: the App's logger is a {type(app.logger).__name__}, "
            "not a logging.Logger"
        )
    if not app.registry.names():
        raise AppNotFound(f"workflow: --app {spec}: the registry has no workflows registered")
    return app


def _where(exc: BaseException) -> str:
    """` (at FILE:LINE)` of the innermost frame `exc` was raised from, or ''."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    return f" (at {frames[-1].filename}:{frames[-1].lineno})"
