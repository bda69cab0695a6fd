"""Two real gloo ranks: an async save's collectives (DCP's, in a background thread, on the checkpoint group) and
the main thread's own (``strategy.any``, ``broadcast_object``, ``barrier``) never pair up with each other, whatever
order each rank issues them in. On one shared group they did: an eval's broadcast waited for good while a save's
gather waited for it (ddp(4) on 2 cores, about one attempt in three)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ranks
from pitstop.strategy.ddp import DDP

pytestmark = pytest.mark.slow


def _rank(rank: int, port: int, out) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK="0")
    s = DDP(nproc_per_node=2, timeout=15, device="cpu", cpu_threads=1)
    s.setup()
    got = {}

    def save() -> None:  # what DCP's async save does in its thread: collectives on the checkpoint group
        t = torch.tensor([10 + rank])
        dist.all_reduce(t, group=s.ckpt_group())
        got["save"] = int(t.item())

    thread = threading.Thread(target=save)
    if rank == 0:  # rank 0: the save's collective first, then the loop's; rank 1: the other way round
        thread.start()
        thread.join(timeout=1)  # (it waits for rank 1's part, which comes only after rank 1's own collectives)
    got["any"] = s.any(rank == 1)
    got["object"] = s.broadcast_object({"from": rank})
    if rank == 1:
        thread.start()
    thread.join()
    s.barrier()
    out.put((rank, got))
    s.teardown()


def test_a_background_saves_collectives_and_the_loops_own_never_pair_up(tmp_path):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in (0, 1)]
    results = ranks.results(procs, out, 60)  # (on one shared group: a hang)
    for r in (0, 1):
        assert results[r] == {"save": 21, "any": True, "object": {"from": 0}}, results
