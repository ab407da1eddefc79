"""The shape shared by the background services: a named thread, `start()`, `stop()`, a wake-up."""

from __future__ import annotations

import contextlib
import threading

from workflow.errors import ThreadNotStarted


def start_thread(thread: threading.Thread) -> None:
    """`thread.start()`, raising `ThreadNotStarted` where Python raises RuntimeError."""
    try:
        thread.start()
    except RuntimeError as exc:
        raise ThreadNotStarted(thread.name, exc) from exc


class Service:
    """A background duty on its own thread; subclasses implement `_loop`.

    `_loop` runs until `_stopping` is set, sleeping with `_sleep()` so `stop()`
    and `wake()` cut any wait short. `start()` and `stop()` may be called from
    any thread, in any order, any number of times: the thread is created,
    started and published under one lock (so a `stop()` never finds a thread it
    cannot join yet), and a service once stopped never starts. A `stop()` on the
    thread inside `start()` (a signal handler's) does not wait for itself.
    """

    name = "workflow-service"

    def __init__(self) -> None:
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        # Its own name (subclasses have a `_lock` of theirs); reentrant: a signal
        # handler's stop() may come on the thread inside start().
        self._service_lock = threading.RLock()

    def start(self) -> None:
        """Start the thread, once; does nothing after `stop()`."""
        with self._service_lock:
            if self._thread is not None or self._stopping.is_set():
                return
            thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            try:
                start_thread(thread)
            except BaseException:
                # Not started, or started and then interrupted (Ctrl-C in start()'s wait
                # for it): either way it is told to end, and never starts again; one
                # that runs is kept for stop() to join.
                self._stopping.set()
                self._wake.set()
                if thread.ident is not None:
                    self._thread = thread
                raise
            self._thread = thread

    def wake(self) -> None:
        """Cut the current wait short."""
        self._wake.set()

    def stop(self, timeout: float | None = None) -> None:
        """Ask the loop to end and wait for the thread (up to `timeout`)."""
        with self._service_lock:
            self._stopping.set()
            thread = self._thread
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            with contextlib.suppress(RuntimeError):  # an interrupted start: not started yet
                thread.join(timeout)

    def _sleep(self, seconds: float) -> None:
        self._wake.wait(max(0.0, seconds))
        self._wake.clear()

    def _loop(self) -> None:
        raise NotImplementedError
