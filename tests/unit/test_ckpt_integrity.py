"""Checkpoints verified by content, and loading that runs no code (hand-made checkpoints in tmp_path, no process
group): every writer records its checksums before its commit marker; a randomized sweep of corruptions (a flipped
byte anywhere, a truncation, a deleted file, a garbled ``.metadata``) is found every time, naming the file; a
crafted ``.metadata`` or ``state.pt`` is refused by name and runs nothing; ``python -m pitstop.ckpt.verify``;
and how a failed load is told apart (integrity falls back, transient retries then fails, anything else raises).
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from pitstop.ckpt import integrity, restore
from pitstop.ckpt.formats import dcp_reader, encode_json, read_checkpoint, write_torch_save
from pitstop.ckpt.rawdcp import _Manifest
from pitstop.ckpt.sync_dcp import dcp_writer
from pitstop.ckpt.verify import main as verify_main
from pitstop.errors import CheckpointError, CorruptCheckpoint

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def app_state() -> dict:
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.BatchNorm1d(5))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 7)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "train.rank0": encode_json({"step": 3})}


def write(kind: str, path: Path) -> Path:
    """A checkpoint dir as each writer makes it: DCP raw, DCP torch_save items, sync_save's one file."""
    if kind == "sync_save":
        write_torch_save(app_state(), str(path), 0, 1, None, 3, None)
    else:
        dcp.save(app_state(), storage_writer=dcp_writer(str(path), None, kind), no_dist=True)
    return path


KINDS = ("raw", "torch_save", "sync_save")


@pytest.mark.parametrize("kind", KINDS)
def test_every_writer_lists_every_file_it_wrote_and_verifies(kind, tmp_path):
    path = write(kind, tmp_path / "step_00000003")
    files = integrity.read_manifest(str(path))
    on_disk = {p.name for p in path.iterdir()} - {integrity.MANIFEST, "COMMITTED"}
    assert set(files) == on_disk and all(files[n]["bytes"] == (path / n).stat().st_size for n in on_disk)
    assert integrity.verify(str(path)) == sum(f["bytes"] for f in files.values())


def test_the_manifest_is_durable_before_the_commit_marker(tmp_path, monkeypatch):
    order: list[str] = []
    put = _Manifest._put
    monkeypatch.setattr(_Manifest, "_put", lambda self, name, data: (order.append(name), put(self, name, data)))
    write("raw", tmp_path / "dcp")
    durable = integrity.write_durable
    monkeypatch.setattr(
        integrity, "write_durable", lambda p, name, data, **kw: (order.append(name), durable(p, name, data, **kw))
    )
    write("sync_save", tmp_path / "one")
    assert order == [integrity.MANIFEST, ".metadata", integrity.MANIFEST, "COMMITTED"]


def corrupt(rng: random.Random, path: Path) -> tuple[str, str]:
    """Damage one file of checkpoint dir ``path`` at random; ``(what, file name)``."""
    name = rng.choice(sorted(p.name for p in path.iterdir()))
    f = path / name
    data = bytearray(f.read_bytes())
    what = rng.choice(["flip", "flip", "truncate", "delete", "garble-metadata"])
    if what == "garble-metadata" and (path / ".metadata").exists():
        name, f = ".metadata", path / ".metadata"
        data = bytearray(f.read_bytes())
        at = rng.randrange(len(data))
        span = rng.randint(1, 64)
        junk = bytes(rng.randrange(256) for _ in range(span))
        if junk == bytes(data[at : at + span]):
            junk = bytes(b ^ 0xFF for b in junk)
        data[at : at + span] = junk
        f.write_bytes(bytes(data))
    elif what in ("flip", "garble-metadata"):
        what = "flip"
        at = rng.randrange(len(data))
        data[at] ^= rng.randint(1, 255)
        f.write_bytes(bytes(data))
    elif what == "truncate":
        f.write_bytes(bytes(data[: rng.randrange(len(data))]))
    else:
        f.unlink()
    return what, name


