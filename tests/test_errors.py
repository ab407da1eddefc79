"""SPEC section 5: classifying failures, and the `WorkflowError` hierarchy."""

from __future__ import annotations

import traceback
from collections.abc import Callable

import pytest

import workflow
from workflow.errors import error_text
from workflow.store import SchemaOutdated


class ProviderRejected(Exception):
    pass


def wrapped(exc: BaseException | None) -> BaseException:
    assert exc is not None
    return exc


# --- None in, None out ---------------------------------------------------------------


def test_permanent_of_none_is_none() -> None:
    assert workflow.permanent(None) is None


def test_with_code_of_none_is_none() -> None:
    assert workflow.with_code("x", None) is None


def test_composed_of_none_is_none() -> None:
    assert workflow.permanent(workflow.with_code("x", None)) is None
    assert workflow.with_code("x", workflow.permanent(None)) is None


# --- permanent() ---------------------------------------------------------------------


def test_permanent_wraps_an_exception() -> None:
    original = ProviderRejected("card declined")
    exc = wrapped(workflow.permanent(original))
    assert workflow.is_permanent(exc)
    assert isinstance(exc, workflow.Permanent)
    assert isinstance(exc, workflow.WorkflowError)
    assert exc.__cause__ is original
    assert str(exc) == "card declined"
    assert workflow.code_of(exc) is None
    assert not workflow.is_permanent(original)


def test_permanent_of_an_exception_without_message_keeps_its_type_name() -> None:
    exc = wrapped(workflow.permanent(ProviderRejected()))
    assert str(exc) == "ProviderRejected"


def test_permanent_of_a_permanent_is_unchanged() -> None:
    exc = workflow.Permanent("already", code="c")
    assert workflow.permanent(exc) is exc


# --- with_code() ---------------------------------------------------------------------


def test_with_code_on_a_plain_exception_is_not_permanent() -> None:
    original = ProviderRejected("try later")
    exc = wrapped(workflow.with_code("busy", original))
    assert not workflow.is_permanent(exc)
    assert workflow.code_of(exc) == "busy"
    assert isinstance(exc, workflow.CodedError)
    assert exc.__cause__ is original
    assert str(exc) == "try later"


@pytest.mark.parametrize("code", ["", None, 3])
def test_with_code_needs_a_non_empty_string(code: object) -> None:
    bad: str = code  # type: ignore[assignment]
    with pytest.raises(ValueError):
        workflow.with_code(bad, ProviderRejected("x"))


def test_double_with_code_replaces_the_code() -> None:
    original = ProviderRejected("x")
    exc = wrapped(workflow.with_code("second", workflow.with_code("first", original)))
    assert workflow.code_of(exc) == "second"
    assert not workflow.is_permanent(exc)
    assert exc.__cause__ is original


def test_with_code_on_a_permanent_replaces_its_code() -> None:
    original = ProviderRejected("x")
    exc = wrapped(
        workflow.with_code("second", workflow.permanent(workflow.with_code("a", original)))
    )
    assert workflow.code_of(exc) == "second"
    assert workflow.is_permanent(exc)


# --- composition, in either order ----------------------------------------------------


def test_with_code_then_permanent() -> None:
    original = ProviderRejected("card declined")
    exc = wrapped(workflow.permanent(workflow.with_code("rejected", original)))
    assert workflow.is_permanent(exc)
    assert workflow.code_of(exc) == "rejected"
    assert exc.__cause__ is original
    assert str(exc) == "card declined"


def test_permanent_then_with_code() -> None:
    original = ProviderRejected("card declined")
    exc = wrapped(workflow.with_code("rejected", workflow.permanent(original)))
    assert workflow.is_permanent(exc)
    assert workflow.code_of(exc) == "rejected"
    assert exc.__cause__ is original
    assert str(exc) == "card declined"


Wrapper = Callable[[BaseException | None], BaseException | None]

WRAPPERS: dict[str, Wrapper] = {
    "permanent": workflow.permanent,
    "code-a": lambda e: workflow.with_code("a", e),
    "code-b": lambda e: workflow.with_code("b", e),
}


@pytest.mark.parametrize(
    "chain",
    [
        ["permanent"],
        ["code-a"],
        ["code-a", "permanent"],
        ["permanent", "code-a"],
        ["code-a", "code-b"],
        ["code-a", "permanent", "code-b"],
        ["permanent", "code-a", "permanent", "code-b"],
        ["code-b", "code-a", "code-b", "permanent", "permanent"],
    ],
)
def test_original_is_the_cause_after_any_chain(chain: list[str]) -> None:
    original = ProviderRejected("the original")
    exc: BaseException | None = original
    for name in chain:
        exc = WRAPPERS[name](exc)
    result = wrapped(exc)
    assert result.__cause__ is original
    assert str(result) == "the original"
    assert workflow.is_permanent(result) == ("permanent" in chain)
    codes = [name for name in chain if name.startswith("code-")]
    assert workflow.code_of(result) == (codes[-1].removeprefix("code-") if codes else None)


