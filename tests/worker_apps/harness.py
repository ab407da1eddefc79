"""Starting `python -m workflow.worker` as a real subprocess and watching its stderr."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers import ROOT, OutputProcess

from .ledger import URL_ENV

STARTED = "workflow: worker started"


class WorkerProcess(OutputProcess):
    """One worker subprocess; its stderr is collected line by line on a thread."""

    def __init__(self, app: str, database_url: str, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if k != "WORKFLOW_DATABASE_URL"}
        env[URL_ENV] = database_url
        env["PYTHONUNBUFFERED"] = "1"
        argv = [
            sys.executable,
            "-m",
            "workflow.worker",
            "--app",
            app,
            "--database-url",
            database_url,
            *args,
        ]
        super().__init__(
            argv, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )

    @property
    def stderr(self) -> str:
        return self.output

    def wait_for_line(self, text: str, timeout: float = 30.0) -> str:
        """The first stderr line containing `text`; AssertionError after `timeout` or at exit."""
        return self.wait_for_lines(text, 1, timeout)[0]

    def _missing(self, text: str, count: int, found: int) -> str:
        return (
            f"worker {self.pid} printed no line with {text!r} "
            f"(exit code {self.proc.poll()}); stderr:\n" + "\n".join(self.lines)
        )

    def wait_started(self, timeout: float = 30.0) -> None:
        self.wait_for_line(STARTED, timeout)
