"""POST /transfers creates a Transfer and starts its run in one transaction; GET shows both."""

from __future__ import annotations

import json

from django.db import transaction
from django.db.models import Sum
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

import workflow
from workflow.contrib.django import get_manager, start_on_commit

from .models import Transfer
from .workflows import SendTransfer, TransferInput

DAILY_LIMIT_CENTS = 1_000_000


class OverDailyLimit(Exception):
    def __init__(self, run: workflow.Run) -> None:
        super().__init__("the account's transfers today would exceed its daily limit")
        self.run = run


@csrf_exempt  # a JSON API for the example's clients, not a form of the site
@require_POST
def create_transfer(request: HttpRequest) -> JsonResponse:
    try:
        body = json.loads(request.body)
        account, amount_cents = str(body["account"]), int(body["amount_cents"])
    except (ValueError, KeyError, TypeError):
        return JsonResponse({"error": "give account and amount_cents"}, status=400)
    try:
        with transaction.atomic():
            transfer = Transfer.objects.create(account=account, amount_cents=amount_cents)
            run = start_on_commit(
                SendTransfer,
                TransferInput(transfer.pk, account, amount_cents),
                idempotency_key=f"transfer-{transfer.pk}",
            )
            transfer.run_id = run.id
            transfer.save(update_fields=["run_id"])
            # Checked after the insert so that concurrent requests count each other.
            today = Transfer.objects.filter(
                account=account, created_at__date=timezone.now().date()
            ).aggregate(total=Sum("amount_cents"))["total"]
            if today > DAILY_LIMIT_CENTS:
                raise OverDailyLimit(run)
    except OverDailyLimit as exc:
        # Rolled back: neither the transfer nor its run exists, and nothing runs.
        return JsonResponse({"error": str(exc), "rolled_back_run_id": exc.run.id}, status=422)
    # Committed: on_commit has handed the run to this process's fast path.
    return JsonResponse({"id": transfer.pk, "run_id": run.id}, status=201)


@require_GET
def show_transfer(request: HttpRequest, pk: int) -> JsonResponse:
    transfer = get_object_or_404(Transfer, pk=pk)
    status = get_manager().run(transfer.run_id or "").status()
    return JsonResponse(
        {
            "id": transfer.pk,
            "account": transfer.account,
            "amount_cents": transfer.amount_cents,
            "run_id": transfer.run_id,
            "status": status.status.value,
            "failure": None if status.failure is None else status.failure.error,
        }
    )


@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    """Prometheus metrics: this process's manager (WORKFLOW["ON_MANAGER"]) and the queue."""
    import prometheus_client

    get_manager()  # built (and instrumented) on first use; a scrape may come first
    return HttpResponse(
        prometheus_client.generate_latest(), content_type=prometheus_client.CONTENT_TYPE_LATEST
    )
