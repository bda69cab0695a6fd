"""Where data workers (and a launcher's attempts) come from: a fork server, never a fork of a busy process itself.

The one place a fork server starts. A trainer starts one for its data workers; a launcher (pitstop's supervisor,
the elastic agent's launcher, replica groups of one rank) starts one for its attempts or ranks
(``pitstop.launch.attempt.start_warm``): each attempt is then a fork of a copy of the launcher, with no
interpreter start and no imports, the first attempt as much as a restart.

The trainer has threads (gloo's, the hang watchdog, queue feeders) and CPython 3.11 deadlocks a forked child
if one of them held the interpreter's thread-state lock at that instant (``PyGILState_Ensure`` in a C++ thread
takes it without the GIL; the child waits for it in ``PyOS_AfterFork_Child`` forever): a worker that never
starts, an epoch that never begins. So workers are forks of a fork server (multiprocessing's ``forkserver``
start method), a process with no Python threads.

Two ways to get that server, both started once per trainer process, early (:func:`start`):

- **forked** (the fast way): while the trainer is still single-threaded (before its process groups, the
  watchdog and any loader exist) it forks a copy of itself that serves forks. The copy has everything the
  trainer imported so far — torch, the entry point, the configured components — so it is ready at once and
  costs no CPU. A warm restart (an attempt forked from the supervisor's pre-imported server) gets its data
  workers without a single import.
- **spawned** (multiprocessing's own): a fresh interpreter that imports torch and the loader's modules
  (~2.7 s of CPU here, overlapping the trainer's setup). Used where the trainer already has threads when it
  asks (an in-process run inside a threaded host such as a test runner), or where this Python's fork server
  differs from the one this module knows (it checks the attributes it sets).

No CUDA context may exist in the parent of a fork: the forked way is refused once CUDA is initialised.
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
import signal
import socket
import sys
import threading
from typing import TYPE_CHECKING, Iterable

from pitstop.notices import NOTICES, notices_blocked

if TYPE_CHECKING:
    from multiprocessing.context import BaseContext
    from multiprocessing.forkserver import ForkServer

log = logging.getLogger("pitstop.data.loader")

_STATE = ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid")


def context() -> BaseContext:
    """The multiprocessing context for data workers (spawn where there is no fork server)."""
    import multiprocessing as mp

    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    return mp.get_context("forkserver")


def start(modules: Iterable[str] = (), fork: bool = True) -> str:
    """Make sure this process's workers' fork server runs; start it now if it does not.  ``modules`` are
    imported first (the components' modules, which every worker would otherwise import on its own).
    ``fork=False``: a fresh interpreter even where a fork would do (children that will use CUDA: this process may
    have asked the CUDA driver for its devices, and a fork after that cannot use it).
    Returns how: ``forked``, ``spawned``, ``running`` (already) or ``none`` (no fork server on this OS)."""
    import multiprocessing as mp
    from multiprocessing import forkserver

    if "forkserver" not in mp.get_all_start_methods():
        return "none"
    server = forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) is not None:
        forkserver.ensure_running()  # (starts a new one if it died)
        return "running"
    quiet_resource_tracker()
    from multiprocessing import resource_tracker

    with notices_blocked():  # (the tracker is a fresh interpreter: it keeps the blocked notices for good; it
        resource_tracker.ensure_running()  # runs before any fork, so the fork server and its workers share it)
    wanted = sorted({"torch", *modules, *entry_point_imports()})
    for name in wanted:
        try:
            importlib.import_module(name)
        except ImportError:  # (a worker that needs it reports it; the config's own checks name the option)
            pass
    why = _cannot_fork(server) if fork else "its children will use CUDA"
    if why is None:
        _fork(server)
        return "forked"
    log.debug("data workers' fork server: a fresh interpreter (%s)", why)
    mp.get_context("forkserver").set_forkserver_preload(wanted)
    with notices_blocked():
        forkserver.ensure_running()
    return "spawned"


def entry_point_imports() -> set[str]:
    """The modules that the entry point's module (``__main__``, e.g. recipe.train) refers to.

    A child of a fork server runs the entry point's module again, as ``__mp_main__`` (so that what it
    defines can be unpickled); with these imported in the server, that costs nothing. The entry point itself
    is not imported there: runpy warns when the module it runs is already in ``sys.modules``."""
    import types

    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    found = set()
    for value in vars(main).values() if main is not None else ():
        module = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
        if isinstance(module, str) and not module.startswith("_") and module not in ("builtins", name):
            found.add(module)
    return found


def workers(modules: Iterable[str] = ()) -> tuple[BaseContext, int]:
    """What a loader starts its data workers with: the multiprocessing context and the workers' parent pid. The
    fork server is made sure of here, when the loader first starts workers (the runner started it already, while
    it was single-threaded; a loader used on its own gets it now); a loader's constructor starts nothing."""
    start(modules)
    return context(), parent()


def parent() -> int:
    """The pid of the data workers' parent: the fork server's, or this process's (spawn)."""
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None) or os.getpid()


def python_threads() -> int:
    """How many threads run Python code in this process. ``threading.active_count()`` is not it: a thread
    started with ``_thread.start_new_thread`` (execnet's, under pytest-xdist) is not in ``threading``'s list
    until it asks for ``threading.current_thread()``; a fork taken beside it can inherit a lock it holds and
    hang forever. Every Python thread has a frame here."""
    return max(len(sys._current_frames()), threading.active_count())


def _cannot_fork(server: ForkServer) -> str | None:
    """Why this process must not fork its workers' server now (None: it may)."""
    import torch

    if sys.version_info >= (3, 13) or not all(hasattr(server, a) for a in (*_STATE, "_lock")):
        return "this Python's fork server is not the one pitstop knows"
    if python_threads() > 1:
        return f"{python_threads()} threads already"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return "process groups exist"
    if torch.cuda.is_initialized():
        return "a CUDA context exists"
    return None


def _fork(server: ForkServer) -> None:
    """Fork this (single-threaded) process into multiprocessing's fork server loop and register it as this
    process's fork server: the state ``ForkServer.ensure_running`` would have set after spawning one. (The
    resource tracker runs already, started by :func:`start`: the server and its workers share it.)"""
    from multiprocessing import connection, forkserver, util

    with server._lock:
        listener = socket.socket(socket.AF_UNIX)
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        # Every client (this process and each worker) holds the write end of the "alive" pipe; the server
        # exits when the last one has gone.
        alive_r, alive_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the server: serve forks until every client has gone, then leave without cleanup
            code = 0
            try:
                os.close(alive_w)
                # (a child of this server that starts a fork server of its own, as a rank forked from a launcher's
                # starts its data workers', must find the state unset and the lock free: it was held at the fork)
                server._lock = threading.Lock()
                server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
                gc.freeze()  # (its heap is the trainer's: no worker's collections walk it, or dirty its pages)
                for sig in NOTICES:  # (not the handler the trainer has now: submitit's requeue, say)
                    signal.signal(sig, signal.SIG_IGN)
                forkserver.main(listener.fileno(), alive_r, [])
            except SystemExit:
                pass
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        listener.close()
        os.close(alive_r)
        server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid


def quiet_resource_tracker() -> None:
    """The resource tracker that a fork server brings (started next with this process's warning options) does
    not warn about the semaphores of workers whose trainer was killed: it removes them, and its warning would
    be the last line on stderr after the job's own one-line error."""
    option = "ignore:resource_tracker:UserWarning"
    if option not in sys.warnoptions:
        sys.warnoptions.append(option)
