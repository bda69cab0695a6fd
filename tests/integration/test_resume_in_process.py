"""The mission, guarded in the fast tier: a resume is exact, and refuses what it must, without a subprocess.

The kill -9 versions of these live in the system tier (tests/system/test_ckpt.py); here the interruption is a
preemption notice the run sends itself (``fault=preempt``): the Runner saves that step and stops, and a new
Runner in the same run dir resumes. Each test fails on a planted bug of its kind: a resume that does not
restore the loader's position, the RNGs or the LR schedule (different parameters), one that accepts a changed
seed, a fallback that takes a corrupt checkpoint, retention that keeps the wrong ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import final_losses as losses, read_jsonl, train
from pitstop.errors import CheckpointError, FingerprintMismatch
from pitstop.resilience.preempt import Preempted

# 30 steps of 16 with 2 data workers: the notice at step 17 is mid-epoch (1438 training samples: ~90 steps an
# epoch), so the loader's position and each worker's stream matter; the LR schedule is mid-decay and dropout
# draws from the torch RNG.
RUN = ["trainer.max_steps=30", "loader.num_workers=2", "trainer.eval_every_steps=15"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data_root):
    from conftest import compose_cfg

    tmp = tmp_path_factory.mktemp("ref")
    cfg = compose_cfg(
        [f"paths.data_dir={data_root / 'data'}", f"paths.output_dir={tmp / 'out'}", f"run_dir={tmp / 'run'}",
         "debug=tiny", *RUN, "ckpt=none"],
        tmp,
    )  # fmt: skip
    s = train(cfg)
    return s["params_sha256"], losses(cfg.run_dir)


@pytest.mark.parametrize("backend", ["sync_save", "async_dcp"])
def test_a_preempted_run_resumes_in_process_to_the_uninterrupted_parameters(backend, make_cfg, uninterrupted):
    cfg = make_cfg(*RUN, f"ckpt={backend}", "ckpt.interval_steps=10", "fault=preempt", "fault.step=17")
    with pytest.raises(Preempted):
        train(cfg)
    doc = json.loads((Path(cfg.run_dir) / "goodput.json").read_text())
    assert doc["attempts"][-1]["status"] == "preempted" and doc["attempts"][-1]["step"] == 17
    s = train(cfg)  # the same config again: resumes from the save of step 17
    assert s["resumed_from"] == 17 and s["final_step"] == 30
    ref_sha, ref_losses = uninterrupted
    assert s["params_sha256"] == ref_sha  # loader position, RNGs, LR schedule and optimizer all restored
    assert losses(cfg.run_dir) == ref_losses  # every step, those after the resume included


def test_a_notice_during_an_evaluation_is_taken_after_it_and_the_resume_is_exact(make_cfg, uninterrupted, caplog):
    """The fault x phase matrix, preemption x evaluation: the notice comes after the evaluation's first batch (RUN
    evaluates at step 15); the evaluation finishes, step 15 is saved, and the same config resumes exactly."""
    cfg = make_cfg(*RUN, "ckpt=async_dcp", "ckpt.interval_steps=10", "fault=preempt", "fault.step=15",
                   "fault.phase=eval")  # fmt: skip
    with caplog.at_level("WARNING"), pytest.raises(Preempted):
        train(cfg)
    assert "preemption notice (SIGTERM) in the evaluation after step 15" in caplog.text
    doc = json.loads((Path(cfg.run_dir) / "goodput.json").read_text())
    assert doc["attempts"][-1]["status"] == "preempted" and doc["attempts"][-1]["step"] == 15
    s = train(cfg)
    assert s["resumed_from"] == 15 and s["params_sha256"] == uninterrupted[0]
    assert losses(cfg.run_dir) == uninterrupted[1]


def test_a_notice_while_the_save_of_its_step_is_written_waits_for_it_and_the_resume_is_exact(
    make_cfg, uninterrupted, caplog
):
    """The fault x phase matrix, preemption x staging/write: the notice comes right after the save of step 20 started
    in the background (throttled to 1 MB/s: still writing); that save is the one kept, not a second one."""
    cfg = make_cfg(*RUN, "ckpt=async_dcp", "ckpt.interval_steps=10", "ckpt.throttle_mbps=1", "fault=preempt",
                   "fault.step=20")  # fmt: skip
    with caplog.at_level("WARNING"), pytest.raises(Preempted):
        train(cfg)
    assert "preempted (" in caplog.text and "at step 20: the save of this step is already under way" in caplog.text
    s = train(cfg)
    assert s["resumed_from"] == 20 and s["params_sha256"] == uninterrupted[0]
    assert losses(cfg.run_dir) == uninterrupted[1]


def test_a_notice_during_a_restore_is_taken_at_the_next_step_and_the_resume_is_exact(make_cfg, uninterrupted, caplog):
    """The fault x phase matrix, preemption x restore: the notice comes as the restore of step 17 reads it; the run
    takes one step, saves it and stops; the same config then resumes from that step exactly."""
    base = [*RUN, "ckpt=async_dcp", "ckpt.interval_steps=10", "fault=preempt"]
    with pytest.raises(Preempted):
        train(make_cfg(*base, "fault.step=17"))
    cfg = make_cfg(*base, "fault.step=10", "fault.phase=restore")  # (another fault: it fires once too)
    with caplog.at_level("WARNING"), pytest.raises(Preempted):
        train(cfg)
    assert "preemption notice (SIGTERM) in the restore of a checkpoint of step 10 or later" in caplog.text
    doc = json.loads((Path(cfg.run_dir) / "goodput.json").read_text())
    assert doc["attempts"][-1]["resumed_from"] == 17 and doc["attempts"][-1]["step"] == 18
    s = train(cfg)
    assert s["resumed_from"] == 18 and s["params_sha256"] == uninterrupted[0]
    assert losses(cfg.run_dir) == uninterrupted[1]


def test_a_changed_seed_is_refused_at_resume_and_leaves_the_checkpoints(make_cfg):
    cfg = make_cfg("ckpt=sync_save", "ckpt.interval_steps=6")
    train(cfg)
    saved = sorted(p.name for p in Path(cfg.ckpt.dir).iterdir())
    changed = make_cfg("ckpt=sync_save", "ckpt.interval_steps=6", "seed=1")  # the same run dir
    assert changed.run_dir == cfg.run_dir
    with pytest.raises(FingerprintMismatch) as e:
        train(changed)
    message = str(e.value)
    assert "\n" not in message and "seed" in message and "changed since it was saved" in message
    assert sorted(p.name for p in Path(cfg.ckpt.dir).iterdir()) == saved  # nothing lost


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(make_cfg):
    from pitstop.ckpt import layout

    cfg = make_cfg("ckpt=sync_dcp", "ckpt.interval_steps=4", "ckpt.keep_last_k=0")
    train(cfg)  # saves at 4, 8, 12
    newest = Path(layout.step_dir(cfg.ckpt.dir, 12))
    for f in newest.glob("*.distcp"):
        f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])  # truncated, the marker still there
    s = train(make_cfg("ckpt=sync_dcp", "ckpt.interval_steps=4", "ckpt.keep_last_k=0", "trainer.max_steps=14"))
    assert s["resumed_from"] == 8 and s["final_step"] == 14


@pytest.mark.parametrize("backend", ["sync_save", "sync_dcp"])
def test_a_checkpoint_moved_under_a_newer_steps_name_is_not_restored_as_its_own_step(backend, make_cfg, caplog):
    """Someone who can write the checkpoints dir puts step 4's checkpoint where step 12's was (its files and manifest
    intact): the run must not resume from step 4 under step 12's name and skip step 8 without a word."""
    import shutil

    from pitstop.ckpt import layout

    args = [f"ckpt={backend}", "ckpt.interval_steps=4", "ckpt.keep_last_k=0"]
    cfg = make_cfg(*args)
    train(cfg)  # saves at 4, 8, 12
    newest = Path(layout.step_dir(cfg.ckpt.dir, 12))
    shutil.rmtree(newest)
    shutil.copytree(layout.step_dir(cfg.ckpt.dir, 4), newest)
    with caplog.at_level("WARNING", logger="pitstop.ckpt"):
        s = train(make_cfg(*args, "trainer.max_steps=14"))
    assert s["resumed_from"] == 8 and s["final_step"] == 14
    assert "step_00000012 is corrupt, not loaded" in caplog.text and "another step's name" in caplog.text


