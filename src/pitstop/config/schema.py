"""Typed schemas of the config groups (Hydra structured configs).

Each YAML option of ``ckpt``, ``loader``, ``strategy``, ``fault``, ``logger`` and ``trainer`` opens with
``defaults: [/schema/<group>/<name>@_here_, _self_]``, so Hydra checks every key's type while composing:
``ckpt.interval_steps=abc`` is refused naming the key, and a misspelled key is refused instead of being
ignored. A key's range is declared next to it (``key(..., check=Integer(at_least=0))``) and applied once to the
composed config (:func:`check`, from ``pitstop.config.validate``); the rules that relate two keys live in one module
per component (``strategy/ft_keys.py``, ``ckpt/tiers.py``, ``resilience/fault.py``...). Each refusal is one line.

Each key is typed once, here, with its default and its one-line doc (:func:`key`): the one home of each default.
A YAML option is its schema, named; it sets only what differs (``ckpt=async_dcp_pinned``: ``pinned: true``), and
keeps the comments that say why an option is what it is. A required key defaults to ``???`` (``fault.step``).
``register()`` runs on import of ``pitstop.config`` (the entry points and tests import it).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from pitstop.config.checks import AtLeastZero, Integer, OneOf, Positive, key
from pitstop.config.schema_loop import (
    MLflow,
    AtStep,
    BadNode,
    Bitflip,
    Bug,
    Crash,
    LoseNode,
    NoFault,
    NonFinite,
    NullLogger,
    Poison,
    Preempt,
    RandomFault,
    SlowRank,
    Stall,
    Trainer,
)


def check(name: str, node: Any, kind: type | None = None) -> None:
    """Each key of a composed section (``node``) against the range its schema (``kind``; by default the node's own
    type) declares; nested schemas (``trainer.hang``, ``ckpt.local``) too. The first key out of range is one
    ``ConfigError``."""
    kind = kind or OmegaConf.get_type(node)
    if not isinstance(node, DictConfig) or not dataclasses.is_dataclass(kind):
        return
    hints = typing.get_type_hints(kind)
    for f in dataclasses.fields(kind):
        nested, rule = hints.get(f.name), f.metadata.get("check")
        if rule is None and not dataclasses.is_dataclass(nested):  # (a key without a range is not read: resolving
            continue  # its interpolation is its reader's business)
        if f.name not in node or OmegaConf.is_missing(node, f.name):
            continue
        value = node[f.name]
        if isinstance(value, DictConfig):
            check(f"{name}.{f.name}", value, nested if dataclasses.is_dataclass(nested) else None)
        elif rule is not None:
            rule(f"{name}.{f.name}", value)


def schema_of(group: str, node: DictConfig) -> type | None:
    """The schema class of a composed group's section; of a config read back from YAML (untyped): the option whose
    ``_target_`` it names, else the smallest schema of the group that has all its keys."""
    options = list(SCHEMAS.get(group, {}).values())
    kind = OmegaConf.get_type(node)
    if isinstance(kind, type) and any(issubclass(kind, o) for o in options):
        return kind
    target, keys = node.get("_target_"), set(node.keys())
    same = [o for o in options if target is not None and getattr(o, "_target_", None) == target]
    for candidate in [*same, *options]:  # (the option it names first; else any of the group that has its keys)
        if {f.name for f in dataclasses.fields(candidate)} >= keys:
            return candidate
    return None


def check_all(cfg: DictConfig) -> None:
    """Every schema'd group of a composed config against its declared ranges (``pitstop.config.validate``)."""
    for group in SCHEMAS:
        node = cfg.get(group)
        if isinstance(node, DictConfig):
            check(group, node, schema_of(group, node))


# ---- ckpt ----------------------------------------------------------------------------------------------


