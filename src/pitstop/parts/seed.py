"""One seed for python, numpy, torch (and CUDA), plus derived per-sample seeds.

Randomness that must survive a restart (data order, augmentation) is never drawn from a live RNG:
it is a pure function of ``(seed, epoch, ...)`` computed with :func:`derive_seed`.  The live RNGs
(used e.g. by dropout) are seeded once here and captured in checkpoints by :func:`rng_state`.
"""

from __future__ import annotations

import base64
import hashlib
import os
import random
import struct
import sys

import numpy as np
import torch


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any printable parts (independent of PYTHONHASHSEED)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return struct.unpack("<Q", digest)[0] & 0x7FFF_FFFF_FFFF_FFFF


def seed_everything(seed: int, deterministic: bool = True) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device
    if deterministic:
        # Bitwise-reproducible kernels; CUBLAS needs a fixed workspace for deterministic GEMMs.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        _deterministic_kernels()
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def _deterministic_kernels() -> None:
    """``torch.use_deterministic_algorithms(True, warn_only=True)``, which also sets inductor's config and so
    imports ``torch._inductor`` (and dynamo): ~2 s of every process start here, for a compiler pitstop does not
    use. The same switch is set without that import unless inductor is loaded already (then its flag too)."""
    setter = getattr(torch._C, "_set_deterministic_algorithms", None)
    if setter is None or "torch._inductor" in sys.modules:
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        setter(True, warn_only=True)


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def rng_state() -> dict:
    """Every live RNG state of this process (python, numpy, torch CPU, each CUDA device), JSON-able,
    so checkpoints never need pickle (they load with ``weights_only=True``)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])
