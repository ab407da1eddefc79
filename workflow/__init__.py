"""pgworkflow: durable, ordered task runs for synchronous Python, stored in PostgreSQL.

Declare workflows and tasks (`Workflow`, `Task`, `define`, `handle`), register
them (`Registry`), build a `Manager` over a connection pool, and start runs with
`Workflow.start` or `Workflow.start_tx`. `workflow.store` holds the schema
migrations and the only SQL.
"""

from workflow.definition import Backoff, Definition, Registry, Step, Task, Workflow, define, handle
from workflow.errors import (
    Cancelled,
    CodedError,
    ConfigError,
    DecodeError,
    EncodeError,
    OutputMissing,
    Permanent,
    RegistrationError,
    RunNotFound,
    WorkflowError,
    code_of,
    is_permanent,
    permanent,
    with_code,
)
from workflow.logs import ALERT
from workflow.store import SchemaOutdated
from workflow.taskrun import TaskRun, new_task_run

__all__ = [
    "ALERT",
    "Backoff",
    "Cancelled",
    "CodedError",
    "ConfigError",
    "DecodeError",
    "Definition",
    "EncodeError",
    "OutputMissing",
    "Permanent",
    "RegistrationError",
    "Registry",
    "RunNotFound",
    "SchemaOutdated",
    "Step",
    "Task",
    "TaskRun",
    "Workflow",
    "WorkflowError",
    "code_of",
    "define",
    "handle",
    "is_permanent",
    "new_task_run",
    "permanent",
    "with_code",
]
