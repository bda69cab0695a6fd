"""Typed schemas of the config groups (Hydra structured configs): types only, the values live in the YAML.

Each YAML option of ``ckpt``, ``loader``, ``strategy``, ``fault``, ``logger`` and ``trainer`` opens with
``defaults: [/schema/<group>/<name>@_here_, _self_]``, so Hydra checks every key's type while composing:
``ckpt.interval_steps=abc`` is refused naming the key, and a misspelled key is refused instead of being
ignored.  Types live here, once; value ranges and rules that relate two keys stay in code
(``pitstop.config.validate`` and the components), as one-line ``ConfigError``s.
Every field defaults to ``???`` (MISSING): merging a schema never overrides a value the YAML set, so an
option that extends another (``fsdp`` extends ``ddp``) adds its own schema after the parent's.
``register()`` runs on import of ``pitstop.config`` (the entry points and tests import it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

# ---- ckpt ----------------------------------------------------------------------------------------------


@dataclass
class LocalTier:
    dir: Optional[str] = MISSING  # null (off) | auto | PATH
    interval_steps: Optional[int] = MISSING
    interval_seconds: Optional[float] = MISSING
    interval: Optional[str] = MISSING  # auto | null
    keep_last_k: int = MISSING


@dataclass
class Ckpt:
    _target_: str = MISSING
    dir: str = MISSING
    interval_steps: Optional[int] = MISSING
    interval_seconds: Optional[float] = MISSING
    interval: Optional[str] = MISSING  # auto | null
    mtbf_seconds: Optional[float] = MISSING
    keep_last_k: int = MISSING
    save_last: bool = MISSING
    load: Any = MISSING  # auto | none | STEP | PATH
    load_model_only: bool = MISSING
    on_error: str = MISSING  # raise | warn
    throttle_mbps: Optional[float] = MISSING
    storage_options: Any = MISSING  # fsspec options for a URL ckpt.dir (never credentials)
    local: LocalTier = field(default_factory=LocalTier)


@dataclass
class DcpCkpt(Ckpt):
    format: str = MISSING  # raw | torch_save


@dataclass
class AsyncCkpt(DcpCkpt):
    pinned: bool = MISSING
    checkpointer: str = MISSING  # auto | thread | process


# ---- loader --------------------------------------------------------------------------------------------


@dataclass
class Loader:
    _target_: str = MISSING
    num_workers: int = MISSING
    prefetch_factor: int = MISSING
    partitions: Optional[int] = MISSING
    shuffle: bool = MISSING
    shuffle_shards_window: int = MISSING  # 1, or K shards mixed by each reader
    drop_last: bool = MISSING
    timeout: float = MISSING
    retries: int = MISSING
    backoff: float = MISSING
    read_timeout: float = MISSING
    download_parts: Any = MISSING  # auto | N ranged requests per shard download
    allow_pipe: bool = MISSING
    eval_in_memory: Any = MISSING  # bytes, "256MB", or 0
    storage_options: Any = MISSING  # fsspec options for a URL data.root (never credentials)


@dataclass
class CachedLoader(Loader):
    cache_dir: str = MISSING
    cache_limit: Any = MISSING  # bytes, "50GB", or null
    prefetch_shards: Any = MISSING  # auto | shards ahead
    verify: str = MISSING  # sha256 | size
    cache_policy: str = MISSING  # future | lru


# ---- strategy ------------------------------------------------------------------------------------------


@dataclass
class Single:
    _target_: str = MISSING
    device: str = MISSING
    cpu_threads: Any = MISSING  # auto | N


@dataclass
class DDP(Single):
    nproc_per_node: int = MISSING
    backend: str = MISSING
    timeout: float = MISSING
    max_restarts: int = MISSING
    master_port: Optional[int] = MISSING
    oversubscribe: bool = MISSING
    nnodes: Any = MISSING  # N | "MIN:MAX"
    rdzv_endpoint: Optional[str] = MISSING  # HOST:PORT of node 0
    last_call_seconds: int = MISSING


@dataclass
class FSDP(DDP):
    shard: Any = MISSING  # auto | [module names]
    reshard_after_forward: bool = MISSING
    mixed_precision: Optional[str] = MISSING  # ${trainer.precision} | null | bfloat16 | float16


@dataclass
class FT(Single):
    replicas: int = MISSING
    replica_id: Optional[int] = MISSING
    lighthouse: Optional[str] = MISSING  # HOST:PORT | null (start one here)
    min_replicas: int = MISSING
    inner: str = MISSING  # ddp
    nproc_per_node: int = MISSING
    backend: str = MISSING  # inside a group of several ranks: auto | gloo | nccl | cpu:gloo,cuda:nccl
    oversubscribe: bool = MISSING
    shard: Any = MISSING  # inner=fsdp: auto | [module names]
    reshard_after_forward: bool = MISSING  # inner=fsdp
    mixed_precision: Optional[str] = MISSING  # inner=fsdp: ${trainer.precision}
    timeout: float = MISSING
    heartbeat_ms: int = MISSING
    quorum_timeout: float = MISSING
    max_restarts: int = MISSING


# ---- fault ---------------------------------------------------------------------------------------------


@dataclass
class NoFault:
    _target_: str = MISSING
    replica: Any = MISSING  # strategy=ft: null | K | any


@dataclass
class AtStep(NoFault):
    step: int = MISSING
    rank: int = MISSING


@dataclass
class Crash(AtStep):
    micro_batch: Optional[int] = MISSING
    phase: str = MISSING  # step | eval | restore | heal


@dataclass
class Preempt(AtStep):
    signal: str = MISSING
    phase: str = MISSING  # step | eval | restore | heal


@dataclass
class Stall(AtStep):
    seconds: float = MISSING
    hold_gil: bool = MISSING
    phase: str = MISSING  # step | eval | restore | heal


@dataclass
class RandomFault(NoFault):
    mtbf_seconds: float = MISSING
    seed: int = MISSING
    rank: int = MISSING


# ---- logger --------------------------------------------------------------------------------------------


@dataclass
class NullLogger:
    _target_: str = MISSING


@dataclass
class MLflow(NullLogger):
    tracking_uri: str = MISSING
    experiment: str = MISSING
    run_name: Optional[str] = MISSING
    flush_every_seconds: float = MISSING


# ---- trainer -------------------------------------------------------------------------------------------


@dataclass
class Hang:
    enabled: bool = MISSING
    factor: float = MISSING
    min_seconds: float = MISSING
    first_seconds: float = MISSING
    grace_seconds: float = MISSING


@dataclass
class Profile:
    steps: Optional[Any] = MISSING  # null | [start, end]
    memory: bool = MISSING


@dataclass
class Trainer:
    epochs: Optional[int] = MISSING
    max_steps: Optional[int] = MISSING
    batch_size: int = MISSING
    eval_split: str = MISSING
    eval_every_steps: Optional[int] = MISSING
    eval_max_batches: Optional[int] = MISSING
    log_every_steps: int = MISSING
    grad_clip: Optional[float] = MISSING
    deterministic: bool = MISSING
    progress_bar: Any = MISSING  # auto | true | false
    max_restarts: int = MISSING
    warm_restarts: bool = MISSING
    preempt_signals: Any = MISSING  # [SIGTERM, SIGUSR1, SIGUSR2]
    preempt_grace_seconds: float = MISSING
    hang: Hang = field(default_factory=Hang)
    precision: str = MISSING  # fp32 | bf16 | fp16
    compile: bool = MISSING
    compile_backend: str = MISSING
    compile_mode: Optional[str] = MISSING
    channels_last: bool = MISSING
    grad_accum_steps: int = MISSING
    profile: Profile = field(default_factory=Profile)


SCHEMAS = {
    "ckpt": {"sync": Ckpt, "dcp": DcpCkpt, "async": AsyncCkpt},
    "loader": {"plain": Loader, "cached": CachedLoader},
    "strategy": {"single": Single, "ddp": DDP, "fsdp": FSDP, "ft": FT},
    "fault": {
        "none": NoFault,
        "at_step": AtStep,
        "crash": Crash,
        "preempt": Preempt,
        "stall": Stall,
        "random": RandomFault,
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
