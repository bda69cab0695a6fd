"""The DCP tensor format (``ckpt.format``): raw tensor bytes round-trip every dtype and layout a state holds,
torch.save-format checkpoints still load, torch's own reader refuses a raw one by name, a truncated file is
named (hand-made states in tmp_path, no process group).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from pitstop.ckpt.formats import dcp_reader
from pitstop.ckpt.sync_dcp import dcp_writer

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def state() -> dict:
    flat = torch.arange(40, dtype=torch.float32)
    return {
        "model": {
            "w": torch.randn(5, 3),
            "half": torch.randn(4, 6).to(torch.bfloat16),
            "view_at_offset": flat[10:22].view(3, 4),  # how HostStager stages: views of one flat buffer
            "transposed": torch.randn(3, 5).t(),  # not contiguous
            "steps": torch.tensor(7, dtype=torch.int64),  # 0-dim
            "mask": torch.tensor([True, False, True]),
            "empty": torch.zeros(0, 4),
        },
        "optim": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w"]}]},
        "count": 3,
    }


def like(sd: dict) -> dict:
    """A state of the same structure with every tensor zeroed (and contiguous) and other values changed."""
    m = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in sd["model"].items()}
    return {"model": m, "optim": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": ["w"]}]}, "count": 0}


def cause(e: pytest.ExceptionInfo) -> str:  # (DCP's CheckpointException is a BaseException)
    """What went wrong on the failing rank (DCP wraps each rank's exception in a CheckpointException)."""
    failures = getattr(e.value, "failures", {})  # rank -> (exception, traceback)
    return " ".join(str(v[0] if isinstance(v, tuple) else v) for v in failures.values()) or str(e.value)


def assert_same(a: dict, b: dict) -> None:
    for k, v in a["model"].items():
        assert b["model"][k].dtype == v.dtype and torch.equal(b["model"][k], v), k
    assert b["optim"] == a["optim"] and b["count"] == a["count"]


@pytest.mark.parametrize("fmt", ["raw", "torch_save"])
def test_every_dtype_and_layout_round_trips_bitwise(fmt, tmp_path):
    saved = state()
    dcp.save(saved, storage_writer=dcp_writer(str(tmp_path), None, fmt), no_dist=True)
    loaded = like(saved)
    dcp.load(loaded, storage_reader=dcp_reader(str(tmp_path)), no_dist=True)
    assert_same(saved, loaded)


def test_torchs_own_reader_refuses_a_raw_checkpoint_by_name(tmp_path):
    dcp.save(state(), storage_writer=dcp_writer(str(tmp_path), None, "raw"), no_dist=True)
    with pytest.raises(BaseException) as e:
        dcp.load(like(state()), storage_reader=dcp.FileSystemReader(str(tmp_path)), no_dist=True)
    assert "Unknown extension name='pitstop.raw'" in cause(e)


def test_a_raw_checkpoint_is_smaller_than_torch_saves(tmp_path):
    big = {"model": {f"t{i}": torch.randn(64) for i in range(50)}}
    for fmt in ("raw", "torch_save"):
        dcp.save(big, storage_writer=dcp_writer(str(tmp_path / fmt), None, fmt), no_dist=True)
    size = {fmt: sum(f.stat().st_size for f in (tmp_path / fmt).glob("*.distcp")) for fmt in ("raw", "torch_save")}
    assert size["raw"] == 50 * 64 * 4 < size["torch_save"]  # exactly the tensors' bytes, no archive per tensor


def test_a_truncated_raw_file_is_named(tmp_path):
    tensors = {"model": state()["model"]}
    dcp.save(tensors, storage_writer=dcp_writer(str(tmp_path), None, "raw"), no_dist=True)
    data = next(tmp_path.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:40])
    with pytest.raises(BaseException) as e:
        dcp.load({"model": like(state())["model"]}, storage_reader=dcp_reader(str(tmp_path)), no_dist=True)
    assert "__0_0.distcp ends after" in cause(e) and "it is truncated" in cause(e)


def test_staged_host_buffers_go_to_disk_in_page_spans_and_load_bitwise(tmp_path):
    """What HostStager stages (views of page-aligned flat buffers) is written as whole page spans with O_DIRECT;
    a tensor of its own (each rank's train state) goes through the buffered path after them, in the same file."""
    from torch.distributed.checkpoint.planner import WriteItemType

    from pitstop.ckpt.rawdcp import PAGE, page_regions
    from pitstop.ckpt.staging import HostStager

    model = torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.BatchNorm1d(17), torch.nn.Linear(17, 3))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 33)).sum().backward()
    opt.step()
    live = {"model": model.state_dict(), "optim": opt.state_dict(), "train.rank0": torch.arange(5, dtype=torch.uint8)}
    stager = HostStager(torch.device("cpu"), shared=False)
    try:
        staged = stager.stage(live).result()
        tensors = [t for t in staged["model"].values()] + [
            t for s in staged["optim"]["state"].values() for t in s.values()
        ]
        items = [(type("Item", (), {"type": WriteItemType.TENSOR})(), t) for t in tensors]
        regions, rest = page_regions(items + [(items[0][0], staged["train.rank0"])])
        assert len(regions) == 2 and [t for _, t in rest] == [staged["train.rank0"]]  # float32 and int64 buffers
        assert all((st.data_ptr() + start) % PAGE == 0 and (end - start) % PAGE == 0 for st, start, end, _ in regions)
        dcp.save(staged, storage_writer=dcp_writer(str(tmp_path), None, "raw"), no_dist=True)
    finally:
        stager.close()
    loaded = {
        "model": {k: torch.zeros_like(v) for k, v in live["model"].items()},
        "train.rank0": torch.zeros(5, dtype=torch.uint8),
    }
    dcp.load(loaded, storage_reader=dcp_reader(str(tmp_path)), no_dist=True)
    assert all(torch.equal(loaded["model"][k], v) for k, v in live["model"].items())
    assert torch.equal(loaded["train.rank0"], live["train.rank0"])


def test_a_raw_checkpoint_converts_to_one_torch_save_file(tmp_path):
    from pitstop.ckpt.formats import to_torch_save

    saved = state()
    dcp.save(saved, storage_writer=dcp_writer(str(tmp_path / "ckpt"), None, "raw"), no_dist=True)
    to_torch_save(str(tmp_path / "ckpt"), str(tmp_path / "all.pt"))
    whole = torch.load(tmp_path / "all.pt", weights_only=True)
    assert all(torch.equal(whole["model"][k], v) for k, v in saved["model"].items())
    assert whole["count"] == 3 and whole["optim"]["param_groups"][0]["lr"] == 0.1
