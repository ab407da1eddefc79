"""Runnable examples of pgworkflow in web applications (not part of the package)."""