@dataclass
class LocalTier:
    """``ckpt.local``: a second, fast tier next to ``ckpt.dir`` (tmpfs, node-local NVMe); off while ``dir`` is null."""

    dir: Optional[str] = key(
        None, "e.g. /dev/shm/pitstop, or auto (= /dev/shm/pitstop-UID); the run's own subdir is made 0700"
    )
    interval_steps: Optional[int] = key(None, "save there every N steps ...", check=Positive(optional=True))
    interval_seconds: Optional[float] = key(None, "... and/or every N seconds", check=Positive(optional=True))
    interval: Optional[str] = key(
        None, "auto: Young-Daly from this tier's own measured save cost (replaces the two above)"
    )
    keep_last_k: int = key(2, "newest complete local checkpoints kept")
    replicas: int = key(
        0,
        "1: every local save is also held by a partner on another node (a node holds its own and its partner's "
        "files); 0: off",
        check=OneOf(0, 1),
    )


@dataclass
class Ckpt:
    """``ckpt=sync_save`` (and every backend's common keys): rank 0 gathers the full state and ``torch.save``s one
    file, synchronously, in the loop."""

    _target_: str = "pitstop.ckpt.sync_save.SyncSave"
    dir: str = key("${run_dir}/checkpoints", "one step_{:08d}/ dir per checkpoint; s3://... too")
    interval_steps: Optional[int] = key(50, "save every N steps (null: off)", check=Positive(optional=True))
    interval_seconds: Optional[float] = key(None, "and/or every N seconds of wall clock", check=Positive(optional=True))
    interval: Optional[str] = key(
        None, "auto: Young-Daly sqrt(2 x save cost x MTBF), measured (replaces the two above)"
    )
    mtbf_seconds: Optional[float] = key(
        None,
        "for interval=auto (else fault.mtbf_seconds, else failures seen in this run dir)",
        check=Positive(optional=True),
    )
    keep_last_k: int = key(
        3,
        "newest complete checkpoints kept (0: all); async: >= 2, the newest may be in flight",
        check=Integer(0, note=" (0 keeps all)"),
    )
    save_last: bool = key(True, "save at the final step")
    load: Any = key("auto", "auto (newest complete) | none | PATH | STEP")
    load_model_only: bool = key(False, "true: take only model weights from ckpt.load (fine-tune, changed config)")
    on_error: str = key(
        "raise",
        "a failed save: raise | warn (the last save failing always fails the run)",
        check=OneOf("raise", "warn"),
    )
    throttle_mbps: Optional[float] = key(
        None,
        "cap read and write bandwidth of a local ckpt.dir (MB/s): a stand-in for a network volume in benchmarks",
        check=Positive(optional=True),
    )
    storage_options: Any = key(
        {},
        "for dir=s3://...: fsspec options, e.g. {client_kwargs: {endpoint_url: URL}}; "
        "credentials only from the environment (AWS_ACCESS_KEY_ID, ...)",
    )
    local: LocalTier = field(default_factory=LocalTier)


@dataclass
class DcpCkpt(Ckpt):
    """``ckpt=sync_dcp``: torch.distributed.checkpoint, every rank writes its own shard, rank 0 ``.metadata``
    last."""

    _target_: str = "pitstop.ckpt.sync_dcp.SyncDCP"
    format: str = key(
        "raw",
        "how each tensor is stored: raw (its bytes) | torch_save (DCP's own format, for tools "
        "that read DCP checkpoints with torch's FileSystemReader); pitstop reads both",
    )


@dataclass
class AsyncCkpt(DcpCkpt):
    """``ckpt=async_dcp``: dcp.async_save; the loop pays only for a snapshot."""

    _target_: str = "pitstop.ckpt.async_dcp.AsyncDCP"
    pinned: bool = key(False, "pinned (CUDA) and shared host buffers, written by a checkpoint process")
    checkpointer: str = key("auto", "auto (a thread; pinned: a process) | thread | process")


# ---- loader --------------------------------------------------------------------------------------------


