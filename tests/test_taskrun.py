"""SPEC sections 5 and 11: what a handler sees (`TaskRun`), built by `new_task_run` for tests."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable

import attrs
import pytest

import workflow
from workflow.durations import Duration


@attrs.frozen
class TransferInput:
    account: str
    amount_cents: int


@attrs.frozen
class Reserved:
    id: str


INPUT = TransferInput(account="acc-1", amount_cents=500)
reserve = workflow.Task("transfer.reserve", Reserved)
maybe = workflow.Task("transfer.maybe", Reserved | None)
send = workflow.Task("transfer.send")


# --- defaults ------------------------------------------------------------------------


def test_defaults() -> None:
    run = workflow.new_task_run(INPUT)
    assert isinstance(run, workflow.TaskRun)
    assert run.input is INPUT
    assert run.attempt == 1
    assert run.last_attempt
    assert run.run_id == "test-run"
    assert run.idempotency_key == "test-run:1"


def test_default_deadline_is_now_plus_60_seconds() -> None:
    before = time.monotonic()
    run = workflow.new_task_run(INPUT)
    after = time.monotonic()
    assert before + 60 <= run.deadline <= after + 60
    remaining = run.remaining()
    assert 0 < remaining <= 60
    assert remaining > 30  # generous: only a very slow machine takes 30s here


def test_cancelled_is_an_unset_event() -> None:
    run = workflow.new_task_run(INPUT)
    assert isinstance(run.cancelled, threading.Event)
    assert not run.cancelled.is_set()
    run.raise_if_cancelled()


def test_each_run_has_its_own_event() -> None:
    first = workflow.new_task_run(INPUT)
    second = workflow.new_task_run(INPUT)
    first.cancelled.set()
    assert not second.cancelled.is_set()


# --- run id and idempotency key ------------------------------------------------------


def test_run_id_drives_the_idempotency_key() -> None:
    run = workflow.new_task_run(INPUT, run_id="0190c8e2-run")
    assert run.run_id == "0190c8e2-run"
    assert run.idempotency_key == "0190c8e2-run:1"


def test_idempotency_key_is_stable_across_attempts() -> None:
    keys = {
        workflow.new_task_run(INPUT, run_id="r", attempt=a, max_attempts=3).idempotency_key
        for a in (1, 2, 3)
    }
    assert keys == {"r:1"}


def test_task_run_built_directly_uses_its_seq() -> None:
    run: workflow.TaskRun[TransferInput] = workflow.TaskRun(
        run_id="r-9",
        seq=4,
        input=INPUT,
        outputs=lambda task: None,
        attempt=2,
        max_attempts=5,
        deadline=time.monotonic() + 10,
        cancelled=threading.Event(),
    )
    assert run.idempotency_key == "r-9:4"
    assert run.attempt == 2
    assert not run.last_attempt


# --- deadline and remaining() --------------------------------------------------------


@pytest.mark.parametrize(
    ("timeout", "expected"),
    [(10, 10.0), (2.5, 2.5), (datetime.timedelta(minutes=2), 120.0)],
)
def test_deadline_is_now_plus_timeout(timeout: Duration, expected: float) -> None:
    before = time.monotonic()
    run = workflow.new_task_run(INPUT, timeout=timeout)
    after = time.monotonic()
    assert before + expected <= run.deadline <= after + expected
    assert 0 < run.remaining() <= expected


@pytest.mark.parametrize("timeout", [0, -5, -0.5, datetime.timedelta(seconds=-1)])
def test_remaining_is_never_negative(timeout: Duration) -> None:
    run = workflow.new_task_run(INPUT, timeout=timeout)
    assert run.remaining() == 0.0


def test_remaining_does_not_grow() -> None:
    run = workflow.new_task_run(INPUT, timeout=30)
    first = run.remaining()
    second = run.remaining()
    assert second <= first <= 30


# --- outputs -------------------------------------------------------------------------


def test_output_of_a_given_task() -> None:
    reserved = Reserved(id="r-1")
    run = workflow.new_task_run(INPUT, outputs={reserve: reserved})
    assert run.output(reserve) is reserved


def test_output_recorded_as_none_is_returned() -> None:
    run = workflow.new_task_run(INPUT, outputs={maybe: None})
    assert run.output(maybe) is None


def test_output_of_a_missing_task_raises_output_missing() -> None:
    run = workflow.new_task_run(INPUT, outputs={maybe: Reserved(id="x")})
    with pytest.raises(workflow.OutputMissing) as info:
        run.output(reserve)
    assert "transfer.reserve" in str(info.value)
    assert isinstance(info.value, workflow.WorkflowError)
    assert isinstance(info.value, LookupError)


def test_output_with_no_outputs_raises_output_missing() -> None:
    run = workflow.new_task_run(INPUT)
    with pytest.raises(workflow.OutputMissing):
        run.output(reserve)


def test_output_of_a_task_without_output_type_raises_output_missing() -> None:
    run = workflow.new_task_run(INPUT, outputs={send: None})
    with pytest.raises(workflow.OutputMissing) as info:
        run.output(send)
    assert "transfer.send" in str(info.value)


def test_outputs_are_looked_up_by_task() -> None:
    other_reserve = workflow.Task("transfer.reserve.other", Reserved)
    run = workflow.new_task_run(
        INPUT, outputs={reserve: Reserved(id="a"), other_reserve: Reserved(id="b")}
    )
    assert run.output(reserve) == Reserved(id="a")
    assert run.output(other_reserve) == Reserved(id="b")


# --- cancellation --------------------------------------------------------------------


def test_raise_if_cancelled_after_set() -> None:
    run = workflow.new_task_run(INPUT)
    run.raise_if_cancelled()
    run.cancelled.set()
    with pytest.raises(workflow.Cancelled) as info:
        run.raise_if_cancelled()
    assert isinstance(info.value, workflow.WorkflowError)
    assert not workflow.is_permanent(info.value)


def test_cancelled_set_from_another_thread_is_seen() -> None:
    run = workflow.new_task_run(INPUT)
    setter = threading.Thread(target=run.cancelled.set)
    setter.start()
    setter.join()
    assert run.cancelled.wait(timeout=5)
    with pytest.raises(workflow.Cancelled):
        run.raise_if_cancelled()


# --- attempts ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("attempt", "max_attempts", "last"),
    [(1, 1, True), (1, 2, False), (2, 2, True), (1, 8, False), (7, 8, False), (8, 8, True)],
)
def test_attempt_and_max_attempts_drive_last_attempt(
    attempt: int, max_attempts: int, last: bool
) -> None:
    run = workflow.new_task_run(INPUT, attempt=attempt, max_attempts=max_attempts)
    assert run.attempt == attempt
    assert run.last_attempt is last


# --- a handler unit test, as SPEC section 5 writes one ------------------------------


class ProviderRejected(Exception):
    pass


@attrs.define
class FakeProvider:
    reject: bool = False
    calls: list[tuple[str, str, float]] = attrs.Factory(list)

    def send(self, reservation: str, *, key: str, timeout: float) -> None:
        self.calls.append((reservation, key, timeout))
        if self.reject:
            raise ProviderRejected("card declined")


Handler = Callable[[workflow.TaskRun[TransferInput]], None]


def make_send(provider: FakeProvider) -> Handler:
    def send_handler(run: workflow.TaskRun[TransferInput]) -> None:
        prior = run.output(reserve)
        try:
            provider.send(prior.id, key=run.idempotency_key, timeout=run.remaining())
        except ProviderRejected as e:
            failure = workflow.permanent(workflow.with_code("rejected", e))
            assert failure is not None
            raise failure  # noqa: B904

    return send_handler


def test_handler_unit_test_as_in_the_spec() -> None:
    provider = FakeProvider()
    handler = make_send(provider)
    run = workflow.new_task_run(INPUT, outputs={reserve: Reserved(id="r-1")}, run_id="run-1")
    handler(run)
    [(reservation, key, timeout)] = provider.calls
    assert (reservation, key) == ("r-1", "run-1:1")
    assert 0 < timeout <= 60


def test_handler_permanent_failure_as_in_the_spec() -> None:
    handler = make_send(FakeProvider(reject=True))
    run = workflow.new_task_run(INPUT, outputs={reserve: Reserved(id="r-1")})
    with pytest.raises(workflow.Permanent) as info:
        handler(run)
    assert workflow.is_permanent(info.value)
    assert workflow.code_of(info.value) == "rejected"
    assert isinstance(info.value.__cause__, ProviderRejected)
