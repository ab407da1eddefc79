"""The engine's runs as a Django model, for Django's admin only.

`WorkflowRun` is unmanaged (`managed = False`): Django never creates, alters or
drops `workflow_runs` (`manage.py workflow_migrate` owns it), and the admin reads
it on `WORKFLOW["DATABASE_ALIAS"]`. Changes go through `workflow.Admin`, never
through the model: its admin has no add, change or delete.
"""

from __future__ import annotations

from typing import Any

from django.db import models

STATUSES = [(s, s) for s in ("pending", "running", "succeeded", "parked", "cancelled")]


class WorkflowRun(models.Model):
    """One run (read-only): its workflow, status, times, idempotency key and position."""

    # Annotated Any: without django-stubs' mypy plugin a field's type is not inferred.
    id: Any = models.UUIDField(primary_key=True)
    workflow: Any = models.TextField()
    status: Any = models.TextField(choices=STATUSES)
    idempotency_key: Any = models.TextField(null=True, blank=True)
    current_seq: Any = models.SmallIntegerField()
    task_count: Any = models.SmallIntegerField()
    created_at: Any = models.DateTimeField()
    finished_at: Any = models.DateTimeField(null=True, blank=True)

    class Meta:
        managed = False
        db_table = "workflow_runs"
        ordering = ("-created_at", "-id")
        verbose_name = "workflow run"
        verbose_name_plural = "workflow runs"

    def __str__(self) -> str:
        return f"{self.workflow} {self.id}"
