"""The Transfer workflow in a Django project (run it with manage.py from this directory)."""