def test_a_signed_run_resumes_and_an_edited_resealed_checkpoint_is_skipped(make_cfg, monkeypatch, caplog):
    """PITSTOP_CKPT_KEY set: the checkpoint process signs each manifest; a changed byte with a CRC32C manifest remade
    to match (what anyone who can write the dir can do) is refused, where without a key it would load."""
    from pitstop.ckpt import integrity, layout

    monkeypatch.setenv(integrity.KEY_ENV, "signing-key-of-this-test-0123456789")
    args = ["ckpt=async_dcp", "ckpt.checkpointer=process", "ckpt.interval_steps=4", "ckpt.keep_last_k=0"]
    cfg = make_cfg(*args)
    train(cfg)  # saves at 4, 8, 12, signed by the checkpoint process
    newest = Path(layout.step_dir(cfg.ckpt.dir, 12))
    assert integrity.is_signed((newest / integrity.MANIFEST).read_bytes())
    data = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    data.write_bytes(bytes(blob))
    body = integrity.unseal((newest / integrity.MANIFEST).read_bytes(), str(newest), integrity.MANIFEST)
    body["files"][data.name] = integrity.file_checksum(str(data)).entry()
    (newest / integrity.MANIFEST).write_bytes(integrity.seal(body, key=b"a-guess-at-the-key-000000"))
    with caplog.at_level("WARNING", logger="pitstop.ckpt"):
        s = train(make_cfg(*args, "trainer.max_steps=14"))
    assert s["resumed_from"] == 8 and "signature does not match" in caplog.text


