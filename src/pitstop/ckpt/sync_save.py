"""``ckpt=sync_save``: the baseline — rank 0 gathers the full state and ``torch.save``s one file, in the loop."""

from __future__ import annotations

from pitstop.ckpt.contract import Pending, SaveRecord
from pitstop.ckpt.manager import CheckpointManager
from pitstop.ckpt.formats import write_torch_save


class SyncSave(CheckpointManager):
    name = "sync_save"
    full_state = True

    def _write(self, app_state: dict, record: SaveRecord) -> Pending | None:
        write_torch_save(
            app_state, record.path, self.rank, self.world_size, self.group, record.step, record.throttle_mbps
        )
        self.strategy.barrier()  # committed on every rank only once rank 0 wrote the marker
        return None
