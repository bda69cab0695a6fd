"""``strategy=ddp``: DistributedDataParallel — one process per device (or per CPU share), gloo/nccl.

Two gloo groups besides the training group: DCP's collectives (an async save runs them in a background thread)
on one, this process's own small ones (the resume choice's broadcast, save barriers, ``any``) on the other. A save
cannot deadlock against gradient all-reduces, nor against the main thread's collectives.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import random
import socket
import time
from datetime import timedelta
from typing import Callable, ContextManager, TypeVar

import torch

import torch.distributed as dist
from torch import nn

from pitstop.errors import PitstopError
from pitstop.strategy.single import Single

T = TypeVar("T")
log = logging.getLogger("pitstop.strategy")


class DDP(Single):
    name = "ddp"
    replicated = True

    def __init__(
        self,
        nproc_per_node: int = 2,
        backend: str = "auto",
        timeout: float = 300,
        device: str = "auto",
        cpu_threads: int | str | None = "auto",
        **launch_keys: object,
    ):
        """``launch_keys``: the keys of ``strategy=ddp`` that say how the job is launched (``max_restarts``,
        ``nnodes``, ``rdzv_endpoint``, ``master_port``, ``last_call_seconds``, ``oversubscribe``): the launcher
        reads them, typed, from the same config node (``pitstop.launch.plan``); the strategy does not use them.
        Their defaults live in the DDP schema (``pitstop.config.schema``)."""
        super().__init__(device=device, cpu_threads=cpu_threads)
        self.nproc_per_node, self.backend, self.timeout = int(nproc_per_node), backend, float(timeout)
        self._ckpt_group: dist.ProcessGroup | None = None
        self._control_group: dist.ProcessGroup | None = None

    def set_cpu_threads(self) -> None:
        """The node's cores, shared by its ranks (whoever launched them: our agent, torchrun, SLURM)."""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        torch.set_num_threads(self.cpu_threads or max(1, (os.cpu_count() or 1) // local))

    def setup(self) -> None:
        self.rank = int(os.environ.get("RANK", 0))
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        super().setup()
        cuda = self.device.type == "cuda"
        backend = self.backend if self.backend != "auto" else ("cpu:gloo,cuda:nccl" if cuda else "gloo")
        if not dist.is_initialized():
            dist.init_process_group(
                backend,
                timeout=timedelta(seconds=self.timeout),
                store=self._store(),
                rank=self.rank,
                world_size=self.world_size,
            )
            self._owns_group = True
        # Two gloo groups beside the training one: DCP's collectives (an async save runs them in a background
        # thread), and this process's own small ones (broadcast_object, any, barrier: the main thread). On one
        # group, the two threads' collectives would pair up in a different order on different ranks: a hang
        # (seen as an eval's broadcast waiting forever while a save's gather waited for it, ddp(4) on 2 cores).
        timeout = timedelta(seconds=self.timeout)
        self._ckpt_group = dist.new_group(backend="gloo", timeout=timeout)
        self._control_group = dist.new_group(backend="gloo", timeout=timeout)
        log.info("rank %d/%d on %s, backend %s", self.rank, self.world_size, self.device, backend)

    def _store(self) -> dist.Store:
        """The rendezvous store, namespaced per elastic restart attempt.

        After an in-job restart the agent's store still holds the previous attempt's keys (e.g. the old
        rank 0's gloo address), so each attempt gets its own prefix. That prefix (the agent's restart count)
        cannot tell rounds apart when nodes join later (a new agent counts from 0): a launch over several
        nodes (``strategy.nnodes``) therefore gets a fresh store per round instead
        (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: rank 0 hosts it). So does a launch on one node, whose agent
        names loopback as the ranks' address: rank 0's store then listens on loopback alone (the agent's own
        shared store would listen on every interface).
        """
        timeout = timedelta(seconds=self.timeout)
        if "MASTER_ADDR" not in os.environ:  # one process without a launcher: a world of one
            return loopback_store(0, 1, timeout)
        use_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        hosts = not use_agent and self.rank == 0
        if hosts and is_loopback(host):  # (a job on one machine: the launcher named loopback, see launch/elastic.py)
            return loopback_store(port, self.world_size, timeout)
        if not use_agent and not hosts:  # (rank 0's fresh store may not listen yet: see wait_listening)
            t0 = time.monotonic()
            if not wait_listening(host, port, self.timeout, self.world_size):  # (TCPStore's own error, in what is
                timeout = timedelta(seconds=max(1.0, self.timeout - (time.monotonic() - t0)))  # left of the timeout)
        store = dist.TCPStore(host, port, self.world_size, is_master=hosts, timeout=timeout)
        if not use_agent:  # our rank 0 hosts a fresh store for this rendezvous round: no stale keys
            return store
        return dist.PrefixStore(f"pitstop/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)

    def wrap(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        ids = [self.device.index] if self.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)

    def watch_gradients(self, model: nn.Module, ready: Callable[[], None]) -> bool:
        """A hook on each parameter, after its gradient is accumulated on this rank (as DDP's own reducer marks it
        ready for its bucket): the last call of a backward is when the last bucket is ready and this rank's own work
        is done. DDP's communication is untouched (its own reducer: the same steps, bitwise). On CUDA ``ready()``
        runs as the gradient's kernels are queued, on the stream they run on (a CUDA event recorded there times
        them)."""
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda _: ready())
        return True

    def no_sync(self, model: nn.Module) -> ContextManager:
        return model.no_sync()  # DDP's own: gradients accumulate locally, the next synced backward reduces them

    def sync_buffers(self, model: nn.Module) -> None:
        """Give every rank rank 0's buffers (e.g. BatchNorm statistics) before they are saved.

        DDP broadcasts rank 0's buffers at the start of every forward anyway, so this changes nothing
        in training; it makes the saved copy (DCP writes one copy of replicated tensors, from any rank)
        the one rank 0 would have used, which exact resume needs.
        """
        with torch.no_grad(), self.collectives.enter("sync_buffers"):
            for b in model.buffers():
                dist.broadcast(b, src=0)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        with self.collectives.enter("all_reduce_sum"):
            dist.all_reduce(t)
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        with self.collectives.enter("all_gather"):
            dist.all_gather(out, t)
        return out

    def all_gather_object(self, obj: object) -> list[object]:
        out: list[object] = [None] * self.world_size
        with self.collectives.enter("all_gather_object"):
            dist.all_gather_object(out, obj, group=self._control_group)
        return out

    def ckpt_group(self) -> dist.ProcessGroup | None:
        return self._ckpt_group

    def init_local_group(self, store_path: str) -> None:
        pass  # already in a process group

    def broadcast_object(self, obj: T, src: int = 0) -> T:
        box = [obj]
        with self.collectives.enter("broadcast_object"):
            dist.broadcast_object_list(box, src=src, group=self._control_group)
        return box[0]

    def any(self, flag: bool) -> bool:
        t = torch.tensor([int(bool(flag))])
        with self.collectives.enter("any"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._control_group)
        return bool(t.item())

    def barrier(self) -> None:
        with self.collectives.enter("barrier"):
            dist.barrier(group=self._control_group)

    def teardown(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address or ``localhost`` (a name is not looked up)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def wait_listening(host: str, port: int, timeout: float, world_size: int) -> bool:
    """Wait until ``host:port`` (rank 0's store of this rendezvous round) accepts a connection, at most ``timeout`` s;
    whether it does (False: it did not within the timeout, or the host cannot be reached: TCPStore's own error
    follows). A rank that asks TCPStore to connect before rank 0 listens is put off by TCPStore's own
    back-off (~0.5 s, then ~1 s, measured on torch 2.14) though rank 0 may listen a few ms later: every start and
    restart of a job whose ranks do not all start at once paid it (up to 0.7 s of a 1.5 s recovery,
    ``bench/peer_restore.py``). Its own connection is made after this one succeeded: at once.

    A connection refused, reset or timed out is tried again every ``world_size / 10,000`` s (at least 0.01 s,
    jittered): the probes stay under ~10,000 a second; a job of more than 10,000 ranks is left to TCPStore's own
    back-off (it spreads its ranks' connects too: True at once). Anything else (a host that does not resolve or cannot
    be reached) returns at once: TCPStore's own error names it, as before."""
    if world_size > 10_000:
        return True
    every = max(0.01, world_size / 10_000)
    address = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # ("[::1]": an IPv6 literal)
    t0 = time.monotonic()
    while True:
        try:
            socket.create_connection((address, port), timeout=max(every, 0.1)).close()
            return True
        except (ConnectionRefusedError, ConnectionResetError, TimeoutError):  # (socket.timeout is TimeoutError)
            pause = every * random.uniform(0.5, 1.5)
            if time.monotonic() - t0 + pause > timeout:
                return False
            time.sleep(pause)
        except OSError:
            return False


def loopback_store(port: int, world_size: int, timeout: timedelta, wait_for_workers: bool = True) -> dist.TCPStore:
    """A ``TCPStore`` server on ``127.0.0.1:port`` (0: a free port) that listens on loopback alone. (TCPStore's own
    server listens on every interface whatever host it is given: it is handed a socket bound to loopback instead,
    which it owns from then on.) A port that is taken is one line naming it."""
    try:
        listening = socket.create_server(("127.0.0.1", port), backlog=socket.SOMAXCONN)
    except OSError as e:
        raise PitstopError(
            f"cannot listen on 127.0.0.1:{port} for the job's store ({e.strerror}): is it taken?"
        ) from None
    try:
        store = dist.TCPStore(
            "127.0.0.1",
            listening.getsockname()[1],
            world_size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=wait_for_workers,
            master_listen_fd=listening.fileno(),
        )
    except BaseException:
        listening.close()
        raise
    listening.detach()
    return store
