"""``params_sha256``: a digest of a model's full state in canonical key order; ``replica_digest``: the cheap one that
data-parallel replicas compare (``trainer.sdc``)."""

from __future__ import annotations

import hashlib

import torch


def state_sha256(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(state):
        t = state[key]
        if not isinstance(t, torch.Tensor):
            continue
        t = t.detach().to("cpu").contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def model_sha256(model: torch.nn.Module) -> str:
    """The digest of a (possibly wrapped or sharded) model's full parameters and buffers, the same on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state_sha256(sd)


# ---- the replicas' cheap digest (trainer.sdc) ----------------------------------------------------------------
_AS_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_sum(t: torch.Tensor) -> torch.Tensor:
    """One int64 of ``t``: the sum of its elements' bit patterns read as integers of their width, wrapping (on its
    device, one pass, no copy: an accumulator of the elements' own width is what CPUs sum fastest, 1.5 ms for 11 M
    float32 against 43 ms with an int64 one). A flipped bit changes it by a power of two below the wrap, so one
    flip always shows; it is no hash (two changes can cancel, a permutation does not show), which a check between
    replicas that should be bitwise equal does not need."""
    t = t.detach()
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=t.device)
    size = t.element_size()
    if size not in _AS_INT or t.is_complex():
        t, size = t.reshape(-1).view(torch.uint8), 1  # (complex, or an odd size: its bytes)
    kind = _AS_INT[size]
    return t.view(kind).sum(dtype=kind).to(torch.int64)


def replica_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """What replicas of a data-parallel model hold bitwise equal after every step, named: its parameters and the
    optimizer's state of each (not buffers: BatchNorm's statistics follow each rank's own batch)."""
    out = [(name, p) for name, p in model.named_parameters()]
    names = {id(p): name for name, p in out}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for k, v in sorted(optimizer.state.get(p, {}).items()):
                if isinstance(v, torch.Tensor):
                    out.append((f"optimizer.{names.get(id(p), '?')}.{k}", v))
    return out


def replica_digest(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The digest of each tensor (:func:`bits_sum`), as one int64 vector on their device."""
    if not tensors:
        return torch.zeros(0, dtype=torch.int64)
    return torch.stack([bits_sum(t) for t in tensors])


def odd_ones_out(digests: list[list[int]]) -> tuple[list[int], list[int] | None]:
    """Ranks whose digest differs from the majority's, and the majority's digest; with no strict majority (two
    ranks that differ, or a tie) no rank can be named: ``([], None)``. Agreement: ``([], the digest)``."""
    counts: dict[tuple[int, ...], int] = {}
    for d in digests:
        counts[tuple(d)] = counts.get(tuple(d), 0) + 1
    best, n = max(counts.items(), key=lambda kv: kv[1]) if counts else ((), 0)
    if n * 2 <= len(digests) and len(counts) > 1:
        return [], None
    return [r for r, d in enumerate(digests) if tuple(d) != best], list(best)


def differing(digests: list[list[int]], names: list[str], limit: int = 3) -> list[str]:
    """The names of the tensors whose digests are not the same on every rank (at most ``limit``)."""
    out = [names[i] for i in range(len(names)) if len({d[i] for d in digests}) > 1]
    return out[:limit]


def worst_element(kept: list[torch.Tensor], now: list[torch.Tensor]) -> tuple[int, int]:
    """Where ``kept`` (a rank's tensors at a detection) is farthest from ``now`` (the same tensors, replayed): (the
    tensor's index, the element's flat index), the difference taken over the largest magnitude of its tensor."""
    best, where = -1.0, (0, 0)
    for t, (a, b) in enumerate(zip(kept, now)):
        if a.numel() == 0:
            continue
        diff = (a.detach().to(b.device, torch.float64) - b.detach().to(torch.float64)).abs().reshape(-1)
        diff = torch.nan_to_num(diff, nan=float("inf"))
        i = int(diff.argmax())
        score = float(diff[i]) / max(float(b.detach().abs().max()), 1e-30)
        if score > best:
            best, where = score, (t, i)
    return where


def deviation_at(kept: list[torch.Tensor], now: list[torch.Tensor], where: tuple[int, int]) -> float:
    """How far element ``where`` (:func:`worst_element`) of ``kept`` is from ``now``'s (inf when not finite)."""
    t, i = where
    a, b = kept[t].detach().reshape(-1)[i], now[t].detach().reshape(-1)[i]
    d = abs(float(a) - float(b))
    return d if d == d else float("inf")


def named_by_replay(deviations: list[list[float]], factor: float = 10.0) -> list[int]:
    """``deviations[r][j]``: how far rank ``r``'s element at rank ``j``'s worst place is from the replay. Rank ``j``
    is named when its own worst element is at least ``factor`` times farther from the replay than the other ranks'
    same element: a flipped bit is its rank's alone, while what the averaged gradients carried is every rank's."""
    out = []
    for j in range(len(deviations)):
        mine = deviations[j][j]
        others = max((deviations[r][j] for r in range(len(deviations)) if r != j), default=0.0)
        if mine > 0 and mine >= factor * others:
            out.append(j)
    return out
