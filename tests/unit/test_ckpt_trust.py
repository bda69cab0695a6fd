"""Nothing a checkpoint says is believed before it is checked (hand-made checkpoints in tmp_path, no process group):
paths in ``.metadata`` and ``CHECKSUMS`` that leave the dir, links to files or step dirs elsewhere, a FIFO, sizes the
files do not have, a train state of the wrong shape or of another step, a crafted ``.run_id``, and signed checkpoints
(``PITSTOP_CKPT_KEY``): each is refused as corrupt in one line (or, for retention and the run id, survived), and
nothing outside the checkpoint is read, deleted or allocated for.  Attackers here can write the checkpoint dir, so
they reseal the CRC32C manifest after every edit: the checks must hold against a manifest that matches.
"""

from __future__ import annotations

import os
import pickle
import resource
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from pitstop.ckpt import integrity, layout, restore
from pitstop.ckpt.formats import dcp_reader, encode_json, read_checkpoint, to_torch_save, write_torch_save
from pitstop.ckpt.sync_dcp import dcp_writer
from pitstop.ckpt.verify import main as verify_main
from pitstop.errors import ConfigError, CorruptCheckpoint

SECRET = b"outside-the-checkpoint:" + bytes(range(256)) * 64


def train_state(step: int) -> dict:
    return {"step": step, "samples_seen": 64 * step, "loader": {}, "scheduler": {}, "rng": {}, "fingerprint": {}}


def app_state(step: int = 4) -> dict:
    model = torch.nn.Linear(64, 64)  # 64*64 float32 = 16 KiB: the same size as SECRET
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return {"model": model.state_dict(), "optim": opt.state_dict(), "train.rank0": encode_json(train_state(step))}


def write(root: Path, step: int = 4, kind: str = "raw") -> Path:
    path = root / f"step_{step:08d}"
    if kind == "sync_save":
        write_torch_save(app_state(step), str(path), 0, 1, None, step, None)
    else:
        dcp.save(app_state(step), storage_writer=dcp_writer(str(path), None, kind), no_dist=True)
    return path


def reseal(path: Path, drop: tuple[str, ...] = ()) -> None:
    """The manifest an attacker who can write the dir makes: CRC32C entries that match the files as they now are."""
    files = integrity.read_manifest(str(path))
    for name in list(files):
        if (path / name).is_file() and not (path / name).is_symlink() and name not in drop:
            files[name] = integrity.file_checksum(str(path / name), strong=False).entry()
    (path / integrity.MANIFEST).write_bytes(integrity.manifest_bytes(files, path.name))


def edit_metadata(path: Path, edit) -> None:
    md = pickle.loads((path / ".metadata").read_bytes())  # (the test's own file: trusted here)
    edit(md)
    (path / ".metadata").write_bytes(pickle.dumps(md))
    reseal(path)


