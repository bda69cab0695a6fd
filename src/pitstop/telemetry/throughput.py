"""Throughput you can compare: samples/s per device, step-time percentiles, and MFU.

MFU (model FLOPs utilisation) = FLOPs of one optimizer step (forward + backward, counted once with
``torch.utils.flop_counter`` on a meta-device copy of the model: no memory, no effect on the RNGs or the
run) x steps per second / the device's peak FLOPs for the step's dtype.  Peak figures are the vendors'
dense tensor-core numbers (no sparsity); a device not in :data:`PEAK_TFLOPS` (and every CPU) reports
``mfu: null`` with the reason in ``mfu_note``, never a made-up figure.
"""

from __future__ import annotations

import logging
import re
from array import array
from typing import Any, Callable

import torch

from pitstop.parts.batch import map_tensors

log = logging.getLogger("pitstop.telemetry.throughput")

# Dense peak TFLOP/s by device-name fragment and compute dtype ("tf32": fp32 matmuls on tensor cores, used
# when torch.backends.cuda.matmul.allow_tf32 is on).  Sources: NVIDIA data sheets (SXM parts unless named).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100 PCIe": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2},
    "H100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "V100": {"fp16": 125.0, "fp32": 15.7},
}


def peak_flops(device: torch.device, precision: str) -> tuple[float | None, str]:
    """(peak FLOP/s, what it is) for ``device`` computing in ``precision``; (None, why) when unknown."""
    if device.type != "cuda":
        return None, f"n/a on {device.type} (no peak FLOPs table for CPUs)"
    name = torch.cuda.get_device_name(device)
    dtype = precision
    # fp32 convolutions run on TF32 tensor cores by default (cudnn.allow_tf32), matmuls when allowed
    if precision == "fp32" and (torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32):
        dtype = "tf32"
    if "NVL" not in name:  # (NVL parts have their own clocks: no figure rather than a wrong one)
        for fragment, peaks in PEAK_TFLOPS.items():  # (ordered: "H100 PCIe" before "H100")
            if re.search(rf"(?<![\w]){re.escape(fragment)}(?![\w])", name) and dtype in peaks:
                return peaks[dtype] * 1e12, f"{fragment} {dtype} dense peak {peaks[dtype]:g} TFLOP/s"
    return None, f"n/a: no peak figure for {name} in {dtype} (pitstop.telemetry.throughput.PEAK_TFLOPS)"


def count_step_flops(
    build_model: Callable[[], torch.nn.Module], loss: Callable[[Any, Any], torch.Tensor], batch: object
) -> int | None:
    """FLOPs of forward + backward of one micro-batch shaped like ``batch``, on a meta-device model."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):  # builds touch no real memory or RNG
            model = build_model()
        with FlopCounterMode(display=False) as counter:
            loss(model, map_tensors(lambda t: torch.empty_like(t, device="meta"), batch)).backward()
        return int(counter.get_total_flops())
    except Exception as e:  # noqa: BLE001 - a model that cannot run on meta tensors just has no MFU
        log.info("FLOPs not counted (the model does not run on meta tensors: %s); MFU n/a", e)
        return None


def cached_count(path: str, key: str, write: bool, count: Callable[[], int | None]) -> int | None:
    """``count()``, remembered in ``path`` (the run dir's ``flops.json``) under ``key``: later attempts of the
    run read it back instead of counting again (counting is part of their start-up)."""
    import hashlib

    from pitstop.statefile import FLOPS, read_state
    from pitstop.telemetry.metrics import write_json_atomic

    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    # (damaged or of another shape: kept aside by the rank that writes it, and counted again)
    known = read_state(path, FLOPS, keep_aside=write, then="FLOPs counted again", logger=log if write else None)
    known = known if known is not None else {}
    if digest in known:
        return known[digest]
    flops = count()
    if flops is not None and write:
        write_json_atomic(path, {**known, digest: flops}, fsync=False)
    return flops


class Throughput:
    """This attempt's step times and samples on this rank; the figures for logs and summary.json."""

    def __init__(self, device: torch.device, precision: str):
        self.peak, self.peak_note = peak_flops(device, precision)
        self.flops_per_step: int | None = None
        self.times = array("d")
        self.samples = 0

    def add(self, seconds: float, samples: int) -> None:
        self.times.append(seconds)
        self.samples += samples

    def mfu(self, steps_per_s: float) -> float | None:
        if self.peak is None or self.flops_per_step is None:
            return None
        return self.flops_per_step * steps_per_s / self.peak

    def summary(self) -> dict[str, Any]:
        busy = sum(self.times)
        out: dict[str, Any] = {
            "steps": len(self.times),
            "samples_per_s_per_device": round(self.samples / busy, 3) if busy else None,
            "flops_per_step": self.flops_per_step,
            "peak_flops": self.peak,
        }
        if self.times:
            ordered = sorted(self.times)
            for p in (50, 90, 99):
                out[f"step_seconds_p{p}"] = round(ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))], 6)
        mfu = self.mfu(len(self.times) / busy) if busy else None
        out["mfu"] = round(mfu, 4) if mfu is not None else None
        if mfu is None:
            out["mfu_note"] = self.peak_note if self.peak is None else "n/a: FLOPs of a step not counted"
        return out
