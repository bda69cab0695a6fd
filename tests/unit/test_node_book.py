"""RUN_DIR/nodes.json: failures per node, exclusions, a damaged book kept aside, the node's name."""

from __future__ import annotations

import json

from pitstop.resilience import node_book


def test_failures_are_counted_per_node_and_an_exclusion_keeps_its_first_reason(tmp_path):
    run = str(tmp_path)
    assert node_book.record_failure(run, "n1", "rank 0 exited 1", step=5) == 1
    assert node_book.record_failure(run, "n2", "rank 1 exited 1") == 1
    assert node_book.record_failure(run, "n1", "rank 0 exited 1", step=5) == 2
    assert node_book.failures(run, "n1") == 2 and node_book.failures(run, "n3") == 0
    assert node_book.excluded(run) == {}
    assert node_book.exclude(run, "n1", "failed twice", by="failures")
    assert not node_book.exclude(run, "n1", "slow", by="straggler")  # (the first reason stays)
    ex = node_book.excluded(run)
    assert list(ex) == ["n1"] and ex["n1"]["by"] == "failures" and ex["n1"]["why"] == "failed twice"
    assert node_book.readmit(run, "n1") and node_book.excluded(run) == {}
    assert node_book.failures(run, "n1") == 2  # (its record stays)


def test_a_book_of_another_shape_is_kept_aside_and_excludes_no_one(tmp_path, caplog):
    path = tmp_path / node_book.NODES_FILE
    path.write_text(json.dumps({"nodes": {"n1": {"excluded": "yes"}}}))
    assert node_book.excluded(str(tmp_path)) == {}  # (a reader: no node excluded by a file it cannot read)
    assert node_book.record_failure(str(tmp_path), "n2", "x") == 1  # (the writer keeps it aside, starts again)
    assert (tmp_path / "nodes.json.corrupt").exists()
    assert list(node_book.read_book(str(tmp_path))) == ["n2"]


def test_a_node_is_named_by_pitstop_then_slurm_then_the_host():
    assert node_book.node_name({"PITSTOP_NODE_NAME": "a", "SLURMD_NODENAME": "n1"}) == "a"
    assert node_book.node_name({"SLURMD_NODENAME": "n1"}) == "n1"
    assert node_book.node_name({})  # (the host name)
