"""What a heal's state looks like on the wire: a JSON manifest (the tree's structure, each leaf's dtype, shape and
memory order, or its plain value) and the tensors' raw bytes; :func:`prepare` makes it from a live state,
:func:`check_manifest` checks what a peer sent before anything of it is rebuilt (plain containers, torch's dtypes,
scalars: nothing is unpickled or imported by name). Sent and received by :mod:`pitstop.strategy.heal_transport`.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Callable

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path, treespec_dumps, treespec_loads

from pitstop.errors import PitstopError

# Plain containers only: a structure naming anything else (defaultdict's factory, an enum: both imported by name when
# torch rebuilds them) is refused before torch reads it.
CONTAINERS = ("builtins.dict", "collections.OrderedDict", "builtins.list", "builtins.tuple", "torch.Size")
DTYPES = frozenset(
    name
    for name in (
        "float64 float32 float16 bfloat16 complex128 complex64 int64 int32 int16 int8 uint8 uint16 uint32 uint64 bool "
        "float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz float8_e8m0fnu"
    ).split()
    if isinstance(getattr(torch, name, None), torch.dtype)  # (torch's dtypes, by name: those of this version)
)
SCALARS = (bool, int, float, str)


class HealTransportError(PitstopError):
    """A heal's state could not be sent or received: refused, unverifiable, or not plain tensors and scalars."""


class Served:
    """One step's state, ready to stream: the manifest's parts and each tensor's bytes (CPU, in memory order)."""

    def __init__(self, step: int, spec: str, leaves: list[dict], data: list[torch.Tensor]):
        self.step, self.spec, self.leaves, self.data = step, spec, leaves, data
        self.data_bytes = sum(int(d.numel()) for d in data)


def prepare(step: int, state: object) -> Served:
    """The state flattened and checked; device tensors copied to CPU now (the server's threads touch no device)."""
    pairs, spec = tree_flatten_with_path(state)
    try:
        spec_text = treespec_dumps(spec)
        structure_ok = _check_spec(json.loads(spec_text)) == len(pairs) and treespec_loads(spec_text) == spec
    except (TypeError, ValueError, NotImplementedError, HealTransportError) as e:
        raise HealTransportError(
            f"the heal state's structure cannot travel as JSON ({str(e).splitlines()[0][:200]}): only dicts "
            f"(str/int/float/bool/None keys), OrderedDicts, lists and tuples"
        ) from None
    if not structure_ok:
        raise HealTransportError(
            "the heal state's structure does not survive JSON (a dict key that is not a str, int, float, bool or "
            "None?): only plain keys travel"
        )
    devices = {v.device for _, v in pairs if isinstance(v, torch.Tensor) and v.device.type not in ("cpu", "meta")}
    for device in devices:  # (the copies below must see the step's last kernels)
        sync = getattr(getattr(torch, device.type, None), "synchronize", None)
        if sync is not None:
            sync(device)
    leaves: list[dict] = []
    data: list[torch.Tensor] = []
    for path, value in pairs:
        if isinstance(value, torch.Tensor):
            meta, raw = _tensor_leaf(keystr(path), value)
            leaves.append(meta)
            data.append(raw)
        elif value is None or isinstance(value, SCALARS):
            base = next(t for t in SCALARS if isinstance(value, t)) if value is not None else None
            leaves.append({"v": base(value) if base is not None and type(value) is not base else value})
        else:
            raise HealTransportError(
                f"the heal state's leaf {keystr(path) or '(the root)'} is a {type(value).__name__}: only tensors and "
                f"JSON scalars (None, bool, int, float, str) travel to a healing peer"
            )
    return Served(step, spec_text, leaves, data)


def _tensor_leaf(where: str, value: torch.Tensor) -> tuple[dict, torch.Tensor]:
    t = value.detach()
    name = str(t.dtype).removeprefix("torch.")
    why = (
        f"a {type(t).__name__} (a tensor subclass)"
        if type(t) is not torch.Tensor
        else f"of dtype {name}"
        if name not in DTYPES
        else f"of layout {t.layout}"
        if t.layout != torch.strided
        else "on the meta device (no data)"
        if t.device.type == "meta"
        else None
    )
    if why:
        raise HealTransportError(f"the heal state's tensor {where} is {why}: it cannot travel to a healing peer")
    t = t.resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        t = t.to("cpu")
    order = _memory_order(t)
    dense = t.permute(order) if order is not None else t.contiguous()
    raw = dense.reshape(-1).view(torch.uint8)
    meta = {"t": name, "shape": list(t.shape), "nbytes": int(raw.numel())}
    if order is not None and order != list(range(t.dim())):
        meta["order"] = order
    return meta, raw


