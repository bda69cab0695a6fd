"""``fault=lose_node``: a node is lost at a step, as when its GPU fails and it is drained and replaced: every process
of node ``fault.node`` clears the node's local checkpoint tier (``ckpt.local``: its own checkpoints and the copies
it holds for its partner, ``ckpt.local.replicas``) and kills itself (SIGKILL) at the end of step ``fault.step``, once
per run dir. The restarted job finds that node empty: its ranks restore from the copy its partner holds, or, without
one, from the durable tier (``ckpt.dir``).

``fault.wait_for_copy`` (on by default): the loss is meant to show what a copy buys, and on a loaded machine no copy
may have travelled by ``fault.step`` (a copy overtaken by a newer save is skipped), so the node is lost at the end of
the first step from ``fault.step`` on at which its partner holds a copy of one of its saves (what a replicator of the
node recorded as acknowledged; every rank agrees on that step, so all of the node's processes go together), said in
the kill's line; with copies off or stopped, at once. A run that ends first ends without the loss, said in one line.
With ``partner=lost`` both nodes are lost at ``fault.step`` (no copy survives either way, and both must fire in the
same attempt).

``fault.partner`` says what happens to the node that holds the lost node's copies (the next node in the ring of
``pitstop.ckpt.peer``): ``keep`` (nothing: the lost node's ranks restore from it); ``corrupt`` (as the job restarts
after the loss, before its restore, the partner's first process flips a byte in every data file of every copy the
partner holds for the lost node: the restore finds the checksums wrong and falls back to the durable tier, said in
one line); ``lost`` (the partner is lost too, as the node: then the durable tier). The durable tier is never touched.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from pitstop.ckpt import integrity, layout, peer
from pitstop.errors import ConfigError
from pitstop.resilience.fault import FaultContext, NoFault, _kill, check_step
from pitstop.resilience.fault_record import fired_keys, note_fired, note_injected
from pitstop.resilience.node_book import node_name

log = logging.getLogger("pitstop.resilience.fault")

PARTNER = ("keep", "corrupt", "lost")


def local_root(checkpointer: Any) -> str | None:
    """The run's local tier dir on this node (``ckpt.local``), or None when the tier is off."""
    tier = getattr(checkpointer, "local", None)
    return getattr(tier, "root", None) if tier is not None else None


def ring_of(checkpointer: Any) -> Any:
    """The ring of nodes of the local tier's copy (``pitstop.ckpt.peer.Ring``: who holds whose copy), or None when
    the local tier is not copied (``ckpt.local.replicas=0``)."""
    copier = getattr(checkpointer, "replicator", None)
    return getattr(copier, "ring", None)


def held_for(root: str, owner: int) -> list[str]:
    """The dirs of the copies this node's local tier holds for node ``owner`` (its index in the ring): every step
    dir under ``<root>/peer/<owner>/`` (``pitstop.ckpt.peer``'s layout; a link is never one)."""
    where = dict(peer.owner_dirs(root)).get(owner)
    return [path for _, path, _ in layout.list_checkpoints(where)] if where is not None else []


MARKERS = (layout.DCP_MARKER, integrity.MANIFEST, peer.COPIED, peer.REPLICATED, peer.OWN, layout.SAVE_MARKER)


def corrupt(step_dir: str) -> int:
    """Flip one byte in the middle of every non-empty data file of ``step_dir`` (its markers and checksum manifest
    stay as they were: the copy looks whole, and only its checksums can tell). The number of files changed."""
    changed = 0
    for name in sorted(os.listdir(step_dir)):
        path = os.path.join(step_dir, name)
        if name in MARKERS or os.path.islink(path) or not os.path.isfile(path) or os.path.getsize(path) == 0:
            continue
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
            f.flush()
            os.fsync(f.fileno())
        changed += 1
    return changed


