"""Logging: the ALERT level, and `EngineLog`, the one way the engine writes a record.

Every message starts with `workflow: `; a message about a run goes on with
`run <id>: ` and its record carries `extra={"run_id": ...}`; a failed write
carries its exception in `exc_info` (the caller passes it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    _Adapter = logging.LoggerAdapter[logging.Logger]
else:  # LoggerAdapter takes a subscript at run time from Python 3.11 only
    _Adapter = logging.LoggerAdapter

ALERT = 60
"""Above CRITICAL: a run is parked and will not move without a person."""

logging.addLevelName(ALERT, "ALERT")


class EngineLog(_Adapter):
    """The engine's records on the manager's logger, prefixed `workflow: `.

    `for_run(run_id)` gives the same log for one run: its messages read
    `workflow: run <id>: ...` and carry the run id in `extra`.
    """

    def __init__(self, logger: logging.Logger, extra: Mapping[str, object] | None = None) -> None:
        super().__init__(logger, extra or {})
        run_id = (extra or {}).get("run_id")
        self._prefix = "workflow: " if run_id is None else f"workflow: run {run_id}: "

    def for_run(self, run_id: object) -> EngineLog:
        """This log, for the messages about one run."""
        return EngineLog(self.logger, {"run_id": str(run_id)})

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        if self.extra:
            kwargs["extra"] = {**self.extra, **(kwargs.get("extra") or {})}
        return self._prefix + str(msg), kwargs
