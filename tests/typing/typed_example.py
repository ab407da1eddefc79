"""Uses the API exactly as SPEC sections 2 and 5 do; `mypy --strict` must accept it.

Checked by `tests/test_typing.py`; never imported by the test suite.
"""

from __future__ import annotations

import datetime

import attrs

import workflow


@attrs.frozen
class TransferInput:
    account: str
    amount_cents: int


@attrs.frozen
class Reserved:
    id: str


class ProviderRejected(Exception):
    pass


class Provider:
    def reserve(self, account: str, amount_cents: int, *, key: str) -> str:
        return f"{account}:{amount_cents}:{key}"

    def send(self, reservation: str, *, key: str, timeout: float) -> None:
        if timeout <= 0:
            raise ProviderRejected(reservation)


provider = Provider()

Transfer = workflow.Workflow("Transfer.Send", TransferInput)  # Workflow[TransferInput]
reserve = workflow.Task("transfer.reserve", Reserved)  # Task[Reserved]
send = workflow.Task("transfer.send")  # Task[None]: records nothing
audit = workflow.Task("transfer.audit")

transfer_workflow: workflow.Workflow[TransferInput] = Transfer
reserve_task: workflow.Task[Reserved] = reserve
send_task: workflow.Task[None] = send


class Handlers:
    def reserve(self, run: workflow.TaskRun[TransferInput]) -> Reserved:
        run.raise_if_cancelled()
        account: str = run.input.account
        attempt: int = run.attempt
        last: bool = run.last_attempt
        deadline: float = run.deadline
        cancelled: bool = run.cancelled.is_set()
        del attempt, last, deadline, cancelled
        key: str = run.idempotency_key
        return Reserved(id=provider.reserve(account, run.input.amount_cents, key=key))

    def send(self, run: workflow.TaskRun[TransferInput]) -> None:
        prior = run.output(reserve)  # Reserved
        reserved: Reserved = prior
        try:
            provider.send(reserved.id, key=run.idempotency_key, timeout=run.remaining())
        except ProviderRejected as e:
            raise workflow.permanent(workflow.with_code("rejected", e))  # noqa: B904

    def audit(self, run: workflow.TaskRun[TransferInput]) -> None:
        if run.input.amount_cents < 0:
            raise workflow.Permanent("negative amount", code="rejected")
        failure = workflow.with_code("audit", ValueError("not audited"))
        code: str | None = workflow.code_of(failure)
        if workflow.is_permanent(failure) or code is None:
            raise workflow.permanent(failure)
        nothing: None = workflow.permanent(workflow.with_code("audit", None))
        del nothing


def already_sent(input: TransferInput) -> bool:
    return input.amount_cents == 0


def register(reg: workflow.Registry, deps: Handlers) -> None:
    reg.register(
        workflow.define(
            Transfer,
            workflow.handle(reserve, deps.reserve, max_attempts=8),
            workflow.handle(send, deps.send, timeout=30).skip_if(already_sent),
            workflow.handle(
                audit,
                deps.audit,
                timeout=datetime.timedelta(seconds=5),
                backoff=workflow.Backoff(base=1.0, max=300.0),
            ),
        )
    )


def register_with_schedule(reg: workflow.Registry, deps: Handlers) -> None:
    step: workflow.Step[TransferInput] = workflow.handle(
        reserve, deps.reserve, timeout=2.5, backoff_schedule=[1, 5, 30]
    )
    definition: workflow.Definition[TransferInput] = workflow.define(
        workflow.Workflow("Transfer.Other", TransferInput), step
    )
    reg.register(definition)


def test_send() -> None:
    run = workflow.new_task_run(
        TransferInput(account="acc-1", amount_cents=100),
        outputs={reserve: Reserved(id="r-1")},
    )
    typed: workflow.TaskRun[TransferInput] = run
    Handlers().send(typed)
    retry = workflow.new_task_run(
        TransferInput(account="acc-1", amount_cents=100),
        attempt=2,
        max_attempts=3,
        run_id="run-7",
        timeout=datetime.timedelta(seconds=10),
    )
    result: Reserved = Handlers().reserve(retry)
    del result


def main() -> None:
    reg = workflow.Registry()
    register(reg, Handlers())
    register_with_schedule(reg, Handlers())
    reg.freeze()
    test_send()
