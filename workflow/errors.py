"""The exception hierarchy, and the wrappers handlers use to classify failures.

Everything the library raises on its own account is a `WorkflowError`. Handler
failures are ordinary exceptions; `permanent()` and `with_code()` wrap one to say
"do not retry" or "tag it with this code" without losing the original, which stays
reachable as `__cause__` so tracebacks remain useful.
"""

from __future__ import annotations

from typing import overload


class WorkflowError(Exception):
    """Base class of every error raised by the library itself."""


class ThreadNotStarted(WorkflowError, RuntimeError):
    """A thread of the library's could not start: the process is out of threads (or
    memory for their stacks). A `RuntimeError`, as Python raises, and a `WorkflowError`."""

    def __init__(self, what: str, cause: BaseException) -> None:
        super().__init__(f"{what}: {cause} (is the process out of threads?)")


class RegistrationError(WorkflowError, ValueError):
    """`Registry.register` refused a definition; the message names the fix."""


class ConfigError(WorkflowError, ValueError):
    """A `Config` or `RunnerConfig` value, or their combination, is unusable."""


class EncodeError(WorkflowError, ValueError):
    """A value could not be encoded to JSON for its declared type.

    Raised by `start`/`start_tx` before anything is written.
    """


class DecodeError(WorkflowError):
    """A stored document could not be decoded (or opened) into its declared type."""


class OutputMissing(WorkflowError, LookupError):
    """`TaskRun.output()` of a task that recorded no output (skipped, or no output type)."""


class RunNotFound(WorkflowError, LookupError):
    """No run has this id (or it is malformed, or belongs to another workflow)."""


class NotResumable(WorkflowError):
    """`Admin.resume` of a run that is neither parked nor cancelled with tasks left."""


class ScheduleNotFound(WorkflowError):
    """An `Admin` schedule action named a schedule no worker has registered."""


class Cancelled(WorkflowError):
    """Raised by `TaskRun.raise_if_cancelled()` once the attempt's `cancelled` is set."""


class Permanent(WorkflowError):
    """A failure that parks the run at once, whatever attempt budget is left.

    Raise it directly (`raise Permanent("card rejected", code="rejected")`) or
    wrap another exception with `permanent(exc)`.
    """

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class CodedError(WorkflowError):
    """A retryable failure tagged with a code; built by `with_code()`."""

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message)
        self.code = code


def _wrap(exc: BaseException, *, permanent: bool, code: str | None) -> WorkflowError:
    """Re-wrap `exc`, keeping its message and the exception it was built around."""
    if isinstance(exc, (Permanent, CodedError)):
        # Unwrap to the original; a Permanent raised directly is itself the original.
        message, cause = str(exc), exc.__cause__ or exc
    else:
        message, cause = error_text(exc), exc
    wrapped: WorkflowError
    if permanent:
        wrapped = Permanent(message, code=code)
    else:
        assert code is not None
        wrapped = CodedError(message, code=code)
    wrapped.__cause__ = cause
    return wrapped


@overload
def permanent(exc: BaseException) -> BaseException: ...


@overload
def permanent(exc: None) -> None: ...


@overload
def permanent(exc: BaseException | None) -> BaseException | None: ...


def permanent(exc: BaseException | None) -> BaseException | None:
    """Return an exception that parks the run now; None for None.

    Keeps any code set by `with_code()` and the original exception as `__cause__`.
    """
    if exc is None or isinstance(exc, Permanent):
        return exc
    return _wrap(exc, permanent=True, code=code_of(exc))


@overload
def with_code(code: str, exc: BaseException) -> BaseException: ...


@overload
def with_code(code: str, exc: None) -> None: ...


@overload
def with_code(code: str, exc: BaseException | None) -> BaseException | None: ...


def with_code(code: str, exc: BaseException | None) -> BaseException | None:
    """Return `exc` tagged with `code` (carried to `Failure.code`); None for None.

    Keeps permanence if `exc` was already permanent, and the original exception
    as `__cause__`. The engine stores the code and never interprets it.
    """
    if exc is None:
        return None
    if not isinstance(code, str) or not code:
        raise ValueError("with_code: code must be a non-empty string")
    return _wrap(exc, permanent=is_permanent(exc), code=code)


def is_permanent(exc: BaseException | None) -> bool:
    """True when `exc` was raised as, or wrapped into, a permanent failure."""
    return isinstance(exc, Permanent)


def code_of(exc: BaseException | None) -> str | None:
    """The code set with `with_code()` or `Permanent(code=...)`, else None."""
    if isinstance(exc, (Permanent, CodedError)):
        return exc.code
    return None


def error_text(exc: BaseException) -> str:
    """The text stored as `Failure.error`: the message, or the type when it has none."""
    text = str(exc)
    return text if text else type(exc).__name__
