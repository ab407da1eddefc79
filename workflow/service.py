"""The shape shared by the background services: a named thread, `start()`, `stop()`, a wake-up."""

from __future__ import annotations

import threading


class Service:
    """A background duty on its own thread; subclasses implement `_loop`.

    `_loop` runs until `_stopping` is set, sleeping with `_sleep()` so `stop()`
    and `wake()` cut any wait short. `start()` and `stop()` may be called from
    any thread, in any order, any number of times: the thread is created,
    started and published under one lock (so a `stop()` never finds a thread it
    cannot join yet), and a service once stopped never starts.
    """

    name = "workflow-service"

    def __init__(self) -> None:
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the thread, once; does nothing after `stop()`."""
        with self._lock:
            if self._thread is not None or self._stopping.is_set():
                return
            thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            thread.start()
            self._thread = thread

    def wake(self) -> None:
        """Cut the current wait short."""
        self._wake.set()

    def stop(self, timeout: float | None = None) -> None:
        """Ask the loop to end and wait for the thread (up to `timeout`)."""
        with self._lock:
            self._stopping.set()
            thread = self._thread
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _sleep(self, seconds: float) -> None:
        self._wake.wait(max(0.0, seconds))
        self._wake.clear()

    def _loop(self) -> None:
        raise NotImplementedError
