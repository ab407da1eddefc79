"""Logging: the ALERT level, and the engine's logger adapter.

Every message starts with `workflow: `; run-related records carry
`extra={"run_id": ...}`; a failed write carries its exception in `exc_info`.
"""

from __future__ import annotations

import logging

ALERT = 60
"""Above CRITICAL: a run is parked and will not move without a person."""

logging.addLevelName(ALERT, "ALERT")
