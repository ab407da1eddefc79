"""The engine's events (`workflow/events.py`): what a subscriber hears, in order.

Metrics, traces and the run history are built on these, so each of the engine's
paths must announce what happened once, in order, on the thread where it
happened: a run that succeeds, one that fails once then succeeds, one that
parks, one whose claim is lost, one swept. A subscriber that raises is logged
and changes nothing; one that raises an interrupt has it raised once the others
have had the event.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import psycopg
import pytest
from helpers import Inp, Out, Records, registry, wait_until

import workflow
from workflow import Status
from workflow.events import (
    AttemptBegan,
    AttemptEnded,
    ClaimLost,
    ClaimsSwept,
    Events,
    Outcome,
    RunFinished,
)
from workflow.logs import EngineLog

A = workflow.Task("a", Out)
B = workflow.Task("b", Out)


class Heard:
    def __init__(self) -> None:
        self.events: list[Any] = []
        self.threads: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, event: Any) -> None:
        with self.lock:
            self.events.append(event)
            self.threads.append(threading.current_thread().name)

    def kinds(self, run_id: str | None = None) -> list[str]:
        with self.lock:
            return [
                type(e).__name__
                + (f":{e.outcome.value}" if isinstance(e, AttemptEnded) else "")
                + (f":{e.status.value}" if isinstance(e, RunFinished) else "")
                for e in self.events
                if run_id is None or str(getattr(e, "run_id", run_id)) == run_id
            ]


def test_a_two_task_run_that_fails_once_announces_each_step_in_order(
    make_manager: Any,
) -> None:
    def flaky(run: workflow.TaskRun[Inp]) -> Out:
        if run.attempt == 1:
            raise RuntimeError("once")
        return Out("a")

    reg, wf = registry(
        workflow.handle(A, flaky, backoff_schedule=[0.01]),
        workflow.handle(B, lambda run: Out("b")),
    )
    mgr = make_manager(reg)
    heard = Heard()
    mgr.events.subscribe(heard)
    run = wf.start(mgr, Inp(1))
    assert run.wait(timeout=20) is Status.SUCCEEDED
    wait_until(lambda: "ExecutionEnded" in heard.kinds(), "the run's end to be heard")
    assert heard.kinds(run.id) == [
        "RunStarted",
        "RunClaimed",
        "AttemptBegan",
        "AttemptEnded:failed",
        "AttemptBegan",
        "AttemptEnded:succeeded",
        "AttemptBegan",
        "AttemptEnded:succeeded",
        "RunFinished:succeeded",
        "ExecutionEnded",
    ]
    began = [e for e in heard.events if isinstance(e, AttemptBegan)]
    assert [(e.task, e.seq, e.attempt) for e in began] == [("a", 1, 1), ("a", 1, 2), ("b", 2, 1)]
    ended = [e for e in heard.events if isinstance(e, AttemptEnded)]
    assert isinstance(ended[0].error, RuntimeError) and ended[1].error is None
    assert all(e.seconds >= 0 and e.workflow == "W" for e in ended)
    # An attempt's events are heard on the thread that ran its handler.
    attempt_threads = {
        t for e, t in zip(heard.events, heard.threads, strict=True)
        if isinstance(e, (AttemptBegan, AttemptEnded))
    }
    assert len(attempt_threads) == 1 and attempt_threads.pop().startswith("workflow-run")


def test_a_park_and_a_timeout_are_announced(make_manager: Any) -> None:
    def slow_then_rejects(run: workflow.TaskRun[Inp]) -> Out:
        if run.attempt == 1:
            run.cancelled.wait(5)
            raise TimeoutError("too slow")
        raise workflow.Permanent("rejected", code="no")

    reg, wf = registry(workflow.handle(A, slow_then_rejects, timeout=0.2, backoff_schedule=[0]))
    mgr = make_manager(reg)
    heard = Heard()
    mgr.events.subscribe(heard)
    run = wf.start(mgr, Inp(1))
    assert run.wait(timeout=20) is Status.PARKED
    wait_until(lambda: "ExecutionEnded" in heard.kinds(), "the park to be heard")
    assert heard.kinds(run.id) == [
        "RunStarted",
        "RunClaimed",
        "AttemptBegan",
        "AttemptEnded:timed_out",
        "AttemptBegan",
        "AttemptEnded:failed",
        "RunFinished:parked",
        "ExecutionEnded",
    ]


def test_a_lost_claim_is_announced(make_manager: Any, db: psycopg.Connection[Any]) -> None:
    entered, go_on = threading.Event(), threading.Event()

    def waits(run: workflow.TaskRun[Inp]) -> Out:
        entered.set()
        go_on.wait(10)
        return Out("late")

    reg, wf = registry(workflow.handle(A, waits))
    mgr = make_manager(reg)
    heard = Heard()
    mgr.events.subscribe(heard)
    run = wf.start(mgr, Inp(1))
    assert entered.wait(10)
    db.execute("UPDATE workflow_runs SET claim_id = gen_random_uuid() WHERE id = %s", (run.id,))
    go_on.set()
    wait_until(lambda: "ExecutionEnded" in heard.kinds(), "the lost claim to be heard")
    lost = [e for e in heard.events if isinstance(e, ClaimLost)]
    assert str(lost[0].run_id) == run.id
    assert not any(isinstance(e, RunFinished) for e in heard.events)
    (ended,) = [e for e in heard.events if isinstance(e, AttemptEnded)]
    assert ended.outcome is Outcome.ABANDONED and ended.claim_lost, (
        "a lost claim's attempt is the sweeper's to count"
    )


def test_a_cancel_is_announced_by_the_execution_it_stops(make_manager: Any, db_url: str) -> None:
    entered = threading.Event()

    def waits(run: workflow.TaskRun[Inp]) -> Out:
        entered.set()
        run.cancelled.wait(10)
        return Out("late")

    reg, wf = registry(workflow.handle(A, waits))
    mgr = make_manager(reg)
    heard = Heard()
    mgr.events.subscribe(heard)
    run = wf.start(mgr, Inp(1))
    assert entered.wait(10)
    with workflow.Admin(db_url) as admin:
        admin.cancel(run.id)
    wait_until(lambda: "ExecutionEnded" in heard.kinds(), "the cancel to be heard")
    assert heard.kinds(run.id)[-3:] == [
        "AttemptEnded:cancelled", "RunFinished:cancelled", "ExecutionEnded"
    ]


def test_a_sweep_is_announced(make_manager: Any, db: psycopg.Connection[Any]) -> None:
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg)
    with db.transaction():
        run = wf.start_tx(db, mgr, Inp(1))
    db.execute(
        "UPDATE workflow_runs SET claim_id = gen_random_uuid(), "
        "heartbeat_at = now() - interval '1 hour' WHERE id = %s",
        (run.id,),
    )
    heard = Heard()
    mgr.events.subscribe(heard)
    sweeper = mgr.new_runnable(workflow.RunnerConfig(listen=False)).sweeper
    assert sweeper is not None and sweeper.sweep() == 1
    (swept,) = [e for e in heard.events if isinstance(e, ClaimsSwept)]
    assert [str(r) for r in swept.run_ids] == [run.id]
    assert [(str(a.run_id), a.workflow, a.task, a.seq, a.attempts) for a in swept.attempts] == [
        (run.id, "W", "a", 1, 1)
    ]


def test_a_subscriber_that_raises_is_logged_and_changes_nothing(
    make_manager: Any, logs: tuple[logging.Logger, Records]
) -> None:
    logger, records = logs
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    mgr = make_manager(reg, logger=logger)

    def broken(event: Any) -> None:
        raise ValueError("a broken subscriber")

    mgr.events.subscribe(broken)
    assert wf.start(mgr, Inp(1)).wait(timeout=20) is Status.SUCCEEDED
    assert any("an event subscriber raised" in m for m in records.messages())


def test_a_subscriber_raising_an_interrupt_leaves_the_others_their_event(
    logs: tuple[logging.Logger, Records],
) -> None:
    """A `SystemExit` (or a Ctrl-C) raised by one subscriber reaches the code that emitted
    the event, but only once every other subscriber has had it: a subscriber that missed
    an event would keep a wrong picture from then on (tracing that missed a run's
    `FinishHandedOver` never ended its spans). A second interrupt is logged."""
    logger, records = logs
    events = Events(EngineLog(logger))
    heard = Heard()

    def exits(event: Any) -> None:
        raise SystemExit(3)

    def interrupted(event: Any) -> None:
        raise KeyboardInterrupt

    events.subscribe(exits)
    events.subscribe(heard)
    events.subscribe(interrupted)
    events.subscribe(heard)
    event = ClaimsSwept(())
    with pytest.raises(SystemExit):
        events.emit(event)
    assert heard.events == [event, event]
    assert any("an event subscriber raised" in m for m in records.messages())


def test_unsubscribing_stops_the_events_and_nothing_is_built_without_subscribers(
    make_manager: Any,
) -> None:
    reg, wf = registry(workflow.handle(A, lambda run: Out("x")))
    # Tracing, on by default when opentelemetry-api is installed, is a subscriber.
    mgr = make_manager(reg, config=workflow.Config(tracing=False))
    assert not mgr.events.active
    heard = Heard()
    unsubscribe = mgr.events.subscribe(heard)
    assert mgr.events.active
    assert wf.start(mgr, Inp(1)).wait(timeout=20) is Status.SUCCEEDED
    wait_until(lambda: "ExecutionEnded" in heard.kinds(), "the first run's end")
    unsubscribe()
    assert not mgr.events.active
    count = len(heard.events)
    assert wf.start(mgr, Inp(2)).wait(timeout=20) is Status.SUCCEEDED
    time.sleep(0.1)
    assert len(heard.events) == count


def test_the_events_name_their_outcomes_as_spec_13_counts_them() -> None:
    assert {o.value for o in Outcome} == {
        "succeeded", "failed", "timed_out", "abandoned", "cancelled"
    }
