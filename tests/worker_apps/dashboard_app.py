"""The dashboard browser test's worker app: `Dash.Charge`, declined while its card is
in the test's `declined` table (a permanent failure coded `card.declined`)."""

from __future__ import annotations

import attrs

import workflow

from .ledger import _connections

CREATE_TABLE = "CREATE TABLE declined (card text PRIMARY KEY)"


@attrs.frozen
class Charge:
    card: str
    cents: int


Charge_ = workflow.Workflow("Dash.Charge", Charge)
RESERVE = workflow.Task("dash.reserve", str)
CAPTURE = workflow.Task("dash.capture", str)


def _reserve(run: workflow.TaskRun[Charge]) -> str:
    return f"hold-{run.input.card}"


def _capture(run: workflow.TaskRun[Charge]) -> str:
    with _connections().connection() as conn:
        declined = conn.execute(
            "SELECT 1 FROM declined WHERE card = %s", (run.input.card,)
        ).fetchone()
    if declined:
        raise workflow.permanent(workflow.with_code(
            "card.declined", RuntimeError(f"the issuer declined card {run.input.card}")
        ))
    return f"captured {run.input.cents}"


def registry() -> workflow.Registry:
    reg = workflow.Registry()
    reg.register(workflow.define(
        Charge_, workflow.handle(RESERVE, _reserve), workflow.handle(CAPTURE, _capture)
    ))
    return reg
