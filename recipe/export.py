"""Export a checkpoint's model weights as a plain ``state_dict`` (loads without pitstop installed).

    python -m recipe.export outputs/runs/mine OUT.pt                 # newest complete checkpoint of a run
    python -m recipe.export outputs/runs/mine/checkpoints/step_00000500 OUT.pt --dtype bfloat16

The output holds only tensors, keyed exactly as the model's own ``state_dict()``, so e.g.
``torchvision.models.resnet18(num_classes=10).load_state_dict(torch.load(OUT, weights_only=True))`` works.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from pitstop.ckpt.layout import DCP_MARKER, SAVE_MARKER, is_complete, list_checkpoints
from pitstop.ckpt.formats import STATE_FILE
from pitstop.errors import PitstopError


def find_checkpoint(path: str) -> str:
    """A checkpoint dir, or the newest complete checkpoint under a run dir or a checkpoints dir."""
    if is_complete(path):
        return path
    for root in (os.path.join(path, "checkpoints"), path):
        complete = [p for _, p, ok in list_checkpoints(root) if ok]
        if complete:
            return complete[-1]
    raise PitstopError(f"no complete checkpoint at or under {path} (looked for step_*/{DCP_MARKER} or {SAVE_MARKER})")


def model_state(ckpt: str) -> dict[str, torch.Tensor]:
    """The model's tensors, once every file of ``ckpt`` matches its checksum (a corrupt or crafted checkpoint is
    refused in one line: nothing in it is unpickled but through a restricted unpickler)."""
    from pitstop.ckpt import integrity

    integrity.verify(ckpt)
    if os.path.isfile(os.path.join(ckpt, SAVE_MARKER)):
        from pitstop.ckpt.formats import safe_torch_load

        where = os.path.join(ckpt, STATE_FILE)
        return dict(safe_torch_load(where, where, map_location="cpu")["model"])
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from pitstop.ckpt.formats import SafeLoadPlanner, dcp_reader

    reader = dcp_reader(ckpt)
    meta = reader.read_metadata().state_dict_metadata
    prefix = "model."
    model = {
        k[len(prefix) :]: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in meta.items()
        if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)
    }
    state = {"model": model}
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    return state["model"]


def export(src: str, out: str, dtype: str | None = None) -> str:
    """Write the model weights of the checkpoint ``src`` names (a checkpoint dir, or the newest complete one under a
    run dir or a checkpoints dir) to ``out`` as a plain ``state_dict`` that ``torch.load`` reads, cast to ``dtype``
    (e.g. ``bfloat16``) if given; return the checkpoint dir it read. What ``python -m recipe.export`` runs. Every file
    of the checkpoint is checked against its checksum first: a corrupt one raises and writes nothing."""
    ckpt = find_checkpoint(src)
    sd = model_state(ckpt)
    if dtype:
        target = getattr(torch, dtype, None)
        if not isinstance(target, torch.dtype):
            raise PitstopError(f"--dtype {dtype!r} is not a torch dtype (e.g. float32, bfloat16, float16)")
        sd = {k: v.to(target) if v.is_floating_point() else v for k, v in sd.items()}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    torch.save({k: v.contiguous().clone() for k, v in sd.items()}, out)
    return ckpt


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m recipe.export", description=__doc__.split("\n")[0])
    ap.add_argument("src", help="a checkpoint dir (step_*), a run dir, or a checkpoints dir")
    ap.add_argument("out", help="output .pt file")
    ap.add_argument("--dtype", default=None, help="cast floating-point tensors, e.g. bfloat16")
    args = ap.parse_args(argv)
    try:
        import warnings

        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        ckpt = export(args.src, args.out, args.dtype)
    except PitstopError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"exported model weights of {ckpt} to {args.out}")


if __name__ == "__main__":
    main()
