"""Settings for the Transfer example: one PostgreSQL database, from `$DATABASE_URL`.

Django's PostgreSQL backend uses psycopg 3 when it is installed (pgworkflow
depends on it); the run and the app's own rows share that database, so
`start_on_commit` can insert the run inside the app's transaction.
"""

import importlib.util
import os
from pathlib import Path

from psycopg.conninfo import conninfo_to_dict

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-only-not-a-secret")
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    # The runs in the admin (/admin/workflow/workflowrun/), with cancel and resume.
    "workflow.contrib.django",
    "transfers",
]
MIDDLEWARE = [
    "django.middleware.common.CommonMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
ROOT_URLCONF = "transfer_site.urls"
WSGI_APPLICATION = "transfer_site.wsgi.application"


def _database(url: str) -> dict[str, object]:
    params = conninfo_to_dict(url)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": params.pop("dbname", "postgres"),
        "USER": params.pop("user", ""),
        "PASSWORD": params.pop("password", ""),
        "HOST": params.pop("host", ""),
        "PORT": params.pop("port", ""),
        "OPTIONS": params,
    }


DATABASES = {"default": _database(os.environ["DATABASE_URL"])}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"

WORKFLOW = {
    "REGISTRY": "transfers.workflows:registry",
    "DATABASE_ALIAS": "default",
    # Each process's manager exports its metrics into prometheus_client's registry,
    # served at /metrics (transfers.views.metrics); needs pgworkflow[metrics].
    "ON_MANAGER": (
        "workflow.metrics:instrument" if importlib.util.find_spec("prometheus_client") else None
    ),
}
