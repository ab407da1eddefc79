"""RunThreads, the fast path's and the poller's thread pool (no database needed).

Jobs run on at most `size` threads; a thread the OS refuses leaves nothing
half-done (with no thread running the submit raises, no job is queued, a later submit
starts a thread; with some running, the job waits for them and `capacity` says how
many there are until another is tried);
after `shutdown()` submits raise and the threads stop behind the queued jobs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from workflow.runthreads import RunThreads

LOG = logging.getLogger("test.runthreads")
REAL_START = threading.Thread.start  # the real one, whatever a test patches in


def alive(prefix: str) -> list[threading.Thread]:
    """The live threads whose names start with `prefix`, by name."""
    return sorted((t for t in threading.enumerate() if t.name.startswith(prefix)),
                  key=lambda t: t.name)


def on_its_own_thread(call: Callable[[], None]) -> list[BaseException | None]:
    """Run `call` on a new thread (started for real, whatever `Thread.start` is patched
    to); [its exception, or None] once it returns, [] if it has not within 10 s."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=run, daemon=True)
    REAL_START(thread)
    thread.join(10)
    return outcome



def test_jobs_run_on_at_most_size_threads() -> None:
    threads = RunThreads(3, "rt-size", LOG)
    lock = threading.Lock()
    seen: set[str] = set()
    done = threading.Semaphore(0)
    gate = threading.Event()

    def job(_: Any) -> None:
        with lock:
            seen.add(threading.current_thread().name)
        gate.wait(10)
        done.release()

    for i in range(12):
        threads.submit(job, i)
    gate.set()
    for _ in range(12):
        assert done.acquire(timeout=10)
    assert 1 <= len(seen) <= 3
    assert all(name.startswith("rt-size_") for name in seen)
    threads.shutdown(wait=True, timeout=10)


def test_a_thread_the_os_refuses_leaves_nothing_half_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    threads = RunThreads(1, "rt-refused", LOG)
    ran: list[int] = []
    done = threading.Event()

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        threads.submit(ran.append, 1)
    monkeypatch.setattr(threading.Thread, "start", REAL_START)

    def job(n: int) -> None:
        ran.append(n)
        done.set()

    threads.submit(job, 2)
    assert done.wait(10)
    assert ran == [2]  # the refused job was never queued
    threads.shutdown(wait=True, timeout=10)


