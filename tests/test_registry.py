"""SPEC section 2: declaring workflows and tasks, and every rule `Registry.register` checks."""

from __future__ import annotations

import datetime
from typing import Any

import attrs
import pytest

import workflow
from workflow.limits import MAX_TASKS


@attrs.frozen
class TransferInput:
    account: str
    amount_cents: int


@attrs.frozen
class Reserved:
    id: str


@attrs.frozen
class Refunded:
    id: str


WF = "Transfer.Rules"


def noop(run: workflow.TaskRun[TransferInput]) -> None:
    del run


def reserve_fn(run: workflow.TaskRun[TransferInput]) -> Reserved:
    return Reserved(id=run.input.account)


def transfer(name: str = WF) -> workflow.Workflow[TransferInput]:
    return workflow.Workflow(name, TransferInput)


def step(name: str = "transfer.send", **options: Any) -> workflow.Step[TransferInput]:
    """A step for a fresh `Task(name)` with the given `handle()` options."""
    return workflow.handle(workflow.Task(name), noop, **options)


def refused(definition: workflow.Definition[Any], registry: workflow.Registry | None = None) -> str:
    """Register `definition`, expect RegistrationError (a ValueError) and return its message."""
    reg = registry if registry is not None else workflow.Registry()
    with pytest.raises(workflow.RegistrationError) as info:
        reg.register(definition)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, workflow.WorkflowError)
    return str(info.value)


def assert_names(message: str, *names: str) -> None:
    for name in names:
        assert name in message, f"{name!r} not named in {message!r}"


# --- the happy path ------------------------------------------------------------------


def test_spec_example_registers() -> None:
    reserve = workflow.Task("transfer.reserve", Reserved)
    send = workflow.Task("transfer.send")
    definition = workflow.define(
        transfer(),
        workflow.handle(reserve, reserve_fn, max_attempts=8),
        workflow.handle(send, noop, timeout=30).skip_if(lambda i: i.amount_cents == 0),
    )
    reg = workflow.Registry()
    reg.register(definition)
    assert reg.names() == [WF]
    assert reg.definition(WF) is definition
    assert reg.definition("Unknown.Workflow") is None
    assert reg.policy(WF, "transfer.reserve").max_attempts == 8
    assert reg.policy(WF, "transfer.send").timeout == 30.0
    assert not reg.frozen


def test_define_keeps_step_order() -> None:
    steps = [step(f"task.{i}") for i in range(5)]
    definition = workflow.define(transfer(), *steps)
    assert definition.workflow.name == WF
    assert [s.task.name for s in definition.steps] == [f"task.{i}" for i in range(5)]


def test_task_records_only_with_an_output_type() -> None:
    assert workflow.Task("x", Reserved).records
    assert workflow.Task("x", Reserved).output_type is Reserved
    assert not workflow.Task("x").records
    assert workflow.Task("x").output_type is None


# --- frozen registry -----------------------------------------------------------------


def test_frozen_registry_refuses() -> None:
    reg = workflow.Registry()
    reg.freeze()
    assert reg.frozen
    message = refused(workflow.define(transfer(), step()), reg)
    assert_names(message, WF, "frozen")
    assert reg.names() == []


def test_freeze_after_register_refuses_the_next() -> None:
    reg = workflow.Registry()
    reg.register(workflow.define(transfer("A.First"), step()))
    reg.freeze()
    message = refused(workflow.define(transfer("A.Second"), step()), reg)
    assert_names(message, "A.Second")
    assert reg.names() == ["A.First"]


# --- workflow-level rules ------------------------------------------------------------


def test_duplicate_workflow_name() -> None:
    reg = workflow.Registry()
    reg.register(workflow.define(transfer(), step()))
    message = refused(workflow.define(transfer(), step("other.task")), reg)
    assert_names(message, WF)
    assert reg.names() == [WF]


def test_zero_tasks() -> None:
    message = refused(workflow.define(transfer()))
    assert_names(message, WF)


def test_empty_task_name() -> None:
    message = refused(workflow.define(transfer(), step("ok.task"), step("")))
    assert_names(message, WF)


def test_duplicate_task_name_within_a_workflow() -> None:
    message = refused(workflow.define(transfer(), step("dup.task"), step("dup.task")))
    assert_names(message, WF, "dup.task")


def test_duplicate_task_name_with_different_types_within_a_workflow() -> None:
    definition = workflow.define(
        transfer(),
        workflow.handle(workflow.Task("dup.task", Reserved), reserve_fn),
        step("dup.task"),
    )
    assert_names(refused(definition), WF, "dup.task")


def test_more_than_32766_tasks() -> None:
    """32767 tasks could not finish: `current_seq` (a smallint) reads task_count + 1 at the end."""
    assert MAX_TASKS == 32766
    steps = [step(f"t{i}") for i in range(32767)]
    message = refused(workflow.define(transfer(), *steps))
    assert_names(message, WF, "32766")


def test_exactly_32766_tasks_accepted() -> None:
    steps = [step(f"t{i}") for i in range(32766)]
    reg = workflow.Registry()
    reg.register(workflow.define(transfer(), *steps))
    assert reg.names() == [WF]


