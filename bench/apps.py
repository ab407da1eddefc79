"""The benchmark workflows, and the `--app` factory the worker processes import.

- `Bench.One`: one no-op task.
- `Bench.Three`: three no-op tasks, strictly in order.
- `Bench.Pickup`: one task whose first line stamps `time.time()` and records it as
  its output, so the bench can measure commit-to-handler pickup latency.
- `Bench.Order`: what users run: an attrs input and three tasks, each returning a
  small attrs output (or text) that the next task reads (`order_registry()`).

No-op tasks are declared without an output type: they record nothing, like the
null engine's `output = NULL`.
"""

from __future__ import annotations

import time

import attrs

import workflow


@attrs.frozen
class BenchInput:
    n: int


One = workflow.Workflow("Bench.One", BenchInput)
Three = workflow.Workflow("Bench.Three", BenchInput)
Pickup = workflow.Workflow("Bench.Pickup", BenchInput)

a = workflow.Task("bench.a")
b = workflow.Task("bench.b")
c = workflow.Task("bench.c")
stamp = workflow.Task("bench.stamp", float)


def noop(run: workflow.TaskRun[BenchInput]) -> None:
    return None


def stamp_now(run: workflow.TaskRun[BenchInput]) -> float:
    return time.time()


def registry() -> workflow.Registry:
    """A fresh registry with the three benchmark workflows."""
    reg = workflow.Registry()
    reg.register(workflow.define(One, workflow.handle(a, noop)))
    reg.register(
        workflow.define(
            Three, workflow.handle(a, noop), workflow.handle(b, noop), workflow.handle(c, noop)
        )
    )
    reg.register(workflow.define(Pickup, workflow.handle(stamp, stamp_now)))
    return reg


def factory() -> workflow.Registry:
    """`python -m workflow.worker --app bench.apps:factory`."""
    return registry()


WORKFLOWS = {1: One, 3: Three}


@attrs.frozen
class Order:
    order_id: int
    cents: int


@attrs.frozen
class Hold:
    ref: str
    cents: int


@attrs.frozen
class Charge:
    ref: str
    captured: int


OrderFlow = workflow.Workflow("Bench.Order", Order)
reserve = workflow.Task("reserve", Hold)
charge = workflow.Task("charge", Charge)
receipt = workflow.Task("receipt", str)


def _reserve(run: workflow.TaskRun[Order]) -> Hold:
    return Hold(ref=f"hold-{run.input.order_id}", cents=run.input.cents)


def _charge(run: workflow.TaskRun[Order]) -> Charge:
    hold = run.output(reserve)
    return Charge(ref=hold.ref.replace("hold", "charge"), captured=hold.cents)


def _receipt(run: workflow.TaskRun[Order]) -> str:
    paid = run.output(charge)
    return f"{paid.ref}: {paid.captured} cents"


def order_steps() -> tuple[workflow.Step[Order], ...]:
    """`Bench.Order`'s three steps, for a registry of one's own."""
    return (
        workflow.handle(reserve, _reserve),
        workflow.handle(charge, _charge),
        workflow.handle(receipt, _receipt),
    )


def order_registry() -> workflow.Registry:
    """A fresh registry with `Bench.Order`."""
    reg = workflow.Registry()
    reg.register(workflow.define(OrderFlow, *order_steps()))
    return reg


@attrs.frozen
class Payment:
    account: int
    n: int


@attrs.frozen
class Paid:
    n: int


Keyed = workflow.Workflow("Bench.Keyed", Payment)
Unkeyed = workflow.Workflow("Bench.Unkeyed", Payment)
pay = workflow.Task("bench.pay", Paid)


def _pay(run: workflow.TaskRun[Payment]) -> Paid:
    return Paid(run.input.n)


def keys_factory() -> workflow.Registry:
    """`Bench.Keyed` (one run per account at once, SPEC 15) and its unkeyed twin
    `Bench.Unkeyed`: one task returning a small attrs output."""
    reg = workflow.Registry()
    reg.register(
        workflow.define(Keyed, workflow.handle(pay, _pay), concurrency_key=lambda p: p.account)
    )
    reg.register(workflow.define(Unkeyed, workflow.handle(pay, _pay)))
    return reg
