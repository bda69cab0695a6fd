"""Hang detection: a rank that stops making progress is stopped within a few step-times, not after the
collective timeout (``strategy.timeout``, 300 s by default) or never (a stuck data worker, a dead store).

The loop says which *phase* it is in (``setup``, ``restore``, ``step``, ``eval``, ``checkpoint``); a daemon
thread checks that the current phase has not run longer than its limit:

- a phase's first run (nothing measured yet: compilation, cold caches, peers still starting) gets
  ``first_seconds``;
- after that, ``factor`` × the longest run of that phase measured in this attempt, but never less than
  ``min_seconds``.

The ``data`` phase (waiting for the next batch) is healed once before it counts as a hang: the data workers
write their stacks to stderr, ``DataStall`` is raised in the main thread, and the runner restarts the workers
from the current data position (the same batches follow, so the run stays bitwise reproducible).

On a hang it writes every thread's stack to ``RUN_DIR/hang.rank<R>.txt``, logs one line naming the rank,
the phase, the limit and, with several ranks, the rank that is behind (a rank stuck outside a collective leaves
the others waiting inside it: each rank's watcher publishes where its loop is, ``hang_peers``), lets the runner
record the attempt as ``hung`` in the ledger, and ends the attempt:
a process that a launcher started (the supervisor, the elastic agent, torchrun) exits with ``HUNG_EXIT``
at once, so it is restarted from its newest checkpoint; a run inside a process that must survive (a test, an
in-process sweep) gets ``Hung`` raised in its main thread, and is exited after ``grace`` seconds if that
thread does not get out (it is stuck in native code).  Reporting (logging, the ledger, the workers' stacks)
may need a lock the stuck main thread holds (``os.fork`` holds logging's and the import lock while it runs),
so it gets ``grace`` seconds in a thread of its own and the process ends anyway.

The watcher itself is Python: a main thread stuck in native code *while holding the GIL* (a fork that
blocks in a C library's at-fork handler, an extension that never releases it) stops it too.  So it keeps a
native backstop armed, ``faulthandler.dump_traceback_later(exit=True)``: a C thread that needs no GIL.  The
watcher re-arms it every cycle (:meth:`Watchdog.backstop_seconds`); if the watcher misses that deadline, the
backstop writes every thread's stack to stderr and exits the process (status 1; a launcher restarts it).
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing
import os
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Callable, Iterator

from pitstop.errors import Interrupt, PitstopError
from pitstop.resilience import hang_peers

log = logging.getLogger("pitstop.resilience.watchdog")

HUNG_EXIT = 124  # like timeout(1): the attempt made no progress within its limit
# How the watcher interrupts the main thread (a blocking wait returns EINTR and the handler raises): SIGURG is
# ignored by default and used by nothing here (SIGALRM would take over pytest-timeout's or a user's alarm).
WAKE = signal.SIGURG


class Hung(Interrupt):
    """A phase ran past its limit (raised in the main thread of an in-process run)."""


class DataStall(PitstopError):
    """The input pipeline produced no batch within the ``data`` phase's limit (raised in the main thread, once per
    fetch: the runner restarts the data workers from the current position and fetches again)."""


class Watchdog:
    def __init__(
        self,
        *,
        enabled: bool = True,
        factor: float = 10.0,
        min_seconds: float = 60.0,
        first_seconds: float = 900.0,
        grace: float = 30.0,
    ):
        self.enabled = bool(enabled)
        self.factor, self.min_seconds, self.first_seconds = float(factor), float(min_seconds), float(first_seconds)
        self.grace = float(grace)
        self.longest: dict[str, float] = {}
        self.floors: dict[str, float] = {}  # a phase's limit is never below this (see at_least)
        self.firsts: dict[str, float] = {}  # an unmeasured phase's limit, where not first_seconds (see phase)
        self._current: tuple[str, float, bool, bool] | None = None  # (phase, since, timed, healable)
        self._stop = threading.Event()
        # the native backstop is armed under this lock and never once _stop is set: a watcher thread that close()
        # did not wait out (its join timed out) cannot arm it again for a process that no longer watches
        self._arming = threading.Lock()
        self._thread: threading.Thread | None = None
        self._previous_handler = None
        self._raise: BaseException | None = None  # what the wake-up signal's handler raises in the main thread
        self._healed: tuple | None = None  # the phase run that got its heal
        self._armed: float | None = None  # the native backstop's seconds when last armed (None: not armed)
        self.world_size, self.position = 1, None
        self._published: tuple | None = None  # (where it was, since when) as last published for the peers
        self._said_publish = False  # (a failed publication is said once)

    # ---- the loop's side ------------------------------------------------------------------------------
    def start(
        self,
        rank: int,
        run_dir: str,
        on_hang: Callable[[str], None],
        exit_process: bool,
        world_size: int = 1,
        position: Callable[[], tuple[int, int, str | None]] | None = None,
    ) -> Callable[[], None]:
        """Arm it; returns ``close``.  ``exit_process``: end the process on a hang (a launcher restarts it).
        ``position``: where the loop is, ``(last step done, collectives entered, the one it is in)``, read by the
        watcher about once a second and published for the other ranks of ``world_size`` (see ``hang_peers``)."""
        self.rank, self.run_dir, self.on_hang, self.exit_process = rank, run_dir, on_hang, exit_process
        self.world_size, self.position = int(world_size), position
        if not self.enabled:
            return self.close
        if self._peers_watched():
            try:
                hang_peers.forget(run_dir, rank)
            except OSError as e:
                log.warning("hang watchdog: %s: %s", hang_peers.path(run_dir, rank), e)
        self._main = threading.main_thread().ident
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(WAKE, self._raise_in_main)
        self._thread = threading.Thread(target=self._watch, name="pitstop-watchdog", daemon=True)
        self._thread.start()
        return self.close

    @contextmanager
    def phase(self, name: str, timed: bool = True, heal: bool = False, first: float | None = None) -> Iterator[None]:
        """Watch ``name`` while inside; a phase inside another pauses it (the outer one's clock restarts
        when it returns).  ``timed=False``: the phase is a loop whose iterations :meth:`beat` times.
        ``heal=True`` (the ``data`` phase): its stall raises ``DataStall`` in the main thread first, and is a
        hang only if the main thread is still in it after another limit's worth of time.  ``first``: the limit
        before the phase was ever measured, instead of ``first_seconds`` (meant for imports and compilation),
        for a phase that something else bounds (applying a peer's state, received within a timeout)."""
        if first is not None:
            self.firsts[name] = max(float(first), self.min_seconds)
        outer = self._current
        self._current = (name, time.monotonic(), timed, heal)
        try:
            yield
        finally:
            current, now = self._current, time.monotonic()
            if current is not None and current[2]:
                self._observe(current[0], now - current[1])
            self._current = (outer[0], now, outer[2], outer[3]) if outer is not None else None

    def beat(self) -> None:
        """The current phase made progress (e.g. a step ended): time its run so far, restart its clock."""
        current, now = self._current, time.monotonic()
        if current is None:
            return
        if current[2]:
            self._observe(current[0], now - current[1])
        self._current = (current[0], now, True, current[3])

    def _observe(self, name: str, seconds: float) -> None:
        self.longest[name] = max(self.longest.get(name, 0.0), seconds)
        if self._armed is not None and self.backstop_seconds() < self._armed / 2:
            self._arm()  # the first measured loop phase: first_seconds -> the loop's limit, now, not next cycle

    def _arm(self, seconds: float | None = None) -> None:
        """(Re-)arm the native backstop (see :meth:`backstop_seconds`), unless the watchdog is closed."""
        with self._arming:
            if self._stop.is_set():
                return
            self._armed = self.backstop_seconds() if seconds is None else seconds
            faulthandler.dump_traceback_later(self._armed, exit=True)

    def at_least(self, name: str, seconds: float) -> None:
        """``name``'s limit is never below ``seconds``: a wait that something else bounds (the ``peers`` phase
        of replica groups: torchft's own timeouts fail a wait for a peer that died or stalled, and the step is
        discarded; the peer's stall is not this process's hang)."""
        self.floors[name] = float(seconds)

    def limit(self, name: str) -> float:
        if name not in self.longest:
            return max(self.firsts.get(name, self.first_seconds), self.floors.get(name, 0.0))
        return max(self.min_seconds, self.factor * self.longest[name], self.floors.get(name, 0.0))

    def backstop_seconds(self) -> float:
        """How long this watcher may be kept from running (the GIL held by a thread in native code) before
        the native backstop ends the process.  Not per phase (the phase may change while it cannot run): the
        loop's longest limit once a loop phase has been measured, ``first_seconds`` before (imports, set-up,
        restore: extensions may hold the GIL for long there), plus ``grace``."""
        measured = [v for k, v in self.longest.items() if k not in ("setup", "restore")]
        limit = max(self.min_seconds, self.factor * max(measured)) if measured else self.first_seconds
        return limit + self.grace

    def close(self) -> None:
        self._stop.set()
        with self._arming:  # (nothing arms it after this)
            if self._thread is not None:
                faulthandler.cancel_dump_traceback_later()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread, self._armed = None, None
        if self.enabled and self._peers_watched():  # (a rank that ended well: nothing of it for a later report)
            try:
                hang_peers.forget(self.run_dir, self.rank)
            except OSError:
                pass
        if self._previous_handler is not None:
            signal.signal(WAKE, self._previous_handler)
            self._previous_handler = None

    # ---- the watcher's side ---------------------------------------------------------------------------
    def _watch(self) -> None:
        try:
            self._watch_phases()
        except Exception as e:  # noqa: BLE001 - a watchdog that died must say so, and must not kill a healthy run later
            # disarmed for good: _stop set under the arming lock, so that the end of the main thread's next phase
            # (_observe) cannot arm the backstop again with no watcher left to re-arm it (it ended the process later)
            with self._arming:
                self._stop.set()
                faulthandler.cancel_dump_traceback_later()
                self._armed = None
            log.error(
                "the hang watchdog stopped (%s: %s): hangs on rank %d are no longer detected in this attempt",
                type(e).__name__,
                e,
                self.rank,
            )

    def _watch_phases(self) -> None:
        while True:
            self._arm()  # this thread must come round again before the backstop fires
            if self._stop.wait(min(1.0, self.min_seconds / 4)):
                return
            self._publish()
            current = self._current
            if current is None:
                continue
            name, since = current[0], current[1]
            elapsed, limit = time.monotonic() - since, self.limit(name)
            if elapsed > limit and self._current is current:
                if current[3] and self._healed is not current:
                    self._heal(current, elapsed, limit)  # once per phase run; still stuck after that: a hang
                    continue
                if self._healed is current and elapsed < 2 * limit:
                    continue  # the heal gets its own limit's worth of time
                self._fire(name, elapsed, limit)
                return

    def _peers_watched(self) -> bool:
        return self.position is not None and self.world_size > 1

    def _where(self) -> hang_peers.Where:
        step, entered, inside = self.position()  # type: ignore[misc]
        current = self._current
        return hang_peers.Where(self.rank, step, entered, inside, current[0] if current is not None else None)

    def _publish(self) -> None:
        """Where this rank's loop is, for the other ranks' hang reports: written when it changed since the last
        cycle. Never fatal (a full disk must not stop hang detection)."""
        if not self._peers_watched():
            return
        try:
            where = self._where()
            if self._published is not None and self._published[0] == where:
                return
            if not os.path.isdir(self.run_dir):
                return  # (setup makes it, after the watchdog starts: the next cycle)
            since = time.time()
            hang_peers.publish(self.run_dir, replace(where, since=since))
            self._published = (where, since)
        except Exception as e:  # noqa: BLE001 - the peers' report loses this rank; the watcher goes on
            if not self._said_publish:
                self._said_publish = True
                log.warning(
                    "hang watchdog: where rank %d is cannot be published (%s: %s)", self.rank, type(e).__name__, e
                )

    def _behind(self) -> tuple[str, str]:
        """The hang line's clause naming the rank that is behind, and every rank's place (for the report file);
        empty with one rank. Never fatal: the hang is declared anyway."""
        if not self._peers_watched():
            return "", ""
        try:
            where = self._where()
            since = self._published[1] if self._published is not None and self._published[0] == where else None
            own = replace(where, since=since)
            places, missing = hang_peers.gather(self.run_dir, self.world_size, own)
            return hang_peers.describe(places, missing), hang_peers.table(places, missing)
        except Exception as e:  # noqa: BLE001
            return f"where the other ranks are is not known ({type(e).__name__}: {e})", ""

    def _heal(self, current: tuple, elapsed: float, limit: float) -> None:
        """A stalled ``data`` phase: stacks of the data workers to stderr, then ``DataStall`` in the main thread."""
        self._healed = current
        workers = _ask_data_workers_for_stacks()
        msg = (
            f"data stall: rank {self.rank} got no batch for {elapsed:.0f} s (limit {limit:.1f} s); "
            f"restarting the data workers from the current position"
            f"{f' ({workers} worker stack(s) on stderr)' if workers else ''}"
        )
        self._raise = DataStall(msg)
        signal.pthread_kill(self._main, WAKE)

    def _fire(self, name: str, elapsed: float, limit: float) -> None:
        how = (
            f"first {name}: trainer.hang.first_seconds"
            if name not in self.longest
            else f"{self.factor:g} x the longest {name} so far ({self.longest[name]:.2f} s), "
            f"at least trainer.hang.min_seconds"
        )
        peers, places = self._behind()
        stacks = os.path.join(self.run_dir, f"hang.rank{self.rank}.txt")
        try:
            with open(stacks, "w") as f:
                f.write(f"rank {self.rank}: no progress in phase '{name}' for {elapsed:.1f} s\n")
                f.write(f"{peers}\n{places}\n" if peers else "")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError as e:
            stacks = f"(not written: {e})"
        what = (
            f"hang: rank {self.rank} made no progress in phase '{name}' for {elapsed:.0f} s (limit {limit:.1f} s "
            f"= {how}); {peers + '; ' if peers else ''}thread stacks in {stacks}"
        )
        then = "; ending this attempt so that it restarts from its newest checkpoint"
        self._raise = Hung(what + then)
        # Reporting may wait on a lock the stuck main thread holds (logging's, the ledger's, a fork's): it gets
        # `grace` seconds in a thread of its own (and the backstop that long again); then the process ends anyway.
        self._arm(2 * self.grace + 5)
        reporter = threading.Thread(target=self._report, args=(what, then), name="pitstop-hang-report", daemon=True)
        reporter.start()
        reporter.join(self.grace)
        if reporter.is_alive():
            try:
                os.write(2, f"{what + then} (reporting it blocked on a lock the main thread holds)\n".encode())
            except OSError:
                pass
        if self.exit_process:
            os._exit(HUNG_EXIT)
        signal.pthread_kill(self._main, WAKE)  # wakes a blocking wait; the handler raises Hung
        if not self._stop.wait(self.grace):
            log.error("hang: the main thread did not stop within %.0f s; exiting", self.grace)
            for h in logging.getLogger().handlers:
                h.flush()
            os._exit(HUNG_EXIT)

    def _report(self, what: str, then: str) -> None:
        workers = _ask_data_workers_for_stacks()
        msg = what + (f" (and {workers} data worker(s)' on stderr)" if workers else "") + then
        self._raise = Hung(msg)
        log.error("%s", msg)
        try:
            self.on_hang(msg)
        except Exception as e:  # noqa: BLE001 - the process must still end
            log.error("hang: recording it failed: %s", e)
        for h in logging.getLogger().handlers:
            h.flush()

    def _raise_in_main(self, signum: int, frame: object) -> None:
        exc, self._raise = self._raise, None
        if isinstance(exc, DataStall) and self._current is not self._healed:
            return  # the batch came after all (the main thread left that fetch): nothing to heal
        if exc is not None:
            raise exc


def _ask_data_workers_for_stacks() -> int:
    """``STACKS_SIGNAL`` to this process's DataLoader workers: they write their stacks to stderr (see
    pitstop.data.loader.workers)."""
    from pitstop.data.loader.workers import STACKS_SIGNAL

    asked = 0
    try:
        children = list(multiprocessing.active_children())
    except (RuntimeError, OSError):  # the main thread changed the set of children meanwhile
        return 0
    for p in children:
        if p.daemon and p.pid:  # (the loader's workers are this process's daemon children)
            try:
                os.kill(p.pid, STACKS_SIGNAL)
                asked += 1
            except OSError:
                pass
    if asked:
        time.sleep(0.5)  # let them write before this process goes
    return asked
