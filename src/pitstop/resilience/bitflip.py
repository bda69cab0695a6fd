"""``fault=bitflip``: silent data corruption on purpose. After step ``step``'s optimizer update, one exponent bit of one
parameter element flips on rank ``rank`` (a bad DIMM, a faulty core), once per run dir (``RUN_DIR/faults.jsonl``
remembers it, so the replay after a rollback or a restart does not flip it again). Nothing fails: the run trains on
the corrupted replica until ``trainer.sdc`` compares the replicas (``pitstop.train.sdc``)."""

from __future__ import annotations

import logging

import torch

from pitstop.errors import ConfigError
from pitstop.resilience.fault import FaultContext, NoFault, check_step
from pitstop.resilience.fault_record import first_time

log = logging.getLogger("pitstop.resilience.fault")

# a floating dtype's (mantissa bits, exponent bits, the integer of its width)
LAYOUT = {
    torch.float32: (23, 8, torch.int32),
    torch.float64: (52, 11, torch.int64),
    torch.bfloat16: (7, 8, torch.int16),
    torch.float16: (10, 5, torch.int16),
}


def flip_exponent_bit(t: torch.Tensor, bit: int) -> tuple[float, float]:
    """Flip exponent bit ``bit`` (0: its lowest) of ``t``'s first element, in place; (before, after)."""
    mantissa, exponent, kind = LAYOUT[t.dtype]
    if not 0 <= bit < exponent:
        raise ValueError(f"{t.dtype} has {exponent} exponent bits, not bit {bit}")
    first = (0,) * t.dim()
    with torch.no_grad():
        before = float(t[first])
        ints = t.view(kind)
        ints[first] = ints[first] ^ (1 << (mantissa + bit))  # (below the sign bit: it fits the width)
        return before, float(t[first])


def first_parameter(model: torch.nn.Module) -> tuple[str, torch.Tensor]:
    """The first floating parameter of ``model`` (the one the fault corrupts), named."""
    for name, p in model.named_parameters():
        if p.dtype in LAYOUT and p.numel():
            return name, p
    raise ConfigError("fault=bitflip: the model has no floating-point parameter to corrupt")


class BitflipAtStep(NoFault):
    """Rank ``rank`` flips exponent bit ``bit`` of its first parameter's first element after step ``step``."""

    name = "bitflip"

    def __init__(self, step: int, rank: int = 0, bit: int = 0, replica: int | str | None = None):
        self.replica = replica
        self.step, self.rank, self.bit = int(step), rank, int(bit)

    def bind(self, ctx: FaultContext) -> None:
        super().bind(ctx)
        check_step(self.step, ctx)
        if ctx.model is None:
            raise ConfigError("fault=bitflip corrupts a parameter: it needs the model (a Runner's run)")
        self.param = first_parameter(ctx.model)
        bits = LAYOUT[self.param[1].dtype][1]
        if not 0 <= self.bit < bits:
            raise ConfigError(
                f"fault.bit={self.bit} but {self.param[0]} is {str(self.param[1].dtype).replace('torch.', '')}, "
                f"whose exponent has {bits} bits; use 0..{bits - 1}"
            )

    def key(self) -> str:
        return f"{self.name}@{self.step}"

    def after_step(self, step: int) -> None:
        if step == self.step and self.ctx.rank == self.rank and first_time(self.ctx.run_dir, self.key()):
            name, p = self.param
            before, after = flip_exponent_bit(p.data, self.bit)
            log.warning(
                "fault injection: rank %d flips exponent bit %d of %s's first element after step %d (%.6g -> %.6g)",
                self.rank,
                self.bit,
                name,
                step,
                before,
                after,
            )
