"""Warm processes for the system tier: real OS processes that start as forks of one pre-imported interpreter.

A test of the command line wants a real process: its own pid, its exit status, its stderr, signals and kill -9
that reach it, its own children. It does not need to pay ~5 s of ``import torch, torchvision, hydra, pitstop``
each time: a fresh interpreter's imports were most of the system tier's time. So one server per test session
(``python tests/warm.py SOCKET``) imports all that once and, per request, forks

    server ── waiter ── child        (the child runs ``python -m MODULE ARGS`` as a fresh interpreter would)

The child is the process under test: the test gets its pid and may signal or kill it. The waiter reaps it and
sends its exit status back (negative for a signal, as ``subprocess`` reports). stdin/stdout/stderr are the
test's own pipes or files, passed over the socket (``SCM_RIGHTS``). The child's cwd, environment, argv and
``sys.path[0]`` are set as ``python -m`` would set them, it exits through the interpreter's own shutdown path
(non-daemon threads joined, atexit handlers run, streams flushed).

What a warm child does differently from a cold one, by construction: its modules were imported before its
environment was set (a variable read only at import time is not seen; no test here sets one), and its program
start is the fork (the ledger's ``program_start`` bucket is ~0). Tests of either, and every README command,
run cold (``cold=True``, or ``PITSTOP_TESTS_COLD=1`` for the whole suite).
"""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRELOAD = [
    "torch",
    "torch._dynamo",
    "torchvision",
    "hydra",
    "omegaconf",
    "fsspec",
    "webdataset",
    "PIL.Image",
    "pitstop.cli",
    "pitstop.train.runner",
    "pitstop.launch.launcher",
    "pitstop.goodput.model",
    "pitstop.goodput.report",
    "pitstop.audit",
    "pitstop.ckpt.async_dcp",
    "pitstop.ckpt.sync_dcp",
    "pitstop.data.loader.cached",
    "pitstop.data.loader.plain",
    "recipe.train",
    "recipe.vision",
    "recipe.prepare",
    "recipe.goodput",
]


# ---------------------------------------------------------------------------------------------- the server side


def serve(path: str) -> None:
    import importlib

    sys.path[0] = str(ROOT)  # (python tests/warm.py put tests/ there)
    for name in PRELOAD:
        importlib.import_module(name)
    threads = max(len(sys._current_frames()), threading.active_count())  # (_thread's threads are in the first)
    if threads != 1:  # a fork copies one thread: others' locks could be held forever
        raise SystemExit(f"warm server: {threads} threads after the imports; cannot fork safely")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # waiters are reaped by the kernel
    print("ready", flush=True)
    session = os.getppid()
    listener.settimeout(5.0)  # (accepted connections are blocking)
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            if os.getppid() != session:  # the test session is gone without saying so (killed): so are we
                return
            continue
        request, fds = _receive(conn)
        if request is None:  # the test session ended
            return
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _wait_for(conn, request, fds)
        conn.close()
        for fd in fds:
            os.close(fd)


def _receive(conn: socket.socket) -> tuple[dict | None, list[int]]:
    fds = array.array("i")
    data, ancillary, _, _ = conn.recvmsg(1 << 20, socket.CMSG_LEN(3 * fds.itemsize))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return (json.loads(data) if data else None), list(fds)


def _wait_for(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """The waiter: fork the child, report its pid, then its exit status."""
    try:
        pid = os.fork()
        if pid == 0:
            conn.close()
            _child(request, fds)
        for fd in fds:
            os.close(fd)
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        _, status = os.waitpid(pid, 0)
        conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
    finally:
        os._exit(0)


def _child(request: dict, fds: list[int]) -> None:
    import atexit
    import runpy
    import traceback

    code: int = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        if request["new_session"]:
            os.setsid()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:1] = [os.getcwd(), *(os.path.abspath(p) for p in extra)]  # what python -m puts first
        sys.argv = [request["module"], *request["args"]]
        sys.modules.pop(request["module"], None)  # python -m runs the module's code as __main__ only
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        threading._shutdown()  # as the interpreter does at exit: non-daemon threads first, then atexit
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


# ---------------------------------------------------------------------------------------------- the test side


