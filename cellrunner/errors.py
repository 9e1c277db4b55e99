"""Errors a cellrunner reports as a setup problem (exit code 2, one clear line, no traceback)."""


class BackendUnavailable(RuntimeError):
    """A configured backend cannot run here: its package is missing or its server would not start.
    The message names what to install or where the backend's log is."""
