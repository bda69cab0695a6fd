"""Who holds whose copy of the local tier (``ckpt.local.replicas=1``), what a node's dir holds, and which step a job
restores from the nodes and their copies: pure logic on names and real dirs (the copies themselves travel in
tests/system/test_ckpt_peer_kills.py)."""

from __future__ import annotations

import os

import pytest

from pitstop.ckpt import integrity, peer
from pitstop.errors import ConfigError


def test_the_ring_pairs_ranks_by_local_index_with_the_next_node():
    r = peer.ring(["b", "a", "b", "a", "c", "c"])  # (nodes in the order of their first rank: b, a, c)
    assert r.nodes == ("b", "a", "c") and r.node_of == (0, 1, 0, 1, 2, 2) and r.local_of == (0, 0, 1, 1, 0, 1)
    assert [r.send_to(x) for x in range(6)] == [1, 4, 3, 5, 0, 2]  # b -> a -> c -> b, local index kept
    assert [r.recv_from(r.send_to(x)) for x in range(6)] == list(range(6))
    assert all(r.node_of[r.send_to(x)] != r.node_of[x] for x in range(6))  # never a copy on its own node
    assert [r.leader(n) for n in range(3)] == [0, 1, 4]


def test_a_ring_of_one_node_or_of_uneven_nodes_is_a_one_line_error():
    with pytest.raises(ConfigError, match=r"ckpt.local.replicas=1 keeps a copy on another node, and the job runs on "):
        peer.ring(["a", "a"])
    with pytest.raises(ConfigError, match=r"different numbers of ranks \(a: 2, b: 1\)"):
        peer.ring(["a", "a", "b"])


def test_each_rank_sends_the_files_it_wrote_and_rank_0_the_manifest_and_metadata():
    names = [".metadata", "__0_0.distcp", "__1_0.distcp", "__12_0.distcp"]
    assert peer.files_of(names, [0]) == [integrity.MANIFEST, ".metadata", "__0_0.distcp"]
    assert peer.files_of(names, [1, 12]) == ["__12_0.distcp", "__1_0.distcp"]
    assert peer.writer_of("__7_3.distcp") == 7 and peer.writer_of("../__7_3.distcp") == 0


def held(step, owner, where, nodes=2, ranks=None):
    return peer.Held(step, owner, nodes, tuple(ranks or [owner]), where)


def test_the_restore_takes_the_newest_step_whose_every_node_is_held_somewhere():
    a = [held(8, 0, "own"), held(8, 1, "peer"), held(10, 0, "own")]  # 10: b's files only on the lost node b
    assert peer.restorable([a, []]) == 8
    assert peer.restorable([a, [held(10, 1, "own")]]) == 10
    assert peer.restorable([[held(10, 0, "own", nodes=3)], [held(10, 1, "own")]]) is None  # (disagree: 3 or 2)
    assert peer.restorable([[], []]) is None


def test_the_plan_sends_a_lost_nodes_files_from_their_holder_the_manifests_owner_first():
    a = [held(8, 0, "own"), held(8, 1, "peer")]
    assert peer.plan([a, []], 8) == [(0, 0, 0, "own"), (0, 0, 1, "own"), (1, 0, 0, "peer"), (1, 0, 1, "peer")]
    b = [held(8, 1, "own"), held(8, 0, "peer")]  # (re-formed: the saving job's node 1 is now first)
    assert peer.plan([b, [held(8, 1, "peer")]], 8)[:3] == [(0, 0, 0, "peer"), (0, 0, 1, "peer"), (1, 0, 0, "own")]
    # saved with copies off (OWN): node 1 holds no manifest of its own, so it receives node 0's files (the
    # manifest among them) before it sends its own
    assert peer.plan([[held(8, 0, "own")], [held(8, 1, "own")]], 8)[1:3] == [(0, 0, 1, "own"), (1, 1, 0, "own")]


