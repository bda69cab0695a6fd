"""The local tier's copy on a peer node (``ckpt.local.replicas=1``): who holds whose copy, what a node holds, and
which step the job can restore from it.  Pure functions of names and dirs (no process groups, no tensors); the copy
itself travels in :mod:`pitstop.ckpt.peer_copy`.

With DCP every rank writes its own files (``__<rank>_<n>.distcp``) into its node's local dir and rank 0 also the
checksum manifest and ``.metadata``: a node's local dir alone never holds a whole checkpoint (tensors replicated
across ranks are written once, by the lowest rank).  So the nodes form a ring, in the order of their first rank:
node ``i``'s files are also held by node ``i+1`` (rank for rank, by local index), under
``<local root>/peer/<i>/step_X/``, verified against the manifest, and then marked ``COPIED``; the owner's own dir is
marked ``REPLICATED`` once every copy of that step is acknowledged; while copies are off (they broke at run time,
or one node is left) each save is marked ``OWN`` instead, and counts while every saving node still holds its own
files.  One node lost never takes a checkpoint's files and their only copy.  A restore takes the newest step whose
every saving node's files are still held somewhere (own dir or copy): every node then assembles the whole step in its
own dir (from its own files, its peer copies and what the holders send) and loads it as DCP does (resharded if the
world size changed).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from pitstop.ckpt import integrity, layout
from pitstop.errors import CheckpointError, ConfigError

PEER_DIR = "peer"  # <local root>/peer/<owner node index>/step_X/: the partner's files
REPLICATED = "REPLICATED"  # in the owner's step dir: every copy of this step was verified by its holder
COPIED = "COPIED"  # in the holder's peer/<i>/step_X/: this copy was verified against the manifest
OWN = "OWN"  # in the owner's step dir, copies off: the node's own files of this save are whole (no copy anywhere)
MARKER_MAX = 1 << 16
_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp")


@dataclass(frozen=True)
class Ring:
    """The job's nodes in the order of their first rank; each rank's node and its index on that node."""

    nodes: tuple[str, ...]
    node_of: tuple[int, ...]  # per rank
    local_of: tuple[int, ...]  # per rank

    def ranks_on(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.node_of) if n == node]

    def _at(self, node: int, local: int) -> int | None:
        ranks = self.ranks_on(node % len(self.nodes))
        return ranks[local] if local < len(ranks) else None

    def send_to(self, rank: int) -> int | None:
        """The rank that holds ``rank``'s copy: the same local index on the next node."""
        return self._at(self.node_of[rank] + 1, self.local_of[rank])

    def recv_from(self, rank: int) -> int | None:
        """The rank whose copy ``rank`` holds: the same local index on the previous node."""
        return self._at(self.node_of[rank] - 1, self.local_of[rank])

    def leader(self, node: int) -> int:
        """The node's first rank: it lists, assembles and purges the node's local dir."""
        return self.ranks_on(node)[0]


def ring(names: list[str], key: str = "ckpt.local.replicas", alone_ok: bool = False) -> Ring:
    """The ring of the job whose rank ``r`` runs on node ``names[r]``; ConfigError when it cannot hold a copy on
    another node (one node, unless ``alone_ok``: a job re-formed on one node; nodes with different numbers of
    ranks)."""
    order: list[str] = []
    for n in names:
        if n not in order:
            order.append(n)
    if len(order) < 2 and not alone_ok:
        raise ConfigError(
            f"{key}=1 keeps a copy on another node, and the job runs on one node ({order[0] if order else '?'}): "
            f"set {key}=0, or run on several nodes"
        )
    node_of = tuple(order.index(n) for n in names)
    local_of = tuple(node_of[:r].count(node_of[r]) for r in range(len(names)))
    counts = {n: node_of.count(i) for i, n in enumerate(order)}
    if len(set(counts.values())) > 1:
        shown = ", ".join(f"{n}: {c}" for n, c in counts.items())
        raise ConfigError(
            f"{key}=1 pairs ranks by their index on the node, and the nodes have different numbers of ranks "
            f"({shown}): run the same number of ranks per node, or set {key}=0"
        )
    return Ring(tuple(order), node_of, local_of)


def writer_of(name: str) -> int:
    """The rank that wrote checkpoint file ``name`` (DCP's ``__<rank>_<n>.distcp``); rank 0 for the others (the
    manifest, ``.metadata``)."""
    m = _RANK_FILE.fullmatch(name)
    return int(m.group(1)) if m else 0


def files_of(names: list[str], ranks: list[int]) -> list[str]:
    """Of a manifest's ``names``, those written by ``ranks`` (the manifest first when rank 0 is one of them: a
    receiver checks every other file against it), in a fixed order."""
    mine = sorted(n for n in names if writer_of(n) in ranks)
    return ([integrity.MANIFEST] if 0 in ranks else []) + mine


