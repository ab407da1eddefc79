"""Run inside the Django example project (cwd examples/django_transfer, `$DATABASE_URL`
set, its schema built): drive the runs' admin with Django's test client and print what
it saw as one JSON line. `tests/test_django_admin.py` runs it and checks the result.

argv: the ids of two parked runs, then of one succeeded run.
"""

from __future__ import annotations

import json
import os
import re
import sys

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "transfer_site.settings")
sys.path.insert(0, os.getcwd())

import django

django.setup()

from django.contrib.auth import get_user_model  # noqa: E402
from django.test import Client  # noqa: E402
from django.test.utils import setup_test_environment  # noqa: E402

setup_test_environment()  # response.context and templates for the test client

ADMIN = "/admin/workflow/workflowrun/"


def rows(html: str) -> list[str]:
    """The run ids listed on a changelist page."""
    return re.findall(r'/admin/workflow/workflowrun/([0-9a-f-]{36})/change/', html)


def main() -> None:
    parked, succeeded = sys.argv[1:3], sys.argv[3]
    user = get_user_model().objects.create_superuser("admin", "admin@example.com", "pw")
    client = Client()
    seen: dict[str, object] = {"anonymous": client.get(ADMIN).status_code}
    client.force_login(user)
    listing = client.get(ADMIN)
    seen["list_status"] = listing.status_code
    seen["listed"] = sorted(set(rows(listing.content.decode())))
    seen["parked_only"] = sorted(set(rows(client.get(ADMIN + "?status__exact=parked").content
                                          .decode())))
    seen["by_workflow"] = sorted(set(rows(client.get(ADMIN + "?workflow=Django.Probe.Other")
                                          .content.decode())))
    detail = client.get(f"{ADMIN}{parked[0]}/change/")
    seen["detail_status"] = detail.status_code
    seen["detail_can_save"] = 'name="_save"' in detail.content.decode()
    seen["add_status"] = client.get(ADMIN + "add/").status_code
    resumed = client.post(ADMIN, {"action": "resume_runs", "_selected_action": parked,
                                  "index": 0}, follow=True)
    seen["resume_message"] = [str(m) for m in resumed.context["messages"]]
    cancelled = client.post(ADMIN, {"action": "cancel_runs",
                                    "_selected_action": [parked[1], succeeded], "index": 0},
                            follow=True)
    seen["cancel_message"] = [str(m) for m in cancelled.context["messages"]]
    print("PROBE " + json.dumps(seen))


main()
