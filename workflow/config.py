"""Configuration values: `Config` (a manager), `RunnerConfig` (a runnable) and `Retention`.

All are frozen attrs classes validated at construction; a field left at None
takes its default. Durations are seconds (int or float) or `datetime.timedelta`.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any

import attrs
from attrs import AttrsInstance

from workflow.durations import Duration, seconds
from workflow.errors import ConfigError

if TYPE_CHECKING:
    from workflow.sealing import Cipher, Propagation


_DEFAULT = "workflow.default"
_KIND = "workflow.kind"


def _option(default: object, kind: str) -> dict[str, object]:
    """The metadata of a field that may be left at None, taking `default`; `kind` says
    how it is checked: "duration" (positive), "delay" (zero or more), "count" (a
    positive int), "flag" (a bool)."""
    return {_DEFAULT: default, _KIND: kind}


def _check(options: AttrsInstance) -> None:
    """`ConfigError` for the first option of `options` that is set but unusable."""
    for field in attrs.fields(type(options)):
        kind = field.metadata.get(_KIND)
        value = getattr(options, field.name)
        if kind is None or value is None:
            continue
        name = field.name
        if kind in ("duration", "delay"):
            try:
                result = seconds(value, name)
            except (TypeError, ValueError) as e:
                raise ConfigError(str(e)) from None
            if result < 0 or (result == 0 and kind == "duration"):
                raise ConfigError(f"{name} must be positive, got {value!r}")
        elif kind == "count":
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        elif kind == "retention":
            if not isinstance(value, Retention):
                raise ConfigError(
                    f"{name} must be a workflow.Retention, not {type(value).__name__}"
                )
        elif not isinstance(value, bool):
            raise ConfigError(f"{name} must be a bool, got {value!r}")


def _resolved(options: AttrsInstance) -> dict[str, Any]:
    """Every option of `options` with its default filled in, durations in seconds."""
    values: dict[str, Any] = {}
    for field in attrs.fields(type(options)):
        if _KIND not in field.metadata:
            continue
        value = getattr(options, field.name)
        if value is None:
            value = field.metadata[_DEFAULT]
        elif field.metadata[_KIND] in ("duration", "delay"):
            value = seconds(value, field.name)
        values[field.name] = value
    return values


@attrs.frozen(kw_only=True)
class Config:
    """A manager's settings; a field left at None takes its default.

    `default_task_timeout` 60 s, `default_max_attempts` 8, `backoff_base` 1 s,
    `backoff_max` 300 s, `max_in_process_backoff` 5 s, `sweep_max_age` 600 s,
    `max_local_runs` 64, `context` (from `workflow.propagate`) and `cipher` None,
    `tracing` True (OpenTelemetry spans and a stored span context when
    opentelemetry-api is installed; False turns both off). Raises `ConfigError`
    for a value that is not a positive duration or count.
    """

    default_task_timeout: Duration | None = attrs.field(
        default=None, metadata=_option(60.0, "duration")
    )
    default_max_attempts: int | None = attrs.field(default=None, metadata=_option(8, "count"))
    backoff_base: Duration | None = attrs.field(default=None, metadata=_option(1.0, "duration"))
    backoff_max: Duration | None = attrs.field(default=None, metadata=_option(300.0, "duration"))
    max_in_process_backoff: Duration | None = attrs.field(
        default=None, metadata=_option(5.0, "delay")
    )
    sweep_max_age: Duration | None = attrs.field(default=None, metadata=_option(600.0, "duration"))
    max_local_runs: int | None = attrs.field(default=None, metadata=_option(64, "count"))
    context: Propagation[Any] | None = None
    cipher: Cipher | None = None
    tracing: bool | None = attrs.field(default=None, metadata=_option(True, "flag"))

    def __attrs_post_init__(self) -> None:
        _check(self)
        if self.context is not None and not hasattr(self.context, "capture_document"):
            raise ConfigError(
                "Config.context takes workflow.propagate(your_propagator), "
                f"not {type(self.context).__name__}"
            )
        if self.cipher is not None and not (
            callable(getattr(self.cipher, "seal", None))
            and callable(getattr(self.cipher, "open", None))
        ):
            raise ConfigError("Config.cipher needs seal(bytes) -> bytes and open(bytes) -> bytes")
        settings = Settings.of(self)
        if settings.backoff_max < settings.backoff_base:
            raise ConfigError(
                f"backoff_max ({settings.backoff_max:g}s) is below backoff_base "
                f"({settings.backoff_base:g}s)"
            )


@attrs.frozen
class Settings:
    """`Config` with every default filled in and durations in seconds (internal)."""

    default_task_timeout: float
    default_max_attempts: int
    backoff_base: float
    backoff_max: float
    max_in_process_backoff: float
    sweep_max_age: float
    max_local_runs: int
    tracing: bool

    @classmethod
    def of(cls, config: Config) -> Settings:
        return cls(**_resolved(config))

    @property
    def pool_size(self) -> int:
        """`max_size` of a pool built for this manager: room for the fast path, bounded."""
        return max(4, min(self.max_local_runs, 16))

    @property
    def heartbeat_interval(self) -> float:
        """How often live claims are heartbeated: well inside `sweep_max_age`."""
        return min(self.sweep_max_age / 4, 15.0)


@attrs.frozen(kw_only=True)
class Retention:
    """How long finished runs are kept before a worker prunes them; None: forever.

    Defaults: `succeeded` 7 days, `cancelled` 30 days, `parked` None (a parked run
    waits for a person). Raises `ConfigError` for a value that is not a
    non-negative duration.
    """

    succeeded: Duration | None = datetime.timedelta(days=7)
    cancelled: Duration | None = datetime.timedelta(days=30)
    parked: Duration | None = None

    def __attrs_post_init__(self) -> None:
        for name in ("succeeded", "cancelled", "parked"):
            value = getattr(self, name)
            if value is None:
                continue
            try:
                age = seconds(value, f"Retention.{name}")
            except (TypeError, ValueError) as e:
                raise ConfigError(str(e)) from None
            if age < 0:
                raise ConfigError(f"Retention.{name} must not be negative, got {value!r}")

    def ages(self) -> dict[str, float]:
        """Status -> seconds after which a finished run of it is pruned (kept ones left out)."""
        return {
            name: seconds(value, name)
            for name in ("succeeded", "cancelled", "parked")
            if (value := getattr(self, name)) is not None
        }


@attrs.frozen(kw_only=True)
class RunnerConfig:
    """A runnable's settings; a field left at None takes its default.

    `poll_interval` 30 s, `batch_size` 10, `concurrency` 4, `sweep_enabled` True,
    `sweep_interval` 60 s, `listen` True (LISTEN for wake-ups; False behind a
    transaction-mode pooler such as PgBouncer), `prune_enabled` True,
    `prune_interval` 300 s, `retention` `Retention()` (succeeded 7 days, cancelled
    30 days, parked kept).

    `concurrency` is how many runs the poller executes at once, one thread each. An
    unkeyed run whose last task succeeded stops counting when its thread hands the
    finishing write to the poller's completer; at most `concurrency` such writes
    are on their way (queued or being written), so a worker holds at most twice
    `concurrency` claims.
    """

    poll_interval: Duration | None = attrs.field(default=None, metadata=_option(30.0, "duration"))
    batch_size: int | None = attrs.field(default=None, metadata=_option(10, "count"))
    concurrency: int | None = attrs.field(default=None, metadata=_option(4, "count"))
    sweep_enabled: bool | None = attrs.field(default=None, metadata=_option(True, "flag"))
    sweep_interval: Duration | None = attrs.field(default=None, metadata=_option(60.0, "duration"))
    listen: bool | None = attrs.field(default=None, metadata=_option(True, "flag"))
    prune_enabled: bool | None = attrs.field(default=None, metadata=_option(True, "flag"))
    prune_interval: Duration | None = attrs.field(
        default=None, metadata=_option(300.0, "duration")
    )
    retention: Retention | None = attrs.field(
        default=None, metadata=_option(Retention(), "retention")
    )

    def __attrs_post_init__(self) -> None:
        _check(self)


@attrs.frozen
class RunnerSettings:
    """`RunnerConfig` with defaults filled in (internal)."""

    poll_interval: float
    batch_size: int
    concurrency: int
    sweep_enabled: bool
    sweep_interval: float
    listen: bool
    prune_enabled: bool
    prune_interval: float
    retention: Retention

    @classmethod
    def of(cls, config: RunnerConfig) -> RunnerSettings:
        return cls(**_resolved(config))
