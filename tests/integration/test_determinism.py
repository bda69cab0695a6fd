"""Same seed => bitwise-identical per-step losses and final parameters (exact equality, on CPU)."""

from __future__ import annotations

from conftest import step_losses, train


def run(make_cfg, tmp_path, name, *overrides):
    cfg = make_cfg(f"run_dir={tmp_path / name}", "trainer.max_steps=30", "loader.num_workers=2", *overrides)
    summary = train(cfg)
    return step_losses(cfg.run_dir), summary["params_sha256"]


def test_same_seed_gives_bitwise_identical_losses_and_params(make_cfg, tmp_path):
    a_losses, a_sha = run(make_cfg, tmp_path, "a")
    b_losses, b_sha = run(make_cfg, tmp_path, "b")
    assert len(a_losses) == 30
    assert a_losses == b_losses  # exact float equality, not closeness
    assert a_sha == b_sha


def test_different_seed_gives_different_losses(make_cfg, tmp_path):
    a_losses, a_sha = run(make_cfg, tmp_path, "a")
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
