"""``samples.rank{R}.jsonl`` (``data.record_sample_ids``): per attempt a header (read by ``python -m
pitstop.audit``), then each step's sample keys, so that exactly-once can be proved from the run dir."""

from __future__ import annotations

import json
import os
import time
from typing import Callable


class SampleLog:
    def __init__(
        self,
        run_dir: str,
        rank: int,
        attempt_id: float,
        accum: int,
        where: Callable[[], tuple[int, int]],
        quorum: Callable[[], int] | None = None,
        epoch: Callable[[], int] | None = None,
    ):
        """``attempt_id``: rank 0's clock at its setup, the same on every rank; ``where()``: the step being
        taken and its micro-batch. ``quorum()`` (``strategy=ft``): the id of the step's quorum of replica
        groups, written with its keys; each step's lines are then on disk before its gradients leave (a peer
        commits a step this group may not live to write down). ``epoch()``: the epoch of the micro-batch being
        written, written with it where a step takes several (one may run into the next epoch)."""
        self.attempt_id, self.rank = attempt_id, rank
        self.file = open(os.path.join(run_dir, f"samples.rank{rank}.jsonl"), "a", buffering=1 << 16)
        f = self.file

        def micro() -> str:  # which micro-batch of the step, and its epoch
            return f'"micro":{where()[1]},"epoch":{epoch()},' if accum > 1 and epoch is not None else ""

        # The keys as JSON whatever they hold (a tar member named o'brien, a quote, a backslash, a newline, a lone
        # surrogate of an undecodable name): ASCII escapes, so the line is JSON in any locale. (The rest of the line
        # is numbers, formatted directly: this runs every step.)
        keys_json = json.JSONEncoder(ensure_ascii=True).encode
        if quorum is not None:

            def write(keys: list[str]) -> None:
                f.write(f'{{"step":{where()[0]},{micro()}"quorum":{quorum()},"keys":{keys_json(keys)}}}\n')
                f.flush()

            self.write = write
        elif accum == 1:
            self.write = lambda keys: f.write(f'{{"step":{where()[0]},"keys":{keys_json(keys)}}}\n')
        else:
            self.write = lambda keys: f.write(f'{{"step":{where()[0]},{micro()}"keys":{keys_json(keys)}}}\n')

    def header(
        self, resumed_from: int | None, world_size: int, epoch_samples: int, epochs: int | None, healed: bool = False
    ) -> None:
        """This attempt: where it resumed, its world, what an epoch holds; ``healed``: it resumed from a live
        peer's state (``strategy=ft``), so it rolled nobody back."""
        head = {
            "attempt": self.attempt_id,
            "resumed_from": resumed_from or 0,
            "rank": self.rank,
            "world_size": world_size,
            "epoch_samples": epoch_samples,
            "epochs": epochs,
            "t": round(time.time(), 3),  # (after the restore or the heal: when the resume point was decided)
        }
        if healed:
            head["healed"] = True
        self.file.write(json.dumps(head) + "\n")

    def outcome(self, step: int, committed: bool, quorum: int) -> None:
        """(``strategy=ft``) whether the keys written for ``step`` were consumed: False, the step was discarded."""
        t = round(time.time(), 3)
        self.file.write(f'{{"commit":{step},"ok":{str(committed).lower()},"quorum":{quorum},"t":{t}}}\n')
        self.file.flush()

    def skipped(self, step: int, epoch: int, why: str) -> None:
        """The keys written last for ``step`` were skipped, not consumed: its update was not applied."""
        line = {"skip": step, "epoch": epoch, "why": why, "t": round(time.time(), 3)}
        self.file.write(json.dumps(line) + "\n")

    def rolled_back(self, to: int, frm: int, keep_data: bool, epochs: dict[int, int], why: str) -> None:
        """Steps ``to``+1..``frm`` of this attempt were rolled back: their keys were skipped (``keep_data``: the
        data position stayed where it was) or will be taken again; ``epochs``: each of those steps' epoch."""
        line = {
            "rollback": to,
            "from": frm,
            "keep_data": keep_data,
            "epochs": {str(s): e for s, e in epochs.items() if to < s <= frm},
            "why": why,
            "t": round(time.time(), 3),
        }
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()
