"""The `Service` base that every background duty shares (poller, sweeper, listener, heartbeat).

A named daemon thread, started once and never after a stop, whose sleeps `wake()`
and `stop()` cut short, and which `stop()` joins (from any thread, its own
included). The race of a stop right after a start is in test_lifecycle.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from workflow.service import Service


class Counting(Service):
    """Counts its loops; sleeps up to an hour between them."""

    name = "test-counting"

    def __init__(self) -> None:
        super().__init__()
        self.loops = 0
        self.looped = threading.Condition()

    def _loop(self) -> None:
        while not self._stopping.is_set():
            with self.looped:
                self.loops += 1
                self.looped.notify_all()
            self._sleep(3600)

    def wait_loops(self, n: int) -> bool:
        with self.looped:
            return self.looped.wait_for(lambda: self.loops >= n, timeout=10)


def test_start_runs_one_named_daemon_thread_once() -> None:
    service = Counting()
    service.start()
    service.start()
    try:
        assert service.wait_loops(1)
        threads = [t for t in threading.enumerate() if t.name == "test-counting"]
        assert len(threads) == 1 and threads[0].daemon
    finally:
        service.stop(timeout=5)


def test_wake_cuts_a_sleep_short() -> None:
    service = Counting()
    service.start()
    try:
        assert service.wait_loops(1)
        service.wake()
        assert service.wait_loops(2), "wake() did not end the hour-long sleep"
    finally:
        service.stop(timeout=5)


def test_stop_cuts_the_sleep_short_and_joins_the_thread() -> None:
    service = Counting()
    service.start()
    assert service.wait_loops(1)
    service.stop(timeout=5)
    assert not any(t.name == "test-counting" and t.is_alive() for t in threading.enumerate())
    assert service.loops == 1


def test_a_service_stopped_before_it_started_never_starts() -> None:
    service = Counting()
    service.stop(timeout=5)
    service.start()
    assert not any(t.name == "test-counting" and t.is_alive() for t in threading.enumerate())
    assert service.loops == 0


def test_stop_from_the_services_own_thread_does_not_wait_for_itself() -> None:
    stopped = threading.Event()

    class StopsItself(Service):
        name = "test-stops-itself"

        def _loop(self) -> None:
            self.stop(timeout=5)  # would deadlock if it joined itself
            stopped.set()

    service = StopsItself()
    service.start()
    assert stopped.wait(10)
    service.stop(timeout=5)


class SlowToEnd(Counting):
    """Counting, which once told to stop takes a moment to wind down (its last write)."""

    name = "test-slow-to-end"

    def __init__(self) -> None:
        super().__init__()
        self.ended = threading.Event()

    def _loop(self) -> None:
        super()._loop()
        time.sleep(0.3)
        self.ended.set()


def start_interrupted_then_stop(
    service: Service,
    monkeypatch: pytest.MonkeyPatch,
    start: Callable[[threading.Thread], None],
) -> None:
    """`service.start()` with `Thread.start` replaced by `start` (which raises
    KeyboardInterrupt), then `start()` again (stopped by the interrupt: it starts
    nothing) and `stop()`."""
    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(KeyboardInterrupt):
        service.start()
    monkeypatch.undo()
    service.start()
    service.stop(timeout=10)


def test_a_start_interrupted_after_its_thread_started_is_stopped_and_joined(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Ctrl-C in start()'s wait for the new thread, after the thread began: start() raises,
    # the thread is told to end, a later start() starts none, and stop() waits for it.
    real_start = threading.Thread.start

    def start_then_interrupt(thread: threading.Thread) -> None:
        real_start(thread)
        raise KeyboardInterrupt

    service = SlowToEnd()
    start_interrupted_then_stop(service, monkeypatch, start_then_interrupt)
    assert service.ended.is_set()  # stop() waited for the thread that did start
    assert [t for t in threading.enumerate() if t.name == SlowToEnd.name] == []


def test_a_start_interrupted_before_its_thread_started_never_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def interrupt(thread: threading.Thread) -> None:
        raise KeyboardInterrupt

    service = Counting()
    start_interrupted_then_stop(service, monkeypatch, interrupt)  # no thread to join
    assert service.loops == 0