def test_a_randomized_sweep_of_corruptions_is_found_every_time_and_names_the_file(tmp_path):
    rng = random.Random(38)
    good = {kind: write(kind, tmp_path / "good" / kind / "step_00000003") for kind in KINDS}
    seen: dict[str, int] = {}
    cases = 240
    for i in range(cases):
        kind = KINDS[i % len(KINDS)]
        path = tmp_path / "case" / "step_00000003"
        shutil.rmtree(path.parent, ignore_errors=True)
        shutil.copytree(good[kind], path)
        what, name = corrupt(rng, path)
        seen[what] = seen.get(what, 0) + 1
        with pytest.raises(CorruptCheckpoint) as e:
            integrity.verify(str(path))
        text = str(e.value)
        assert name in text and "\n" not in text, (kind, what, name, text)
    assert sum(seen.values()) == cases >= 200
    assert all(seen.get(w, 0) >= 25 for w in ("flip", "truncate", "delete", "garble-metadata")), seen


def test_verify_checks_every_file_once_across_ranks(tmp_path):
    path = tmp_path / "step_00000003"
    dcp.save({"model": {"w": torch.randn(300, 100)}}, storage_writer=dcp_writer(str(path), None, "raw"), no_dist=True)
    files = integrity.read_manifest(str(path))
    big = {n: f for n, f in files.items() if not n.startswith(".") and f["bytes"] > 1 << 16}
    assert len(big) == 1
    total = sum(integrity.verify(str(path), share=(r, 3)) for r in range(3))
    small = sum(f["bytes"] for n, f in files.items() if n not in big)
    assert total == sum(f["bytes"] for f in big.values()) + 3 * small  # the big ones split, the small on every rank


class Runs:
    """Builds a file on ``__reduce__``: proof that unpickling ran code."""

    def __init__(self, proof: Path):
        self.proof = proof

    def __reduce__(self):
        return (os.system, (f"touch {self.proof}",))


def reseal(path: Path) -> None:
    """What an attacker who can write the dir does too: a manifest that matches the crafted files."""
    files = {}
    for p in path.iterdir():
        if p.name not in (integrity.MANIFEST, "COMMITTED"):
            files[p.name] = integrity.file_checksum(str(p)).entry()
    (path / integrity.MANIFEST).write_bytes(integrity.manifest_bytes(files))


def test_a_crafted_metadata_is_refused_by_name_and_runs_nothing(tmp_path, capsys):
    path = write("raw", tmp_path / "ckpts" / "step_00000003")
    proof = tmp_path / "ran"
    (path / ".metadata").write_bytes(pickle.dumps(Runs(proof)))
    reseal(path)
    integrity.verify(str(path))  # the checksums match: the unpickler is what stands in the way
    with pytest.raises(CorruptCheckpoint) as e:
        dcp_reader(str(path)).read_metadata()
    assert "refused" in str(e.value) and ".metadata" in str(e.value) and "system" in str(e.value)
    assert verify_main([str(path)]) == 1
    assert "CORRUPT" in capsys.readouterr().out
    assert not proof.exists()


def test_a_crafted_state_file_is_refused_by_name_and_runs_nothing(tmp_path):
    path = write("sync_save", tmp_path / "step_00000003")
    proof = tmp_path / "ran"
    torch.save({"model": {}, "optim": {}, "x": Runs(proof)}, path / "state.pt")
    reseal(path)
    with pytest.raises(CorruptCheckpoint) as e:
        read_checkpoint(str(path), None, None, None)
    assert "refused" in str(e.value) and "state.pt" in str(e.value)
    assert not proof.exists()


