"""Typed schemas of the config groups (Hydra structured configs).

Each YAML option of ``ckpt``, ``loader``, ``strategy``, ``fault``, ``logger`` and ``trainer`` opens with
``defaults: [/schema/<group>/<name>@_here_, _self_]``, so Hydra checks every key's type while composing:
``ckpt.interval_steps=abc`` is refused naming the key, and a misspelled key is refused instead of being
ignored. Value ranges and rules that relate two keys stay in code (``pitstop.launch.plan`` for the launch keys,
``pitstop.config.validate`` and the components), as one-line ``ConfigError``s.

``trainer`` and ``strategy`` are typed once, here, with each key's default and one-line doc (:func:`key`): their
YAML options set nothing else (an option is its schema, named). A schema of another group still defaults every
field to ``???`` (MISSING), its values in the YAML, so that merging it never overrides a value an option set: an
option that extends another (``async_dcp`` extends ``sync_dcp``) adds its own schema after the parent's.
``register()`` runs on import of ``pitstop.config`` (the entry points and tests import it).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING


def key(default: Any, doc: str) -> Any:
    """A key's default (its one home: the YAML options set only what differs) and its one-line doc."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


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
    nproc_per_node: int = key(2, "ranks on this machine")
    backend: str = key("auto", "auto: gloo on CPU, cpu:gloo,cuda:nccl on GPU")
    timeout: float = key(300.0, "seconds before a stuck or dead peer fails the job instead of hanging")
    max_restarts: int = key("${trainer.max_restarts}", "elastic in-job restarts: all ranks restart and resume")
    master_port: Optional[int] = key(None, "rendezvous port (null: a free one)")
    oversubscribe: bool = key(False, "allow more ranks than CPU cores or GPUs")
    nnodes: Any = key(1, "nodes: N, or MIN:MAX (elastic: a lost node shrinks the job, a new one grows it)")
    rdzv_endpoint: Optional[str] = key(
        None,
        "with nnodes > 1: HOST:PORT of node 0 (its agent hosts the "
        "rendezvous), the same on every node; slurm: the allocation's first node",
    )
    last_call_seconds: int = key(5, "nnodes=MIN:MAX: after MIN nodes joined, wait this long for more")


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
    replicas: int = key(2, "replica groups started here (each its own process, restarted on its own)")
    replica_id: Optional[int] = key(
        None,
        "null: this command starts the groups; K: this process is group K (of a "
        "job whose Lighthouse runs at strategy.lighthouse)",
    )
    lighthouse: Optional[str] = key(None, "HOST:PORT of the Lighthouse; null: start one in this process")
    min_replicas: int = key(1, "a step commits only with at least this many groups in its quorum")
    inner: str = key("ddp", "inside a group of several ranks: ddp (replicated) | fsdp (FSDP2-sharded: HSDP)")
    nproc_per_node: int = key(1, "ranks per group (> 1: the group's own elastic agent restarts them together)")
    backend: str = key("auto", "of a group's own process group: gloo on CPU, cpu:gloo,cuda:nccl on GPUs")
    oversubscribe: bool = key(
        False,
        "allow more processes (replicas x nproc_per_node) than this machine's cores "
        "(or a group's nproc_per_node more than its GPUs)",
    )
    shard: Any = key("auto", "inner=fsdp: as strategy=fsdp's")
    reshard_after_forward: bool = key(True, "inner=fsdp: as strategy=fsdp's")
    mixed_precision: Optional[str] = key("${trainer.precision}", "inner=fsdp: as strategy=fsdp's")
    timeout: float = key(10.0, "seconds: a collective or commit that waits longer fails the step (discarded)")
    heartbeat_ms: int = key(250, "a group silent this long leaves the quorum (bounds a healthy group's pause)")
    quorum_timeout: float = key(60.0, "seconds a group waits for a quorum (min_replicas groups) before it fails")
    max_restarts: int = key(5, "restarts per group (each restarts alone and heals from a live peer)")


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
    """``trainer.hang``: a phase (setup, restore, step, eval, checkpoint) that runs far longer than it ever did ends
    the attempt, so that it restarts (``pitstop/resilience/watchdog.py``)."""

    enabled: bool = key(True, "detect hangs")
    factor: float = key(10.0, "limit = factor x the longest run of that phase in this attempt ...")
    min_seconds: float = key(60.0, "... but at least this (a remote store's retries, a slow epoch start)")
    first_seconds: float = key(900.0, "limit of a phase's first run (compilation, cold caches, peers starting)")
    grace_seconds: float = key(
        30.0,
        "for reporting a hang; also how far past a limit the native backstop fires "
        "when the watcher itself cannot run (a thread stuck in native code holding the GIL)",
    )