# --- backoff -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "base", [0, 0.0, -1, -0.5, datetime.timedelta(0), datetime.timedelta(seconds=-1)]
)
def test_backoff_non_positive_base(base: Any) -> None:
    definition = workflow.define(
        transfer(), step("bad.task", backoff=workflow.Backoff(base=base, max=10))
    )
    message = refused(definition)
    assert_names(message, WF, "bad.task", "base")


@pytest.mark.parametrize(
    "cap", [0, 0.0, -1, -300.0, datetime.timedelta(0), datetime.timedelta(seconds=-3)]
)
def test_backoff_non_positive_max(cap: Any) -> None:
    definition = workflow.define(
        transfer(), step("bad.task", backoff=workflow.Backoff(base=1, max=cap))
    )
    message = refused(definition)
    assert_names(message, WF, "bad.task", "max")


def test_backoff_max_below_base() -> None:
    definition = workflow.define(
        transfer(), step("bad.task", backoff=workflow.Backoff(base=10, max=5))
    )
    message = refused(definition)
    assert_names(message, WF, "bad.task", "max", "base")


def test_backoff_max_equal_to_base_accepted() -> None:
    reg = workflow.Registry()
    backoff = workflow.Backoff(base=datetime.timedelta(seconds=5), max=5)
    reg.register(workflow.define(transfer(), step("ok.task", backoff=backoff)))
    policy = reg.policy(WF, "ok.task")
    assert (policy.backoff_base, policy.backoff_max) == (5.0, 5.0)
    assert policy.schedule is None


def test_backoff_defaults() -> None:
    backoff = workflow.Backoff()
    assert (backoff.base, backoff.max) == (1.0, 300.0)


def test_empty_backoff_schedule() -> None:
    definition = workflow.define(transfer(), step("bad.task", backoff_schedule=[]))
    message = refused(definition)
    assert_names(message, WF, "bad.task", "backoff_schedule")


@pytest.mark.parametrize(
    "schedule",
    [[-1], [1, 5, -30], [0.5, -0.001], [1, datetime.timedelta(seconds=-1)]],
)
def test_negative_backoff_schedule_entry(schedule: list[Any]) -> None:
    definition = workflow.define(transfer(), step("bad.task", backoff_schedule=schedule))
    message = refused(definition)
    assert_names(message, WF, "bad.task", "negative")


def test_backoff_schedule_accepted() -> None:
    reg = workflow.Registry()
    schedule = [0, 1, 5.5, datetime.timedelta(seconds=30)]
    reg.register(workflow.define(transfer(), step("ok.task", backoff_schedule=schedule)))
    assert reg.policy(WF, "ok.task").schedule == (0.0, 1.0, 5.5, 30.0)


def test_backoff_schedule_is_copied() -> None:
    schedule = [1, 5, 30]
    s = step("ok.task", backoff_schedule=schedule)
    schedule.append(-1)
    reg = workflow.Registry()
    reg.register(workflow.define(transfer(), s))
    assert reg.policy(WF, "ok.task").schedule == (1.0, 5.0, 30.0)


def test_backoff_and_schedule_are_exclusive() -> None:
    definition = workflow.define(
        transfer(),
        step("bad.task", backoff=workflow.Backoff(), backoff_schedule=[1, 5, 30]),
    )
    message = refused(definition)
    assert_names(message, WF, "bad.task", "backoff", "backoff_schedule")


# --- timeout and max_attempts --------------------------------------------------------


@pytest.mark.parametrize(
    "timeout",
    [0, 0.0, -1, -0.25, datetime.timedelta(0), datetime.timedelta(milliseconds=-1)],
)
def test_non_positive_timeout(timeout: Any) -> None:
    message = refused(workflow.define(transfer(), step("bad.task", timeout=timeout)))
    assert_names(message, WF, "bad.task", "timeout")


@pytest.mark.parametrize("timeout", [float("nan"), "30", True])
def test_timeout_that_is_not_a_duration(timeout: Any) -> None:
    message = refused(workflow.define(transfer(), step("bad.task", timeout=timeout)))
    assert_names(message, WF, "bad.task", "timeout")


@pytest.mark.parametrize(
    ("timeout", "expected"),
    [(30, 30.0), (2.5, 2.5), (datetime.timedelta(minutes=1, milliseconds=500), 60.5)],
)
def test_timeouts_accepted(timeout: Any, expected: float) -> None:
    reg = workflow.Registry()
    reg.register(workflow.define(transfer(), step("ok.task", timeout=timeout)))
    assert reg.policy(WF, "ok.task").timeout == expected


def test_unset_options_fall_back_to_config() -> None:
    reg = workflow.Registry()
    reg.register(workflow.define(transfer(), step("ok.task")))
    policy = reg.policy(WF, "ok.task")
    assert policy.timeout is None
    assert policy.max_attempts is None
    assert policy.backoff_base is None
    assert policy.backoff_max is None
    assert policy.schedule is None