def test_the_verify_command_says_one_line_per_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    for step in (4, 8):
        write("raw", run / "checkpoints" / f"step_{step:08d}")
    (run / "checkpoints" / "step_00000012").mkdir()  # a save that never completed
    assert verify_main([str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == ["ok", "ok", "partial"]
    data = next((run / "checkpoints" / "step_00000008").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-1])
    assert verify_main([str(run / "checkpoints")]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("CORRUPT") and "__0_0.distcp is truncated" in out[1]
    assert verify_main([str(tmp_path / "nothing")]) == 2


# ---- how a failed load is told apart ------------------------------------------------------------------------


class OneRank:
    """The two collectives first_loadable uses, for one rank (a small fake: the logic under test is the decision)."""

    rank, world_size = 0, 1

    def any(self, flag: bool) -> bool:
        return bool(flag)


def wrapped(*errors: BaseException) -> BaseException:
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException("load", {r: (e, None) for r, e in enumerate(errors)})


@pytest.mark.parametrize(
    "error,kind",
    [
        (CorruptCheckpoint("x"), "integrity"),
        (FileNotFoundError("x"), "integrity"),
        (ConnectionResetError("x"), "transient"),
        (TimeoutError("x"), "transient"),
        (OSError(5, "Input/output error"), "transient"),
        (TypeError("x"), "bug"),
        (PermissionError(13, "denied"), "bug"),
        (wrapped(CorruptCheckpoint("a"), TimeoutError("b")), "transient"),
        (wrapped(CorruptCheckpoint("a"), KeyError("b")), "bug"),
        (wrapped(CorruptCheckpoint("a")), "integrity"),
    ],
)
def test_a_failed_load_is_classified(error, kind):
    assert restore.classify(error) == kind


def loads(failures: dict[str, list[BaseException]]):
    """``load(path)`` that raises the next of ``failures[path]`` each call, then succeeds."""

    def load(path: str) -> None:
        if failures.get(path):
            raise failures[path].pop(0)

    return load


def first(choice, failures, explicit=False):
    slept: list[float] = []
    got = restore.first_loadable(
        OneRank(), choice, explicit, loads(failures), "/ckpts", None, lambda: 7, sleep=slept.append
    )
    return got, slept


def test_a_transient_read_error_is_retried_and_never_falls_back(caplog):
    got, slept = first(["/c/step_2", "/c/step_1"], {"/c/step_2": [ConnectionResetError("reset"), TimeoutError()]})
    assert got == 7 and slept == [1.0, 2.0] and "falling back" not in caplog.text
    with pytest.raises(CheckpointError) as e:
        first(["/c/step_2", "/c/step_1"], {"/c/step_2": [TimeoutError("slow")] * 3})
    assert "transient I/O error, 3 tries" in str(e.value) and "step_2" in str(e.value)


def test_a_damaged_checkpoint_falls_back_in_one_line_and_a_bug_is_raised(caplog):
    got, slept = first(["/c/step_2", "/c/step_1"], {"/c/step_2": [CorruptCheckpoint("CHECKSUMS is missing")]})
    assert got == 7 and slept == []
    assert "step_2 is corrupt, not loaded (CorruptCheckpoint: CHECKSUMS is missing); falling back to step_1" in (
        caplog.text
    )
    with pytest.raises(KeyError):
        first(["/c/step_2", "/c/step_1"], {"/c/step_2": [KeyError("model.w")]})
    with pytest.raises(CheckpointError):  # asked for by name: no fallback
        first(["/c/step_2"], {"/c/step_2": [CorruptCheckpoint("x")]}, explicit=True)


class Killed(BaseException):
    """Stands for a SIGKILL at that point of a save: what is on disk stays as it is (the page cache survives a
    killed process; only a power loss could lose more, which fsync and the marker-last order are there for)."""


@pytest.mark.parametrize("kind", KINDS)
def test_a_save_stopped_at_any_point_of_its_commit_is_partial_and_skipped_or_complete_and_verifies(
    kind, tmp_path, monkeypatch
):
    from pitstop.ckpt import layout

    real_fsync, calls = os.fsync, [0]

    def counting(fd):
        calls[0] += 1
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting)
    write(kind, tmp_path / "count" / "step_00000003")
    points = calls[0]  # every fsync of a save: its data, the manifest, the marker, their dirs
    assert points >= 3
    outcomes = set()
    for k in range(1, points + 1):
        root = tmp_path / f"at{k}"
        seen = [0]

        def stop_at_k(fd, k=k):
            seen[0] += 1
            if seen[0] == k:
                raise Killed
            real_fsync(fd)

        monkeypatch.setattr(os, "fsync", stop_at_k)
        with pytest.raises(BaseException) as e:  # (DCP wraps what a rank raised in its CheckpointException)
            write(kind, root / "step_00000003")
        assert e.type is Killed or "Killed" in str(e.value)
        monkeypatch.setattr(os, "fsync", real_fsync)
        path = str(root / "step_00000003")
        if layout.is_complete(path):
            integrity.verify(path)  # a complete checkpoint is whole: its manifest was durable before its marker
            outcomes.add("complete")
        else:
            assert layout.candidates(str(root), "auto") == [] and not os.path.exists(path)  # skipped and removed
            outcomes.add("partial")
    assert outcomes == {"partial", "complete"}  # (the last point: the dir fsync after the marker's rename)
