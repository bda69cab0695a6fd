"""Silent data corruption's pure parts: the replicas' digest (one flipped bit always shows), who is the odd one out,
the exponent bit flip of ``fault=bitflip``, the shape of ``RUN_DIR/suspects.json``, and where the time line and the
goodput account put a detection."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pitstop.goodput.ledger import JOB_BUCKETS, GoodputLog, Ledger, account, table
from pitstop.goodput.timeline import read
from pitstop.parts.digest import bits_sum, differing, odd_ones_out, replica_digest, replica_state
from pitstop.resilience.bitflip import flip_exponent_bit
from pitstop.statefile import SUSPECTS, Damaged, loads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64])
def test_every_single_bit_flip_changes_the_digest(dtype):
    t = (torch.randn(257) * 3).to(dtype)
    width = t.element_size() * 8
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    before = int(bits_sum(t))
    for bit in range(width):  # (the sign bit too: the sum wraps at the width, a power of two below it never does)
        u = t.clone()
        mask = 1 << bit if bit < width - 1 else -(1 << bit)
        u.view(ints)[100] ^= mask
        assert int(bits_sum(u)) != before, (dtype, bit)
    assert int(bits_sum(t.clone())) == before  # (a copy is bitwise equal: the same digest)


def test_the_digest_reads_a_non_contiguous_tensor_and_an_empty_one_without_copying_wrong():
    t = torch.randn(8, 6)
    assert int(bits_sum(t.t())) == int(bits_sum(t))  # (the same elements: the same sum)
    assert int(bits_sum(torch.empty(0))) == 0 and int(bits_sum(torch.zeros(3, dtype=torch.bool))) == 0


def test_the_replica_state_is_the_parameters_and_the_optimizer_state_by_name():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    opt = torch.optim.AdamW(model.parameters())
    assert [n for n, _ in replica_state(model, opt)] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    names = [n for n, _ in replica_state(model, opt)]
    assert "optimizer.0.weight.exp_avg_sq" in names and "optimizer.1.bias.step" in names
    assert not any("running_mean" in n for n in names)  # (buffers follow each rank's own batch: never compared)
    digest = replica_digest([v for _, v in replica_state(model, opt)])
    assert digest.dtype == torch.int64 and digest.shape == (len(names),)


@pytest.mark.parametrize(
    "digests, odd, agreed",
    [
        ([[1, 2], [1, 2]], [], [1, 2]),  # agreement
        ([[1, 2], [1, 3]], [], None),  # two that differ: no majority, nobody named
        ([[1, 2], [1, 3], [1, 2]], [1], [1, 2]),  # the odd one out of three
        ([[5], [5], [5], [6]], [3], [5]),
        ([[5], [5], [6], [6]], [], None),  # a tie
        ([[5], [6], [7]], [], None),  # all differ
        ([[9]], [], [9]),  # one rank
    ],
)
def test_the_odd_one_out_is_named_only_against_a_strict_majority(digests, odd, agreed):
    assert odd_ones_out(digests) == (odd, agreed)


def test_the_tensors_that_differ_are_named():
    assert differing([[1, 2, 3], [1, 9, 4]], ["a", "b", "c"]) == ["b", "c"]
    assert differing([[1, 2, 3], [1, 2, 3]], ["a", "b", "c"]) == []


def test_an_exponent_bit_flip_doubles_or_halves_and_the_highest_makes_it_huge():
    t = torch.tensor([[0.75, 2.0]])
    assert flip_exponent_bit(t, 0) == (0.75, 1.5) and t.tolist() == [[1.5, 2.0]]  # (the first element only)
    assert flip_exponent_bit(t, 0) == (1.5, 0.75)  # (flipped back)
    assert flip_exponent_bit(t, 7)[1] > 1e38
    with pytest.raises(ValueError, match="5 exponent bits"):
        flip_exponent_bit(torch.ones(2, dtype=torch.float16), 5)


def test_suspects_json_has_a_checked_shape():
    good = {"suspects": [{"rank": 1, "step": 10, "how": "x", "host": "h", "time": 1.0, "tensors": ["w"]}]}
    assert loads(json.dumps(good), SUSPECTS) == good
    bad = [
        "[]",
        '{"suspects": {}}',
        '{"suspects": [{"rank": -1, "step": 1, "how": "x"}]}',
        '{"suspects": [{"rank": 1, "how": "x"}]}',
        '{"suspects": [{"rank": "1", "step": 1, "how": "x"}]}',
    ]
    for text in bad:
        with pytest.raises(Damaged):
            loads(text, SUSPECTS)


def test_the_sdc_bucket_is_in_the_account_and_its_table_when_it_is_not_zero(tmp_path):
    ledger = Ledger(0.0)
    log = GoodputLog(str(tmp_path), ledger, heartbeat=0.0)
    assert "sdc" not in table(log.write(0))  # (not shown while zero)
    ledger.add("sdc", 1.5)
    doc = log.write(3, status="finished")
    assert "sdc" in JOB_BUCKETS and doc["totals"]["sdc"] == 1.5 and "sdc" in table(doc)
    assert account(doc["attempts"])["totals"]["sdc"] == 1.5


def test_the_time_line_marks_a_detected_corruption(tmp_path):
    log = GoodputLog(str(tmp_path), Ledger(1000.0), heartbeat=0.0)
    log.write(4, status="finished")
    with open(os.path.join(tmp_path, "metrics.jsonl"), "w") as f:
        for step in (1, 2, 3, 2, 3, 4):
            f.write(json.dumps({"step": step, "loss": 1.0, "time": 1000.0 + step}) + "\n")
        f.write(json.dumps({"event": "sdc", "step": 3, "ranks": [1], "time": 1003.5}) + "\n")
    line = read(str(tmp_path))
    assert [s for _, s in line.sdc] == [3] and len(line.steps) == 6


def test_with_two_ranks_the_replay_names_the_rank_whose_own_worst_element_the_other_does_not_share():
    from pitstop.parts.digest import deviation_at, named_by_replay, worst_element

    replay = [torch.tensor([[0.5, -0.25], [0.125, 1.0]]), torch.tensor([0.3, 0.2])]
    drift = [t + 1e-4 for t in replay]  # (what the averaged gradients carried: both ranks')
    rank0 = [t.clone() for t in drift]
    rank1 = [t.clone() for t in drift]
    flip_exponent_bit(rank1[0], 0)  # (0.5 -> 1.0 on rank 1 alone)
    places = [worst_element(rank0, replay), worst_element(rank1, replay)]
    assert places[1] == (0, 0)
    devs = [[deviation_at(k, replay, w) for w in places] for k in (rank0, rank1)]
    assert named_by_replay(devs) == [1]
    assert named_by_replay([[1e-4, 1e-4], [1e-4, 1e-4]]) == []  # (only the shared drift: nobody)
    assert named_by_replay([[0.1, 0.02], [0.02, 0.1]]) == []  # (not 10 times apart: nobody)
    assert named_by_replay([[0.0, 0.0], [0.0, 0.0]]) == []