@pytest.mark.parametrize("backend", ["sync_save", "sync_dcp", "async_dcp"])
def test_a_flipped_byte_in_the_newest_checkpoint_is_named_skipped_and_the_run_ends_exactly(
    backend, make_cfg, uninterrupted, caplog
):
    """A bad disk or a bad copy: one byte of the newest checkpoint's biggest file changed, its commit marker intact."""
    from pitstop.ckpt import layout

    args = [*RUN, f"ckpt={backend}", "ckpt.interval_steps=5", "ckpt.keep_last_k=0", "fault=preempt", "fault.step=17"]
    cfg = make_cfg(*args)
    with pytest.raises(Preempted):
        train(cfg)
    newest = Path(layout.step_dir(cfg.ckpt.dir, 17))
    biggest = max((p for p in newest.iterdir()), key=lambda p: p.stat().st_size)
    data = bytearray(biggest.read_bytes())
    data[len(data) // 2] ^= 0x10
    biggest.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="pitstop.ckpt"):
        s = train(cfg)
    line = next(r.getMessage() for r in caplog.records if "is corrupt, not loaded" in r.getMessage())
    assert f"{biggest.name}: expected crc32c=" in line and "falling back to step_00000015" in line
    assert s["resumed_from"] == 15 and s["final_step"] == 30
    assert s["params_sha256"] == uninterrupted[0] and losses(cfg.run_dir) == uninterrupted[1]


def test_a_crafted_metadata_runs_nothing_skipped_under_auto_and_refused_by_name(make_cfg, tmp_path, caplog):
    """Someone who can write the checkpoint dir (a shared bucket) plants a pickle that runs code, with checksums that
    match: ``ckpt.load=auto`` skips it as corrupt in one line, ``ckpt.load=PATH`` refuses it (exit 2 in the CLI)."""
    import os
    import pickle

    from pitstop.ckpt import integrity, layout

    proof = tmp_path / "ran"

    class Runs:
        def __reduce__(self):
            return (os.system, (f"touch {proof}",))

    args = ["ckpt=sync_dcp", "ckpt.interval_steps=4", "ckpt.keep_last_k=0"]
    cfg = make_cfg(*args)
    train(cfg)  # saves at 4, 8, 12
    newest = Path(layout.step_dir(cfg.ckpt.dir, 12))
    (newest / ".metadata").write_bytes(pickle.dumps(Runs()))
    files = integrity.read_manifest(str(newest))
    files[".metadata"] = integrity.file_checksum(str(newest / ".metadata")).entry()
    (newest / integrity.MANIFEST).write_bytes(integrity.manifest_bytes(files))
    with pytest.raises(CheckpointError) as e:
        train(make_cfg(*args, "trainer.max_steps=16", f"ckpt.load={newest}"))
    assert "refused" in str(e.value) and "\n" not in str(e.value) and not proof.exists()
    with caplog.at_level("WARNING", logger="pitstop.ckpt"):
        s = train(make_cfg(*args, "trainer.max_steps=14"))
    assert s["resumed_from"] == 8 and not proof.exists()
    assert "step_00000012 is corrupt, not loaded (CorruptCheckpoint: refused" in caplog.text