class Server:
    """The session's warm server (started on first use, stopped at the end of the session)."""

    def __init__(self, directory: Path) -> None:
        self.path = str(directory / "warm.sock")
        self.log = directory / "warm.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, self.path],
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"warm server did not start: {line!r} {self.log.read_text()[-3000:]}")

    def start(
        self, module: str, args: list[str], cwd: str | Path, env: dict | None, fds: list[int], new_session: bool = False
    ) -> "WarmProcess":
        request = {
            "module": module,
            "args": list(args),
            "cwd": str(cwd),
            "env": dict(os.environ if env is None else env),
            "new_session": new_session,
        }
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        conn.sendmsg(
            [json.dumps(request).encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        )
        return WarmProcess(conn)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                    conn.connect(self.path)
                    conn.sendmsg([b""], [])
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


class WarmProcess:
    """What ``subprocess.Popen`` gives for the child: ``pid``, ``poll``, ``wait``, ``returncode``, signals."""

    def __init__(self, conn: socket.socket) -> None:
        self._conn = conn
        self._lines = conn.makefile("r")
        first = self._lines.readline()
        if not first:
            raise RuntimeError("warm server closed the connection before the child started")
        self.pid: int = json.loads(first)["pid"]
        self.returncode: int | None = None
        self.stdout = self.stderr = None  # set by the caller when they are pipes

    def poll(self) -> int | None:
        if self.returncode is None:
            self._conn.setblocking(False)
            try:
                line = self._lines.readline()
            except (BlockingIOError, OSError, TypeError):
                line = ""
            finally:
                self._conn.setblocking(True)
            if line:
                self._done(line)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                line = self._lines.readline()
            except (socket.timeout, TimeoutError):
                raise subprocess.TimeoutExpired(f"warm pid {self.pid}", timeout) from None
            finally:
                self._conn.settimeout(None)
            if not line:
                raise RuntimeError(f"warm waiter of pid {self.pid} went away")
            self._done(line)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        out: dict[str, str] = {}
        readers = [
            threading.Thread(target=lambda k=k, s=s: out.__setitem__(k, s.read()), daemon=True)
            for k, s in (("stdout", self.stdout), ("stderr", self.stderr))
            if s is not None
        ]
        for t in readers:
            t.start()
        self.wait(timeout)
        for t in readers:
            t.join(timeout)
        return out.get("stdout"), out.get("stderr")

    def _done(self, line: str) -> None:
        self.returncode = json.loads(line)["returncode"]
        self._lines.close()
        self._conn.close()

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> "WarmProcess":
        return self

    def __exit__(self, *exc) -> None:
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        if self.returncode is None:
            self.wait()


def _fd_for(spec, default_mode: str) -> tuple[int, object | None]:
    """(the fd the child gets, the test's end if it is a pipe). spec: None, subprocess.PIPE/DEVNULL/STDOUT, a
    file object or an fd."""
    if spec is None:
        return os.dup(1 if default_mode == "w" else 0), None
    if spec == subprocess.DEVNULL:
        return os.open(os.devnull, os.O_RDWR), None
    if spec == subprocess.PIPE:
        r, w = os.pipe()
        if default_mode == "w":
            return w, os.fdopen(r, "r", errors="replace")
        return r, os.fdopen(w, "w")
    if isinstance(spec, int):
        return os.dup(spec), None
    return os.dup(spec.fileno()), None


def popen(
    server: Server,
    argv: list[str],
    cwd,
    env=None,
    stdin=subprocess.DEVNULL,
    stdout=None,
    stderr=None,
    start_new_session: bool = False,
) -> WarmProcess:
    """``subprocess.Popen(argv, ...)`` for ``argv = [python, "-m", MODULE, *ARGS]`` (text mode), warm."""
    if len(argv) < 3 or argv[1] != "-m":
        raise ValueError(f"warm processes run python -m MODULE ...; got {argv[:3]}")
    fd_in, end_in = _fd_for(stdin, "r")
    fd_out, end_out = _fd_for(stdout, "w")
    if stderr == subprocess.STDOUT:
        fd_err, end_err = os.dup(fd_out), None
    else:
        fd_err, end_err = _fd_for(stderr, "w")
    try:
        proc = server.start(argv[2], argv[3:], cwd, env, [fd_in, fd_out, fd_err], start_new_session)
    finally:
        for fd in (fd_in, fd_out, fd_err):
            os.close(fd)
    proc.stdin, proc.stdout, proc.stderr = end_in, end_out, end_err
    return proc


def run(server: Server, argv: list[str], cwd, env=None, timeout: float | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True, timeout=...)``, warm."""
    proc = popen(server, argv, cwd, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    finally:
        proc.stdout.close()
        proc.stderr.close()
    return subprocess.CompletedProcess(argv, proc.returncode, out or "", err or "")


if __name__ == "__main__":
    serve(sys.argv[1])
