"""HostStager on its own: a snapshot of the right step, host buffers allocated once, DCP round trip.

The CPU cases run everywhere; the same cases on CUDA (pinned buffers, a side stream that waits for the
compute stream) run where a GPU is present (``-m cuda``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import flatten
from pitstop.ckpt.staging import HostStager

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
    ),
]


def bn_model_and_optimizer(device: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4)).to(
        device
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def train_step(model, opt, device: str, before_step=None) -> None:
    x = torch.randn(4, 3, 8, 8, device=device)
    opt.zero_grad()
    model(x).square().mean().backward()
    if before_step is not None:
        before_step()
    opt.step()


def app_state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "train.rank0": torch.tensor([1, 2, 3], dtype=torch.uint8)}


def flat(state: dict) -> dict:
    return flatten(state, lambda t: t.detach().cpu().clone())


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_staged_state_is_the_saved_steps_although_forward_and_step_follow(device, shared):
    model, opt = bn_model_and_optimizer(device)
    train_step(model, opt, device)
    stager = HostStager(torch.device(device), shared=shared)
    try:
        for _ in range(3):
            state = app_state(model, opt)
            expected = flat(state)
            stager.snapshot_in_call(model.buffers())
            future = stager.stage(state)
            # the next step: forward changes BatchNorm statistics at once; the step waits for the copy first
            train_step(model, opt, device, before_step=stager.synchronize_staging)
            staged = flat(future.result())
            assert sorted(staged) == sorted(expected)
            for k, v in expected.items():
                if isinstance(v, torch.Tensor):
                    assert staged[k].dtype == v.dtype and torch.equal(staged[k], v), k
                else:
                    assert staged[k] == v, k
            assert any("running_mean" in k for k in expected)
            assert all(t.device.type == "cpu" for t in flat(future.result()).values() if isinstance(t, torch.Tensor))
            if shared:
                assert all(t.is_shared() for k, t in future.result()["model"].items())
        assert stager.allocations == 1  # one layout, reused by every save
    finally:
        stager.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_staged_state_saves_and_loads_with_dcp(device, tmp_path):
    import torch.distributed.checkpoint as dcp

    model, opt = bn_model_and_optimizer(device)
    train_step(model, opt, device)
    stager = HostStager(torch.device(device), shared=False)
    try:
        state = app_state(model, opt)
        stager.snapshot_in_call(model.buffers())
        dcp.save(stager.stage(state).result(), checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    finally:
        stager.close()
    loaded = {k: torch.zeros_like(v) for k, v in state["model"].items()}
    dcp.load({"model": loaded}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert all(torch.equal(loaded[k], v) for k, v in state["model"].items())


@pytest.mark.parametrize("shared", [False, True])
def test_buffers_prepared_before_the_first_save_are_the_ones_it_uses(shared):
    """The manager allocates the host buffers once the optimizer has state, in the background, so the first
    save only copies: it reuses them (no second allocation) and its snapshot is still exact."""
    model, opt = bn_model_and_optimizer("cpu")
    train_step(model, opt, "cpu")
    stager = HostStager(torch.device("cpu"), shared=shared)
    try:
        stager.prepare(app_state(model, opt))
        stager.synchronize_staging()
        assert stager.allocations == 1
        pages = [b.data_ptr() for b in stager.layout.buffers]
        train_step(model, opt, "cpu")
        state = app_state(model, opt)
        expected = flat(state)
        stager.snapshot_in_call(model.buffers())
        staged = flat(stager.stage(state).result())
        assert stager.allocations == 1 and [b.data_ptr() for b in stager.layout.buffers] == pages
        assert all(torch.equal(staged[k], v) for k, v in expected.items() if isinstance(v, torch.Tensor))
    finally:
        stager.close()
