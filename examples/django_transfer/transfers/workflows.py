"""The Transfer workflow: reserve, then send. No Django imports: workers load it as is."""

from __future__ import annotations

import os

import attrs

import workflow


@attrs.frozen
class TransferInput:
    transfer_id: int
    account: str
    amount_cents: int


@attrs.frozen
class Reserved:
    id: str
    pid: int  # the process that executed the task


SendTransfer = workflow.Workflow("Transfer.Send", TransferInput)
reserve = workflow.Task("transfer.reserve", Reserved)
send = workflow.Task("transfer.send")  # records nothing


def do_reserve(run: workflow.TaskRun[TransferInput]) -> Reserved:
    # A real handler asks the provider for a hold, passing run.idempotency_key.
    return Reserved(id=f"hold-{run.input.transfer_id}", pid=os.getpid())


def do_send(run: workflow.TaskRun[TransferInput]) -> None:
    hold = run.output(reserve)
    # A real handler sends against hold.id with key=run.idempotency_key and
    # timeout=run.remaining(), and raises workflow.permanent(...) on a rejection.
    run.raise_if_cancelled()
    print(f"sent transfer {run.input.transfer_id} against {hold.id}", flush=True)


def registry() -> workflow.Registry:
    """The factory named by settings.WORKFLOW["REGISTRY"]."""
    reg = workflow.Registry()
    reg.register(
        workflow.define(
            SendTransfer,
            workflow.handle(reserve, do_reserve, max_attempts=8),
            workflow.handle(send, do_send, timeout=30),
        )
    )
    return reg
