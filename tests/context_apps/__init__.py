"""An app for the calling-context and sealing tests, importable by a worker subprocess.

`app()` is a worker factory (`--app context_apps:app`): a registry running the
`context.Audit` workflow, a propagator over the `CALLER` ContextVar and, when
`$CONTEXT_APPS_KEYS` holds comma-separated hex keys, an `AESGCMCipher` over them.
Each handler returns what it saw (`Seen`) as its output, so a test in another
process reads it back from `workflow_tasks.output`.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from contextvars import ContextVar

import attrs

import workflow


@attrs.frozen
class Caller:
    """The calling context a web request would carry: who asked, and which request."""

    actor: str
    request_id: str


CALLER: ContextVar[Caller | None] = ContextVar("context_apps_caller", default=None)
ANONYMOUS = Caller(actor="anonymous", request_id="")


@attrs.frozen
class Order:
    item: str


@attrs.frozen
class Seen:
    """What a handler saw: the calling context (None fields when unset) and its process."""

    actor: str | None
    request_id: str | None
    item: str
    pid: int


Audit = workflow.Workflow("context.Audit", Order)
first = workflow.Task("context.first", Seen)
second = workflow.Task("context.second", Seen)


class CallerPropagator:
    """Snapshots `CALLER`; records every restore()'s enter and exit."""

    snapshot_type = Caller

    def __init__(self) -> None:
        self.events: list[tuple[str, Caller, str]] = []
        self._lock = threading.Lock()

    def capture(self) -> Caller:
        return CALLER.get() or ANONYMOUS

    @contextlib.contextmanager
    def restore(self, snapshot: Caller) -> Iterator[None]:
        thread = threading.current_thread().name
        with self._lock:
            self.events.append(("enter", snapshot, thread))
        token = CALLER.set(snapshot)
        try:
            yield
        finally:
            CALLER.reset(token)
            with self._lock:
                self.events.append(("exit", snapshot, thread))


def seen(run: workflow.TaskRun[Order]) -> Seen:
    """The default handler: report the calling context it runs under."""
    caller = CALLER.get()
    return Seen(
        actor=caller.actor if caller else None,
        request_id=caller.request_id if caller else None,
        item=run.input.item,
        pid=os.getpid(),
    )


def registry() -> workflow.Registry:
    reg = workflow.Registry()
    reg.register(
        workflow.define(Audit, workflow.handle(first, seen), workflow.handle(second, seen))
    )
    return reg


def cipher_from_env() -> workflow.AESGCMCipher | None:
    keys = os.environ.get("CONTEXT_APPS_KEYS")
    if not keys:
        return None
    return workflow.AESGCMCipher([bytes.fromhex(k) for k in keys.split(",")])


def app() -> workflow.App:
    """The worker factory: the registry, the propagator and the cipher from the environment."""
    config = workflow.Config(
        context=workflow.propagate(CallerPropagator()), cipher=cipher_from_env()
    )
    return workflow.App(registry(), config=config)
