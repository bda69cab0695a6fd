"""What a run sets for its whole process: the heap frozen out of the cyclic collector while it runs, and the log line
for a background thread that dies of an exception."""

from __future__ import annotations

import gc
import logging
import threading
from typing import Callable

log = logging.getLogger("pitstop")
_SETUPS = 0  # runs set up in this process (the first freezes the heap without a collection first) ...
_ACTIVE = 0  # ... and those not ended yet (the heap stays frozen until the last has ended)


def frozen_heap() -> Callable[[], None]:
    """Freeze the heap for a run that starts now; returns what ends it for that run.

    What exists when a run is set up (torch's and every other module's objects, the config) lives as long as the
    process: the cyclic collector leaves it out of its passes, here and in the processes forked from here (a full
    pass over a warm attempt's heap cost its data workers CPU and dirtied their copy-on-write pages). It is back in
    the collector's care when the last run of this process that is still going ends; a later run (a sweep's next
    job) first collects what the last left (a Runner is a cycle: its model, optimizer state and device memory
    would stay frozen through the next run)."""
    global _SETUPS, _ACTIVE
    if _ACTIVE == 0:
        if _SETUPS:
            gc.collect()
        gc.freeze()
    _SETUPS, _ACTIVE = _SETUPS + 1, _ACTIVE + 1

    def end() -> None:
        global _ACTIVE
        _ACTIVE -= 1
        if _ACTIVE == 0:
            gc.unfreeze()

    return end


def log_thread_failures() -> None:
    """An exception that ends a background thread (a writer, the purger, a prefetch, a timer) reaches the run's
    log, not only stderr; a failure that loses data also reaches the exit status through the future that carries
    it (a save's, a read's)."""
    if getattr(threading.excepthook, "_pitstop", False):
        return
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is not SystemExit:
            name = args.thread.name if args.thread is not None else "?"
            log.error(
                "background thread %s failed: %s: %s",
                name,
                args.exc_type.__name__,
                args.exc_value,
                exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
            )
        else:
            previous(args)

    hook._pitstop = True  # type: ignore[attr-defined]
    threading.excepthook = hook
