"""The runs in Django's admin: a read-only list with filters, and cancel and resume.

The list, filters and detail read `workflow_runs` through the unmanaged
`WorkflowRun` on `WORKFLOW["DATABASE_ALIAS"]`; the two actions go through
`workflow.Admin` on this process's manager's pool, so they record their history
(actor: the Django user) exactly as the CLI and the dashboard do. Users need the
model's change permission for the actions, its view permission to look.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from workflow.contrib.django import conf
from workflow.contrib.django.models import WorkflowRun


def _admin() -> Any:
    from workflow.admin import Admin
    from workflow.contrib.django import get_manager

    return Admin(get_manager().pool)


def _actor(request: HttpRequest) -> str:
    user = getattr(request, "user", None)
    name = user.get_username() if user is not None else ""
    return f"django:{name}" if name else "django"


@admin.register(WorkflowRun)
class WorkflowRunAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Runs newest first, filtered by status and workflow; cancel and resume actions."""

    list_display = ("id", "workflow", "status", "created_at", "finished_at")
    list_filter = ("status", "workflow")
    search_fields = ("=id", "=idempotency_key")
    readonly_fields = ("id", "workflow", "status", "idempotency_key", "current_seq",
                       "task_count", "created_at", "finished_at")
    actions = ("cancel_runs", "resume_runs")
    list_per_page = 50
    show_full_result_count = False  # no count(*) over the whole history per page

    def get_queryset(self, request: HttpRequest) -> QuerySet[WorkflowRun]:
        runs: QuerySet[WorkflowRun] = super().get_queryset(request)
        used: QuerySet[WorkflowRun] = runs.using(conf.database_alias())
        return used

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # A run is never edited here; the change permission (asked without an object)
        # is what the actions require.
        return obj is None and super().has_change_permission(request)

    @admin.action(description="Cancel the selected runs", permissions=["change"])
    def cancel_runs(self, request: HttpRequest, queryset: QuerySet[WorkflowRun]) -> None:
        ids = [str(run.id) for run in queryset]
        with _admin() as steering:
            changed = sum(
                1 for run_id in ids if _try(steering.cancel, run_id, _actor(request), "cancelled")
            )
        self.message_user(request, f"Cancelled {changed} of {len(ids)} run(s).",
                          messages.SUCCESS if changed else messages.WARNING)

    @admin.action(description="Resume the selected runs", permissions=["change"])
    def resume_runs(self, request: HttpRequest, queryset: QuerySet[WorkflowRun]) -> None:
        ids = [str(run.id) for run in queryset]
        with _admin() as steering:
            changed = sum(
                1 for run_id in ids if _try(steering.resume, run_id, _actor(request), None)
            )
        self.message_user(
            request,
            f"Resumed {changed} of {len(ids)} run(s)"
            + ("" if changed == len(ids) else " (the others were not parked or cancelled)")
            + ".",
            messages.SUCCESS if changed else messages.WARNING,
        )


def _try(act: Any, run_id: str, actor: str, expect: str | None) -> bool:
    """Run one Admin action; whether it took (the run is `expect` after it, when given),
    False when the run was not in a state to take it."""
    from workflow.errors import NotResumable, RunNotFound

    try:
        status = act(run_id, actor=actor)
    except (NotResumable, RunNotFound):
        return False
    return expect is None or status.status.value == expect