@dataclass
class Loader:
    """``loader=plain``: every rank reads its shards from ``data.root`` (local or remote) in worker processes."""

    _target_: str = "pitstop.data.loader.plain.PlainLoader"
    num_workers: int = key(2, "worker processes per rank (0: read in the training process)", check=Integer(0))
    prefetch_factor: int = key(4, "batches each worker prepares ahead", check=Integer(1))
    partitions: Optional[int] = key(None, "fixed logical partitions of the shards (null: one per shard)")
    shuffle: bool = key(True, "shard and in-shard order from (seed, epoch): the same after any restart")
    shuffle_shards_window: int = key(
        1,
        "K > 1: each reader mixes the samples of K shards at a time (class-sorted shards)",
        check=Integer(1, note=" (1: one shard at a time; K: each reader mixes K shards)"),
    )
    drop_last: bool = key(False, "drop an epoch's last partial batch")
    timeout: float = key(0.0, "seconds to wait for a worker batch (0: forever)", check=AtLeastZero())
    retries: int = key(3, "remote reads: attempts after the first (local files: none)", check=Integer(0))
    backoff: float = key(0.5, "seconds before the first retry, doubling each time", check=AtLeastZero())
    read_timeout: float = key(60.0, "seconds per request (connect and each read)", check=Positive())
    download_parts: Any = key("auto", "ranged requests per remote shard at once: auto (one per 2 MB, <= 8), N")
    allow_pipe: bool = key(False, "pipe:CMD shard URLs run shell commands; refused unless true")
    eval_in_memory: Any = key(
        "256MB", "keep a rank's evaluation batches in memory after the first pass if they fit (0: never)"
    )
    storage_options: Any = key(
        {},
        "for data.root=s3://...: fsspec options, e.g. {client_kwargs: {endpoint_url: "
        "URL}}; credentials only from the environment (AWS_ACCESS_KEY_ID, ...), never here",
    )


@dataclass
class CachedLoader(Loader):
    """``loader=cached``: shards downloaded ahead into a local cache that every rank and worker on the machine
    shares."""

    _target_: str = "pitstop.data.loader.cached.CachedLoader"
    cache_dir: str = key("${paths.cache_dir}", "local NVMe/SSD; shared by every rank and worker on the machine")
    cache_limit: Any = key(None, "bytes or e.g. 50GB (null: the disk's size); idle shards are evicted by cache_policy")
    prefetch_shards: Any = key(
        "auto", "shards each reader downloads ahead in threads: auto (as deep as downloads need), N, 0"
    )
    verify: str = key(
        "sha256",
        "check each download against the index: sha256 (and size) | size",
        check=OneOf("sha256", "size", say="use sha256 (hash each download) or size"),
    )
    cache_policy: str = key(
        "future",
        "future (the shard read furthest ahead goes first: the order is known) | lru",
        check=OneOf(
            "future", "lru", say="use future (evict the shard read furthest ahead) or lru (the least recently used)"
        ),
    )


# ---- strategy ------------------------------------------------------------------------------------------


@dataclass
class Single:
    """``strategy=single``: one process on one device, CUDA when available, else the CPU."""

    _target_: str = "pitstop.strategy.single.Single"
    device: str = key("auto", "auto | cpu | cuda | cuda:N")
    cpu_threads: Any = key(
        "auto",
        "CPU only: intra-op threads (auto: the cores the loader's workers leave, at least "
        "1, at most OMP_NUM_THREADS if set; under ddp: this node's cores // its ranks; under ft: "
        "cores // (replicas x nproc_per_node)). Part of the arithmetic: runs compare bitwise only "
        "with the same count",
    )


@dataclass
class DDP(Single):
    """``strategy=ddp``: DistributedDataParallel, one process per rank, started (and restarted) through torch's
    elastic agent; under torchrun or SLURM (``RANK`` set) nothing is spawned."""

    _target_: str = "pitstop.strategy.ddp.DDP"
    nproc_per_node: int = key(2, "ranks on this machine", check=Integer())
    backend: str = key("auto", "auto: gloo on CPU, cpu:gloo,cuda:nccl on GPU")
    timeout: float = key(
        300.0, "seconds before a stuck or dead peer fails the job instead of hanging", check=Positive()
    )
    max_restarts: int = key(
        "${trainer.max_restarts}", "elastic in-job restarts: all ranks restart and resume", check=Integer(0)
    )
    master_port: Optional[int] = key(None, "rendezvous port (null: a free one)")
    oversubscribe: bool = key(False, "allow more ranks than CPU cores or GPUs")
    nnodes: Any = key(1, "nodes: N, or MIN:MAX (elastic: a lost node shrinks the job, a new one grows it)")
    rdzv_endpoint: Optional[str] = key(
        None,
        "with nnodes > 1: HOST:PORT of node 0 (its agent hosts the "
        "rendezvous), the same on every node; slurm: the allocation's first node",
    )
    last_call_seconds: int = key(
        5, "nnodes=MIN:MAX: after MIN nodes joined, wait this long for more", check=AtLeastZero()
    )