def test_raised_wrapper_traceback_shows_the_original() -> None:
    def provider() -> None:
        raise ProviderRejected("card declined")

    def handler() -> None:
        try:
            provider()
        except ProviderRejected as e:
            raise wrapped(workflow.permanent(workflow.with_code("rejected", e)))  # noqa: B904

    with pytest.raises(workflow.Permanent) as info:
        handler()
    text = "".join(traceback.format_exception(info.value))
    assert "ProviderRejected: card declined" in text
    assert "in provider" in text
    assert info.value.__cause__ is not None
    assert info.value.__cause__.__traceback__ is not None


# --- Permanent raised directly -------------------------------------------------------


def test_raise_permanent_directly() -> None:
    with pytest.raises(workflow.Permanent) as info:
        raise workflow.Permanent("text", code="rejected")
    assert workflow.is_permanent(info.value)
    assert workflow.code_of(info.value) == "rejected"
    assert str(info.value) == "text"
    assert isinstance(info.value, workflow.WorkflowError)


def test_raise_permanent_without_code() -> None:
    exc = workflow.Permanent("text")
    assert workflow.is_permanent(exc)
    assert workflow.code_of(exc) is None


def test_permanent_raised_from_an_original_keeps_it_through_with_code() -> None:
    original = ProviderRejected("x")
    try:
        raise workflow.Permanent("declined", code="a") from original
    except workflow.Permanent as e:
        exc = wrapped(workflow.with_code("b", e))
    assert exc.__cause__ is original
    assert workflow.is_permanent(exc)
    assert workflow.code_of(exc) == "b"
    assert str(exc) == "declined"


def test_with_code_keeps_a_directly_raised_permanent_reachable() -> None:
    def check() -> None:
        raise workflow.Permanent("declined")

    try:
        check()
    except workflow.Permanent as e:
        first = e
    exc = wrapped(workflow.with_code("rejected", first))
    assert workflow.is_permanent(exc)
    assert workflow.code_of(exc) == "rejected"
    assert str(exc) == "declined"
    # The Permanent the handler raised (and its traceback) must not be dropped.
    assert exc.__cause__ is first


# --- reading back plain exceptions ---------------------------------------------------


@pytest.mark.parametrize(
    "exc", [ValueError("x"), RuntimeError(), KeyboardInterrupt(), workflow.Cancelled("c")]
)
def test_plain_exceptions_have_no_code_and_are_not_permanent(exc: BaseException) -> None:
    assert workflow.code_of(exc) is None
    assert not workflow.is_permanent(exc)


def test_readers_accept_none() -> None:
    assert workflow.code_of(None) is None
    assert not workflow.is_permanent(None)


def test_error_text() -> None:
    assert error_text(ValueError("boom")) == "boom"
    assert error_text(ValueError()) == "ValueError"
    assert error_text(ProviderRejected("")) == "ProviderRejected"


# --- hierarchy -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls",
    [
        workflow.RegistrationError,
        workflow.ConfigError,
        workflow.EncodeError,
        workflow.DecodeError,
        workflow.OutputMissing,
        workflow.RunNotFound,
        workflow.Cancelled,
        workflow.SchemaOutdated,
        workflow.Permanent,
        workflow.CodedError,
    ],
)
def test_library_errors_are_workflow_errors(cls: type[BaseException]) -> None:
    assert issubclass(cls, workflow.WorkflowError)
    assert issubclass(workflow.WorkflowError, Exception)


def test_schema_outdated_is_reexported_from_the_store() -> None:
    assert workflow.SchemaOutdated is SchemaOutdated
    exc = SchemaOutdated(2, 3)
    assert isinstance(exc, workflow.WorkflowError)


@pytest.mark.parametrize(
    ("cls", "base"),
    [
        (workflow.RegistrationError, ValueError),
        (workflow.ConfigError, ValueError),
        (workflow.EncodeError, ValueError),
        (workflow.OutputMissing, LookupError),
        (workflow.RunNotFound, LookupError),
    ],
)
def test_builtin_bases(cls: type[BaseException], base: type[BaseException]) -> None:
    assert issubclass(cls, base)
