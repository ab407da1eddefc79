"""Deliberate type errors; `mypy --strict` must report one on each line marked "E:".

Checked by `tests/test_typing.py`; never imported by the test suite, and excluded
from ruff in pyproject.toml.
"""

from __future__ import annotations

import attrs

import workflow


@attrs.frozen
class TransferInput:
    account: str
    amount_cents: int


@attrs.frozen
class OtherInput:
    name: str


@attrs.frozen
class Reserved:
    id: str


Transfer = workflow.Workflow("Transfer.Send", TransferInput)
reserve = workflow.Task("transfer.reserve", Reserved)
send = workflow.Task("transfer.send")


def do_reserve(run: workflow.TaskRun[TransferInput]) -> Reserved:
    return Reserved(id=run.input.account)


def do_send(run: workflow.TaskRun[TransferInput]) -> None:
    wrong: int = run.output(reserve)  # E: output() of Task[Reserved] is a Reserved, not an int
    del wrong


def do_other(run: workflow.TaskRun[OtherInput]) -> None:
    del run


def other_sent(input: OtherInput) -> bool:
    return input.name == ""


def register(reg: workflow.Registry) -> None:
    reg.register(
        workflow.define(
            Transfer,
            workflow.handle(reserve, do_reserve),
            workflow.handle(send, do_send).skip_if(other_sent),  # E: predicate of OtherInput
        )
    )


def define_other() -> workflow.Definition[TransferInput]:
    return workflow.define(Transfer, workflow.handle(send, do_other))  # E: OtherInput handler


def register_other(reg: workflow.Registry) -> None:
    # As SPEC section 2 writes it: define() directly inside register().
    reg.register(workflow.define(Transfer, workflow.handle(send, do_other)))  # E: OtherInput


def wrong_output() -> workflow.Step[TransferInput]:
    return workflow.handle(reserve, do_send)  # E: do_send records nothing, reserve a Reserved
