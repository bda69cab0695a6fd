"""``strategy=ft``: replica groups joined by torchft, so that healthy groups keep training when one dies.

Each replica group is one process, or ``strategy.nproc_per_node`` ranks joined by their own process group (inside a
group: ``strategy.inner=ddp``, DistributedDataParallel, or ``fsdp``, FSDP2: HSDP); every rank has its own
``torchft.Manager``, and rank ``r`` of each group all-reduces with rank ``r`` of the others. Every step:

    begin_step()        the step's quorum at the Lighthouse: which groups take part, this group's place among
                        them; a group that is behind (new, or its last step failed) heals here from a live peer
    (fetch + forward/backward: this group's share of the step, see ``pitstop.data.loader.replica``)
    reduce_gradients()  one all-reduce (average) of the gradients over the groups of the quorum (Gloo); inside a
                        group of several ranks, DDP's backward averaged them over the group's ranks first (FSDP's
                        reduce-scattered them: rank r all-reduces its shard with rank r of the other groups)
    commit()            torchft's should_commit: False if a collective of this step failed (a peer died) --
                        the step is discarded, nothing changes, the loop goes on; True: the optimizer steps

A peer's death costs a healthy group the step in flight and a pause of about the Lighthouse's heartbeat timeout
(``strategy.heartbeat_ms``); the dead group's launcher restarts it alone and it heals from a peer's live state
(model, optimizer, step, data position, RNGs) over torchft's checkpoint transport: no checkpoint file is read.
A group of several ranks restarts all of them (its own elastic agent), and each heals from the same rank of a peer.

A heal's state travels over :class:`~pitstop.strategy.heal_transport.RawHTTPTransport` (raw tensor bytes and a JSON
manifest, authenticated by the job's secret ``PITSTOP_FT_SECRET``; torchft's default transport unpickles what it
receives). When the whole job is on this machine (its Lighthouse on loopback), every socket a group listens on is
bound to loopback: torchft's manager server, the group's store, the heal transport (Gloo's, through
``GLOO_SOCKET_IFNAME=lo``, which the launcher sets).

This module is the ``Strategy``: the group's own ranks (the inner strategy), the torchft ``Manager`` it builds and
tears down. The hooks above, the quorum, the heal and the commit, are :class:`~pitstop.strategy.ft_quorum.Quorums`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch import nn
from torch.distributed import TCPStore

from pitstop.errors import ConfigError
from pitstop.strategy.base import Collectives, Strategy
from pitstop.strategy.groups import ReplicaGroups
from pitstop.strategy.ft_keys import SECRET_ENV, check_keys, on_loopback
from pitstop.strategy.ft_quorum import Quorums, _SeenQuorums
from pitstop.strategy.ddp import DDP
from pitstop.strategy.single import Single, cpu_threads_key

if TYPE_CHECKING:
    from torchft import Manager

log = logging.getLogger("pitstop.strategy")


def lighthouse_url(address: str) -> str:
    """``HOST:PORT`` (or a URL) -> the URL torchft's clients take."""
    return address if "://" in address else f"http://{address}"


