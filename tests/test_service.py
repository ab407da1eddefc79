"""The `Service` base that every background duty shares (poller, sweeper, listener, heartbeat).

A named daemon thread, started once and never after a stop, whose sleeps `wake()`
and `stop()` cut short, and which `stop()` joins (from any thread, its own
included). The race of a stop right after a start is in test_lifecycle.py.
"""

from __future__ import annotations

import threading

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
