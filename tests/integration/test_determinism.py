"""Same seed => bitwise-identical per-step losses and final parameters (exact equality, on CPU)."""

from __future__ import annotations

import pytest

from conftest import step_losses, tiny_cfg, train

RUN = ("trainer.max_steps=30", "loader.num_workers=2")


def run(make_cfg, tmp_path, name, *overrides):
    cfg = make_cfg(f"run_dir={tmp_path / name}", *RUN, *overrides)
    summary = train(cfg)
    return step_losses(cfg.run_dir), summary["params_sha256"]


@pytest.fixture(scope="module")
def reference(data_root, tmp_path_factory):
    """One run of the default seed (30 steps, 2 loader workers), compared with by both seed tests."""
    tmp = tmp_path_factory.mktemp("reference")
    cfg = tiny_cfg(data_root, tmp, f"run_dir={tmp / 'a'}", *RUN)
    summary = train(cfg)
    return step_losses(cfg.run_dir), summary["params_sha256"]


def test_same_seed_gives_bitwise_identical_losses_and_params(make_cfg, tmp_path, reference):
    a_losses, a_sha = reference
    b_losses, b_sha = run(make_cfg, tmp_path, "b")
    assert len(a_losses) == 30
    assert a_losses == b_losses  # exact float equality, not closeness
    assert a_sha == b_sha


def test_different_seed_gives_different_losses(make_cfg, tmp_path, reference):
    a_losses, a_sha = reference
    c_losses, c_sha = run(make_cfg, tmp_path, "c", "seed=99")
    assert a_losses != c_losses and a_sha != c_sha


def test_worker_count_does_not_change_the_samples_seen(make_cfg, tmp_path):
    # Same seed, different worker count: the same set of samples per epoch (order may differ).
    one_epoch = ("data.record_sample_ids=true", "trainer.max_steps=null", "trainer.epochs=1", "trainer.batch_size=64")
    run(make_cfg, tmp_path, "w2", *one_epoch)
    run(make_cfg, tmp_path, "w1", *one_epoch, "loader.num_workers=1")
    from conftest import read_jsonl

    keys = [
        sorted(k for r in read_jsonl(tmp_path / d / "samples.rank0.jsonl") for k in r.get("keys", []))
        for d in ("w2", "w1")
    ]
    assert keys[0] == keys[1] and len(keys[0]) == 1438 == len(set(keys[0]))