def test_retention_keeps_the_newest_k_complete_checkpoints(make_cfg):
    from pitstop.ckpt import layout

    cfg = make_cfg("ckpt=sync_save", "ckpt.interval_steps=2", "ckpt.keep_last_k=2")
    train(cfg)  # saves at 2, 4, ..., 12
    left = sorted(layout.step_of(str(p)) for p in Path(cfg.ckpt.dir).iterdir() if layout.is_complete(str(p)))
    assert left == [10, 12]


def test_a_retention_delete_that_fails_is_told_and_counted_and_leaves_no_loadable_remnant(make_cfg, caplog):
    """An old checkpoint that cannot be deleted (an immutable file here; a read-only mount or a store that refuses a
    delete elsewhere): the run goes on, says so in one line and counts it in summary.json; its commit marker went
    first, so what stays is partial and never loaded."""
    import subprocess

    from pitstop.ckpt import layout

    args = ["ckpt=sync_save", "ckpt.interval_steps=2", "ckpt.keep_last_k=2"]
    train(make_cfg(*args, "trainer.max_steps=4"))  # saves at 2, 4
    stuck = Path(layout.step_dir(make_cfg(*args).ckpt.dir, 2)) / "state.pt"
    if subprocess.run(["chattr", "+i", str(stuck)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not supported here")
    try:
        with caplog.at_level("WARNING", logger="pitstop.ckpt"):
            s = train(make_cfg(*args, "trainer.max_steps=8"))  # saves 6, 8: step 2 is purged
    finally:
        subprocess.run(["chattr", "-i", str(stuck)], check=True)
    assert s["checkpoint"]["purge_failures"] >= 1
    rows = read_jsonl(Path(make_cfg(*args).run_dir) / "metrics.jsonl")
    assert sum(r.get("ckpt_purge_failed", 0) for r in rows) == s["checkpoint"]["purge_failures"]
    assert "checkpoint retention failed: OSError: could not remove" in caplog.text and "step_00000002" in caplog.text
    assert not layout.is_complete(str(stuck.parent)) and stuck.exists()
    assert [p for p in layout.candidates(str(stuck.parent.parent), "auto")] == [
        layout.step_dir(str(stuck.parent.parent), step) for step in (8, 6)
    ]


def test_a_damaged_goodput_json_is_kept_aside_and_named(make_cfg, caplog):
    cfg = make_cfg("ckpt=sync_save", "ckpt.interval_steps=6")
    train(cfg)
    doc = Path(cfg.run_dir) / "goodput.json"
    doc.write_text('{"attempts": [{"status": "fin')  # torn by a full disk, say
    with caplog.at_level("WARNING", logger="pitstop.goodput"):
        train(make_cfg("ckpt=sync_save", "ckpt.interval_steps=6", "trainer.max_steps=14"))
    aside = Path(str(doc) + ".corrupt")
    assert aside.read_text() == '{"attempts": [{"status": "fin'
    assert f"{doc} is unreadable (JSONDecodeError" in caplog.text and f"kept aside as {aside}" in caplog.text


def test_a_full_disk_at_the_commit_marker_never_commits_and_keeps_the_others(make_cfg, monkeypatch, caplog):
    """The fault x phase matrix, full disk x commit (the real full tmpfs, mid-write, is system/test_ckpt.py's): the
    disk fills up as sync_save writes step 20's COMMITTED marker; that save fails in one line and its files go,
    the run goes on (ckpt.on_error=warn) and the checkpoints before and after it are whole."""
    import errno

    from pitstop.ckpt import integrity, layout

    durable = integrity.write_durable

    def full_at_20(path, name, data, **kw):
        if name == "COMMITTED" and path.endswith("step_00000020"):
            raise OSError(errno.ENOSPC, "No space left on device")
        durable(path, name, data, **kw)

    monkeypatch.setattr(integrity, "write_durable", full_at_20)
    cfg = make_cfg(*RUN, "ckpt=sync_save", "ckpt.interval_steps=10", "ckpt.keep_last_k=0", "ckpt.on_error=warn")
    with caplog.at_level("ERROR", logger="pitstop.ckpt"):
        s = train(cfg)
    assert s["checkpoint"]["failures"] == 1 and s["final_step"] == 30
    assert "checkpoint at step 20 failed: OSError: [Errno 28] No space left on device" in caplog.text
    assert not Path(layout.step_dir(cfg.ckpt.dir, 20)).exists()
    assert layout.candidates(cfg.ckpt.dir, "auto") == [layout.step_dir(cfg.ckpt.dir, n) for n in (30, 10)]
    for n in (10, 30):
        integrity.verify(layout.step_dir(cfg.ckpt.dir, n))