class NodeLoss(NoFault):
    name = "lose_node"

    def __init__(
        self,
        node: str,
        step: int,
        partner: str = "keep",
        wait_for_copy: bool = True,
        replica: int | str | None = None,
    ):
        super().__init__(replica)
        if partner not in PARTNER:
            raise ConfigError(f"fault.partner={partner!r}: use one of {', '.join(PARTNER)}")
        self.node, self.step, self.partner = str(node), int(step), partner
        self.wait_for_copy = bool(wait_for_copy) and partner != "lost"
        self.armed = False
        self.waiting = False

    def key(self) -> str:
        return f"{self.name}@{self.step}/{self.node}"

    def bind(self, ctx: FaultContext) -> None:
        super().bind(ctx)
        check_step(self.step, ctx)
        self.here = node_name()
        fired = fired_keys(ctx.run_dir)
        # decided at start, by every process alone: all of a node's processes fire (each notes its own line)
        self.armed = not any(k.startswith(self.key() + "/rank") for k in fired)
        if self.partner == "corrupt" and not self.armed and self.key() + "/corrupt" not in fired:
            self._corrupt_held()  # (the restart after the loss, before its restore: no copy is in flight now)

    def _corrupt_held(self) -> None:
        """On the lost node's partner, by its first rank alone (a byte flipped twice would be whole again): every copy
        it holds for the lost node, corrupted."""
        root, ring = local_root(self.ctx.checkpointer), ring_of(self.ctx.checkpointer)
        if root is None or ring is None or self.node not in ring.nodes:
            return
        lost = ring.nodes.index(self.node)
        holder = (lost + 1) % len(ring.nodes)
        if ring.nodes[holder] != self.here or ring.leader(holder) != self.ctx.rank:
            return
        copies = held_for(root, lost)
        files = sum(corrupt(c) for c in copies)
        note_injected(self.ctx.run_dir, self.key() + "/corrupt", files=files, copies=len(copies))
        log.warning(
            "fault injection: node %s corrupted %d file(s) of the %d cop%s it holds for lost node %s",
            self.here,
            files,
            len(copies),
            "y" if len(copies) == 1 else "ies",
            self.node,
        )

    def _copier(self) -> Any:
        """The replicator whose acknowledged copies the loss waits for; None when it does not wait (not asked, copies
        off, or ``partner=lost``)."""
        return getattr(self.ctx.checkpointer, "replicator", None) if self.wait_for_copy else None

    def _copied(self, copier: Any) -> tuple[bool, int | None]:
        """Whether this process's replicator lets the lost node go now (a copy acknowledged, or copies stopped), and
        the newest step of its saves acknowledged (None: none)."""
        done = list(copier.copies)  # (appended by the copy's thread once every rank agreed it is held)
        newest = max(s for s, _, _ in done) if done else None
        return bool(done) or copier.broken is not None, newest

    def after_step(self, step: int) -> None:
        if not self.armed or step < self.step:
            return
        root, ring = local_root(self.ctx.checkpointer), ring_of(self.ctx.checkpointer)
        copier, held = self._copier(), None
        if copier is not None:  # every rank, every step from fault.step on, until the loss: one small collective
            go, held = self._copied(copier) if self.here == self.node else (False, None)
            if not copier.strategy.any(go):
                if not self.waiting and self.here == self.node:
                    log.warning(
                        "fault injection: node %s is lost once its partner holds a copy of one of its saves (none "
                        "yet at step %d; fault.wait_for_copy=false: at fault.step whatever is held)",
                        self.node,
                        step,
                    )
                self.waiting = True
                return
        elif step != self.step:
            return
        self.armed = self.waiting = False
        if self.here == self.node:
            tail = "" if held is None else f"; its partner holds its copy of step {held}"
            self._lose(root, f"node {self.node} lost at step {step}{tail}")
        elif self.partner == "lost" and ring is not None and self.node in ring.nodes:
            lost = ring.nodes.index(self.node)
            if ring.nodes[(lost + 1) % len(ring.nodes)] == self.here:  # this node holds the lost node's copies
                self._lose(root, f"node {self.here}, the partner of lost node {self.node}, lost too at step {step}")

    def close(self) -> None:
        if self.armed and self.waiting and self.here == self.node:
            log.warning(
                "fault injection: node %s was not lost: the run ended before its partner held a copy of one of its "
                "saves (fault.wait_for_copy)",
                self.node,
            )

    def _lose(self, root: str | None, why: str) -> None:
        note_fired(self.ctx.run_dir, f"{self.key()}/rank{self.ctx.rank}")  # (before the kill: a launcher reads it)
        if root is not None:
            layout.free_dir(root, "the lost node's local tier")  # (every process of the node: whichever is first)
            log.warning("fault injection: the local checkpoint tier of node %s is cleared (%s)", self.here, root)
        _kill(why)