@dataclass
class FSDP(DDP):
    """``strategy=fsdp``: FSDP2 (fully_shard): parameters, gradients and optimizer state sharded across ranks."""

    _target_: str = "pitstop.strategy.fsdp.FSDP"
    shard: Any = key("auto", "auto: each child module with parameters; or a list of module names")
    reshard_after_forward: bool = key(
        True, "free the gathered parameters after forward (gather them again in backward)"
    )
    mixed_precision: Optional[str] = key(
        "${trainer.precision}",
        "follows trainer.precision: parameters for compute in it, reductions in fp32; no autocast on top",
    )


@dataclass
class FT(Single):
    """``strategy=ft``: replica groups joined by torchft: a group's death costs the others one discarded step and a
    pause of about the heartbeat timeout; it restarts alone and heals from a live peer."""

    _target_: str = "pitstop.strategy.ft.FT"
    replicas: int = key(
        2,
        "replica groups started here (each its own process, restarted on its own)",
        check=Integer(note=" (replica groups)"),
    )
    replica_id: Optional[int] = key(
        None,
        "null: this command starts the groups; K: this process is group K (of a "
        "job whose Lighthouse runs at strategy.lighthouse)",
    )
    lighthouse: Optional[str] = key(None, "HOST:PORT of the Lighthouse; null: start one in this process")
    min_replicas: int = key(1, "a step commits only with at least this many groups in its quorum")
    inner: str = key("ddp", "inside a group of several ranks: ddp (replicated) | fsdp (FSDP2-sharded: HSDP)")
    nproc_per_node: int = key(
        1,
        "ranks per group (> 1: the group's own elastic agent restarts them together)",
        check=Integer(note=" (ranks per group)"),
    )
    backend: str = key("auto", "of a group's own process group: gloo on CPU, cpu:gloo,cuda:nccl on GPUs")
    oversubscribe: bool = key(
        False,
        "allow more processes (replicas x nproc_per_node) than this machine's cores "
        "(or a group's nproc_per_node more than its GPUs)",
    )
    shard: Any = key("auto", "inner=fsdp: as strategy=fsdp's")
    reshard_after_forward: bool = key(True, "inner=fsdp: as strategy=fsdp's")
    mixed_precision: Optional[str] = key("${trainer.precision}", "inner=fsdp: as strategy=fsdp's")
    timeout: float = key(
        10.0, "seconds: a collective or commit that waits longer fails the step (discarded)", check=Positive()
    )
    heartbeat_ms: int = key(
        250, "a group silent this long leaves the quorum (bounds a healthy group's pause)", check=Positive()
    )
    quorum_timeout: float = key(
        60.0,
        "seconds a group waits for a quorum (min_replicas groups) before it fails; "
        "and the job's first quorum for every group",
        check=Positive(),
    )
    max_restarts: int = key(5, "restarts per group (each restarts alone and heals from a live peer)", check=Integer(0))


SCHEMAS = {
    "ckpt": {"sync": Ckpt, "dcp": DcpCkpt, "async": AsyncCkpt},
    "loader": {"plain": Loader, "cached": CachedLoader},
    "strategy": {"single": Single, "ddp": DDP, "fsdp": FSDP, "ft": FT},
    "fault": {
        "none": NoFault,
        "at_step": AtStep,
        "crash": Crash,
        "bug": Bug,
        "bitflip": Bitflip,
        "preempt": Preempt,
        "stall": Stall,
        "random": RandomFault,
        "nonfinite": NonFinite,
        "poison": Poison,
        "bad_node": BadNode,
        "lose_node": LoseNode,
        "slow_rank": SlowRank,
    },
    "logger": {"none": NullLogger, "mlflow": MLflow},
    "trainer": {"default": Trainer},
}


def register() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for group, schemas in SCHEMAS.items():
        for name, node in schemas.items():
            cs.store(group=f"schema/{group}", name=name, node=node)
