"""The Transfer workflow in a Flask app served by Gunicorn."""