def _memory_order(t: torch.Tensor) -> list[int] | None:
    """The dims from outermost to innermost in memory when ``t`` is dense (a permutation of a contiguous tensor:
    channels_last, a transpose); None when it is not (it travels as a contiguous copy)."""
    if t.dim() == 0:
        return None
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))
    return order if t.permute(order).is_contiguous() else None


def check_manifest(
    manifest: bytes, step: int, nonce: str, failed: Callable[[str], HealTransportError]
) -> tuple[str, list[dict]]:
    try:
        m = json.loads(manifest)
        if not isinstance(m, dict) or set(m) != {"step", "nonce", "byteorder", "spec", "leaves"}:
            raise ValueError("not the manifest's keys")
        if m["step"] != step or type(m["step"]) is not int:
            raise failed(f"the peer sent step {m['step']!r}, not step {step}")
        if m["nonce"] != nonce:
            raise failed("an answer to another request (a replay)")
        if m["byteorder"] != sys.byteorder:
            raise failed(f"the peer's byte order is {m['byteorder']!r}, this machine's {sys.byteorder}")
        leaves = m["leaves"]
        if not isinstance(m["spec"], str) or not isinstance(leaves, list):
            raise ValueError("spec or leaves of the wrong type")
        if _check_spec(json.loads(m["spec"])) != len(leaves):
            raise ValueError("the structure and the leaves disagree in number")
        for leaf in leaves:
            _check_leaf(leaf)
        return m["spec"], leaves
    except HealTransportError:
        raise
    except (ValueError, TypeError, KeyError, RecursionError) as e:
        raise failed(f"a malformed manifest ({str(e).splitlines()[0][:200] if str(e) else type(e).__name__})") from None


def _check_leaf(leaf: object) -> None:
    if not isinstance(leaf, dict):
        raise ValueError("a leaf that is not an object")
    if set(leaf) == {"v"}:
        if leaf["v"] is not None and type(leaf["v"]) not in SCALARS:
            raise ValueError("a scalar leaf that is not a JSON scalar")
        return
    if not {"t", "shape", "nbytes"} <= set(leaf) <= {"t", "shape", "nbytes", "order"}:
        raise ValueError(f"a leaf with keys {sorted(leaf)}")
    name, shape, nbytes = leaf["t"], leaf["shape"], leaf["nbytes"]
    if name not in DTYPES or not isinstance(getattr(torch, name, None), torch.dtype):
        raise ValueError(f"dtype {str(name)[:40]!r} is not one that travels")
    if not isinstance(shape, list) or len(shape) > 64 or any(type(n) is not int or n < 0 for n in shape):
        raise ValueError("a shape that is not a list of sizes")
    if type(nbytes) is not int or nbytes != math.prod(shape) * getattr(torch, name).itemsize:
        raise ValueError(f"{nbytes!r} bytes for a {name} tensor of shape {shape}")
    order = leaf.get("order", list(range(len(shape))))
    if (
        not isinstance(order, list)
        or sorted(order) != list(range(len(shape)))
        or any(type(d) is not int for d in order)
    ):
        raise ValueError("a memory order that is not a permutation of the dims")


def _check_spec(node: object) -> int:
    """The number of leaves of a ``treespec_dumps`` structure made of plain containers (refused otherwise, before
    torch reads it: its loader imports the names a defaultdict or an enum carries)."""
    if not (isinstance(node, list) and len(node) == 2 and node[0] == 1):
        raise ValueError("a structure of another format")
    return _spec_leaves(node[1])


def _spec_leaves(node: object) -> int:
    if not isinstance(node, dict) or set(node) != {"type", "context", "children_spec"}:
        raise ValueError("a structure node of another form")
    kind, context, children = node["type"], node["context"], node["children_spec"]
    if not isinstance(children, list):
        raise ValueError("a structure node's children are no list")
    if kind is None:
        if context is not None or children:
            raise ValueError("a leaf with a context")
        return 1
    if kind not in CONTAINERS or not isinstance(context, str):
        raise ValueError(f"a container of type {str(kind)[:60]!r}")
    keys = json.loads(context)
    if kind in ("builtins.dict", "collections.OrderedDict"):
        plain = isinstance(keys, list) and all(k is None or type(k) in SCALARS for k in keys)
        if not plain or len(set(keys)) != len(keys) or len(keys) != len(children):
            raise ValueError("a dict whose keys are not distinct plain keys, one per child")
    elif keys is not None:
        raise ValueError(f"a {kind} with a context")
    return sum(_spec_leaves(child) for child in children)


def inverse(order: list[int]) -> list[int]:
    inverse = [0] * len(order)
    for i, d in enumerate(order):
        inverse[d] = i
    return inverse