@dataclass
class Profile:
    """``trainer.profile``: a torch.profiler trace of a window of steps in ``RUN_DIR/profile/`` (off: no cost)."""

    steps: Optional[Any] = key(None, "[start, end], e.g. [20, 25]; null: off")
    memory: bool = key(False, "allocations in the trace too; on CUDA also a memory snapshot (memory_viz)")


@dataclass
class Trainer:
    """``trainer``: the loop's length and cadence, precision, restarts and preemption (one option,
    ``conf/trainer/default.yaml``, which sets nothing of its own: the defaults are these)."""

    epochs: Optional[int] = key(15, "used when max_steps is null")
    max_steps: Optional[int] = key(None, "total optimizer steps (overrides epochs)")
    batch_size: int = key(64, "per rank")
    eval_split: str = key("val", "the split evaluated")
    eval_every_steps: Optional[int] = key(None, "null: at the end of every epoch (and always at the last step)")
    eval_max_batches: Optional[int] = key(None, "cap evaluation batches (null: the whole split)")
    log_every_steps: int = key(10, "tracker cadence; metrics.jsonl gets every step")
    grad_clip: Optional[float] = key(None, "max grad norm (null: no clipping)")
    deterministic: bool = key(
        True,
        "deterministic kernels (torch.use_deterministic_algorithms, cuDNN "
        "deterministic, CUBLAS_WORKSPACE_CONFIG): same seed => bitwise-identical losses",
    )
    progress_bar: Any = key("auto", "auto (only on an interactive terminal) | true | false")
    max_restarts: int = key(
        0,
        "restart a failed job (it resumes from its newest checkpoint): a supervisor "
        "process for strategy=single, the elastic agent for ddp/fsdp",
    )
    warm_restarts: bool = key(
        True, "attempts (single) and ranks (ddp/fsdp, via the elastic agent) fork from a copy of the launcher"
    )
    preempt_signals: Any = key(
        ["SIGTERM", "SIGUSR1", "SIGUSR2"],
        "preemption notices: finish the step, save, "
        "exit 75 (requeue); SIGUSR2 is submitit's: its requeue runs after the save",
    )
    preempt_grace_seconds: float = key(
        30.0, "save on a notice only if a measured save takes less (else keep the newest checkpoint)"
    )
    hang: Hang = field(default_factory=Hang)
    precision: str = key(
        "fp32",
        "fp32 | bf16 | fp16: autocast for forward + loss (fp16: CUDA only, with a "
        "GradScaler whose state is checkpointed); strategy=fsdp: its MixedPrecisionPolicy instead",
    )
    compile: bool = key(False, "torch.compile the model in place (its compile time: ledger bucket `compile`)")
    compile_backend: str = key("inductor", "any of torch._dynamo.list_backends()")
    compile_mode: Optional[str] = key(
        None, "null | default | reduce-overhead | max-autotune | max-autotune-no-cudagraphs"
    )
    channels_last: bool = key(False, "NHWC memory format for the model and every 4-D input (convnets on GPUs)")
    grad_accum_steps: int = key(
        1,
        "micro-batches per optimizer step: effective batch = batch_size x this x "
        "ranks (gradients are reduced across ranks on the last micro-batch only)",
    )
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