def copy_dir(root: str, owner: int, step: int) -> str:
    return os.path.join(root, PEER_DIR, str(owner), os.path.basename(layout.step_dir(root, step)))


def owner_dirs(root: str) -> list[tuple[int, str]]:
    """``(owner, dir)`` of the copies a node's local dir holds, per owner node (``<root>/peer/<owner>/``), by owner;
    none when ``peer/`` is missing or a link (never listed, written or deleted through)."""
    peers = os.path.join(root, PEER_DIR)
    if not os.path.isdir(peers) or layout.is_link(peers):
        return []
    return sorted((int(o), os.path.join(peers, o)) for o in os.listdir(peers) if o.isdigit())


def step_dirs(root: str) -> list[str]:
    """The dirs a node's local tier keeps step dirs in: its own root, then each owner's copies (:func:`owner_dirs`)."""
    return [root, *(d for _, d in owner_dirs(root))]


def make_copy_dir(root: str, owner: int, step: int) -> str:
    """The dir of node ``owner``'s copy of ``step`` under local root ``root``, made (0700) where missing;
    CorruptCheckpoint where a part of it below the root is a link or not a dir (a copy is never written through a
    link to elsewhere)."""
    path, where = copy_dir(root, owner, step), root
    for part in os.path.relpath(path, root).split(os.sep):
        where = os.path.join(where, part)
        if os.path.lexists(where):
            integrity.check_dir(where)
        else:
            os.mkdir(where, 0o700)
    return path


def marker(step: int, owner: int, nodes: int, ranks: list[int]) -> bytes:
    return json.dumps({"step": step, "owner": owner, "nodes": nodes, "ranks": ranks}, sort_keys=True).encode()


@dataclass(frozen=True)
class Held:
    """One node's files of one step, held here: in the owner's own dir (``own``) or a copy (``peer``)."""

    step: int
    owner: int  # the saving job's node index
    nodes: int  # how many nodes the saving job had
    ranks: tuple[int, ...]  # the owner's ranks at the save
    where: str  # "own" | "peer"


MAX_NODES = 1 << 16  # (more nodes than any job has: a marker naming more is not pitstop's)


def read_marker(path: str, name: str, step: int) -> Held | None:
    """The marker ``name`` of dir ``path`` (a checkpoint's own step dir or a copy), checked; None when it is absent or
    is not what pitstop writes (a link, a FIFO, garbage: that dir then counts as not held)."""
    try:
        with integrity.open_regular(os.path.join(path, name)) as f:
            doc = json.loads(f.read(MARKER_MAX + 1)[:MARKER_MAX])
    except (OSError, ValueError, CheckpointError):  # (open_regular: CorruptCheckpoint for a link or a FIFO)
        return None
    if not isinstance(doc, dict):
        return None
    owner, nodes, ranks = doc.get("owner"), doc.get("nodes"), doc.get("ranks")
    counts = [owner, nodes, *(ranks if isinstance(ranks, list) else [None])]
    if doc.get("step") != step or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in counts):
        return None
    if not ranks or owner >= nodes or nodes > MAX_NODES:  # (a damaged count must not size what restore builds)
        return None
    return Held(step, owner, nodes, tuple(ranks), "peer" if name == COPIED else "own")


def holdings(root: str) -> list[Held]:
    """What a node's local dir holds: its own checkpoints that were replicated (or saved while copies were off:
    ``OWN``) and the copies it verified."""
    out = []
    for step, path, _ in layout.list_checkpoints(root):
        held = read_marker(path, REPLICATED, step) or read_marker(path, OWN, step)
        if held is not None:
            out.append(held)
    for owner, where in owner_dirs(root):
        for step, path, _ in layout.list_checkpoints(where):
            held = read_marker(path, COPIED, step)
            if held is not None and held.owner == owner:
                out.append(held)
    return out


