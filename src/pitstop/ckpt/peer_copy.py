"""The local tier's copy on a peer node, over the job's own process group (``ckpt.local.replicas=1``; who holds
what: :mod:`pitstop.ckpt.peer`).

A dedicated gloo group (made at setup on every rank; used only by this module's one thread, never by the loop's)
carries raw bytes (:mod:`pitstop.ckpt.peer_wire`: a header checked against the checkpoint's own manifest, the
receiver's answer, then the files in chunks, each file's length and CRC32C checked once written).  Nothing received
is unpickled: what the nodes hold travels as int64 values (:func:`pitstop.ckpt.peer.encode`).  A save is copied
after the local save completed, in this thread (off the loop); whatever one rank finds (a file that does not check,
a dir it cannot write) every rank agrees on before the next collective.  A copy that fails (a partner gone: gloo's
timeout; a dir that cannot be written) is said once, and the local tier goes on without copies, each save then
marked ``OWN`` by its node (restorable while every node holds its own files); the durable tier is never affected.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pitstop.ckpt import integrity, layout, peer, peer_wire
from pitstop.ckpt.contract import StrategyLike, one_line
from pitstop.ckpt.peer_wire import FINDINGS
from pitstop.ckpt.storage import dir_bytes
from pitstop.errors import CheckpointError, ConfigError

log = logging.getLogger("pitstop.ckpt")
KEY = "ckpt.local.replicas"


class Replicator:
    """One rank's part of the ring: it sends the files its rank wrote to its partner on the next node and holds the
    previous node's (rank for rank)."""

    def __init__(self, strategy: StrategyLike, root: str, node: str, keep: int, timeout: float):
        self.strategy, self.root, self.keep, self.rank = strategy, root, keep, strategy.rank
        names = [str(n) for n in strategy.all_gather_object(node)]
        # One node left of a job that had several (an elastic job re-formed without the others): no copies now, but
        # what this node holds (its own files and its copies) is restored from.
        alone = len(set(names)) == 1 and strategy.any(os.path.isdir(os.path.join(root, peer.PEER_DIR)))
        self.ring = peer.ring(names, alone_ok=alone)
        self.node = self.ring.node_of[self.rank]
        self.leads = self.ring.leader(self.node) == self.rank
        self.group = None
        if dist.is_available() and dist.is_initialized():
            try:  # (gloo connects every pair of ranks here: a node that cannot be reached fails it)
                self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
            except RuntimeError as e:
                raise ConfigError(
                    f"{KEY}=1: the nodes ({', '.join(self.ring.nodes)}) cannot reach each other over the job's process "
                    f"group for the copies ({one_line(e)}): check the nodes' network, or set {KEY}=0"
                ) from None
        self.broken: str | None = None
        self._newest = -1  # the newest step handed to copy()
        self.held_by: list[list[peer.Held]] = []  # what each node held at the restore
        self.copies: list[tuple[int, float, int]] = []  # (step, seconds from the save's end to every ack, bytes sent)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pitstop-ckpt-peer")
        self.chunk = peer_wire.CHUNK  # (bytes per message: what a copy holds of a file at a time)
        if alone:
            self.broken = f"the job runs on one node now ({names[0]}): no other node to hold a copy"
            log.warning(
                "local checkpoints are not copied to a peer node: %s; the local tier goes on without copies",
                self.broken,
            )
        else:
            self._handshake()

    @classmethod
    def start(
        cls, strategy: StrategyLike, local: Any, node: str | None, timeout: float, backend: str, full_state: bool
    ) -> Replicator:
        """The replicator of local tier ``local`` (a :class:`~pitstop.ckpt.tiers.Tier`); ConfigError for a backend
        that writes no per-rank files, one node, or a partner that cannot be reached."""
        if full_state:
            raise ConfigError(
                f"{KEY}=1 copies each rank's DCP files; ckpt={backend} writes one file from rank 0: use "
                f"ckpt=sync_dcp or ckpt=async_dcp, or set {KEY}=0"
            )
        return cls(strategy, local.root, node or socket.gethostname(), local.keep_last_k, timeout)

    def _handshake(self) -> None:
        """Every rank greets its partner on both sides: one that cannot be reached stops the run here."""
        to, of = self.ring.send_to(self.rank), self.ring.recv_from(self.rank)
        got, problem = -1, None
        try:
            got = peer_wire.one_int(self.node, to, of, self.group)
        except RuntimeError as e:
            problem = one_line(e)
        if problem is None and got != self.ring.node_of[of]:
            problem = f"it answered as node {got}"
        if self.strategy.any(problem is not None):
            names = self.ring.nodes
            raise ConfigError(
                f"{KEY}=1: the partner node {names[self.ring.node_of[to]]} (rank {to}) or "
                f"{names[self.ring.node_of[of]]} (rank {of}) cannot be reached from {names[self.node]} over the job's "
                f"process group ({problem or 'on another rank'}): check the nodes' network, or set {KEY}=0"
            )

    # ---- at start -----------------------------------------------------------------------------------
    def check_space(self, state_bytes: int, replicated: bool) -> None:
        """ConfigError (on every rank, naming the node and the sizes) unless every node's local dir can hold its own
        checkpoint and its partner's: ``state_bytes`` is one checkpoint of the whole job (``restore.state_bytes``:
        already summed over the ranks); with replicated state (DDP) a checkpoint holds it once."""
        need = peer.need_bytes(state_bytes, len(self.ring.ranks_on(self.node)), len(self.ring.node_of), replicated)
        room, problem = need, None  # (a rank that does not lead measures nothing)
        try:
            if self.leads:
                room = shutil.disk_usage(self.root).free + dir_bytes(self.root)
        except OSError as e:  # (before a collective: every rank hears of it)
            problem = f"{KEY}=1: the local dir {self.root} cannot be measured ({one_line(e)}): check ckpt.local.dir"
        every = self._gather([room, need, int(problem is not None)])
        short = [(r, v) for r, v in enumerate(every) if len(v) == 3 and v[0] < v[1]]
        if problem is None and short:
            rank, (room, need, _) = short[0]
            problem = (
                f"{KEY}=1: the local dir (ckpt.local.dir) on node {self.ring.nodes[self.ring.node_of[rank]]} has "
                f"{_size(room)} for checkpoints, and a node holds its own checkpoint and its partner's "
                f"({_size(need)}): make it larger (a bigger tmpfs or disk), or set {KEY}=0"
            )
        if problem is not None or any(v[2] for v in every if len(v) == 3):
            raise ConfigError(problem or f"{KEY}=1: a node's local dir cannot be measured (see its log)")

    # ---- after each local save --------------------------------------------------------------------------
    def copy(self, step: int, ok: bool) -> Future:
        """Copy local save ``step`` (``ok``: it completed on this rank) to the partner, in this module's thread.  A copy
        that a newer save overtook before it began is skipped (on every rank: they agree), so copies never queue up
        behind saves that come faster than they travel."""
        self._newest = step
        return self._pool.submit(self._guarded, self._copy, step, ok)

    def purge(self, up_to: int | None = None) -> Future:
        """A node's retention (its leader's; every ``keep_last_k`` copied saves and copies, or, with copies off,
        every save), and with ``up_to`` what a durable save of that step made of no more use."""
        return self._pool.submit(self._purge, up_to)

    def _guarded(self, work: Any, step: int, ok: bool) -> bool:
        """``work``'s answer (a copy: True once made), False when copies are off or it failed (the save is then
        marked as its node's own, if it completed)."""
        if self.broken is not None:
            self._own(step, ok)
            self._purge(None)  # (copies off: the node's own retention goes on)
            return False
        try:
            return bool(work(step, ok))
        except Exception as e:  # noqa: BLE001 - any failure: the local tier goes on without copies, said once
            self.broken = one_line(e)
            log.warning(
                "local checkpoints are no longer copied to the peer node (%s); the local tier goes on without "
                "copies, the durable tier is unaffected",
                self.broken,
            )
            self._own(step, ok)
            self._purge(None)
            return False

    def _own(self, step: int, ok: bool) -> None:
        """Copies off: mark local save ``step`` (``ok``: it completed) as this node's own (``OWN``), so a restart
        takes it while every node still holds its own files; no collective (the group may be gone)."""
        own = layout.step_dir(self.root, step)
        if not (ok and self.leads and os.path.isdir(own)) or peer.read_marker(own, peer.REPLICATED, step):
            return
        try:
            nodes, mine = len(self.ring.nodes), self.ring.ranks_on(self.node)
            integrity.write_durable(own, peer.OWN, peer.marker(step, self.node, nodes, mine))
        except FINDINGS as e:
            log.warning("local checkpoint of step %d cannot be marked as this node's own: %s", step, one_line(e))

    def _purge(self, up_to: int | None) -> None:
        """The node leader's retention, alone (no collective): whatever it finds is said, and the checkpoints stay."""
        if self.leads:
            try:
                peer.purge(self.root, self.keep, up_to, marked=self.broken is None)
            except FINDINGS as e:
                log.warning("local checkpoint retention failed: %s; the checkpoint stays (ckpt.local.keep_last_k)", e)

    def forget(self, step: int) -> None:
        """Remove this node's copies of ``step`` (a new save of that step begins: an earlier one's copy, from before a
        restart, must not count for it)."""
        for owner, _ in peer.owner_dirs(self.root):
            layout.remove(peer.copy_dir(self.root, owner, step))

    def discard_after(self, step: int) -> None:
        """Remove this node's saves and copies newer than ``step`` (a rollback abandoned their steps; a restart must
        never resume from them), after the copy in flight."""
        self._pool.submit(self._discard, step).result()

    def _discard(self, step: int) -> None:
        """The node leader's part of a rollback, alone (the other ranks go on to the next collective): what it cannot
        list or remove is said, never raised."""
        if not self.leads:
            return
        try:
            dirs = peer.step_dirs(self.root)
            found = [(s, path) for where in dirs for s, path, _ in layout.list_checkpoints(where) if s > step]
        except FINDINGS as e:
            log.error("the local dir %s cannot be listed to remove the rolled-back steps: %s", self.root, e)
            return
        for _, path in found:
            try:
                layout.remove(path)
            except FINDINGS as e:
                log.error("checkpoint %s of rolled-back steps could not be removed: %s", path, e)

    def _copy(self, step: int, ok: bool) -> bool:
        """True once the copy is made and marked (REPLICATED); False when it was skipped or not agreed."""
        t0 = time.perf_counter()
        if not self._agree(ok and step == self._newest):
            return False
        own = layout.step_dir(self.root, step)
        sealed = b""
        if self.rank == 0:
            try:
                sealed = integrity.read_file(os.path.join(own, integrity.MANIFEST), integrity.MANIFEST_MAX)
            except FINDINGS as e:  # (announced as 0 bytes: every rank stops copying, said once)
                log.warning("local checkpoint of step %d: its manifest cannot be read: %s", step, one_line(e))
        manifest = self._broadcast(sealed)
        to, of = self.ring.send_to(self.rank), self.ring.recv_from(self.rank)
        src_node = self.ring.node_of[of]
        there = peer.copy_dir(self.root, src_node, step)
        problem = None
        try:
            if self.leads:  # (one writer per node; the others read it after the agreement)
                peer.make_copy_dir(self.root, src_node, step)
                integrity.write_durable(there, integrity.MANIFEST, manifest, sync_dir=False)
        except FINDINGS as e:
            problem = one_line(e)
        self._stop_unless(problem, "its copy dir cannot be written")
        try:
            files = integrity.read_manifest(there)
        except FINDINGS as e:
            problem, files = one_line(e), {}
        self._stop_unless(problem, "the manifest of its copy cannot be read")
        try:
            peer_wire.exchange(self.group, own, files, [self.rank], to, there, of, [of], self.chunk)
        except FINDINGS as e:
            problem = one_line(e)
        if not self._agree(problem is None):
            log.warning("local checkpoint of step %d not copied to its peer: %s", step, problem or "see another rank")
            return False
        nodes = len(self.ring.nodes)
        try:
            if self.leads:
                mine, theirs = self.ring.ranks_on(self.node), self.ring.ranks_on(src_node)
                integrity.write_durable(there, peer.COPIED, peer.marker(step, src_node, nodes, theirs))
                if not layout.is_file(os.path.join(own, integrity.MANIFEST)):  # (every holder can send what it holds)
                    integrity.write_durable(own, integrity.MANIFEST, manifest, sync_dir=False)
                integrity.write_durable(own, peer.REPLICATED, peer.marker(step, self.node, nodes, mine))
        except FINDINGS as e:
            problem = one_line(e)
        self._stop_unless(problem, "its markers cannot be written")
        self._purge(None)
        sent = sum(files[n]["bytes"] for n in peer.files_of(sorted(files), [self.rank]) if n in files)
        self.copies.append((step, time.perf_counter() - t0, sent))
        log.debug("local checkpoint of step %d copied to rank %d, rank %d's held", step, to, of)
        return True

    def _stop_unless(self, problem: str | None, what: str) -> None:
        """Every rank agrees on what one found (a write of a node's leader, say): a CheckpointError on every rank
        (copies stop, said once) unless no rank found anything."""
        if not self._agree(problem is None):
            where = f"node {self.ring.nodes[self.node]}"
            raise CheckpointError(
                f"{what} on {where}: {problem}" if problem else f"{what} on another node (see its log)"
            )

    # ---- restore ----------------------------------------------------------------------------------------
    def newest(self) -> tuple[int, list[list[peer.Held]]] | None:
        """The newest step every saving node's files are held of, and what each node holds (the same on every
        rank); None when there is none."""
        mine: list[peer.Held] = []
        if self.leads:
            try:
                mine = peer.holdings(self.root)
            except FINDINGS as e:  # (before a collective: said, and this node holds nothing)
                log.warning("the local dir %s cannot be listed (%s): this node restores nothing of it", self.root, e)
        every = self._gather(peer.encode(mine))
        held_by = [_held(every[self.ring.leader(n)], len(self.ring.node_of)) for n in range(len(self.ring.nodes))]
        step = peer.restorable(held_by)
        self.held_by = held_by
        return None if step is None else (step, held_by)

    def assemble(self, step: int, held_by: list[list[peer.Held]]) -> str | None:
        """Make every node's own dir of ``step`` whole (its own files, its copies, what the holders send), each
        file checked; the tier it came from (``peer`` when some node's files exist only as a copy, else ``local``),
        or None when it could not be made (said in one line; the durable tier is next)."""
        target = layout.step_dir(self.root, step)
        problem = None
        for owner, frm, to, where in peer.plan(held_by, step):  # (every transfer is made, even after a finding)
            if self.node not in (frm, to) or not self.leads:
                continue
            src = target if where == "own" else peer.copy_dir(self.root, owner, step)
            ranks = next(list(h.ranks) for h in held_by[frm] if h.step == step and h.owner == owner)
            try:
                if frm == to:
                    if where != "own":
                        _copy_local(src, target, ranks)
                elif self.node == frm:
                    peer_wire.send_step(self.group, src, ranks, self.ring.leader(to), self.chunk)
                else:
                    peer_wire.recv_step(self.group, target, self.ring.leader(frm), ranks, self.chunk)
            except FINDINGS as e:
                problem = problem or one_line(e)
        try:
            if self.leads and problem is None:
                integrity.verify(target)
        except FINDINGS as e:
            problem = one_line(e)
        if not self._agree(problem is None):
            log.warning(
                "the local checkpoint of step %d cannot be made whole from the nodes and their peer copies (%s): "
                "restoring from the durable tier",
                step,
                problem or "see another node's log",
            )
            return None
        owners = {h.owner for held in held_by for h in held if h.step == step and h.where == "own"}
        return "local" if owners == set(range(held_by_nodes(held_by, step))) else "peer"

    def _gather(self, values: list[int]) -> list[list[int]]:
        """Every rank's int64 ``values`` (an all_gather of their counts, then of the values padded to the longest);
        CheckpointError on every rank when a count is beyond :data:`peer.MAX_HELD`."""
        if self.group is None:
            return [values]
        world = dist.get_world_size(self.group)
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(counts, torch.tensor([len(values)], dtype=torch.int64), group=self.group)
        sizes = [int(c) for c in counts]
        if not all(0 < n <= peer.MAX_HELD for n in sizes):
            raise CheckpointError(f"the ranks announced holdings of {sizes} values (at most {peer.MAX_HELD})")
        longest = max(sizes)
        padded = torch.zeros(longest, dtype=torch.int64)
        padded[: len(values)] = torch.tensor(values, dtype=torch.int64)
        out = [torch.zeros(longest, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(out, padded, group=self.group)
        return [t[:n].tolist() for t, n in zip(out, sizes)]

    def _broadcast(self, data: bytes, src: int = 0) -> bytes:
        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(size, src, group=self.group)
        n = int(size)
        if not 0 < n <= integrity.MANIFEST_MAX:
            raise CheckpointError(f"a checkpoint manifest of {n} bytes was announced")
        mine = self.rank == src
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if mine else torch.empty(n, dtype=torch.uint8)
        dist.broadcast(buf, src, group=self.group)
        return buf.numpy().tobytes()

    def _agree(self, ok: bool) -> bool:
        if self.group is None:
            return ok
        t = torch.tensor([int(bool(ok))], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(int(t))

    def stats(self) -> dict:
        """For ``summary.json``'s checkpoint section: the copies made, their mean time (from the local save's end to
        every holder's acknowledgement, in this thread: off the loop), and why copies stopped, if they did."""
        done = self.copies
        mean = sum(c[1] for c in done) / len(done) if done else 0.0
        return {
            "local_replicas": 1,
            "local_copies": len(done),
            "local_copy_seconds_mean": round(mean, 5),
            "local_copy_bytes_last": done[-1][2] if done else 0,
            "local_copies_off": self.broken,
        }

    def close(self, remove: bool) -> None:
        """Wait for the copy in flight; ``remove``: the run is complete, the node's local dir is freed."""
        self._pool.shutdown(wait=True)
        if remove and self.leads:
            layout.free_dir(self.root)


def _size(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 10 << 20 else f"{n / 2**10:.0f} KiB"


def held_by_nodes(held_by: list[list[peer.Held]], step: int) -> int:
    return next(h.nodes for held in held_by for h in held if h.step == step)


def _held(values: list[int], world: int) -> list[peer.Held]:
    """What a node's leader said its node holds (:func:`peer.encode`), checked; nothing when it does not decode (said:
    every rank decodes the same values, so every rank drops the same node's)."""
    try:
        return peer.decode(values, world)
    except ValueError as e:
        log.warning("a node's list of the local checkpoints it holds does not decode (%s): counted as none", e)
        return []


def _copy_local(src: str, dst: str, ranks: list[int]) -> None:
    """The files of ``ranks`` from a copy this node holds (``src``) into its own step dir ``dst``, each checked."""
    files = integrity.read_manifest(src)
    os.makedirs(dst, mode=0o700, exist_ok=True)
    for name in peer.files_of(sorted(files), ranks):
        if name == integrity.MANIFEST:
            data = integrity.read_file(os.path.join(src, name), integrity.MANIFEST_MAX)
            integrity.write_durable(dst, name, data, sync_dir=False)
            continue
        there = os.path.join(dst, name)
        if os.path.lexists(there):
            os.remove(there)
        try:  # (a second name for the same bytes: the node's memory holds them once; files are never changed in place)
            os.link(os.path.join(src, name), there, follow_symlinks=False)
        except OSError:
            integrity.write_durable(dst, name, integrity.read_file(os.path.join(src, name)), sync_dir=False)
        integrity.check_file(dst, name, files[name])
