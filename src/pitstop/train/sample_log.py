"""``samples.rank{R}.jsonl`` (``data.record_sample_ids``): per attempt a header (read by ``python -m
pitstop.audit``), then each step's sample keys, so that exactly-once can be proved from the run dir."""

from __future__ import annotations

import json
import os
from typing import Callable


class SampleLog:
    def __init__(self, run_dir: str, rank: int, attempt_id: float, accum: int, where: Callable[[], tuple[int, int]]):
        """``attempt_id``: rank 0's clock at its setup, the same on every rank; ``where()``: the step being
        taken and its micro-batch."""
        self.attempt_id, self.rank = attempt_id, rank
        self.file = open(os.path.join(run_dir, f"samples.rank{rank}.jsonl"), "a", buffering=1 << 16)
        f = self.file
        if accum == 1:
            self.write = lambda keys: f.write(f'{{"step":{where()[0]},"keys":{keys!r}}}\n'.replace("'", '"'))
        else:  # which micro-batch of the step
            self.write = lambda keys: f.write(
                f'{{"step":{where()[0]},"micro":{where()[1]},"keys":{keys!r}}}\n'.replace("'", '"')
            )

    def header(self, resumed_from: int | None, world_size: int, epoch_samples: int, epochs: int | None) -> None:
        """This attempt: where it resumed, its world, what an epoch holds."""
        head = {
            "attempt": self.attempt_id,
            "resumed_from": resumed_from or 0,
            "rank": self.rank,
            "world_size": world_size,
            "epoch_samples": epoch_samples,
            "epochs": epochs,
        }
        self.file.write(json.dumps(head) + "\n")

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()