@pytest.mark.parametrize("max_attempts", [0, -1, -100])
def test_non_positive_max_attempts(max_attempts: int) -> None:
    message = refused(workflow.define(transfer(), step("bad.task", max_attempts=max_attempts)))
    assert_names(message, WF, "bad.task", "max_attempts")


@pytest.mark.parametrize("max_attempts", [1.5, 2.0, "3", True, False])
def test_non_int_max_attempts(max_attempts: Any) -> None:
    message = refused(workflow.define(transfer(), step("bad.task", max_attempts=max_attempts)))
    assert_names(message, WF, "bad.task", "max_attempts")


@pytest.mark.parametrize("max_attempts", [1, 8, 10_000])
def test_max_attempts_accepted(max_attempts: int) -> None:
    reg = workflow.Registry()
    reg.register(workflow.define(transfer(), step("ok.task", max_attempts=max_attempts)))
    assert reg.policy(WF, "ok.task").max_attempts == max_attempts


# --- task names shared between workflows ---------------------------------------------


def test_shared_task_name_with_a_different_output_type() -> None:
    reg = workflow.Registry()
    reg.register(
        workflow.define(
            transfer("Transfer.A"), workflow.handle(workflow.Task("shared", Reserved), reserve_fn)
        )
    )

    def refund(run: workflow.TaskRun[TransferInput]) -> Refunded:
        return Refunded(id=run.input.account)

    definition = workflow.define(
        transfer("Transfer.B"), workflow.handle(workflow.Task("shared", Refunded), refund)
    )
    message = refused(definition, reg)
    assert_names(message, "Transfer.B", "shared", "Reserved", "Refunded")
    assert reg.names() == ["Transfer.A"]


def test_shared_task_name_recording_nothing_versus_an_output_type() -> None:
    reg = workflow.Registry()
    reg.register(workflow.define(transfer("Transfer.A"), step("shared")))
    definition = workflow.define(
        transfer("Transfer.B"), workflow.handle(workflow.Task("shared", Reserved), reserve_fn)
    )
    assert_names(refused(definition, reg), "Transfer.B", "shared")


def test_shared_task_name_with_the_same_output_type_accepted() -> None:
    reg = workflow.Registry()
    reg.register(
        workflow.define(
            transfer("Transfer.A"), workflow.handle(workflow.Task("shared", Reserved), reserve_fn)
        )
    )
    reg.register(
        workflow.define(
            transfer("Transfer.B"), workflow.handle(workflow.Task("shared", Reserved), reserve_fn)
        )
    )
    reg.register(workflow.define(transfer("Transfer.C"), step("shared.none")))
    reg.register(workflow.define(transfer("Transfer.D"), step("shared.none")))
    assert reg.names() == ["Transfer.A", "Transfer.B", "Transfer.C", "Transfer.D"]


def test_refused_definition_leaves_no_trace() -> None:
    reg = workflow.Registry()
    bad = workflow.define(
        transfer("Transfer.Bad"),
        workflow.handle(workflow.Task("first", Reserved), reserve_fn),
        step("second", timeout=0),
    )
    refused(bad, reg)
    assert reg.names() == []
    # Neither the workflow name nor the output type of "first" was kept.
    reg.register(workflow.define(transfer("Transfer.Bad"), step("first")))
    assert reg.names() == ["Transfer.Bad"]


# --- malformed arguments -------------------------------------------------------------


def test_register_takes_a_definition() -> None:
    bad: Any = transfer()
    refused(bad)


def test_step_needs_a_callable_handler() -> None:
    not_callable: Any = "not a function"
    definition = workflow.define(
        transfer(), workflow.handle(workflow.Task("bad.task"), not_callable)
    )
    assert_names(refused(definition), WF, "bad.task")


def test_empty_workflow_name() -> None:
    refused(workflow.define(transfer(""), step()))


# --- steps ---------------------------------------------------------------------------


def test_handle_keeps_its_options() -> None:
    task = workflow.Task("t", Reserved)
    backoff = workflow.Backoff(base=2, max=60)
    s = workflow.handle(task, reserve_fn, timeout=5, max_attempts=3, backoff=backoff)
    assert s.task is task
    assert s.fn is reserve_fn
    assert (s.timeout, s.max_attempts, s.backoff, s.backoff_schedule) == (5, 3, backoff, None)
    assert s.skip is None


def test_skip_if_returns_a_new_step() -> None:
    def pred(i: TransferInput) -> bool:
        return i.amount_cents == 0

    original = step("t", timeout=30, max_attempts=4, backoff_schedule=[1, 2])
    skipping = original.skip_if(pred)
    assert skipping is not original
    assert original.skip is None
    assert skipping.skip is pred
    assert attrs.evolve(skipping, skip=None) == original
    assert skipping.skip(TransferInput(account="a", amount_cents=0))
    assert not skipping.skip(TransferInput(account="a", amount_cents=1))


def test_skip_if_step_registers() -> None:
    s = step("t").skip_if(lambda i: i.amount_cents == 0)
    reg = workflow.Registry()
    reg.register(workflow.define(transfer(), s))
    definition = reg.definition(WF)
    assert definition is not None
    assert definition.steps[0].skip is s.skip
