"""A local dir as a stand-in for a network volume (``ckpt.throttle_mbps``): writes and reads of a checkpoint under it
go at that speed, files elsewhere at full speed, and what is read is the bytes written (hand-made checkpoints in
tmp_path, no process group)."""

from __future__ import annotations

import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

from pitstop.ckpt import integrity, storage, throttle
from pitstop.ckpt.formats import dcp_reader
from pitstop.ckpt.sync_dcp import dcp_writer

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

MB = 1_000_000


def state() -> dict:
    torch.manual_seed(0)
    return {"w": torch.randn(200_000), "b": torch.arange(10)}  # (~0.8 MB)


def test_a_checkpoint_under_a_slow_volume_is_read_at_its_speed_and_elsewhere_at_full_speed(tmp_path):
    slow, fast = tmp_path / "volume", tmp_path / "local"
    for root in (slow, fast):
        dcp.save(state(), storage_writer=dcp_writer(str(root / "step_1"), None), no_dist=True)
    nbytes = sum(f["bytes"] for f in integrity.read_manifest(str(slow / "step_1")).values())
    throttle.slow_volume(str(slow), 4.0)
    try:
        t0 = time.monotonic()
        integrity.verify(str(fast / "step_1"))
        full = time.monotonic() - t0
        t0 = time.monotonic()
        integrity.verify(str(slow / "step_1"))  # (every byte checked: read once at 4 MB/s)
        checked = time.monotonic() - t0
        got = {"w": torch.zeros(200_000), "b": torch.zeros(10, dtype=torch.int64)}
        t0 = time.monotonic()
        dcp.load(got, storage_reader=dcp_reader(str(slow / "step_1")), no_dist=True)  # (DCP's reads: the same files)
        loaded = time.monotonic() - t0
    finally:
        throttle.slow_volume(str(slow), None)
    assert nbytes > 0.75 * MB
    assert checked >= nbytes / (4.0 * MB) * 0.95 and full < checked, (checked, full)
    assert loaded >= 0.75 * MB / (4.0 * MB) * 0.95, loaded
    assert torch.equal(got["w"], state()["w"]) and torch.equal(got["b"], state()["b"])
    # the volume back at full speed: not throttled any more
    with integrity.open_regular(str(next((slow / "step_1").glob("*.distcp")))) as f:
        assert not isinstance(f, throttle.ThrottledReader)


def test_a_throttled_reader_seeks_and_reads_what_the_file_holds(tmp_path):
    data = bytes(range(256)) * 4096  # 1 MiB
    (tmp_path / "f").write_bytes(data)
    throttle.slow_volume(str(tmp_path), 8.0)
    try:
        with integrity.open_regular(str(tmp_path / "f")) as f:
            assert isinstance(f, throttle.ThrottledReader)
            f.seek(1000)
            assert f.read(10) == data[1000:1010] and f.tell() == 1010
            t0 = time.monotonic()
            rest = f.read()
            took = time.monotonic() - t0
    finally:
        throttle.slow_volume(str(tmp_path), None)
    assert rest == data[1010:]
    assert took >= len(data) / (8.0 * MB) * 0.9, took


def test_a_small_file_read_whole_under_a_slow_volume_is_whole_past_a_megabyte(tmp_path):
    # (a CHECKSUMS or .metadata over 1 MB is read with one read(limit + 1): a short read would fail its check)
    data = bytes(range(251)) * 12_000  # ~3 MB
    (tmp_path / "f").write_bytes(data)
    throttle.slow_volume(str(tmp_path), 100.0)
    try:
        assert integrity.read_file(str(tmp_path / "f"), 4 << 20) == data
        with integrity.open_regular(str(tmp_path / "f")) as f:
            assert f.read(len(data) + 1) == data and f.read(10) == b""
    finally:
        throttle.slow_volume(str(tmp_path), None)


def test_writes_through_the_throttle_take_their_time(tmp_path):
    t0 = time.monotonic()
    with storage.open_write(tmp_path / "f", 8.0) as f:
        f.write(b"x" * 800_000)
    assert time.monotonic() - t0 >= 0.09 and (tmp_path / "f").stat().st_size == 800_000