def outside(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.bin"
    victim.write_bytes(SECRET)
    return victim


def refused(path: Path, *words: str) -> str:
    """The restore's reader and both exports refuse ``path`` as corrupt, naming ``words``; the message."""
    from recipe.export import model_state

    with pytest.raises(CorruptCheckpoint) as e:
        integrity.verify(str(path))
        dcp_reader(str(path)).read_metadata()
    with pytest.raises(CorruptCheckpoint):
        to_torch_save(str(path), str(path.parent / "export.pt"))
    with pytest.raises(CorruptCheckpoint):
        model_state(str(path))  # (python -m recipe.export)
    text = str(e.value)
    assert "\n" not in text and all(w in text for w in words), text
    assert not (path.parent / "export.pt").exists()
    return text


# ---- containment: nothing outside the checkpoint is named, linked or opened ------------------------------------


@pytest.mark.parametrize("where", ["../../victim.bin", "ABSOLUTE", "sub/x.distcp"])
def test_a_storage_path_in_metadata_that_leaves_the_dir_is_refused_and_nothing_outside_is_read(tmp_path, where):
    victim = outside(tmp_path)
    path = write(tmp_path / "ckpts")
    where = str(victim) if where == "ABSOLUTE" else where

    def point_outside(md):
        for info in md.storage_data.values():
            info.relative_path = where

    edit_metadata(path, point_outside)
    refused(path, "not a plain name", ".metadata")


def test_a_storage_path_to_a_file_the_manifest_does_not_list_is_refused(tmp_path):
    path = write(tmp_path / "ckpts")
    (path / "planted.distcp").write_bytes(SECRET)

    def point_at_planted(md):
        for info in md.storage_data.values():
            info.relative_path = "planted.distcp"

    edit_metadata(path, point_at_planted)
    refused(path, "planted.distcp", "does not list")


@pytest.mark.parametrize("name", ["../victim.bin", "/dev/zero", "ABSOLUTE", "a/../../victim.bin"])
def test_a_manifest_entry_outside_the_dir_is_refused_by_verify_and_the_restore(tmp_path, name, capsys):
    victim = outside(tmp_path)
    path = write(tmp_path / "ckpts")
    name = str(victim) if name == "ABSOLUTE" else name
    files = integrity.read_manifest(str(path))
    files[name] = integrity.entry(len(SECRET), integrity.crc(SECRET))  # it would match, were it read
    (path / integrity.MANIFEST).write_bytes(integrity.manifest_bytes(files, path.name))
    t0 = time.monotonic()
    refused(path, "CHECKSUMS", "not a plain name")
    assert verify_main([str(path)]) == 1 and "CORRUPT" in capsys.readouterr().out
    assert time.monotonic() - t0 < 30  # (/dev/zero would never end)


def test_a_file_that_is_a_link_to_one_outside_is_refused_though_its_bytes_match(tmp_path):
    path = write(tmp_path / "ckpts")
    data = next(path.glob("*.distcp"))
    copy = tmp_path / "elsewhere.distcp"
    copy.write_bytes(data.read_bytes())  # the same bytes: only the link itself can tell
    data.unlink()
    data.symlink_to(copy)
    assert integrity.file_checksum(str(copy)).entry() == integrity.read_manifest(str(path))[data.name]
    refused(path, "symbolic link", data.name)


@pytest.mark.timeout(60)
def test_a_fifo_in_place_of_a_file_is_refused_at_once_and_hangs_nothing(tmp_path, capsys):
    path = write(tmp_path / "ckpts")
    data = next(path.glob("*.distcp"))
    data.unlink()
    os.mkfifo(data)  # no writer: a plain open() would wait for one forever
    t0 = time.monotonic()
    refused(path, "FIFO", data.name)
    assert verify_main([str(path)]) == 1 and "FIFO" in capsys.readouterr().out
    assert time.monotonic() - t0 < 10


@pytest.mark.timeout(30)  # (the bug hangs on the FIFO: fail soon)
def test_a_link_or_fifo_left_at_a_files_temporary_name_is_replaced_never_written_through_nor_waited_on(tmp_path):
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    step = tmp_path / "step_00000004"
    step.mkdir()
    (step / "COPIED.tmp").symlink_to(outside)
    os.mkfifo(step / "OWN.tmp")  # (no reader: a plain open() for writing would wait for one forever)
    t0 = time.monotonic()
    integrity.write_durable(str(step), "COPIED", b"copied")
    integrity.write_durable(str(step), "OWN", b"own")
    assert time.monotonic() - t0 < 10
    assert (step / "COPIED").read_bytes() == b"copied" and (step / "OWN").read_bytes() == b"own"
    assert outside.read_bytes() == b"keep" and not (step / "COPIED").is_symlink()
    assert sorted(p.name for p in step.iterdir()) == ["COPIED", "OWN"]


def test_a_step_dir_that_links_to_another_runs_checkpoint_is_never_loaded_nor_deleted_through(tmp_path, caplog):
    other = write(tmp_path / "other_run" / "checkpoints", step=12)
    root = tmp_path / "run" / "checkpoints"
    for step in (4, 8):
        write(root, step)
    (root / "step_00000012").symlink_to(other, target_is_directory=True)
    with caplog.at_level("WARNING", logger="pitstop.ckpt"):
        assert [s for s, _, _ in layout.list_checkpoints(str(root))] == [4, 8]
        assert layout.candidates(str(root), "auto") == [str(root / "step_00000008"), str(root / "step_00000004")]
        layout.purge(str(root), 1)
    assert "step_00000012 is a symbolic link" in caplog.text
    assert sorted(p.name for p in root.iterdir()) == ["step_00000008", "step_00000012"]
    assert {p.name for p in other.iterdir()} >= {".metadata", integrity.MANIFEST}  # the other run's markers stay
    with pytest.raises(CorruptCheckpoint, match="symbolic link"):
        integrity.verify(str(root / "step_00000012"))  # named explicitly (ckpt.load=12): refused
    layout.remove(str(root / "step_00000012"))
    assert not (root / "step_00000012").exists() and (other / ".metadata").is_file()


# ---- bounded reads: declared sizes are checked against the files before anything is allocated ---------------


def test_a_storage_length_beyond_its_file_is_refused(tmp_path):
    path = write(tmp_path / "ckpts")

    def stretch(md):
        for info in md.storage_data.values():
            info.length += 1 << 20

    edit_metadata(path, stretch)
    refused(path, "a declared size the file does not have")


@pytest.mark.parametrize("declared", [2 << 30, 1 << 60])
def test_a_tensor_that_declares_more_bytes_than_it_has_is_refused_before_anything_is_allocated(tmp_path, declared):
    path = write(tmp_path / "ckpts")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def inflate(md):
        meta = md.state_dict_metadata["train.rank0"]  # uint8: its shape is its bytes
        meta.size = torch.Size([declared])
        meta.chunks[0].sizes = torch.Size([declared])

    edit_metadata(path, inflate)
    refused(path, "declares", "train.rank0")
    with pytest.raises(CorruptCheckpoint):
        read_checkpoint(str(path), torch.nn.Linear(64, 64), None, None)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 200_000  # KiB: nothing near 2 GiB


def test_a_tensor_whose_chunks_hold_less_than_its_shape_is_refused(tmp_path):
    path = write(tmp_path / "ckpts")

    def grow(md):
        meta = md.state_dict_metadata["model.weight"]
        meta.size = torch.Size([64 << 20, 64])  # the chunk stays 64 x 64: the export would allocate 16 GiB

    edit_metadata(path, grow)
    refused(path, "declares 17179869184 bytes for model.weight, its chunks hold 16384")


def test_a_small_file_that_is_not_small_is_not_read_whole(tmp_path):
    path = write(tmp_path / "ckpts")
    manifest = path / integrity.MANIFEST
    manifest.write_bytes(manifest.read_bytes() + b" " * (integrity.MANIFEST_MAX + 1))
    with pytest.raises(CorruptCheckpoint, match="larger than"):
        integrity.read_manifest(str(path))


# ---- state read back: its shape and its step ---------------------------------------------------------------


@pytest.mark.parametrize(
    "state",
    [None, [], "x", {**train_state(4), "step": "4"}, {**train_state(4), "loader": []}, {**train_state(4), "step": -1}],
    ids=["null", "list", "string", "step-string", "loader-list", "step-negative"],
)
def test_a_train_state_of_the_wrong_shape_is_corrupt_not_a_bug(state):
    with pytest.raises(CorruptCheckpoint) as e:
        restore.check_train("ckpts/step_00000004", "train.rank0", state)
    assert "train.rank0" in str(e.value) and restore.classify(e.value) == "integrity"


def test_a_crafted_train_key_is_corrupt(tmp_path):
    path = write(tmp_path / "ckpts")
    state = app_state()
    state["train.rankX"] = encode_json(train_state(4))
    dcp.save(state, storage_writer=dcp_writer(str(path), None, "raw"), no_dist=True)
    with pytest.raises(CorruptCheckpoint, match="not a rank's train state"):
        read_checkpoint(str(path), torch.nn.Linear(64, 64), torch.optim.SGD(torch.nn.Linear(1, 1).parameters()), None)


@pytest.mark.parametrize("kind", ["raw", "sync_save"])
def test_a_checkpoint_moved_under_another_steps_name_is_corrupt(tmp_path, kind):
    root = tmp_path / "ckpts"
    old = write(root, 4, kind)
    moved = root / "step_00000012"
    old.rename(moved)
    with pytest.raises(CorruptCheckpoint, match="another step's name"):
        integrity.verify(str(moved))


def test_an_older_manifest_without_its_dir_is_caught_by_the_train_states_step(tmp_path):
    root = tmp_path / "ckpts"
    moved = write(root, 4)
    moved = moved.rename(root / "step_00000012")
    # (read_manifest would refuse it by the dir it names: the manifest of an older pitstop names none)
    body = integrity.unseal((moved / integrity.MANIFEST).read_bytes(), str(moved), integrity.MANIFEST)
    files = body["files"]
    (moved / integrity.MANIFEST).write_bytes(integrity.manifest_bytes(files))
    integrity.verify(str(moved))  # nothing in the files says so: the train state does
    trains, _ = read_checkpoint(str(moved), torch.nn.Linear(64, 64), None, None)

    class Target:
        class state:  # noqa: N801 - the one attribute load_into reads before the step check
            @staticmethod
            def fingerprint():
                return {}

    with pytest.raises(CorruptCheckpoint, match="its name says step 12, its train state step 4"):
        restore.load_into(str(moved), Target, (trains, lambda: ({}, {})), 0, 1, False)


# ---- the run id names a dir: only what pitstop made is used ---------------------------------------------------


@pytest.mark.parametrize("planted", ["../victim", "ABSOLUTE", "", "LINK", "0123456789abcdef/.."])
def test_a_crafted_run_id_is_kept_aside_and_a_new_one_made(tmp_path, planted, caplog):
    root = tmp_path / "checkpoints"
    root.mkdir()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("x")
    path = root / ".run_id"
    if planted == "LINK":
        path.symlink_to(victim / "keep")
    else:
        path.write_text(str(victim) if planted == "ABSOLUTE" else planted)
    with caplog.at_level("WARNING", logger="pitstop.ckpt"):
        rid = layout.run_id(str(root))
    assert layout.RUN_ID.fullmatch(rid) and path.read_text() == rid and not path.is_symlink()
    assert (victim / "keep").read_text() == "x"
    if planted:
        assert "not a run id pitstop made: kept aside" in caplog.text and list(root.glob(".run_id.damaged-*"))
    assert layout.run_id(str(root)) == rid  # kept


# ---- signed checkpoints ---------------------------------------------------------------------------------------

KEY = "k" * 40


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setenv(integrity.KEY_ENV, KEY)


@pytest.mark.parametrize("kind", ["raw", "torch_save", "sync_save"])
def test_a_signed_checkpoint_verifies_and_loads_with_its_key(tmp_path, key, kind, capsys):
    path = write(tmp_path / "ckpts", 4, kind)
    data = (path / integrity.MANIFEST).read_bytes()
    assert integrity.is_signed(data) and all(integrity.STRONG in e for e in integrity.read_manifest(str(path)).values())
    integrity.verify(str(path))
    trains, _ = read_checkpoint(
        str(path), torch.nn.Linear(64, 64), torch.optim.SGD(torch.nn.Linear(1, 1).parameters()), None
    )
    assert trains["train.rank0"]["step"] == 4
    assert verify_main([str(path)]) == 0 and "signature checked" in capsys.readouterr().out


def test_an_edited_and_resealed_checkpoint_is_refused_with_the_key(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(integrity.KEY_ENV, KEY)
    path = write(tmp_path / "ckpts")
    data = next(path.glob("*.distcp"))
    blob = bytearray(data.read_bytes())
    blob[100] ^= 0xFF
    data.write_bytes(bytes(blob))
    # The attacker's reseal: CRC32C entries that match, and the SHA-256 they can compute too; no key, so no HMAC.
    body = integrity.unseal((path / integrity.MANIFEST).read_bytes(), str(path), integrity.MANIFEST)
    body["files"][data.name] = integrity.file_checksum(str(data), strong=True).entry()
    forged = integrity.seal(body, key=b"not-the-key-" * 4)
    (path / integrity.MANIFEST).write_bytes(forged)
    with pytest.raises(CorruptCheckpoint, match="signature does not match"):
        integrity.verify(str(path))
    (path / integrity.MANIFEST).write_bytes(forged.rsplit(b"\n" + integrity.SIGNATURE.encode(), 1)[0] + b"\n")
    with pytest.raises(CorruptCheckpoint, match="is not signed"):
        integrity.verify(str(path))
    monkeypatch.delenv(integrity.KEY_ENV)
    integrity.verify(str(path))  # without the key: CRC32C alone, which the attacker resealed (the docs say so)


def test_a_file_replaced_under_a_signed_manifest_is_refused_though_its_crc_matches(tmp_path, key):
    path = write(tmp_path / "ckpts")
    files = integrity.read_manifest(str(path))
    name = next(n for n in files if n.endswith(".distcp"))
    files[name] = {**files[name], integrity.STRONG: "0" * 64}  # (what a CRC32C collision leaves: the hash differs)
    body = integrity.unseal((path / integrity.MANIFEST).read_bytes(), str(path), integrity.MANIFEST)
    body["files"] = files
    (path / integrity.MANIFEST).write_bytes(integrity.seal(body, key=KEY.encode()))  # signed with the real key
    with pytest.raises(CorruptCheckpoint, match="sha256 is not the signed one"):
        integrity.verify(str(path))


def test_with_a_key_an_unsigned_checkpoint_is_refused_and_without_one_a_signed_checkpoint_loads(
    tmp_path, monkeypatch, capsys
):
    unsigned = write(tmp_path / "a")
    monkeypatch.setenv(integrity.KEY_ENV, KEY)
    signed = write(tmp_path / "b")
    with pytest.raises(CorruptCheckpoint, match="unset PITSTOP_CKPT_KEY to load unsigned"):
        integrity.verify(str(unsigned))
    monkeypatch.delenv(integrity.KEY_ENV)
    integrity.verify(str(signed))
    assert verify_main([str(signed)]) == 0 and "signed: set PITSTOP_CKPT_KEY" in capsys.readouterr().out


def test_a_short_key_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    path = write(tmp_path / "ckpts")
    monkeypatch.setenv(integrity.KEY_ENV, "short")
    with pytest.raises(ConfigError, match="PITSTOP_CKPT_KEY is 5 characters"):
        integrity.verify(str(path))
    assert verify_main([str(path)]) == 2 and "PITSTOP_CKPT_KEY is 5 characters" in capsys.readouterr().err


# ---- found by the red-team pass over this change: each was a crash (a bug, restarted forever) or a hang ----------


@pytest.mark.parametrize(
    "edit",
    [
        "qint32",  # torch read past the bytes: a segfault in 1 of 3 tries
        "properties-none",
        "size-int",
        "chunks-none",
        "offsets-int",
        "fqn-int",
        "train-as-bytes",
        "train-2d",
        "huge-dim-of-empty",
    ],
)
def test_malformed_or_unloadable_metadata_is_corrupt_never_a_crash(tmp_path, edit, capsys):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    path = write(tmp_path / "ckpts")

    def craft(md):
        t = md.state_dict_metadata
        if edit == "qint32":
            t["model.weight"].properties.dtype = torch.qint32
        elif edit == "properties-none":
            t["model.weight"].properties = None
        elif edit == "size-int":
            t["model.weight"].size = 5
        elif edit == "chunks-none":
            t["model.weight"].chunks = None
        elif edit == "offsets-int":
            t["model.weight"].chunks[0].offsets = 0
        elif edit == "fqn-int":
            t[7] = t.pop("model.bias")
        elif edit == "train-as-bytes":
            t["train.rank0"] = BytesStorageMetadata()
        elif edit == "train-2d":
            meta = t["train.rank0"]
            n = meta.size[0]
            meta.size = meta.chunks[0].sizes = torch.Size([1, n])
            meta.chunks[0].offsets = torch.Size([0, 0])
        elif edit == "huge-dim-of-empty":
            meta = t["model.weight"]
            meta.size = torch.Size([0, 1 << 70])
            meta.chunks[0].sizes = torch.Size([0, 1 << 70])

    edit_metadata(path, craft)
    refused(path, ".metadata")
    assert verify_main([str(path)]) == 1 and "CORRUPT" in capsys.readouterr().out


@pytest.mark.parametrize(
    "train",
    [5, {"a": 1}, "bf16", "nested", "rank-superscript"],
)
def test_a_crafted_train_state_in_state_pt_is_corrupt_never_a_crash(tmp_path, train):
    path = tmp_path / "ckpts" / "step_00000004"
    state = app_state()
    if train == "bf16":
        state["train.rank0"] = torch.zeros(8, dtype=torch.bfloat16)
    elif train == "nested":
        state["train.rank0"] = encode_json(None)[:0].new_tensor(list(b"[" * 100_000 + b"]" * 100_000))
    elif train == "rank-superscript":
        state["train.rank\u00b2"] = state["train.rank0"]
    else:
        state["train.rank0"] = train
    write_torch_save(state, str(path), 0, 1, None, 4, None)
    with pytest.raises(CorruptCheckpoint):
        read_checkpoint(str(path), None, None, None)


def test_a_linked_checkpoints_dir_is_refused_before_it_deletes_anything(tmp_path, monkeypatch):
    from pitstop.ckpt.sync_dcp import SyncDCP

    victim = tmp_path / "victim"
    for step in (10, 20):
        write(victim, step)
    (victim / "step_00000100").mkdir()  # another run's save in flight: no commit marker yet
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(victim, target_is_directory=True)

    class OneRank:
        rank, world_size = 0, 1

        def ckpt_group(self):
            return None

    with pytest.raises(ConfigError, match="is a symbolic link .* set ckpt.dir to the real dir"):
        SyncDCP(dir=str(run / "checkpoints"), interval_steps=1, keep_last_k=1).setup(OneRank(), lambda *a: None)
    assert sorted(p.name for p in victim.iterdir()) == ["step_00000010", "step_00000020", "step_00000100"]


@pytest.mark.parametrize("planted", ["other-owner", "open-mode", "link"])
def test_a_local_tier_dir_someone_else_made_or_can_write_is_not_used(tmp_path, planted):
    from pitstop.ckpt.layout import check_writable
    from pitstop.errors import CheckpointError

    shm = tmp_path / "shm"
    shm.mkdir(mode=0o777)
    root = shm / "0123456789abcdef"
    if planted == "link":
        (tmp_path / "elsewhere").mkdir()
        root.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    else:
        root.mkdir()
        write(root, 99)  # the planted checkpoint a restore would prefer
        if planted == "other-owner":
            os.chown(root, 65534, 65534)
        else:
            root.chmod(0o777)
    with pytest.raises(CheckpointError, match="not a dir of this user's alone"):
        check_writable(str(root), key="ckpt.local.dir", private=True)
    mine = shm / "fedcba9876543210"
    check_writable(str(mine), key="ckpt.local.dir", private=True)
    assert oct(mine.stat().st_mode & 0o777) == "0o700"


def test_a_save_is_signed_with_the_key_the_trainer_had_when_it_made_the_writer(tmp_path, monkeypatch):
    """A checkpoint process may have started before the key was set (or without it): the writer carries the
    trainer's key into it, so what signs a save is what its restore checks (in the suite, a checkpoint process
    of an earlier test's made unsigned saves for a signed run)."""
    monkeypatch.setenv(integrity.KEY_ENV, KEY)
    writer = dcp_writer(str(tmp_path / "step_00000004"), None, "raw")
    monkeypatch.delenv(integrity.KEY_ENV)  # (the checkpoint process's environment)
    dcp.save(app_state(), storage_writer=writer, no_dist=True)
    assert integrity.is_signed((tmp_path / "step_00000004" / integrity.MANIFEST).read_bytes())
    monkeypatch.setenv(integrity.KEY_ENV, KEY)
    integrity.verify(str(tmp_path / "step_00000004"))