def test_a_nodes_holdings_are_read_from_its_markers_and_garbage_counts_as_not_held(tmp_path):
    own = tmp_path / "step_00000008"
    own.mkdir()
    (own / peer.REPLICATED).write_bytes(peer.marker(8, 0, 2, [0]))
    copy = tmp_path / "peer" / "1" / "step_00000008"
    copy.mkdir(parents=True)
    (copy / peer.COPIED).write_bytes(peer.marker(8, 1, 2, [1]))
    huge = peer.marker(14, 0, 10**12, [0])  # (a damaged count: restore would build range(nodes))
    for bad, text in [("step_00000010", peer.marker(9, 0, 2, [0])), ("step_00000012", b"{not json"),
                      ("step_00000014", huge)]:  # fmt: skip
        (tmp_path / bad).mkdir()
        (tmp_path / bad / peer.REPLICATED).write_bytes(text)
    wrong = tmp_path / "peer" / "0" / "step_00000008"  # (a copy under another owner's name)
    wrong.mkdir(parents=True)
    (wrong / peer.COPIED).write_bytes(peer.marker(8, 1, 2, [1]))
    assert peer.holdings(str(tmp_path)) == [held(8, 0, "own"), held(8, 1, "peer")]


def test_a_marker_that_is_a_link_or_a_fifo_counts_as_not_held_and_retention_goes_on(tmp_path):
    (tmp_path / "step_00000008").mkdir()
    (tmp_path / "step_00000008" / peer.REPLICATED).write_bytes(peer.marker(8, 0, 2, [0]))
    real = tmp_path / "marker"  # (a link to a marker that would count if it were followed)
    real.write_bytes(peer.marker(10, 0, 2, [0]))
    (tmp_path / "step_00000010").mkdir()
    (tmp_path / "step_00000010" / peer.REPLICATED).symlink_to(real)
    (tmp_path / "step_00000012").mkdir()
    os.mkfifo(tmp_path / "step_00000012" / peer.OWN)  # (a FIFO: a read would wait for a writer)
    for step, make in ((8, None), (10, "link"), (12, "fifo")):
        copy = tmp_path / "peer" / "1" / f"step_{step:08d}"
        copy.mkdir(parents=True)
        if make == "link":
            (copy / peer.COPIED).symlink_to(real)
        elif make == "fifo":
            os.mkfifo(copy / peer.COPIED)
        else:
            (copy / peer.COPIED).write_bytes(peer.marker(step, 1, 2, [1]))
    assert peer.holdings(str(tmp_path)) == [held(8, 0, "own"), held(8, 1, "peer")]
    peer.purge(str(tmp_path), keep=1)  # (the unmarked are newer than the newest marked: they stay, nothing raises)
    assert len(list(tmp_path.glob("**/step_*"))) == 6
    peer.purge(str(tmp_path), keep=1, up_to=12)
    assert list(tmp_path.glob("**/step_*")) == []


