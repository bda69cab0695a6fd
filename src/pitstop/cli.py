"""Entry-point glue: a config that Hydra cannot compose is reported like every other config error.

``@hydra.main`` prints a composition error (a wrong type, an unknown key or option, a bad override) over
several lines with a hint about ``HYDRA_FULL_ERROR`` and exits with status 1.  :func:`run` makes it one line,
``error: <what is wrong, naming the key>``, and exit status 2, like pitstop's own ``ConfigError``s
(``PITSTOP_TRACEBACK=1`` prints the traceback too).

A command that ends (finished, refused or failed with its one line) leaves through :func:`exit_now`: what the
interpreter does at exit that matters (non-daemon threads joined, atexit handlers: logging's flush,
multiprocessing's children), without the teardown of every module that follows. With torch loaded that teardown
is 0.5-1 s of CPU here, with nothing left to write. An uncaught exception still takes the interpreter's path.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, NoReturn

_NOISE = ("full_key:", "object_type=", "reference_type=", "Set the environment variable HYDRA_FULL_ERROR")


def one_line(error: BaseException) -> str:
    """Hydra's and OmegaConf's multi-line messages (and their cause) as one line."""
    texts = [str(error)]
    if error.__cause__ is not None and str(error.__cause__) not in texts[0]:
        texts.append(str(error.__cause__))
    parts: list[str] = []
    for text in texts:
        lines = [ln.strip() for ln in text.split("Config search path:")[0].splitlines()]
        options: list[str] = []
        for ln in lines:
            if not ln or ln.startswith(_NOISE):
                continue
            if parts and parts[-1].startswith("Available options in") and not ln.endswith(":") and " " not in ln:
                options.append(ln)
                continue
            if options:
                parts[-1] += " " + ", ".join(options)
                options = []
            parts.append(ln)
        if options:
            parts[-1] += " " + ", ".join(options)
    if any(" not in '" in p for p in parts):  # a schema'd group: appending with + would be refused too
        parts = [p for p in parts if not p.startswith("To append to your config use")]
        parts.append("see the option's YAML in conf/ for its keys")
    return "; ".join(p.rstrip(".") for p in parts)


def exit_now(code: int | str | None = 0) -> NoReturn:
    """Exit with ``code`` (as ``SystemExit`` takes it) the way the interpreter would, without freeing each module:
    non-daemon threads joined, atexit handlers run, stdout and stderr flushed, then ``os._exit``."""
    import atexit
    import threading

    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    try:
        try:
            threading._shutdown()  # type: ignore[attr-defined]  # (the interpreter's own first step at exit)
        except BaseException:  # noqa: BLE001 - Ctrl-C while a thread is joined: say so, still run the handlers
            import traceback

            traceback.print_exc()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        try:  # (C stdio buffers: native libraries writing to a redirected stdout; the interpreter's exit flushes them)
            import ctypes

            ctypes.CDLL(None).fflush(None)
        except (OSError, AttributeError):
            pass
        os._exit(code or 0)


def run(hydra_main: Callable[[], Any]) -> NoReturn:
    """Call a ``@hydra.main`` function and exit: composition errors -> one line on stderr, exit status 2."""
    try:
        _run(hydra_main)
    except SystemExit as e:
        exit_now(e.code)
    exit_now(0)


def _run(hydra_main: Callable[[], Any]) -> Any:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from pitstop.config import register
    from pitstop.config.credentials import mask
    from pitstop.errors import PitstopError

    register()  # config schemas and resolvers

    from pitstop.fsurl import credentials_in_overrides

    secret = credentials_in_overrides(sys.argv[1:])
    if secret:  # (Hydra would write it into the run dir before the config is checked)
        print(f"error: {secret}", file=sys.stderr)
        raise SystemExit(2)
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # let the exception reach us instead of Hydra's report
    try:
        return hydra_main()
    except (HydraException, OmegaConfBaseException) as e:
        if os.environ.get("PITSTOP_TRACEBACK"):
            import traceback

            traceback.print_exc()
        print(f"error: {mask(one_line(e))}", file=sys.stderr)  # (Hydra quotes an override, value and all)
        raise SystemExit(2) from None
    except PitstopError as e:  # a failed job of a sweep, re-raised by Hydra after the others ran
        print(f"error: {mask(str(e))}", file=sys.stderr)
        raise SystemExit(2) from None
