"""A service started by a launcher stops when that launcher is gone, however it went.

`ddtree-serve up` and the benches start the three services in sessions of their own (a Ctrl-C in the terminal goes
to the launcher, which stops them in order) and stop them on the way out. A launcher killed outright (SIGKILL, the
OOM killer, a crash) runs no such code, and its services would serve on, holding ports and GPU memory. With
--exit-with-parent a service watches for that: once the process that started it is gone (the service has been
re-parented), it sends itself SIGTERM, so its usual shutdown runs (NOT_SERVING, in-flight calls drained, stop).
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time

log = logging.getLogger(__name__)


def watch_parent(interval_s: float = 1.0) -> threading.Thread | None:
    """Starts a daemon thread that SIGTERMs this process once its parent has exited (checked every interval_s);
    None when there is no parent to watch (already re-parented to init)."""
    parent = os.getppid()
    if parent <= 1:
        return None

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                log.warning("the process that started this service (pid %d) is gone: stopping", parent)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread
