"""Retry policies: how long an attempt may take, how many there are, how long between them.

`handle(..., timeout=, max_attempts=, backoff=, backoff_schedule=)` gives a step
its own values; `policy_of` validates them into a `RetryPolicy` at registration
(None: the manager's `Config` decides). `RetryPolicy.resolve(settings)` fills the
Config's values in once per manager, giving a `Retry` with the delay maths: every
retry delay is computed here, from the persisted attempt count (SPEC 9,
invariant 3), so an executor resuming after a crash waits as long as the
original would have.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from workflow.durations import Duration, seconds
from workflow.errors import ConfigError, RegistrationError

if TYPE_CHECKING:
    from workflow.config import Settings


@attrs.frozen
class Backoff:
    """Exponential retry delay `min(base * 2**(attempt-1), max)`, in seconds."""

    base: Duration = 1.0
    max: Duration = 300.0


@attrs.frozen
class RetryPolicy:
    """A step's own retry settings, in seconds; None: the manager's `Config` decides."""

    timeout: float | None
    max_attempts: int | None
    backoff_base: float | None
    backoff_max: float | None
    schedule: tuple[float, ...] | None

    def resolve(self, settings: Settings) -> Retry:
        """This policy with the Config's values filled in."""
        return Retry(
            timeout=self.timeout if self.timeout is not None else settings.default_task_timeout,
            max_attempts=self.max_attempts or settings.default_max_attempts,
            backoff_base=(
                self.backoff_base if self.backoff_base is not None else settings.backoff_base
            ),
            backoff_max=self.backoff_max if self.backoff_max is not None else settings.backoff_max,
            schedule=self.schedule,
        )


@attrs.frozen
class Retry:
    """A step's retry rules with every value decided: what the executor follows."""

    timeout: float
    max_attempts: int
    backoff_base: float
    backoff_max: float
    schedule: tuple[float, ...] | None

    def delay(self, attempts: int) -> float:
        """Seconds to wait before the attempt after `attempts` ended attempts.

        A schedule gives `schedule[attempts-1]`, reusing its last entry past the
        end. Otherwise `min(base * 2**(attempts-1), max)`: the exponent is capped
        first (a float power overflows past 2**1023) and a float product
        saturates to infinity rather than raising, so a task retried forever
        keeps its capped delay however many attempts it has spent.
        """
        if self.schedule is not None:
            return self.schedule[max(min(attempts, len(self.schedule)), 1) - 1]
        exponent = min(max(attempts - 1, 0), 1023)
        return min(self.backoff_base * 2.0**exponent, self.backoff_max)

    def owed(
        self,
        attempts: int,
        failed_at: datetime.datetime,
        db_now: datetime.datetime,
        elapsed: float,
    ) -> tuple[datetime.datetime, float]:
        """When the next attempt is due after the last failure, and the seconds still owed.

        `failed_at` and `db_now` (the claim's moment) are the database clock;
        `elapsed` is the seconds spent here since the claim. Never negative.
        """
        due = failed_at + datetime.timedelta(seconds=self.delay(attempts))
        return due, max(0.0, (due - db_now).total_seconds() - elapsed)


def policy_of(
    where: str,
    *,
    timeout: object,
    max_attempts: object,
    backoff: object,
    backoff_schedule: Sequence[object] | None,
) -> RetryPolicy:
    """Validate one step's retry settings; `RegistrationError` naming `where` and the fix.

    Refused: a non-positive, infinite or too long timeout or backoff, a max below
    its base, a non-positive or non-int attempt budget, an empty or negative
    schedule, and backoff with a schedule.
    """
    checked_timeout = None if timeout is None else _positive(where, "timeout", timeout)
    if max_attempts is not None and (
        not isinstance(max_attempts, int) or isinstance(max_attempts, bool) or max_attempts < 1
    ):
        raise RegistrationError(
            f"{where}: max_attempts must be a positive int, got {max_attempts!r}"
        )
    if backoff is not None and backoff_schedule is not None:
        raise RegistrationError(
            f"{where}: backoff and backoff_schedule are exclusive; keep one of them"
        )
    base = cap = None
    if backoff is not None:
        if not isinstance(backoff, Backoff):
            raise RegistrationError(f"{where}: backoff must be a workflow.Backoff")
        base = _positive(where, "backoff base", backoff.base)
        cap = _positive(where, "backoff max", backoff.max)
        if cap < base:
            raise RegistrationError(
                f"{where}: backoff max ({cap:g}s) is below its base ({base:g}s)"
            )
    schedule = None
    if backoff_schedule is not None:
        if not backoff_schedule:
            raise RegistrationError(
                f"{where}: backoff_schedule is empty; give at least one delay"
            )
        entries = []
        for entry in backoff_schedule:
            try:
                delay = seconds(entry, "a backoff_schedule entry")
            except (TypeError, ValueError) as e:
                raise RegistrationError(f"{where}: {e}") from None
            if delay < 0:
                raise RegistrationError(
                    f"{where}: backoff_schedule entry {entry!r} is negative"
                )
            entries.append(delay)
        schedule = tuple(entries)
    return RetryPolicy(
        timeout=checked_timeout,
        max_attempts=max_attempts,
        backoff_base=base,
        backoff_max=cap,
        schedule=schedule,
    )


def check_against_sweep(where: str, retry: Retry, settings: Settings) -> None:
    """`ConfigError` unless an attempt plus an in-process backoff fits inside `sweep_max_age`.

    Otherwise a sweeper could reclaim a run whose executor is still inside a
    legitimate attempt.
    """
    if retry.timeout + settings.max_in_process_backoff >= settings.sweep_max_age:
        raise ConfigError(
            f"{where}: timeout {retry.timeout:g}s + max_in_process_backoff "
            f"{settings.max_in_process_backoff:g}s must be under sweep_max_age "
            f"{settings.sweep_max_age:g}s, or a sweeper could reclaim a run whose executor "
            "is still inside a legitimate attempt"
        )


def _positive(where: str, what: str, value: object) -> float:
    try:
        result = seconds(value, what)
    except (TypeError, ValueError) as e:
        raise RegistrationError(f"{where}: {e}") from None
    if result <= 0:
        raise RegistrationError(f"{where}: {what} must be positive, got {value!r}")
    return result