def need_bytes(total: int, node_ranks: int, world: int, replicated: bool) -> int:
    """What a node's local dir must hold of one checkpoint of ``total`` bytes: its own files and its partner's (its
    ranks' share twice), and, at a restore, the whole checkpoint (:func:`plan` makes every node's own dir whole: what
    it holds is linked, what others send is new bytes); with replicated state (DDP: the lowest rank writes what every
    rank holds) the whole checkpoint twice (the node of rank 0 holds nearly all of it, its partner a copy)."""
    if replicated:
        return 2 * total
    return max(2 * (total * node_ranks // max(1, world)), total)


def restorable(held_by: list[list[Held]]) -> int | None:
    """The newest step of which every saving node's files are held by some node now (``held_by[n]``: what node
    ``n`` holds), the saving nodes agreeing on how many they were; None if there is none."""
    steps: dict[int, list[Held]] = {}
    for held in held_by:
        for h in held:
            steps.setdefault(h.step, []).append(h)
    for step in sorted(steps, reverse=True):
        hs = steps[step]
        if len({h.nodes for h in hs}) == 1 and {h.owner for h in hs} == set(range(hs[0].nodes)):
            return step
    return None


def lost(held_by: list[list[Held]], newer_than: int) -> tuple[int, list[int]] | None:
    """The newest step newer than ``newer_than`` that the nodes hold only part of, and the saving nodes whose files
    no node holds any more (a node and its partner both lost); None if there is none."""
    steps = sorted({h.step for held in held_by for h in held if h.step > newer_than}, reverse=True)
    for step in steps:
        hs = [h for held in held_by for h in held if h.step == step]
        gone = sorted(set(range(max(h.nodes for h in hs))) - {h.owner for h in hs})
        if gone:
            return step, gone
    return None


def plan(held_by: list[list[Held]], step: int) -> list[tuple[int, int, int, str]]:
    """How every node gets the whole of ``step``: ``(owner, from node, to node, where)`` in a fixed order, the
    files of the owner of rank 0's (the manifest, ``.metadata``) to every node first (a node that saved with copies
    off holds no manifest of its own: it sends its files once it has received one); ``from == to`` for files the
    node holds itself (``where``: in its own dir or a copy), else the first node that holds them sends them."""
    of_step = [[h for h in held if h.step == step] for held in held_by]
    nodes = next(h.nodes for hs in of_step for h in hs)
    first = next(h.owner for hs in of_step for h in hs if 0 in h.ranks)
    owners = [first, *(o for o in range(nodes) if o != first)]
    out = []
    for owner in owners:
        for to, mine in enumerate(of_step):
            here = [h for h in mine if h.owner == owner]
            if here:
                out.append((owner, to, to, here[0].where))
                continue
            src = next(n for n, hs in enumerate(of_step) if any(h.owner == owner for h in hs))
            where = next(h.where for h in of_step[src] if h.owner == owner)
            out.append((owner, src, to, where))
    return out


def purge(root: str, keep: int, up_to: int | None = None, marked: bool = True) -> None:
    """A node's retention: its own checkpoints and its copies beyond the newest ``keep`` replicated (or copied) ones
    (``marked`` False, copies off: beyond the newest ``keep`` of its own), and, with ``up_to`` (a durable save of
    that step is committed), every one not newer than it."""
    for where in step_dirs(root):
        name = REPLICATED if where == root else COPIED
        found = layout.list_checkpoints(where)
        done = [
            s
            for s, p, _ in found
            if read_marker(p, name, s) is not None
            or (where == root and (not marked or read_marker(p, OWN, s) is not None))
        ]
        floor = done[-keep] if len(done) >= keep else None
        for s, path, _ in found:
            if (up_to is not None and s <= up_to) or (floor is not None and s < floor):
                layout.remove(path)


MAX_HELD = 1 << 20  # int64 values of one node's encoded holdings (far more rows than keep_last_k makes)


def encode(held: list[Held]) -> list[int]:
    """A node's holdings as int64 values, to travel between nodes without pickles: the row count, then per row
    ``step, owner, nodes, own (1) or peer (0), len(ranks), *ranks``."""
    out = [len(held)]
    for h in held:
        out += [h.step, h.owner, h.nodes, int(h.where == "own"), len(h.ranks), *h.ranks]
    return out


def decode(values: list[int], world: int) -> list[Held]:
    """What :func:`encode` made, checked (steps, ranks >= 0; an owner among its ``nodes``, at most
    :data:`MAX_NODES`; at most ``MAX_NODES * world`` rows; nothing left over); ValueError naming what is wrong."""
    if not values or not 0 <= values[0] <= MAX_NODES * max(1, world):
        raise ValueError(f"a row count of {values[0] if values else None}")
    out, at = [], 1
    for _ in range(values[0]):
        row = values[at : at + 5]
        if len(row) < 5:
            raise ValueError("a row cut short")
        step, owner, nodes, own, count = row
        ranks = values[at + 5 : at + 5 + count]
        if step < 0 or not 0 <= owner < nodes <= MAX_NODES or own not in (0, 1) or not 0 < count == len(ranks):
            raise ValueError(f"a row of step {step}, node {owner} of {nodes}, {count} ranks")
        if min(ranks) < 0:
            raise ValueError(f"a negative rank in the row of step {step}")
        out.append(Held(step, owner, nodes, tuple(ranks), "own" if own else "peer"))
        at += 5 + count
    if at != len(values):
        raise ValueError(f"{len(values) - at} values after the last row")
    return out