def test_a_thread_refused_beside_running_ones_queues_the_job_and_lowers_capacity(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("workflow.runthreads.GROW_RETRY", 1.0)
    threads = RunThreads(3, "rt-ceiling", LOG)
    gate = threading.Event()
    done = threading.Semaphore(0)
    names: list[str] = []
    refusing = True

    def start(thread: threading.Thread) -> None:
        if refusing and thread.name != "rt-ceiling_0":
            raise RuntimeError("can't start new thread")
        REAL_START(thread)

    def job(_: Any) -> None:
        gate.wait(10)
        names.append(threading.current_thread().name)
        done.release()

    monkeypatch.setattr(threading.Thread, "start", start)
    assert threads.capacity == 3
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        threads.submit(job, 1)  # rt-ceiling_0
        threads.submit(job, 2)  # rt-ceiling_1 refused: queued behind the first
        threads.submit(job, 3)  # no new thread tried before the retry
    assert threads.capacity == 1
    assert [r.getMessage() for r in caplog.records if "can't start a new" in r.getMessage()]
    gate.set()
    for _ in range(3):
        assert done.acquire(timeout=10)
    assert names == ["rt-ceiling_0"] * 3
    time.sleep(1.05)
    assert threads.capacity == 3  # a new thread is tried again
    refusing = False
    both = threading.Barrier(2, timeout=10)  # passed only by two jobs running at once

    def side_by_side(_: Any) -> None:
        both.wait()
        names.append(threading.current_thread().name)
        done.release()

    threads.submit(side_by_side, 4)  # rt-ceiling_0 is idle: no new thread needed
    threads.submit(side_by_side, 5)  # starts rt-ceiling_1
    assert threads.capacity == 3
    for _ in range(2):
        assert done.acquire(timeout=10)
    assert sorted(names[3:]) == ["rt-ceiling_0", "rt-ceiling_1"]
    threads.shutdown(wait=True, timeout=10)


def test_start_all_starts_every_thread_idle_and_jobs_start_none() -> None:
    threads = RunThreads(3, "rt-all", LOG)
    threads.start_all()
    before = alive("rt-all_")
    assert [t.name for t in before] == ["rt-all_0", "rt-all_1", "rt-all_2"]
    both = threading.Barrier(3, timeout=10)  # passed only by three jobs running at once
    done = threading.Semaphore(0)

    def job(_: Any) -> None:
        both.wait()
        done.release()

    for i in range(3):
        threads.submit(job, i)
    for _ in range(3):
        assert done.acquire(timeout=10)
    assert alive("rt-all_") == before  # the same threads ran the jobs: none started for one
    threads.shutdown(wait=True, timeout=10)
    assert alive("rt-all_") == []


def test_start_all_refused_beside_started_threads_lowers_capacity_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    threads = RunThreads(4, "rt-some", LOG)

    def start(thread: threading.Thread) -> None:
        if thread.name not in ("rt-some_0", "rt-some_1"):
            raise RuntimeError("can't start new thread")
        REAL_START(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        threads.start_all()
        assert threads.capacity == 2
        done = threading.Semaphore(0)
        for i in range(4):  # the two idle threads take two; no new thread is tried
            threads.submit(lambda _: done.release(), i)
        for _ in range(4):
            assert done.acquire(timeout=10)
    said = [r.getMessage() for r in caplog.records if "can't start a new" in r.getMessage()]
    assert len(said) == 1 and "going on with 2 of 4" in said[0], said
    threads.shutdown(wait=True, timeout=10)


def test_start_all_with_no_thread_able_to_start_leaves_the_refusal_to_submit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    threads = RunThreads(2, "rt-none", LOG)

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    threads.start_all()  # quietly: a worker still starts, and its poller pauses
    with pytest.raises(RuntimeError, match="can't start new thread"):
        threads.submit(lambda _: None, 1)
    monkeypatch.setattr(threading.Thread, "start", REAL_START)
    done = threading.Event()
    threads.submit(lambda _: done.set(), 2)
    assert done.wait(10)
    threads.shutdown(wait=True, timeout=10)


def test_a_shutdown_from_a_signal_handler_inside_start_all_stops_every_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A handler that runs on the starting thread while it waits for a new thread, and
    # calls shutdown() (Runnable.stop from a signal handler): before, start_all held the
    # lock shutdown takes, and this thread waited for itself.
    threads = RunThreads(3, "rt-handler", LOG)
    calls = 0

    def start(thread: threading.Thread) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            threads.shutdown()  # as the handler would, before the thread is counted
        REAL_START(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    outcome = on_its_own_thread(threads.start_all)
    assert outcome == [None], "start_all waited for the lock its own thread held"
    monkeypatch.undo()
    threads.shutdown(wait=True, timeout=10)
    assert alive("rt-handler_") == []


def test_a_thread_started_then_interrupted_in_start_all_is_counted_and_stops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    threads = RunThreads(2, "rt-ctrl-c", LOG)

    def start(thread: threading.Thread) -> None:
        REAL_START(thread)
        raise KeyboardInterrupt  # Ctrl-C in the wait for the started thread

    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(KeyboardInterrupt):
        threads.start_all()
    monkeypatch.undo()
    assert threads.capacity == 2
    ran = threading.Event()
    threads.submit(lambda _: ran.set(), 1)  # the started thread takes it
    assert ran.wait(10)
    threads.shutdown(wait=True, timeout=10)
    assert alive("rt-ctrl-c_") == []


def test_a_thread_starting_for_a_job_holds_up_neither_threads_back_nor_other_submits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A new thread can wait a while for the GIL before it runs. Before, submit started
    # it under the lock every thread back from a job takes: they, and every submit,
    # waited with it.
    threads = RunThreads(2, "rt-slow", LOG)
    gate = threading.Event()

    def start(thread: threading.Thread) -> None:
        if thread.name == "rt-slow_1":
            gate.wait(30)  # this start is slow
        REAL_START(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    first_done, second_ran, third_ran = threading.Event(), threading.Event(), threading.Event()
    try:
        holding = threading.Event()
        threads.submit(lambda _: (holding.wait(10), first_done.set()), 1)  # rt-slow_0
        slow = threading.Thread(target=threads.submit, args=(lambda _: second_ran.set(), 2))
        REAL_START(slow)  # needs rt-slow_1, whose start waits for the gate
        time.sleep(0.1)
        holding.set()  # rt-slow_0 comes back from its job
        assert first_done.wait(10)
        other = threading.Thread(target=threads.submit, args=(lambda _: third_ran.set(), 3))
        REAL_START(other)  # rt-slow_0 is free: it takes this job at once
        assert third_ran.wait(5), "a submit waited for another's thread to start"
        assert not second_ran.is_set()  # queued once its own thread runs
    finally:
        gate.set()
    assert second_ran.wait(10)
    slow.join(10)
    other.join(10)
    threads.shutdown(wait=True, timeout=10)


def test_a_shutdown_from_a_signal_handler_inside_submit_refuses_the_job_and_stops_the_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    threads = RunThreads(2, "rt-submit-handler", LOG)

    def start(thread: threading.Thread) -> None:
        threads.shutdown()  # as a handler's Manager.close() would, on this thread
        REAL_START(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    outcome = on_its_own_thread(lambda: threads.submit(lambda _: None, 1))
    assert outcome, "submit waited for the lock its own thread held"
    assert isinstance(outcome[0], RuntimeError) and "shut down" in str(outcome[0])
    monkeypatch.undo()
    threads.shutdown(wait=True, timeout=10)
    assert alive("rt-submit-handler_") == []


def test_after_shutdown_submits_raise_and_queued_jobs_still_run() -> None:
    threads = RunThreads(1, "rt-shutdown", LOG)
    gate = threading.Event()
    ran: list[int] = []
    threads.submit(lambda _: gate.wait(10), None)
    threads.submit(ran.append, 1)  # queued behind the blocked job
    threads.shutdown()
    with pytest.raises(RuntimeError):
        threads.submit(ran.append, 2)
    gate.set()
    threads.shutdown(wait=True, timeout=10)  # twice is fine
    assert ran == [1]


def test_a_job_that_raises_is_logged_and_the_thread_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    threads = RunThreads(1, "rt-raises", LOG)
    done = threading.Event()

    def boom(_: Any) -> None:
        raise ValueError("boom")

    with caplog.at_level(logging.ERROR, logger=LOG.name):
        threads.submit(boom, None)
        threads.submit(lambda _: done.set(), None)
        assert done.wait(10)
    assert any("raised" in r.getMessage() for r in caplog.records)
    threads.shutdown(wait=True, timeout=10)
