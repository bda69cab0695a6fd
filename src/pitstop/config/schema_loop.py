"""The schemas of the loop's own groups: ``trainer`` (with its nested ``trainer.hang`` and ``trainer.profile``),
``fault`` and ``logger``; ``pitstop.config.schema`` registers them with the others (see its docstring)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from pitstop.config.checks import Above, AtLeastZero, Integer, OneOf, Positive, key

PHASE = (
    "where it fires: step (the end of step N), eval (inside the first evaluation at or after step N), restore "
    "(as the first restore of a checkpoint of step N or later reads it), heal (strategy=ft: as the group applies "
    "the state a peer sent, at step N or later)"
)
# ---- fault ---------------------------------------------------------------------------------------------


@dataclass
class NoFault:
    """``fault=none``: nothing injected."""

    _target_: str = "pitstop.resilience.fault.NoFault"
    replica: Any = key(None, "strategy=ft: K = aimed at replica group K; null or any: every group")


@dataclass
class AtStep(NoFault):
    """A fault at a step (``fault=during_save``, ``during_heal`` and the kinds below)."""

    step: int = key(MISSING, "the step it fires at (or the first save or heal at or after it)", check=Integer())
    rank: int = key(0, "which rank")


@dataclass
class Crash(AtStep):
    """``fault=crash_at_step``: a rank kills itself (SIGKILL) at a step."""

    _target_: str = "pitstop.resilience.fault.CrashAtStep"
    micro_batch: Optional[int] = key(
        None,
        "K: inside step `step`, after its K-th micro-batch (trainer.grad_accum_steps > K)",
        check=Integer(optional=True),
    )
    phase: str = key("step", PHASE)


@dataclass
class Bug(AtStep):
    """``fault=bug``: a rank raises the same error at a step in every attempt that reaches it (a deterministic bug)."""

    _target_: str = "pitstop.resilience.fault.BugAtStep"
    phase: str = key(
        "step",
        "step (the end of step N, in every attempt that reaches it) | heal (strategy=ft: in every heal at step N or "
        "later, as the group applies a peer's state: a state it cannot take)",
    )


@dataclass
class Bitflip(AtStep):
    """``fault=bitflip``: silent data corruption. After step ``step``'s update one exponent bit of one parameter element
    (the first element of the first parameter) flips on rank ``rank``, once per run dir (``trainer.sdc`` finds it)."""

    _target_: str = "pitstop.resilience.bitflip.BitflipAtStep"
    bit: int = key(
        0,
        "which exponent bit: 0 its lowest (the element doubles or halves: the run goes on, silently), up to the "
        "dtype's highest (float32: 7, ~1e38)",
        check=Integer(0),
    )


@dataclass
class Preempt(AtStep):
    """``fault=preempt``: a rank gets a preemption notice at a step (every rank stops at the same step)."""

    _target_: str = "pitstop.resilience.fault.PreemptAtStep"
    signal: str = key("SIGTERM", "the notice; SIGUSR2: what submitit has SLURM send under hydra/launcher=slurm")
    phase: str = key("step", PHASE)


@dataclass
class Stall(AtStep):
    """``fault=stall``: a rank sleeps at a step (hang detection's case)."""

    _target_: str = "pitstop.resilience.fault.StallAtStep"
    rank: int = key(1, "which rank stalls")
    seconds: float = key(3600.0, "how long it sleeps")
    hold_gil: bool = key(
        False,
        "sleep in native code holding the GIL (as a fork stuck in a C library's at-fork "
        "handler does): the Python watcher cannot run; its native backstop ends it",
    )
    phase: str = key("step", PHASE)


@dataclass
class RandomFault(NoFault):
    """``fault=random``: a rank is killed at random times (a seeded Poisson stream), in seconds or in steps."""

    _target_: str = "pitstop.resilience.fault.RandomFault"
    mtbf_seconds: Optional[float] = key(
        None,
        "mean time between failures (seconds of wall clock; a timer: any phase); or mtbf_steps",
        check=Positive(optional=True, what="a positive number of seconds"),
    )
    mtbf_steps: Optional[float] = key(
        None,
        "mean steps between failures (an attempt fails at the end of a drawn step: the same on every machine)",
        check=Positive(optional=True, what="a positive number of steps"),
    )
    seed: int = key("${seed}", "the same seed gives the same failure times (attempt by attempt)")
    rank: int = key(0, "which rank is killed (the others follow: the job restarts as a whole)")


@dataclass
class NonFinite(AtStep):
    """``fault=nonfinite``: the loss of a step is NaN on a rank, once per run dir (a transient numeric fault)."""

    _target_: str = "pitstop.resilience.numeric_faults.NonFiniteAtStep"


@dataclass
class SlowRank(NoFault):
    """``fault=slow_rank``: a fail-slow rank. From step ``from_step`` on, rank ``rank``'s work takes ``factor`` times as
    long: it sleeps at the start of each backward (before any of its gradients is ready, as a slow device would be)
    for (factor - 1) x its own measured forward + backward time (``trainer.straggler`` should name it)."""

    _target_: str = "pitstop.resilience.slow_faults.SlowRank"
    rank: int = key(1, "which rank is slow", check=Integer(0))
    factor: float = key(1.5, "its work takes this many times as long", check=Above(1))
    from_step: int = key(1, "the first step slowed", check=Integer())
    steps: Optional[int] = key(None, "for how many steps (null: to the end of the run)", check=Integer(optional=True))


@dataclass
class Poison(NoFault):
    """``fault=poison``: every batch that holds a sample has a non-finite loss, every time it is seen (a bad record)."""

    _target_: str = "pitstop.resilience.numeric_faults.PoisonSample"
    sample: str = key(MISSING, "the sample key (a training sample's __key__, as samples.rank*.jsonl names it)")


@dataclass
class BadNode(NoFault):
    """``fault=bad_node``: one node is bad for the whole run (``resilience/bad_node.py``): every attempt on it fails
    at start (``fail``), or its checkpoint dir is not writable (``unwritable``: node health's check finds it)."""

    _target_: str = "pitstop.resilience.bad_node.BadNode"
    node: str = key(MISSING, "the node's name as pitstop names it: PITSTOP_NODE_NAME, else SLURMD_NODENAME, else host")
    how: str = key(
        "fail",
        "fail (every attempt on the node raises at start) | unwritable (its checkpoint dir cannot be written: the "
        "launcher's health check fails and the node is not used)",
        check=OneOf("fail", "unwritable"),
    )


@dataclass
class LoseNode(NoFault):
    """``fault=lose_node``: a node is lost at a step (``resilience/node_loss.py``): its processes clear its local
    checkpoint tier and are killed, once per run dir; ``partner`` says what befalls the node holding its copies."""

    _target_: str = "pitstop.resilience.node_loss.NodeLoss"
    node: str = key(MISSING, "the node's name as pitstop names it: PITSTOP_NODE_NAME, else SLURMD_NODENAME, else host")
    step: int = key(MISSING, "the step at whose end it is lost", check=Integer())
    partner: str = key(
        "keep",
        "the node holding its copies (ckpt.local.replicas): keep | corrupt (a byte flipped in each of their files: "
        "the restart finds them wrong: the durable tier) | lost (lost too: the durable tier)",
        check=OneOf("keep", "corrupt", "lost"),
    )
    wait_for_copy: bool = key(
        True,
        "lose it at the end of the first step from `step` on at which its partner holds a copy of one of its saves "
        "(a loaded machine may not have copied one by `step`); false: at `step` whatever is held. Not with "
        "partner=lost (both at `step`)",
    )


# ---- logger --------------------------------------------------------------------------------------------


@dataclass
class NullLogger:
    """``logger=none``: no tracker (metrics.jsonl and summary.json are always written)."""

    _target_: str = "pitstop.telemetry.logger.base.NullLogger"


@dataclass
class MLflow(NullLogger):
    """``logger=mlflow``: params, metrics, goodput and artifacts in an MLflow tracking store."""

    _target_: str = "pitstop.telemetry.logger.mlflow.MLflowLogger"
    tracking_uri: str = key("sqlite:///${paths.output_dir}/mlflow.db", "any MLflow URI (http://..., databricks, ...)")
    experiment: str = key("pitstop", "the MLflow experiment")
    run_name: Optional[str] = key("${run_name}", "the tracker run's name")
    flush_every_seconds: float = key(
        2.0, "metrics are sent in batches this often (off the loop's thread)", check=Positive()
    )


# ---- trainer -------------------------------------------------------------------------------------------


@dataclass
class Hang:
    """``trainer.hang``: a phase (setup, restore, step, eval, checkpoint) that runs far longer than it ever did ends
    the attempt, so that it restarts (``pitstop/resilience/watchdog.py``)."""

    enabled: bool = key(True, "detect hangs")
    factor: float = key(10.0, "limit = factor x the longest run of that phase in this attempt ...", check=Positive())
    min_seconds: float = key(
        60.0, "... but at least this (a remote store's retries, a slow epoch start)", check=Positive()
    )
    first_seconds: float = key(
        900.0, "limit of a phase's first run (compilation, cold caches, peers starting)", check=Positive()
    )
    grace_seconds: float = key(
        30.0,
        "for reporting a hang; also how far past a limit the native backstop fires "
        "when the watcher itself cannot run (a thread stuck in native code holding the GIL)",
        check=Positive(),
    )


@dataclass
class Profile:
    """``trainer.profile``: a torch.profiler trace of a window of steps in ``RUN_DIR/profile/`` (off: no cost)."""

    steps: Optional[Any] = key(None, "[start, end], e.g. [20, 25]; null: off")
    memory: bool = key(False, "allocations in the trace too; on CUDA also a memory snapshot (memory_viz)")


@dataclass
class Sdc:
    """``trainer.sdc``: silent data corruption. Replicas that must be bitwise equal (``strategy=ddp``, and the replica
    groups of ``strategy=ft``) compare a digest of their parameters and optimizer state every ``interval`` steps in
    one small collective; a mismatch names the rank (or group), records it in ``RUN_DIR/suspects.json``, rolls back
    to the newest checkpoint at or before the last step that agreed and goes on (ledger bucket ``sdc``;
    ``pitstop/train/sdc.py``)."""

    enabled: bool = key(
        True, "compare the replicas (strategy=ddp, ft's groups; fsdp shards and single has no replica: nothing)"
    )
    interval: int = key(
        20,
        "every K steps (and at the last step); a mismatch rolls back to a checkpoint at or before the last check "
        "that agreed. A check is a digest pass and one small all-gather: at 20 it costs under 1% of a quick-start "
        "step (bench/sdc.py measures it)",
        check=Integer(),
    )
    replay: bool = key(
        False,
        "strategy=single: take every interval-th step twice and compare bitwise (a fault in the computation; not "
        "corruption at rest). Off: it costs a whole step per check (5% at interval=20) and a copy of the state",
    )


@dataclass
class Instability:
    """``trainer.instability``: a step whose loss or gradient norm is non-finite on any rank (or whose loss spikes) is
    not applied and its data is skipped; past the budgets the run rolls back to a checkpoint from before the trouble
    and skips the data in between, and past those it stops in one line (``pitstop/train/instability.py``)."""

    enabled: bool = key(True, "check every step's loss and gradient norm (one small all-reduce per step on >1 rank)")
    on_instability: str = key(
        "rollback",
        "past max_skips in skip_window steps: rollback (to a checkpoint before the first of them, its data "
        "skipped), skip (stop then), stop (at the first unstable step, as a spike detector that only stops)",
        check=OneOf("rollback", "skip", "stop"),
    )
    spike_factor: Optional[float] = key(
        None,
        "a loss above this x the median of the last spike_window steps is a spike (null: off; no factor fits "
        "every loss's scale, and a false spike skips good data)",
        check=Positive(optional=True),
    )
    spike_window: int = key(50, "steps in the running median (spikes are looked for once it is full)", check=Integer(2))
    max_skips: int = key(3, "unstable steps skipped within skip_window before escalating", check=Integer(0))
    skip_window: int = key(100, "steps over which max_skips counts", check=Integer())
    max_rollbacks: int = key(2, "rollbacks in the run dir before the run stops (exit status 2)", check=Integer(0))
    quarantine: bool = key(
        True,
        "on a non-finite step, find the sample that is non-finite alone (a forward per sample, on that rank) and "
        "never feed it again (RUN_DIR/instability.json; not under strategy=fsdp)",
    )


@dataclass
class Health:
    """``trainer.health``: each node checks itself before the first rendezvous and before each restart, in about a
    second (``launch/health.py``): its run dir and checkpoint dirs writable with room for a checkpoint, free memory, a
    short matmul against its peers' speed (and, a warning, /dev/shm's room for an async save's staging). A node that
    fails a check, on which attempts failed twice, or that the silent-corruption check suspects (jobs of several nodes)
    is not used (``RUN_DIR/nodes.json``); the time is the ledger's ``health``."""

    enabled: bool = key(True, "check the node before the first rendezvous and before each restart")
    room_factor: float = key(
        1.0,
        "free space a checkpoint dir needs, in checkpoints (the newest one's size, else the model's parameters and "
        "optimizer state, estimated); raise it to 2 where a save is written whole before the one it replaces goes",
        check=Positive(),
    )
    min_free_memory_gb: float = key(0.5, "free memory (MemAvailable) the node needs, GiB", check=AtLeastZero())
    slow_factor: float = key(
        3.0,
        "the matmul fails when slower than this x the reference: the faster of the other nodes' median and this "
        "node's own past median (RUN_DIR/health.json)",
        check=Positive(),
    )
    matmul_size: int = key(256, "N of the N x N float32 matmul timed (best of 5)", check=Integer(16))


@dataclass
class Straggler:
    """``trainer.straggler``: slow ranks. Each rank times its own work per step apart from its waits in collectives
    (under ``strategy=ddp``: up to the moment its last gradient is ready for DDP's all-reduce); every ``window``
    steps the ranks share these figures in one small all-gather, and a rank whose typical step is above ``factor`` x
    the median of the others' for ``windows`` windows in a row is named (the log, ``summary.json``, the tracker, the
    time line). What the job lost waiting for it is booked in the ledger's ``straggler`` bucket
    (``pitstop/train/straggler.py``)."""

    enabled: bool = key(
        True, "time each rank's work and compare (strategy=ddp; one rank has no peer; fsdp: not covered, said once)"
    )
    window: int = key(20, "steps per comparison (one all-gather of three numbers per rank)", check=Integer())
    factor: float = key(
        1.3,
        "a rank is slow when its typical step's work in a window is above this x the median of the other ranks' "
        "(1.3 named no one in a clean ddp(2) run of 2,000 steps on a shared 2-core machine: bench/straggler.py)",
        check=Above(1),
    )
    windows: int = key(2, "slow windows in a row before the rank is named", check=Integer())
    action: str = key(
        "report",
        "report (name it, book it) | exclude (a rank slow for longer than exclude_after_seconds: the job saves, its "
        "node is excluded (RUN_DIR/nodes.json) and the job re-forms without it: several nodes; strategy=ft: the slow "
        "replica group leaves the quorum and rejoins by healing from a peer)",
        check=OneOf("report", "exclude"),
    )
    exclude_after_seconds: float = key(
        600.0, "action=exclude: slow for longer than this (wall clock of its slow windows)", check=Positive()
    )


@dataclass
class Trainer:
    """``trainer``: the loop's length and cadence, precision, restarts and preemption (one option,
    ``conf/trainer/default.yaml``, which sets nothing of its own: the defaults are these)."""

    epochs: Optional[int] = key(15, "used when max_steps is null", check=Integer(optional=True))
    max_steps: Optional[int] = key(None, "total optimizer steps (overrides epochs)", check=Integer(optional=True))
    batch_size: int = key(64, "per rank", check=Integer())
    eval_split: str = key("val", "the split evaluated")
    eval_every_steps: Optional[int] = key(
        None, "null: at the end of every epoch (and always at the last step)", check=Integer(optional=True)
    )
    eval_max_batches: Optional[int] = key(
        None, "cap evaluation batches (null: the whole split)", check=Integer(optional=True)
    )
    log_every_steps: int = key(10, "tracker cadence; metrics.jsonl gets every step", check=Integer())
    grad_clip: Optional[float] = key(None, "max grad norm (null: no clipping)", check=Positive(optional=True))
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
        check=Integer(0),
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
        30.0,
        "save on a notice only if a measured save takes less (else keep the newest checkpoint)",
        check=AtLeastZero(what="a number of seconds >= 0"),
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
        check=Integer(),
    )
    profile: Profile = field(default_factory=Profile)
    sdc: Sdc = field(default_factory=Sdc)
    instability: Instability = field(default_factory=Instability)
    health: Health = field(default_factory=Health)
    straggler: Straggler = field(default_factory=Straggler)
