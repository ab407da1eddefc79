"""The shape shared by the background services: a named thread, `start()`, `stop()`, a wake-up."""

from __future__ import annotations

import threading


class Service:
    """A background duty on its own thread; subclasses implement `_loop`.

    `_loop` runs until `_stopping` is set, sleeping with `_sleep()` so `stop()`
    and `wake()` cut any wait short.
    """

    name = "workflow-service"

    def __init__(self) -> None:
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()

    def wake(self) -> None:
        """Cut the current wait short."""
        self._wake.set()

    def stop(self, timeout: float | None = None) -> None:
        """Ask the loop to end and wait for the thread (up to `timeout`)."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _sleep(self, seconds: float) -> None:
        self._wake.wait(max(0.0, seconds))
        self._wake.clear()

    def _loop(self) -> None:
        raise NotImplementedError
