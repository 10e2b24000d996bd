"""Local launcher (``tfcs-run``)."""