def test_a_nodes_retention_keeps_its_newest_replicated_saves_and_copies(tmp_path):
    for step in (2, 4, 8, 10):
        for where, name in ((tmp_path, peer.REPLICATED), (tmp_path / "peer" / "1", peer.COPIED)):
            d = where / f"step_{step:08d}"
            d.mkdir(parents=True)
            if step != 10:  # (10: not copied yet)
                (d / name).write_bytes(peer.marker(step, 0, 2, [0]))
    peer.purge(str(tmp_path), keep=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000004", "step_00000008", "step_00000010"]
    peer.purge(str(tmp_path), keep=2, up_to=8)  # (a durable save of step 8)
    assert sorted(p.name for p in tmp_path.glob("**/step_*")) == ["step_00000010", "step_00000010"]


def test_a_step_whose_node_and_partner_are_both_gone_is_named_with_the_nodes_lost():
    three = [[held(10, 0, "own", 3), held(10, 2, "peer", 3), held(8, 0, "own", 3)], [], []]  # (1 and its holder 2 gone)
    three[0] += [held(8, 1, "peer", 3), held(8, 2, "peer", 3)]
    assert peer.restorable(three) == 8 and peer.lost(three, 8) == (10, [1])
    assert peer.lost(three, 10) is None  # (not newer than what is restored: nothing lost)


def test_a_node_needs_room_for_its_share_twice_and_a_whole_checkpoint_or_twice_the_whole_when_replicated():
    assert peer.need_bytes(800, node_ranks=2, world=8, replicated=False) == 800  # (a restore makes the step whole)
    assert peer.need_bytes(800, node_ranks=4, world=8, replicated=False) == 800  # (two nodes: own + partner's)
    assert peer.need_bytes(900, node_ranks=1, world=2, replicated=False) == 900
    assert peer.need_bytes(800, node_ranks=2, world=8, replicated=True) == 1600


def test_a_rollback_removes_a_nodes_newer_saves_and_copies_so_no_restart_resumes_from_them(tmp_path):
    from pitstop.ckpt.peer_copy import Replicator

    for step in (4, 8):
        for where, name, owner in ((tmp_path, peer.REPLICATED, 0), (tmp_path / "peer" / "1", peer.COPIED, 1)):
            (where / f"step_{step:08d}").mkdir(parents=True)
            (where / f"step_{step:08d}" / name).write_bytes(peer.marker(step, owner, 2, [owner]))
    assert [h.step for h in peer.holdings(str(tmp_path))] == [4, 8, 4, 8]
    node = Replicator.__new__(Replicator)  # (the removal alone: no process group)
    node.root, node.leads = str(tmp_path), True
    node._discard(5)
    assert [h.step for h in peer.holdings(str(tmp_path))] == [4, 4]


def test_saves_made_with_copies_off_are_held_as_the_nodes_own_and_restorable_while_every_node_holds_its_own(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for root, node in ((a, 0), (b, 1)):
        (root / "step_00000008").mkdir(parents=True)
        (root / "step_00000008" / peer.REPLICATED).write_bytes(peer.marker(8, node, 2, [node]))
        (root / "step_00000012").mkdir()  # (copies broke at run time: saved and marked OWN)
        (root / "step_00000012" / peer.OWN).write_bytes(peer.marker(12, node, 2, [node]))
    (a / "peer" / "1" / "step_00000008").mkdir(parents=True)
    (a / "peer" / "1" / "step_00000008" / peer.COPIED).write_bytes(peer.marker(8, 1, 2, [1]))
    held_by = [peer.holdings(str(a)), peer.holdings(str(b))]
    assert held(12, 0, "own") in held_by[0] and held(12, 1, "own") in held_by[1]
    assert peer.restorable(held_by) == 12  # (before: 8, the last replicated one, and 10 steps more to redo)
    assert peer.restorable([held_by[0], []]) == 8  # node b lost: its own saves of 12 with it; 8 from a's copy
    peer.purge(str(a), keep=1)  # (an OWN save counts for retention as a replicated one does)
    assert sorted(p.name for p in a.glob("step_*")) == ["step_00000012"]


def test_holdings_travel_as_int64_values_and_anything_else_does_not_decode():
    rows = [held(8, 0, "own", ranks=[0, 1]), held(8, 1, "peer", ranks=[2, 3]), held(0, 2, "own", nodes=3)]
    assert peer.decode(peer.encode(rows), world=4) == rows and peer.decode(peer.encode([]), world=4) == []
    good = peer.encode(rows[:1])  # [1, step, owner, nodes, own, count, *ranks]
    for bad in ([], [-1], [peer.MAX_NODES * 4 + 1], [2, *good[1:]], [*good, 0], good[:-1],
                [1, -8, 0, 2, 1, 2, 0, 1], [1, 8, 2, 2, 1, 2, 0, 1], [1, 8, 0, peer.MAX_NODES + 1, 1, 2, 0, 1],
                [1, 8, 0, 2, 7, 2, 0, 1], [1, 8, 0, 2, 1, 0], [1, 8, 0, 2, 1, 2, 0, -1]):  # fmt: skip
        with pytest.raises(ValueError):
            peer.decode(bad, world=4)


def test_a_copy_dir_is_never_made_through_a_link_below_the_local_root(tmp_path):
    from pitstop.errors import CorruptCheckpoint

    root, outside = tmp_path / "local", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    made = peer.make_copy_dir(str(root), 0, 10)
    assert made == peer.copy_dir(str(root), 0, 10) and os.path.isdir(made) and os.stat(made).st_mode & 0o777 == 0o700
    (root / peer.PEER_DIR / "1").symlink_to(outside, target_is_directory=True)
    with pytest.raises(CorruptCheckpoint, match="symbolic link"):
        peer.make_copy_dir(str(root), 1, 10)
    assert list(outside.iterdir()) == []
