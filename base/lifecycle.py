"""What every child process of the controller does at start (stdlib only, so any package may use it).

The parent side (spawning, readiness, stopping) is ``controller.processes``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time


PARENT_PID_ENV = "GYRE_PARENT_PID"
"""Set by ``controller.processes.spawn`` to the spawning process's pid: a child that starts up
slowly (imports take seconds on a loaded node) may already be an orphan when it first looks at
its parent, and would otherwise take its adoptive parent for the real one."""


def exit_with_parent(*, poll_s: float = 1.0, grace_s: float = 30.0) -> None:
    """In a child: stop when the process that started it is gone.

    Children run in their own sessions (a Ctrl-C at the controller must not reach them mid-step),
    so a controller that is SIGKILLed cannot stop them: without this they would run forever. When
    the parent changes (the child was reparented), the child gets SIGTERM, its normal graceful
    stop; if it is still alive ``grace_s`` later, it exits hard.
    """
    told = os.environ.pop(PARENT_PID_ENV, "")  # not for our own children
    parent = int(told) if told.isdigit() else os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        logging.getLogger(__name__).warning("parent %d is gone: stopping", parent)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(3)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
