"""What one training step computes: a generic supervised objective (inputs, targets) -> loss.

Nothing here knows about images: the loss and the metrics come from the config (``task.loss``,
``task.metrics``); each metric returns a *sum* over the batch, which evaluation divides by the count.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Protocol

import torch
from torch import nn

from pitstop.errors import ConfigError


class Task(Protocol):
    """The contract of a ``task``: the training loss of a batch, and the metrics of an evaluation pass.

    Any object with these two methods is a task (a protocol: no base class to inherit); ``task._target_`` names
    its class and the config's other ``task.*`` keys are its ``__init__`` arguments. :class:`Supervised` (inputs,
    targets, a loss module, metric functions) is the one pitstop ships; write your own for another objective.
    """

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The training loss of one micro-batch: a scalar tensor the loop calls ``backward()`` on.

        Called once per micro-batch, on every rank, inside the precision context (autocast) and with ``batch``
        already on the device (``batch`` is what the dataset's decode and collate made: e.g. ``(inputs,
        targets)``). It must run ``model``'s forward exactly once (under DDP/FSDP the forward takes part in the
        gradient reduction) and must not call ``backward()`` or step an optimizer: the loop does both. Return the
        loss in fp32 (cast the model's output with ``.float()``: a low-precision loss overflows under fp16)."""
        ...

    def evaluate(
        self, model: nn.Module, batches: Iterable[tuple[Any, bool]], all_reduce_sum: Callable, device: torch.device
    ) -> dict[str, float]:
        """The metrics of one evaluation pass, the same on every rank: e.g. ``{"val_loss": ..., "val_accuracy":
        ...}``: they go to ``metrics.jsonl``, the tracker and ``summary.json`` as they are named.

        Called on every rank at each evaluation (every ``trainer.eval_every_steps`` steps, else at each epoch's end,
        and after the last step). ``batches`` yields
        ``(batch, counted)`` pairs, as many on every rank: run the forward on each (a collective under DDP/FSDP)
        but score only the counted ones (the others pad a rank's share). Sum on this rank, then call
        ``all_reduce_sum(tensor)`` once on the sums (on ``device``) and divide: the result must not depend on how
        the samples were spread over the ranks. Put the model back in the mode it was in (``model.train()``), and
        compute under ``torch.no_grad()``."""
        ...


class Supervised:
    """``label_smoothing`` (``task.label_smoothing``): passed to a loss that has the option (cross-entropy)."""

    def __init__(
        self,
        loss: nn.Module,
        metrics: dict[str, Callable[..., torch.Tensor]] | None = None,
        label_smoothing: float = 0.0,
    ):
        self.loss_fn = loss
        self.metrics = dict(metrics or {})
        if (
            isinstance(label_smoothing, bool)
            or not isinstance(label_smoothing, (int, float))
            or not 0.0 <= label_smoothing < 1.0
        ):
            raise ConfigError(f"task.label_smoothing must be a number in [0, 1), got {label_smoothing!r}")
        if label_smoothing:
            if not hasattr(loss, "label_smoothing"):
                raise ConfigError(
                    f"task.label_smoothing={label_smoothing}: the loss {type(loss).__name__} has no "
                    f"label smoothing; use torch.nn.CrossEntropyLoss or set it to 0"
                )
            loss.label_smoothing = float(label_smoothing)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        # in fp32 whatever the model computes in (FSDP's bf16/fp16 policy hands back low-precision logits;
        # an fp16 loss would also overflow under the GradScaler's scale); a no-op for fp32 outputs
        return self.loss_fn(model(inputs).float(), targets)

    @torch.no_grad()
    def evaluate(
        self, model: nn.Module, batches: Iterable[tuple[Any, bool]], all_reduce_sum: Callable, device: torch.device
    ) -> dict[str, float]:
        """``batches``: ``(batch, counted)`` pairs; an uncounted (padding) batch runs the forward — a
        collective under DDP/FSDP, so every rank must run as many — but is not scored."""
        was_training = model.training
        model.eval()
        sums = torch.zeros(2 + len(self.metrics), dtype=torch.float64, device=device)  # count, loss, metrics...
        for (inputs, targets), counted in batches:
            outputs = model(inputs).float()
            if not counted:
                continue
            n = targets.shape[0]
            sums[0] += n
            sums[1] += self.loss_fn(outputs, targets).double() * n
            for j, fn in enumerate(self.metrics.values()):
                sums[2 + j] += fn(outputs, targets).double()
        model.train(was_training)
        sums = all_reduce_sum(sums)
        count = max(sums[0].item(), 1.0)
        out = {"val_loss": sums[1].item() / count, "val_samples": sums[0].item()}
        out.update({f"val_{name}": sums[2 + j].item() / count for j, name in enumerate(self.metrics)})
        return out


def abs_error_sum(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of absolute errors (``task=regression``'s ``val_mae`` once the evaluator divides by the count)."""
    return (outputs.reshape(targets.shape) - targets).abs().sum()
