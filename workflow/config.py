"""Configuration values: `Config` (a manager) and `RunnerConfig` (a runnable), with defaults.

All are frozen attrs classes validated at construction; a field left at None
takes its default. Durations are seconds (int or float) or `datetime.timedelta`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from workflow.durations import Duration, seconds
from workflow.errors import ConfigError

if TYPE_CHECKING:
    from workflow.sealing import Cipher, Propagation


def _duration(name: str, value: Any, *, allow_zero: bool = False) -> None:
    if value is None:
        return
    try:
        result = seconds(value, name)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None
    if result < 0 or (result == 0 and not allow_zero):
        raise ConfigError(f"{name} must be positive, got {value!r}")


def _count(name: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")


@attrs.frozen(kw_only=True)
class Config:
    """A manager's settings; a field left at None takes its default.

    `default_task_timeout` 60 s, `default_max_attempts` 8, `backoff_base` 1 s,
    `backoff_max` 300 s, `max_in_process_backoff` 5 s, `sweep_max_age` 600 s,
    `max_local_runs` 64, `context` (from `workflow.propagate`) and `cipher` None.
    Raises `ConfigError` for a value that is not a positive duration or count.
    """

    default_task_timeout: Duration | None = None
    default_max_attempts: int | None = None
    backoff_base: Duration | None = None
    backoff_max: Duration | None = None
    max_in_process_backoff: Duration | None = None
    sweep_max_age: Duration | None = None
    max_local_runs: int | None = None
    context: Propagation[Any] | None = None
    cipher: Cipher | None = None

    def __attrs_post_init__(self) -> None:
        _duration("default_task_timeout", self.default_task_timeout)
        _count("default_max_attempts", self.default_max_attempts)
        _duration("backoff_base", self.backoff_base)
        _duration("backoff_max", self.backoff_max)
        _duration("max_in_process_backoff", self.max_in_process_backoff, allow_zero=True)
        _duration("sweep_max_age", self.sweep_max_age)
        _count("max_local_runs", self.max_local_runs)
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
        base = _or(self.backoff_base, 1.0)
        cap = _or(self.backoff_max, 300.0)
        if cap < base:
            raise ConfigError(f"backoff_max ({cap:g}s) is below backoff_base ({base:g}s)")


def _or(value: Duration | None, default: float) -> float:
    return default if value is None else seconds(value, "duration")


@attrs.frozen
class Settings:
    """`Config` with every default filled in and durations in seconds (internal)."""

    task_timeout: float
    max_attempts: int
    backoff_base: float
    backoff_max: float
    max_in_process_backoff: float
    sweep_max_age: float
    max_local_runs: int

    @classmethod
    def of(cls, config: Config) -> Settings:
        return cls(
            task_timeout=_or(config.default_task_timeout, 60.0),
            max_attempts=config.default_max_attempts or 8,
            backoff_base=_or(config.backoff_base, 1.0),
            backoff_max=_or(config.backoff_max, 300.0),
            max_in_process_backoff=_or(config.max_in_process_backoff, 5.0),
            sweep_max_age=_or(config.sweep_max_age, 600.0),
            max_local_runs=config.max_local_runs or 64,
        )

    @property
    def pool_size(self) -> int:
        """`max_size` of a pool built for this manager: room for the fast path, bounded."""
        return max(4, min(self.max_local_runs, 16))

    @property
    def heartbeat_interval(self) -> float:
        """How often live claims are heartbeated: well inside `sweep_max_age`."""
        return min(self.sweep_max_age / 4, 15.0)


@attrs.frozen(kw_only=True)
class RunnerConfig:
    """A worker's settings; a field left at None takes its default.

    `poll_interval` 30 s, `batch_size` 10, `concurrency` 4, `sweep_enabled` True,
    `sweep_interval` 60 s, `listen` True (LISTEN for wake-ups; False behind a
    transaction-mode pooler such as PgBouncer).
    """

    poll_interval: Duration | None = None
    batch_size: int | None = None
    concurrency: int | None = None
    sweep_enabled: bool | None = None
    sweep_interval: Duration | None = None
    listen: bool | None = None

    def __attrs_post_init__(self) -> None:
        _duration("poll_interval", self.poll_interval)
        _count("batch_size", self.batch_size)
        _count("concurrency", self.concurrency)
        _duration("sweep_interval", self.sweep_interval)
        for name in ("sweep_enabled", "listen"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ConfigError(f"{name} must be a bool, got {value!r}")


@attrs.frozen
class RunnerSettings:
    """`RunnerConfig` with defaults filled in (internal)."""

    poll_interval: float
    batch_size: int
    concurrency: int
    sweep_enabled: bool
    sweep_interval: float
    listen: bool

    @classmethod
    def of(cls, config: RunnerConfig) -> RunnerSettings:
        return cls(
            poll_interval=_or(config.poll_interval, 30.0),
            batch_size=config.batch_size or 10,
            concurrency=config.concurrency or 4,
            sweep_enabled=True if config.sweep_enabled is None else config.sweep_enabled,
            sweep_interval=_or(config.sweep_interval, 60.0),
            listen=True if config.listen is None else config.listen,
        )
