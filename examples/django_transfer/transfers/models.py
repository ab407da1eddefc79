from django.db import models


class Transfer(models.Model):
    account = models.CharField(max_length=64)
    amount_cents = models.PositiveBigIntegerField()
    # The pgworkflow run that sends it; set in the transaction that creates the row.
    run_id = models.CharField(max_length=36, null=True, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
