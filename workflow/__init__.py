"""pgworkflow: durable, ordered task runs for synchronous Python, stored in PostgreSQL.

Declare workflows and tasks (`Workflow`, `Task`, `define`, `handle`), register
them (`Registry`), build a `Manager` over a connection pool, and start runs with
`Workflow.start` or `Workflow.start_tx`. `workflow.store` holds the schema
migrations and the only SQL.
"""

from workflow.admin import (
    Admin,
    HistoryEntry,
    QueueDepth,
    QueueStats,
    RunDetail,
    RunPage,
    RunSummary,
    ScheduleState,
    TaskState,
    WorkflowStats,
)
from workflow.app import App
from workflow.config import Config, Retention, RunnerConfig
from workflow.definition import Definition, Registry, Step, Task, Workflow, define, handle
from workflow.errors import (
    Cancelled,
    CodedError,
    ConfigError,
    DecodeError,
    EncodeError,
    NotResumable,
    OutputMissing,
    Permanent,
    RegistrationError,
    RunNotFound,
    ScheduleNotFound,
    WorkflowError,
    code_of,
    is_permanent,
    permanent,
    with_code,
)
from workflow.logs import ALERT
from workflow.manager import Manager
from workflow.retry import Backoff
from workflow.run import Failure, Run, RunStatus, Status
from workflow.schedules import Schedule
from workflow.sealing import AESGCMCipher, Cipher, Propagation, Propagator, propagate
from workflow.store import SchemaOutdated
from workflow.taskrun import TaskRun, new_task_run

__all__ = [
    "ALERT",
    "AESGCMCipher",
    "Admin",
    "App",
    "Backoff",
    "Cancelled",
    "Cipher",
    "CodedError",
    "Config",
    "ConfigError",
    "DecodeError",
    "Definition",
    "EncodeError",
    "Failure",
    "HistoryEntry",
    "Manager",
    "NotResumable",
    "OutputMissing",
    "Permanent",
    "Propagation",
    "Propagator",
    "QueueDepth",
    "QueueStats",
    "RegistrationError",
    "Registry",
    "Retention",
    "Run",
    "RunDetail",
    "RunNotFound",
    "RunPage",
    "RunStatus",
    "RunSummary",
    "RunnerConfig",
    "Schedule",
    "ScheduleNotFound",
    "ScheduleState",
    "SchemaOutdated",
    "Status",
    "Step",
    "Task",
    "TaskRun",
    "TaskState",
    "Workflow",
    "WorkflowError",
    "WorkflowStats",
    "code_of",
    "define",
    "handle",
    "is_permanent",
    "new_task_run",
    "permanent",
    "propagate",
    "with_code",
]
