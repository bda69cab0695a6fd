"""The local checkpoint tier (ckpt.local), in-process: saves go to both tiers on their own intervals, a finished
run frees the local one, and bad settings are one-line errors. Kills, fallbacks and full or read-only tiers are in
tests/system/test_ckpt_local_kills.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import read_jsonl, train
from pitstop.errors import ConfigError


def local_args(shm: Path, every: int = 3) -> list[str]:
    return [f"ckpt.local.dir={shm}", f"ckpt.local.interval_steps={every}"]


def test_saves_go_to_both_tiers_on_their_own_intervals_and_a_finished_run_frees_the_local_one(make_cfg, tmp_path):
    shm = tmp_path / "shm"
    cfg = make_cfg("trainer.max_steps=12", "ckpt=sync_dcp", "ckpt.interval_steps=5", *local_args(shm, 2))
    s = train(cfg)
    c = s["checkpoint"]
    assert c["saves"] == 3 and c["local_saves"] == 4  # durable 5, 10, 12; local 2, 4, 6, 8 (10 is durable)
    assert c["local_failures"] == 0 and c["local_block_seconds_mean"] > 0
    assert not list(shm.glob("*/step_*"))  # done: the final durable save supersedes the tmpfs copies
    rows = read_jsonl(Path(cfg.run_dir) / "metrics.jsonl")
    assert sorted(r["step"] for r in rows if "ckpt_local_total_seconds" in r) == [2, 4, 6, 8]


def test_a_crafted_run_id_never_makes_the_finished_run_delete_another_dir(make_cfg, tmp_path, caplog):
    """``checkpoints/.run_id`` names the local tier's dir and the finished run removes that dir: a planted
    ``../victim`` must be kept aside, not followed."""
    shm, victim = tmp_path / "shm", tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("not pitstop's")
    cfg = make_cfg("trainer.max_steps=6", "ckpt=sync_dcp", "ckpt.interval_steps=5", *local_args(shm, 2))
    (Path(cfg.ckpt.dir)).mkdir(parents=True)
    (Path(cfg.ckpt.dir) / ".run_id").write_text("../victim")
    with caplog.at_level("WARNING", logger="pitstop.ckpt"):
        s = train(cfg)
    assert (victim / "keep.txt").read_text() == "not pitstop's"
    assert s["checkpoint"]["local_saves"] == 2 and s["checkpoint"]["local_dir"].startswith(str(shm) + "/")
    assert "not a run id pitstop made: kept aside" in caplog.text


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["ckpt.local.dir=${run_dir}/checkpoints/fast", "ckpt.local.interval_steps=2"], "overlaps ckpt.dir"),
        (["ckpt.local.dir=/dev/shm/x"], "the local tier has no interval"),
        (["ckpt.local.dir=/dev/shm/x", "ckpt.local.interval_steps=-1"], "ckpt.local.interval_steps must be a positive"),
        (
            ["ckpt=async_dcp", "ckpt.local.dir=/dev/shm/x", "ckpt.local.interval_steps=2", "ckpt.local.keep_last_k=1"],
            "ckpt.local.keep_last_k must be an integer >= 2 with async saves",
        ),
    ],
)
def test_bad_local_tier_settings_are_one_line_errors(make_cfg, overrides, expected):
    with pytest.raises(ConfigError, match=expected) as err:
        train(make_cfg("ckpt=sync_save", *overrides))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "backend,expected",
    [
        ("sync_save", "ckpt.local.replicas=1 copies each rank's DCP files; ckpt=sync_save writes one file from rank 0"),
        ("sync_dcp", "ckpt.local.replicas=1 keeps a copy on another node, and the job runs on one node"),
    ],
)
def test_replicas_without_a_second_node_or_dcp_files_are_one_line_errors(make_cfg, tmp_path, backend, expected):
    cfg = make_cfg(f"ckpt={backend}", *local_args(tmp_path / "shm", 2), "ckpt.local.replicas=1")
    with pytest.raises(ConfigError, match=expected) as err:
        train(cfg)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="ckpt.local.replicas"):
        train(make_cfg(f"ckpt={backend}", *local_args(tmp_path / "shm", 2), "ckpt.local.replicas=2"))