class FT(Strategy, Quorums):
    name = "ft"

    def __init__(
        self,
        *,
        replicas: int,
        replica_id: int | None,
        lighthouse: str | None,
        min_replicas: int,
        inner: str,
        nproc_per_node: int,
        backend: str,
        oversubscribe: bool,
        shard: Any,
        reshard_after_forward: bool,
        mixed_precision: str | None,
        timeout: float,
        heartbeat_ms: int,
        quorum_timeout: float,
        max_restarts: int,
        cpu_threads: Any,
        device: str,
    ):
        """Every key of ``strategy=ft`` (the FT schema, ``pitstop.config.schema``, holds their defaults and meaning)."""
        check_keys(replicas, replica_id, min_replicas, inner, nproc_per_node)
        self.cpu_threads = cpu_threads_key(cpu_threads)
        self.nproc_per_node = int(nproc_per_node)
        # inside the group: one process, or its ranks under DDP or FSDP2 (HSDP: sharded inside the group, replicated
        # across groups); their own process group, whose collectives (the checkpoint's too) wait at least a minute: a
        # rank that died ends the others at once, a stalled one is the watchdog's
        group = dict(
            nproc_per_node=nproc_per_node,
            backend=backend,
            timeout=max(60.0, float(timeout)),
            device=device,
            cpu_threads=cpu_threads,
        )
        self.inner: Single
        if inner == "fsdp":
            from pitstop.strategy.fsdp import FSDP

            self.inner = FSDP(shard, reshard_after_forward, mixed_precision, **group)
        elif self.nproc_per_node > 1:
            self.inner = DDP(**group)
        else:
            self.inner = Single(device=device, cpu_threads=cpu_threads)
        self._init_quorums(replicas, replica_id, min_replicas, timeout, quorum_timeout, heartbeat_ms)
        self.lighthouse = lighthouse
        self.manager: Manager | None = None
        self._store: TCPStore | None = None

    @property
    def groups(self) -> ReplicaGroups:
        """This strategy is the job's replica groups too: the Runner holds it as its ``ReplicaGroups``."""
        return self

    # ---- the group's own ranks: the inner strategy's --------------------------------------------------
    @property
    def rank(self) -> int:  # type: ignore[override]
        return self.inner.rank

    @property
    def local_rank(self) -> int:  # type: ignore[override]
        return self.inner.local_rank

    @property
    def world_size(self) -> int:  # type: ignore[override]
        """The ranks of this group (the job has ``strategy.replicas`` such groups)."""
        return self.inner.world_size

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self.inner.device

    @property
    def compute_dtype(self) -> torch.dtype | None:  # type: ignore[override]
        return self.inner.compute_dtype

    @property
    def channels_last_params(self) -> bool:  # type: ignore[override]
        return self.inner.channels_last_params

    @property
    def collectives(self) -> Collectives:  # type: ignore[override]
        """The group's own ranks' count (the inner strategy's collectives; a hang report compares the group's ranks)."""
        return self.inner.collectives

    def share_cores(self, loader_workers: int) -> None:
        self.inner.share_cores(loader_workers)

    def to_device(self, batch: Any) -> Any:
        return self.inner.to_device(batch)

    def no_sync(self, model: nn.Module) -> Any:
        return self.inner.no_sync(model)

    def sync_buffers(self, model: nn.Module) -> None:
        self.inner.sync_buffers(model)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return self.inner.all_reduce_sum(t)

    def ckpt_group(self) -> Any:
        return self.inner.ckpt_group()

    def init_local_group(self, store_path: str) -> None:
        self.inner.init_local_group(store_path)

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return self.inner.all_gather(t)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.inner.all_gather_object(obj)

    def watch_gradients(self, model: nn.Module, ready: Callable[[], None]) -> bool:
        return self.inner.watch_gradients(model, ready)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.inner.broadcast_object(obj, src)

    def any(self, flag: bool) -> bool:
        return self.inner.any(flag)

    def barrier(self) -> None:
        self.inner.barrier()

    def setup(self) -> None:
        if self.inner.requested == "auto" and torch.cuda.is_available() and self.replica_id is not None:
            count, wanted = torch.cuda.device_count(), self.replicas * self.nproc_per_node
            if count >= wanted:  # a GPU for every rank of every group: group K takes its own
                local = int(os.environ.get("LOCAL_RANK", 0))
                self.inner.requested = f"cuda:{self.replica_id * self.nproc_per_node + local}"
        if self.cpu_threads is None:  # this machine's cores, shared by every rank of the groups started here
            cores = os.cpu_count() or 1
            self.inner.cpu_threads = max(1, cores // (self.replicas * self.nproc_per_node))
        self.inner.setup()  # the device; with several ranks, the group's process group
        if self.replica_id is None or not self.lighthouse:
            raise ConfigError(
                "strategy=ft: this process is no replica group (strategy.replica_id and strategy.lighthouse are "
                "unset): start the job with python -m recipe.train strategy=ft, which starts the groups"
            )
        # (the one PITSTOP_* variable read below launch/: a secret must not travel in the config, and LaunchFacts
        # does not carry it yet; pitstop's launcher sets it for the processes it starts. A job of one group has no
        # peer to heal from or to serve: a secret of its own, known to nobody else, does.)
        secret = os.environ.get(SECRET_ENV, "") or (secrets.token_hex(32) if self.replicas == 1 else "")
        if not secret:
            raise ConfigError(
                f"strategy=ft: {SECRET_ENV} is not set (the job's secret: a heal's state is served only to a group "
                f"that has it); the launcher makes one; for several machines export the same value on each"
            )
        try:
            from torchft import Manager, ProcessGroupGloo
        except ImportError as e:
            raise ConfigError(f"strategy=ft needs torchft ({e}): pip install -e '.[ft]'") from None
        from pitstop.strategy.heal_transport import RawHTTPTransport

        timeout = timedelta(seconds=self.timeout)
        self._started_ms = int(time.time() * 1000)
        # one machine (the Lighthouse on loopback): every socket below listens on loopback alone
        local = on_loopback(lighthouse_url(str(self.lighthouse)))
        # the group's store for torchft (its manager's address, its replica id): hosted by the group's rank 0 on a
        # free port of loopback (the group's ranks share a machine), made known to the others over the group's
        # process group (no key of an earlier attempt). (TCPStore's own server listens on every interface whatever
        # its host: it is handed a socket listening on loopback, which it owns from then on.)
        if self.rank == 0:
            listening = socket.create_server(("127.0.0.1", 0), backlog=socket.SOMAXCONN)
            self._store = TCPStore(
                "127.0.0.1",
                listening.getsockname()[1],
                is_master=True,
                wait_for_workers=False,
                master_listen_fd=listening.fileno(),
            )
            listening.detach()
        port = self.inner.broadcast_object(self._store.port if self.rank == 0 else None)
        transport = RawHTTPTransport(secret, timeout, bind_host="127.0.0.1" if local else "::")
        try:
            with _manager_server_on("127.0.0.1" if local else None):
                self.manager = Manager(
                    pg=ProcessGroupGloo(timeout=timeout),
                    load_state_dict=None,
                    state_dict=None,
                    min_replica_size=self.min_replicas,
                    use_async_quorum=False,  # the step's data share depends on the quorum: known before the fetch
                    timeout=timeout,
                    quorum_timeout=timedelta(seconds=self.quorum_timeout),
                    connect_timeout=timeout,
                    rank=self.rank,
                    world_size=self.world_size,
                    store_addr="127.0.0.1",
                    store_port=int(port),
                    lighthouse_addr=lighthouse_url(str(self.lighthouse)),
                    replica_id=f"replica{self.replica_id}:{self._code}:{self._started_ms}",  # torchft adds :{uuid}
                    heartbeat_interval=timedelta(milliseconds=max(10, self.heartbeat_ms // 5)),
                    init_sync=False,  # every group starts from the same seeded parameters
                    checkpoint_transport=transport,
                    **({"hostname": "127.0.0.1"} if local else {}),  # (what its peers reach its manager by)
                )
        except Exception as e:  # noqa: BLE001 - torchft raises RuntimeError for an unreachable Lighthouse
            transport.shutdown(wait=False)
            raise ConfigError(
                f"strategy.lighthouse={self.lighthouse} cannot be reached within strategy.timeout={self.timeout:g}s "
                f"({str(e).splitlines()[0][:200]}): start the job's Lighthouse or fix the address"
            ) from None
        from torchft.manager import REPLICA_ID_KEY

        self._full_id = self.manager._store.get(REPLICA_ID_KEY).decode()  # (rank 0's, with torchft's uuid)
        self._started_ms = int(self._full_id.split(":")[2])  # (every rank of the group decides as its rank 0)
        self.manager._client = _SeenQuorums(self.manager._client, self._check_peers)
        log.info(
            "replica group %d of %d (%d rank%s), Lighthouse %s",
            self.replica_id,
            self.replicas,
            self.world_size,
            "s" if self.world_size > 1 else "",
            self.lighthouse,
        )

    # ---- the model and the end -------------------------------------------------------------------------
    def wrap(self, model: nn.Module) -> nn.Module:
        self._model = self.inner.wrap(model)
        return self._model

    def teardown(self) -> None:
        if self.manager is not None:
            try:
                self.manager.shutdown(wait=False)
            finally:
                self.manager = None
        self.inner.teardown()


_MANAGER_SERVER = threading.Lock()


@contextlib.contextmanager
def _manager_server_on(host: str | None) -> Iterator[None]:
    """While torchft's ``Manager`` is built: its manager server (rank 0's) listens on ``host`` (None: where torchft
    puts it, ``[::]``, every interface); torchft takes no address for it, only a port."""
    if host is None:
        yield
        return
    import torchft.manager

    with _MANAGER_SERVER:  # (groups built in threads of one process, as in the tests: one at a time)
        original = torchft.manager.ManagerServer

        def on_host(*args: Any, **kw: Any) -> Any:
            kw["bind"] = f"{host}:{str(kw['bind']).rsplit(':', 1)[1]}"
            return original(*args, **kw)

        torchft.manager.ManagerServer = on_host
        try:
            yield
        finally:
            torchft.manager.ManagerServer = original
