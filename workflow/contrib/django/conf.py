"""The `WORKFLOW` setting, and what is derived from it.

    WORKFLOW = {
        "REGISTRY": "transfers.workflows:registry",  # required: PACKAGE.MODULE:FACTORY
        "CONFIG": workflow.Config(max_local_runs=16),  # optional: a Config, or "module:attr"
        "DATABASE_ALIAS": "default",                  # optional: a psycopg 3 PostgreSQL alias
        "ON_MANAGER": "workflow.metrics:instrument",  # optional: called with each manager
    }

`REGISTRY` names a callable returning a `workflow.Registry` or a `workflow.App`
(or such an object), exactly like `python -m workflow.worker --app`. The
manager's connections use the alias's connection settings, in a pool of their own;
`start_on_commit` inserts on the alias's own connection, inside the caller's
transaction. `ON_MANAGER` (a callable, or "module:attr") is handed each process's
manager once it is built: `workflow.metrics:instrument` exports its metrics into
prometheus_client's registry (and what it returns is closed with the manager).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import attrs
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from psycopg.conninfo import make_conninfo

from workflow.app import App, AppFailed, AppNotFound, load_app
from workflow.config import Config
from workflow.definition import Registry
from workflow.store.connections import one_line

if TYPE_CHECKING:
    from workflow.manager import Manager

SETTING = "WORKFLOW"
KEYS = ("REGISTRY", "CONFIG", "DATABASE_ALIAS", "ON_MANAGER")
DEFAULT_ALIAS = "default"

# Connection parameters Django passes to psycopg.connect() that are not libpq's.
_DJANGO_ONLY = ("cursor_factory", "context", "prepare_threshold")


def workflow_settings() -> dict[str, Any]:
    """`settings.WORKFLOW`, checked: a dict with `REGISTRY` and only known keys."""
    value = getattr(settings, SETTING, None)
    if value is None:
        raise ImproperlyConfigured(
            f'settings.{SETTING} is missing: set {SETTING} = {{"REGISTRY": '
            '"yourapp.workflows:registry"}'
        )
    if not isinstance(value, dict):
        raise ImproperlyConfigured(f"settings.{SETTING} must be a dict, not {type(value).__name__}")
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise ImproperlyConfigured(
            f"settings.{SETTING} has unknown keys {unknown}; the keys are {list(KEYS)}"
        )
    if "REGISTRY" not in value:
        raise ImproperlyConfigured(
            f'settings.{SETTING}["REGISTRY"] is missing: name the factory of your '
            'workflow.Registry, e.g. "yourapp.workflows:registry"'
        )
    return value


def database_alias() -> str:
    """`WORKFLOW["DATABASE_ALIAS"]`, default `"default"`; checked to be a known alias."""
    alias = workflow_settings().get("DATABASE_ALIAS") or DEFAULT_ALIAS
    if alias not in settings.DATABASES:
        raise ImproperlyConfigured(
            f'settings.{SETTING}["DATABASE_ALIAS"] is {alias!r}, which is not in '
            f"settings.DATABASES ({', '.join(settings.DATABASES)})"
        )
    return str(alias)


def on_manager() -> Callable[[Manager], object] | None:
    """`WORKFLOW["ON_MANAGER"]` resolved: a callable, or None when it is not set."""
    hook = workflow_settings().get("ON_MANAGER")
    what = f'settings.{SETTING}["ON_MANAGER"]'
    if isinstance(hook, str):
        hook = _resolve(hook, what)
    if hook is not None and not callable(hook):
        raise ImproperlyConfigured(f"{what} must be callable, not {type(hook).__name__}")
    return cast("Callable[[Manager], object] | None", hook)


def _resolve(spec: str, what: str) -> Any:
    """Import `spec` ("package.module:attr"); `ImproperlyConfigured` when it does not resolve."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ImproperlyConfigured(f"{what} {spec!r} is not PACKAGE.MODULE:NAME")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise ImproperlyConfigured(f"{what} {spec!r} does not resolve: {exc}") from exc
    return target


def app() -> App:
    """The App the `WORKFLOW` setting names: its registry, config, logger and runner.

    Also the worker's default `--app` (`workflow.contrib.django.conf:app`).
    Raises `ImproperlyConfigured` with the fix when the setting is off.
    """
    values = workflow_settings()
    spec = values["REGISTRY"]
    if isinstance(spec, (Registry, App)):
        resolved = spec if isinstance(spec, App) else App(spec)
    elif isinstance(spec, str):
        try:
            resolved = load_app(spec)
        except (AppNotFound, AppFailed) as exc:
            raise ImproperlyConfigured(f'settings.{SETTING}["REGISTRY"]: {one_line(exc)}') from None
    else:
        raise ImproperlyConfigured(
            f'settings.{SETTING}["REGISTRY"] must be "package.module:factory", '
            f"not {type(spec).__name__}"
        )
    config = values.get("CONFIG")
    if isinstance(config, str):
        config = _resolve(config, f'settings.{SETTING}["CONFIG"]')
    if config is None:
        return resolved
    if not isinstance(config, Config):
        raise ImproperlyConfigured(
            f'settings.{SETTING}["CONFIG"] must be a workflow.Config, not {type(config).__name__}'
        )
    if resolved.config is not None and resolved.config != config:
        raise ImproperlyConfigured(
            f'settings.{SETTING}["CONFIG"] is set and {spec!r} returned a workflow.App with '
            "its own config: keep the Config in one place"
        )
    return attrs.evolve(resolved, config=config)


def connection_settings(alias: str) -> tuple[str, dict[str, Any]]:
    """(conninfo, connection kwargs) for a pool of the manager's own on `alias`.

    Built from Django's own connection parameters for the alias, so OPTIONS
    (sslmode, service, ...) apply; `prepare_threshold` keeps Django's choice
    (None by default: safe behind PgBouncer).
    """
    wrapper = connections[alias]
    if wrapper.vendor != "postgresql":
        raise ImproperlyConfigured(
            f"database {alias!r} is {wrapper.vendor}: pgworkflow needs PostgreSQL "
            '(ENGINE "django.db.backends.postgresql") with psycopg 3'
        )
    from django.db.backends.postgresql.psycopg_any import is_psycopg3

    if not is_psycopg3:
        raise ImproperlyConfigured(
            f"database {alias!r} uses psycopg2: pgworkflow needs the psycopg 3 backend "
            "(pip install 'psycopg[binary]' and uninstall psycopg2)"
        )
    params = dict(wrapper.get_connection_params())
    kwargs: dict[str, Any] = {"autocommit": True}
    if "prepare_threshold" in params:
        kwargs["prepare_threshold"] = params["prepare_threshold"]
    for key in _DJANGO_ONLY:
        params.pop(key, None)
    conninfo = make_conninfo("", **{k: v for k, v in params.items() if v is not None})
    return conninfo, kwargs
