"""The generic training loop, assembled from the config.  It knows nothing about images.

    Runner(cfg, run_dir).run()
      setup()    strategy -> seed -> data -> model -> optimizer/schedule -> loaders -> checkpointer -> logger -> fault
      restore()  the checkpointer loads the newest complete checkpoint (if any) into the train state
      fit()      step (fetch -> forward/backward, per micro-batch -> optimizer) -> record -> (eval) -> (save)
      finish()   final eval and save, wait for in-flight saves, summary.json

Every component is built with ``hydra.utils.instantiate`` from its config group, so a new model, data
set, optimizer, loader, strategy or checkpoint backend is a new YAML file (and module), not an edit here.
Each component kind has one contract (``Strategy``, ``ShardLoader``, ``Checkpointer``, ``Logger``,
``Fault``) and gets the few collaborators it uses passed in.  Whatever ``setup()`` acquires is released
in reverse order however the run ends (``self._resources``), even when setup fails half-way.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from contextlib import ExitStack, closing, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from pitstop.train import compiler
from pitstop.train.launch_facts import LaunchFacts, facts_from_env, record_error
from pitstop.train.batch import map_tensors
from pitstop.config.build import build, target_modules
from pitstop.ckpt.base import ERRORS, Target
from pitstop.config import flatten, validate
from pitstop.train.digest import state_sha256
from pitstop.errors import ConfigError, FingerprintMismatch
from pitstop.resilience.fault import FaultContext
from pitstop.data.loader import server as worker_server
from pitstop.goodput.ledger import GoodputLog, Ledger, table
from pitstop.telemetry.metrics import MetricsFile, write_json_atomic
from pitstop.strategy.nodes import check_nodes
from pitstop.train.precision import DTYPES, Precision
from pitstop.resilience.preempt import Preempted, PreemptionNotice
from pitstop.telemetry.profiler import StepProfiler
from pitstop.train.lr import planned_steps, replan
from pitstop.train.seed import rng_state, seed_everything, set_rng_state
from pitstop.train.throughput import Throughput, cached_count, count_step_flops
from pitstop.resilience.watchdog import DataStall, Hung, Watchdog

log = logging.getLogger("pitstop")


@dataclass
class Progress:
    step: int = 0
    samples_seen: int = 0


class TrainState:
    """Everything besides model and optimizer tensors that a checkpoint must restore (``Stateful``)."""

    def __init__(self, progress: Progress, loader: Any, scheduler: Any, fingerprint: dict, precision: Precision):
        self.progress, self.loader, self.scheduler, self._fingerprint = progress, loader, scheduler, fingerprint
        self.precision = precision

    @property
    def step(self) -> int:
        return self.progress.step

    def fingerprint(self) -> dict:
        """Config parts that must not change across a resume."""
        return self._fingerprint

    def state_dict(self) -> dict:
        state = {
            "step": self.progress.step,
            "samples_seen": self.progress.samples_seen,
            "loader": self.loader.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_state(),
            "fingerprint": self._fingerprint,
        }
        scaler = self.precision.state_dict()
        if scaler:  # fp16: the loss scale and its growth tracker
            state["scaler"] = scaler
        return state

    def load_state_dict(self, state: dict, peers: list[dict] | None = None) -> None:
        """``peers``: every saved rank's state (needed when the number of ranks changed)."""
        self.progress.step, self.progress.samples_seen = int(state["step"]), int(state["samples_seen"])
        self.loader.load_state_dict(state["loader"], peers=[p["loader"] for p in peers] if peers else None)
        self.scheduler.load_state_dict(state["scheduler"])
        self.precision.load_state_dict(state.get("scaler"))
        set_rng_state(state["rng"])


@dataclass
class StepResult:
    """One optimizer step: its mean loss, this rank's samples, and where its seconds went besides compute."""

    loss: float
    samples: int
    data_wait: float
    staging: float


class Batches:
    """The training batches, fetched in the watchdog's ``data`` phase.  When the data workers stall (a worker
    stuck in a read, a store that stopped answering), the watchdog raises ``DataStall`` once: the workers are
    restarted from the current data position and the fetch is tried again (a second stall in the same fetch
    propagates, and the attempt ends)."""

    def __init__(self, loader: Any, watchdog: Watchdog):
        self.loader, self.watchdog = loader, watchdog
        self.it = iter(loader)

    def next(self) -> Any:
        try:
            with self.watchdog.phase("data", heal=True):
                return next(self.it)
        except DataStall as e:
            stalled = e  # (its traceback holds the stuck workers' iterator until it is dropped below)
        with self.watchdog.phase("data"):  # the restart is data wait too; a stall in here is a hang
            log.warning("%s", stalled)
            stalled.__traceback__ = None  # the stuck workers stop (shut down, terminated if they do not)
            del stalled
            self.it.close()
            self.it = iter(self.loader)  # new ones resume from the position of the last batch received
            return next(self.it)

    def close(self) -> None:
        self.it.close()


class Runner:
    def __init__(self, cfg: DictConfig, run_dir: str, launch: LaunchFacts | None = None):
        """``launch``: how this attempt was launched (from the environment when not given: a person's run)."""
        validate(cfg)
        self.cfg, self.run_dir = cfg, os.path.abspath(run_dir)
        self.launch = launch if launch is not None else facts_from_env(os.environ)
        self.ledger = Ledger(self.launch.program_start)
        self.progress = Progress()
        self.resumed_from: int | None = None
        self.callbacks: list[Any] = []
        self.last_eval: dict[str, float] = {}
        self._last_io: dict[str, float] = {}
        self._resources = ExitStack()
        self._finished = False
        self._preempted = False
        self.goodput: GoodputLog | None = None
        hang = cfg.trainer.hang
        self.watchdog = Watchdog(
            enabled=hang.enabled,
            factor=hang.factor,
            min_seconds=hang.min_seconds,
            first_seconds=hang.first_seconds,
            grace=hang.grace_seconds,
        )

    @property
    def step(self) -> int:
        return self.progress.step

    @property
    def samples_seen(self) -> int:
        return self.progress.samples_seen

    # ---- assembly ---------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg, hold = self.cfg, self._resources
        if OmegaConf.select(cfg, "loader.num_workers", default=0):
            # The data workers' fork server, forked now while this process has no threads of its own yet
            # (none may exist at a fork) and already has the components' modules: ready at once, no imports.
            with self.ledger.measure("init"):
                log.debug("data workers' fork server: %s", worker_server.start(target_modules(cfg)))
        # A launcher (the supervisor, the elastic agent, torchrun) restarts a process that exits on a hang.
        rank = int(os.environ.get("RANK", 0))
        hold.callback(self.watchdog.start(rank, self.run_dir, self._on_hang, self.launch.launched))
        with self.ledger.measure("init"), self.watchdog.phase("setup"):
            self.preempt = PreemptionNotice(
                cfg.trainer.preempt_signals, cfg.trainer.preempt_grace_seconds, agent_pid=self.launch.agent_pid
            )
            hold.callback(self.preempt.install())  # a notice from here on stops the job after a step
            self.strategy = build(cfg.strategy)
            hold.callback(self.strategy.teardown)  # released last: the others may still need the group
            self.strategy.setup()
            check_nodes(self.strategy, cfg, self.run_dir)  # same config, shared run dir, node-local caches
            main = self.strategy.is_main
            seed_everything(cfg.seed, deterministic=cfg.trainer.deterministic)
            os.makedirs(self.run_dir, exist_ok=True)
            self.goodput = GoodputLog(
                self.run_dir,
                self.ledger,
                enabled=main,
                auto_restart=self.launch.restart > 0,
                start_method=self.launch.start_method,
            )
            hold.push(self._record_failure)
            t = cfg.trainer
            self.precision = Precision(t.precision, self.strategy.device, strategy_casts=self._strategy_casts())
            if t.compile:
                compiler.check(t.compile_backend, t.compile_mode)
            self.accum = int(t.grad_accum_steps)
            self.data = build(cfg.data, _convert_="partial")
            self.task = build(cfg.task)
            model = build(cfg.model)
            if t.channels_last and self.strategy.channels_last_params:  # (else the inputs alone are NHWC)
                model = model.to(memory_format=torch.channels_last)
            self.model = self.strategy.wrap(model)
            if t.compile:  # in place, after wrapping (torch's advice for DDP and FSDP2); parameter names unchanged
                compiler.compile_model(self.model, t.compile_backend, t.compile_mode)
            self.compile_clock = compiler.CompileClock() if t.compile else None
            self.optimizer = build(cfg.optim.optimizer)(self.model.parameters())
            common = dict(
                dataset=self.data,
                batch_size=cfg.trainer.batch_size,
                seed=cfg.seed,
                rank=self.strategy.rank,
                world_size=self.strategy.world_size,
                pin_memory=self.strategy.pin_memory,
            )
            self.loader = build(cfg.loader, split="train", train=True, **common)
            self.eval_loader = build(cfg.loader, split=cfg.trainer.eval_split, train=False, **common)
            self.total_steps = self._total_steps()
            self.scheduler = build(cfg.optim.scheduler)(self.optimizer, total_steps=self.total_steps)
            self.state = TrainState(self.progress, self.loader, self.scheduler, self.fingerprint(), self.precision)
            self.target = Target(self.model, self.optimizer, self.state)
            self.metrics_file = MetricsFile(os.path.join(self.run_dir, "metrics.jsonl"), enabled=main)
            hold.callback(self.metrics_file.close)
            self.logger = build(cfg.logger) if main else build({"_target_": "pitstop.telemetry.logger.base.NullLogger"})
            hold.callback(self._close_logger, "FAILED")  # a no-op once finish() closed it
            self.ckpt = build(cfg.ckpt)
            hold.callback(self._release_ckpt)
            self.ckpt.setup(
                self.strategy,
                self.report,
                fault_mtbf=OmegaConf.select(cfg, "fault.mtbf_seconds"),
                failures=self.goodput.failures(),
                job_seconds=self.goodput.job_seconds(),
            )
            if cfg.data.get("record_sample_ids"):
                self._open_sample_log()
            self.fault = build(cfg.fault)
            hold.callback(self.fault.close)
            self.fault.bind(
                FaultContext(
                    run_dir=self.run_dir,
                    rank=self.strategy.rank,
                    world_size=self.strategy.world_size,
                    total_steps=self.total_steps,
                    max_restarts=int(cfg.trainer.get("max_restarts") or 0),
                    start_wall=self.ledger.start_wall,
                    checkpointer=self.ckpt,
                    grad_accum_steps=self.accum,
                )
            )
            self.profiler = StepProfiler(
                t.profile.steps,
                t.profile.memory,
                self.run_dir,
                self.strategy.rank,
                self.strategy.device,
                self.total_steps,
            )
            hold.callback(self.profiler.close)
            self.throughput = Throughput(self.strategy.device, t.precision)
            self.callbacks = [build(c) for c in (cfg.get("callbacks") or {}).values() if c]

    def _strategy_casts(self) -> bool:
        """The strategy applies ``trainer.precision`` itself (FSDP's mixed-precision policy): it must agree."""
        casts = self.strategy.compute_dtype
        if casts is not None and casts != DTYPES.get(self.cfg.trainer.precision):
            raise ConfigError(
                f"strategy.mixed_precision casts to {str(casts).replace('torch.', '')} but "
                f"trainer.precision={self.cfg.trainer.precision}; set only trainer.precision"
            )
        return casts is not None

    def _on_hang(self, message: str) -> None:
        """The watchdog's thread, on a hang: the ledger records the attempt as hung (the main thread is stuck)."""
        if self.goodput is not None:
            self.goodput.write(self.step, status="hung")
        if self.launch.supervised:  # the supervisor names the cause of the restart
            record_error(self.run_dir, message)

    def close(self) -> None:
        """Release what setup() acquired (``run()`` does this itself; for callers that drive the steps)."""
        self._resources.close()

    def _record_failure(self, exc_type, exc, tb) -> bool:
        """On the way out of a failed run: the ledger records the failed attempt (a config error, or a changed
        config refused at resume, is no attempt: it must leave nothing a later run would count)."""
        if isinstance(exc, (ConfigError, FingerprintMismatch)):
            self.goodput.withdraw()
        elif exc is not None and not isinstance(exc, (Preempted, Hung)) and not self._preempted:
            # (a hang and a preemption are recorded as such, also when a launcher's handler exits after one)
            self.goodput.write(self.step, status="failed")
        return False

    def _release_ckpt(self) -> None:
        try:
            self.ckpt.close()  # a save in flight becomes durable (or fails) before the process goes down
        except ERRORS as e:  # noqa: BLE001 - the original error matters more
            if not self._finished:
                log.error("while failing, the checkpoint in flight also failed: %s", e)
            else:
                raise

    def _total_steps(self) -> int:
        t = self.cfg.trainer
        if t.max_steps is not None:
            return int(t.max_steps)
        # (with gradient accumulation a step takes grad_accum_steps batches; a window may span two epochs)
        batches = self._batches_left()  # (at setup: the loader is at the start, so every epoch's batches)
        if batches < self.accum:
            raise ConfigError(
                f"trainer.epochs={t.epochs} is {batches} batch(es) per rank, fewer than "
                f"trainer.grad_accum_steps={self.accum}: not one step; train longer or accumulate less"
            )
        return batches // self.accum

    def _batches_left(self) -> int:
        """Batches each rank has left of ``trainer.epochs`` from the loader's position, at this world size."""
        loader, epochs = self.loader, int(self.cfg.trainer.epochs)
        left = max(0, loader.steps_per_epoch() - loader.batches) if loader.epoch < epochs else 0
        return left + sum(loader.steps_per_epoch(e) for e in range(loader.epoch + 1, epochs))

    def _steps_left_at_this_world_size(self) -> None:
        """``trainer.epochs`` after a resume: the steps left are the batches left of the epochs at *this* world
        size (a checkpoint written by another number of ranks, e.g. after a node was lost or came back, leaves
        the rest of its epoch to more or fewer ranks). The LR schedule (as saved) is re-planned to decay over them."""
        total = self.step + self._batches_left() // self.accum
        planned = planned_steps(self.scheduler) or self.total_steps
        if total != planned:
            fits = replan(self.scheduler, self.step, total)
            log.info(
                "resumed at step %d at world size %d: %d epochs end at step %d (were %d); %s",
                self.step,
                self.strategy.world_size,
                self.cfg.trainer.epochs,
                total,
                planned,
                "the LR schedule decays over the steps left from where it was"
                if fits
                else f"the LR schedule ({type(self.scheduler).__name__}) cannot be re-planned and keeps its length",
            )
        self.total_steps = total

    def fingerprint(self) -> dict:
        """Config parts that must not change across a resume."""
        cfg = self.cfg
        fp = {
            **self.data.fingerprint(),
            "seed": int(cfg.seed),
            "model": OmegaConf.to_yaml(cfg.model, resolve=True),
            "batch_size": int(cfg.trainer.batch_size),
        }
        if self.accum != 1:  # (absent when 1: checkpoints from before the option still resume)
            fp["grad_accum_steps"] = self.accum
        return fp

    _sample_file = None

    def _open_sample_log(self) -> None:
        """``samples.rank{R}.jsonl``: per attempt a header (read by ``python -m pitstop.audit``), then each
        step's sample keys. The attempt id is rank 0's clock at its setup, the same on every rank."""
        path = os.path.join(self.run_dir, f"samples.rank{self.strategy.rank}.jsonl")
        f = open(path, "a", buffering=1 << 16)
        self._sample_file = f
        self._attempt_id = self.strategy.broadcast_object(round(time.time(), 6))
        self._resources.callback(f.close)
        if self.accum == 1:
            self.loader.sample_log = lambda keys: f.write(
                f'{{"step":{self.step + 1},"keys":{keys!r}}}\n'.replace("'", '"')
            )
        else:  # which micro-batch of the step
            self.loader.sample_log = lambda keys: f.write(
                f'{{"step":{self.step + 1},"micro":{self._micro},"keys":{keys!r}}}\n'.replace("'", '"')
            )

    # ---- the run ----------------------------------------------------------------------------------
    def run(self) -> dict:
        with self._resources:  # however it ends, what setup() acquired is released, in reverse order
            self.setup()
            self.restore()
            self.fit()
            return self.finish()

    def restore(self) -> None:
        with self.ledger.measure("restore"), self.watchdog.phase("restore"):
            self.resumed_from = self.ckpt.restore(self.target)
        self._evaluated_epochs = self._epochs_ended()
        if self.resumed_from is not None and self.cfg.trainer.max_steps is None:
            self._steps_left_at_this_world_size()
        self.goodput.resumed(self.resumed_from)
        self.goodput.write(self.step)
        if self._sample_file is not None:  # this attempt: where it resumed, its world, what an epoch holds
            t = self.cfg.trainer
            self._sample_file.write(
                json.dumps(
                    {
                        "attempt": self._attempt_id,
                        "resumed_from": self.resumed_from or 0,
                        "rank": self.strategy.rank,
                        "world_size": self.strategy.world_size,
                        "epoch_samples": self.data.index.num_samples("train"),
                        "epochs": int(t.epochs) if t.max_steps is None else None,
                    }
                )
                + "\n"
            )
        if self.resumed_from is not None:
            log.info("resumed from step %d", self.resumed_from)
            self.metrics_file.write({"event": "resume", "step": self.step})
        if self.strategy.is_main:
            tags = {"strategy": self.strategy.name, "ckpt": self.ckpt.name, "loader": self.loader.kind}
            sweep = self.cfg.get("sweep")
            if sweep:  # mlflow ui: filter tags.sweep = '<id>' and compare the jobs side by side
                tags.update(
                    {"sweep": str(sweep.id), "sweep_job": str(sweep.job), "sweep_overrides": str(sweep.overrides)}
                )
            self.logger.start(self.run_dir, flatten(self.cfg), tags=tags)

    def fit(self) -> None:
        ledger = self.ledger
        batches = Batches(self.loader, self.watchdog)
        bar = self._progress_bar()
        window = {"t": time.perf_counter(), "samples": 0, "fetch": 0.0, "compute": 0.0, "n": 0}
        for cb in self.callbacks:
            cb.on_train_start(self)
        watch = self.watchdog
        # closing(): the loader's workers stop when the loop ends, also on an error (a traceback kept by the
        # caller would otherwise keep them alive)
        with closing(batches), watch.phase("step", timed=False):  # each iteration is timed by beat()
            while self.step < self.total_steps:
                watch.beat()  # 0. a step has ended (hang detection)
                self.profiler.before_step(self.step + 1)
                t0 = time.perf_counter()
                out = self.train_step(batches)  # 1. fetch + step (syncs on loss.item())
                took = time.perf_counter() - t0
                compiling = self.compile_clock.take() if self.compile_clock is not None else 0.0
                compute = took - out.data_wait - out.staging - compiling
                ledger.add("data_wait", out.data_wait)
                ledger.add("compute", compute)
                ledger.add("compile", compiling)
                self.progress.step += 1
                self.progress.samples_seen += out.samples * self.strategy.world_size
                if not compiling:  # (a step that compiled is no measure of throughput)
                    self.throughput.add(out.data_wait + compute, out.samples)
                if not self._flops_counted:
                    with ledger.measure("init"):
                        self._count_flops()
                window["samples"] += out.samples
                window["fetch"] += out.data_wait
                window["compute"] += compute
                window["n"] += 1
                self.profiler.after_step(self.step)
                with ledger.measure("logging"):  # 2. record
                    self.record(out.loss, out.data_wait, compute, window, bar)
                if self._eval_due():  # 3. evaluate
                    self.evaluate()
                last = self.step >= self.total_steps
                with watch.phase("checkpoint"):
                    saved = self.ckpt.maybe_save(self.target, self.step, last=last)  # 4. save
                ledger.add("checkpoint", saved.blocked)
                if saved.started == self.step:
                    self._flush_logs()  # what a resume would not redo is on disk
                    self.goodput.mark(self.step)
                self.goodput.tick(self.step)
                self.fault.after_step(self.step)
                for cb in self.callbacks:
                    cb.on_step_end(self)
                if self.strategy.agree(self.preempt.received is not None):  # 5. a preemption notice on any rank
                    self._stop_for_preemption()
        if bar is not None:
            bar.close()

    def _stop_for_preemption(self) -> None:
        """Every rank is here after the same step: save now if a save fits the grace period, wait until it is
        durable, write down where the time went, and leave with the 'requeue me' exit status."""
        why = self.preempt.received.name if self.preempt.received is not None else "a peer's notice"
        took = float(self.ckpt.stats().get("total_seconds_mean") or 0.0)  # a measured save, start -> durable
        if self.ckpt.root is None:
            log.warning(
                "preempted (%s) at step %d: no checkpoints (ckpt=none), the next run starts over", why, self.step
            )
        elif self.ckpt.last_started == self.step:
            log.warning("preempted (%s) at step %d: the save of this step is already under way", why, self.step)
        elif took > self.preempt.grace:
            log.warning(
                "preempted (%s) at step %d: a save takes ~%.1f s, more than trainer.preempt_grace_seconds=%g; "
                "keeping the newest complete checkpoint (step %s)",
                why,
                self.step,
                took,
                self.preempt.grace,
                self.ckpt.last_started,
            )
        else:
            with self.watchdog.phase("checkpoint"):
                self.ledger.add("checkpoint", self.ckpt.maybe_save(self.target, self.step, force=True).blocked)
            log.warning("preempted (%s) at step %d: saved it", why, self.step)
        with self.ledger.measure("checkpoint"), self.watchdog.phase("checkpoint"):
            self.ckpt.wait()  # durable (or failed, per ckpt.on_error) before the process goes
        self._flush_logs()
        self.goodput.write(self.step, status="preempted")
        self._preempted = True
        self.preempt.forward()  # a launcher's own handler (submitit: requeue, then exit) runs after our save
        raise Preempted(f"preempted ({why}) after step {self.step}; run the same command again to resume")

    def train_step(self, batches: Batches) -> StepResult:
        """One optimizer step over ``trainer.grad_accum_steps`` micro-batches (gradients reduced across ranks on
        the last one only), in ``trainer.precision``."""
        self.optimizer.zero_grad(set_to_none=True)
        losses, samples, wait = [], 0, 0.0
        for micro in range(1, self.accum + 1):
            self._micro = micro
            t = time.perf_counter()
            batch = self._device_batch(batches.next())
            wait += time.perf_counter() - t
            samples += len(batch[-1]) if isinstance(batch, (list, tuple)) else self.cfg.trainer.batch_size
            if micro == 1 and not self._flops_counted:
                self._first_batch = batch  # its shapes, for counting a step's FLOPs once
            with self.strategy.no_sync(self.model) if micro < self.accum else nullcontext():
                with self.precision.autocast():
                    loss = self.task.loss(self.model, batch)
                self.precision.backward(loss / self.accum if self.accum > 1 else loss)
            losses.append(loss.detach())
            if micro < self.accum:
                self.fault.after_micro_batch(self.step + 1, micro)
        loss = losses[0] if self.accum == 1 else torch.stack(losses).float().mean()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss is {loss.item()} at step {self.step + 1}; lower optim.lr or check the data")
        self.precision.unscale(self.optimizer)  # (fp16) clipping reads the true gradients
        if self.cfg.trainer.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.trainer.grad_clip)
        staging = self.ckpt.wait_staging()  # staging must finish before params change
        self.ledger.add("checkpoint", staging)
        # (what forward changes, BatchNorm statistics, was copied when the save started)
        self.precision.step(self.optimizer)
        self.scheduler.step()
        return StepResult(loss.item(), samples, wait, staging)

    _first_batch: Any = None
    _flops_counted = False
    _micro = 1

    def _device_batch(self, batch: Any) -> Any:
        batch = self.data.on_device(self.strategy.to_device(batch))
        if self.cfg.trainer.channels_last:  # every 4-D floating input (images) in NHWC, as the model's weights
            batch = map_tensors(_channels_last, batch)
        return batch

    def _count_flops(self) -> None:
        """FLOPs of one optimizer step on this rank (forward + backward of each micro-batch), once per attempt."""
        batch, self._first_batch, self._flops_counted = self._first_batch, None, True
        # (the first meta-device pass loads torch's meta kernels, ~2 s: a restart reads the count back instead)
        key = json.dumps(
            [
                OmegaConf.to_yaml(self.cfg.model, resolve=True),
                str(self.cfg.task.loss),
                map_tensors(lambda t: [list(t.shape), str(t.dtype)], batch),
            ],
            sort_keys=True,
            default=lambda leaf: type(leaf).__name__,
        )
        flops = cached_count(
            os.path.join(self.run_dir, "flops.json"),
            key,
            self.strategy.is_main,
            lambda: count_step_flops(lambda: build(self.cfg.model), self.task.loss, batch),
        )
        self.throughput.flops_per_step = flops * self.accum if flops is not None else None
        if flops:
            log.info("one step: %.3g GFLOP per rank (%s)", flops * self.accum / 1e9, self.throughput.peak_note)

    def record(self, loss: float, fetch: float, compute: float, window: dict, bar: Any) -> None:
        lr = self.optimizer.param_groups[0]["lr"]
        self.metrics_file.write(
            {
                "step": self.step,
                "epoch": self.loader.epoch,
                "loss": loss,
                "lr": lr,
                "fetch_seconds": round(fetch, 6),
                "compute_seconds": round(compute, 6),
            }
        )
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", epoch=self.loader.epoch, refresh=False)
        if self.step % self.cfg.trainer.log_every_steps == 0 or self.step == self.total_steps:
            now = time.perf_counter()
            elapsed = max(now - window["t"], 1e-9)
            speed = {
                "samples_per_s": window["samples"] * self.strategy.world_size / elapsed,
                "samples_per_s_per_device": window["samples"] / elapsed,
            }
            mfu = self.throughput.mfu(window["n"] / elapsed)
            if mfu is not None:
                speed["mfu"] = mfu
            self.logger.log_metrics(
                {
                    "loss": loss,
                    "lr": lr,
                    "epoch": self.loader.epoch,
                    **speed,
                    "fetch_seconds": window["fetch"] / window["n"],
                    "compute_seconds": window["compute"] / window["n"],
                    "data_wait_fraction": window["fetch"] / elapsed,
                },
                self.step,
            )
            self.metrics_file.write({"step": self.step, **{k: round(v, 6) for k, v in speed.items()}})
            io = self.data_stats()  # cumulative: cache hits/misses, bytes from the source, retries
            changed = {k: v for k, v in io.items() if self._last_io.get(k) != v}
            if changed:  # counters that moved since the last log (most stop moving once the cache is warm)
                self.logger.log_metrics(changed, self.step)
                self.metrics_file.write({"step": self.step, **changed})
                self._last_io = io
            self.metrics_file.flush()
            window.update(t=now, samples=0, fetch=0.0, compute=0.0, n=0)

    def data_stats(self) -> dict[str, float]:
        return {k: v for k, v in self.loader.stats.items() if k != "samples"}

    def report(self, metrics: dict[str, float], step: int) -> None:
        """Extra metrics from components (e.g. per-save checkpoint costs): tracker + metrics.jsonl."""
        if self.logger is not None:  # (None once the run has ended)
            self.logger.log_metrics(metrics, step)
        self.metrics_file.write({"step": step, **metrics})

    def _flush_logs(self) -> None:
        self.metrics_file.flush()
        if self._sample_file is not None:
            self._sample_file.flush()

    def _eval_due(self) -> bool:
        every = self.cfg.trainer.eval_every_steps
        if every:
            return self.step % every == 0 or self.step == self.total_steps
        ended = self._epochs_ended()  # (with accumulation an epoch can end inside a step)
        due = ended > self._evaluated_epochs or self.step == self.total_steps
        self._evaluated_epochs = ended
        return due

    _evaluated_epochs = 0

    def _epochs_ended(self) -> int:
        return self.loader.epoch + int(self.loader.batches >= self.loader.steps_per_epoch())

    def evaluate(self) -> dict[str, float]:
        with self.ledger.measure("eval"), self.watchdog.phase("eval"):
            # Every rank runs the same number of forwards (they are collectives under DDP/FSDP): see iterate_once.
            passes = self.eval_loader.iterate_once(
                self.cfg.trainer.eval_max_batches, share=self.strategy.broadcast_object
            )
            batches = ((self._device_batch(b), counted) for b, counted in passes)
            with self.precision.autocast():
                out = self.task.evaluate(self.model, batches, self.strategy.all_reduce_sum, self.strategy.device)
        if self.compile_clock is not None:  # the first evaluation compiles the model in eval mode
            compiling = self.compile_clock.take()
            self.ledger.add("eval", -compiling)
            self.ledger.add("compile", compiling)
        self.last_eval = out
        self.logger.log_metrics(out, self.step)
        self.metrics_file.write({"step": self.step, **out})
        log.info("step %d: %s", self.step, ", ".join(f"{k}={v:.4f}" for k, v in out.items()))
        return out

    def finish(self) -> dict:
        if not self.last_eval:  # e.g. restarted after the last step: report the final model anyway
            self.evaluate()
        with self.ledger.measure("checkpoint"), self.watchdog.phase("checkpoint"):
            self.ckpt.close()  # never report success with a save still in flight
        self._finished = True
        self.fault.close()
        account = self.goodput.write(self.step, status="finished")
        restart = {"restart_seconds": account["restart_seconds"]} if account["restart_seconds"] is not None else {}
        self.logger.log_metrics(
            {
                "goodput": account["goodput"],
                "restarts": account["restarts"],
                **restart,
                **{f"goodput_{k}_seconds": v for k, v in account["totals"].items()},
            },
            self.step,
        )
        digest = self.params_sha256()
        summary = {
            "final_step": self.step,
            "total_steps": self.total_steps,
            "epoch": self.loader.epoch,
            "samples_seen": self.samples_seen,
            "resumed_from": self.resumed_from,
            "metrics": self.last_eval,
            "params_sha256": digest,
            "data": {**self.loader.stats, "data_wait_fraction": self._data_wait_fraction()},
            "checkpoint": self.ckpt.stats(),
            "strategy": self.strategy.name,
            "world_size": self.strategy.world_size,
            "throughput": self.throughput.summary(),
            "precision": self.precision.name,
            "goodput": {k: account[k] for k in ("goodput", "totals", "restarts", "failures", "restart_seconds")},
        }
        for cb in self.callbacks:
            cb.on_train_end(self)
        if self.strategy.is_main:
            self.logger.log_metrics({f"time_{k}": v for k, v in self.ledger.split().items()}, self.step)
        summary.update(self._close_logger("FINISHED"))
        self.metrics_file.close()
        split = self.ledger.split()
        summary["wall_clock"] = split
        summary["samples_per_s"] = self.samples_seen / max(split["total"], 1e-9)
        if self.strategy.is_main:
            write_json_atomic(os.path.join(self.run_dir, "summary.json"), summary)
            log.info(
                "done: step %d, %s, params_sha256=%s",
                self.step,
                ", ".join(f"{k}={v:.4f}" for k, v in self.last_eval.items()),
                digest[:16],
            )
            log.info("%s", table(account))
        return summary

    def _data_wait_fraction(self) -> float:
        """Share of step time (fetch + compute) spent waiting for the next batch."""
        wait, compute = self.ledger.seconds["data_wait"], self.ledger.seconds["compute"]
        return round(wait / max(wait + compute, 1e-9), 4)

    def _close_logger(self, status: str) -> dict:
        """End the tracker run (FINISHED, or FAILED on the way out of a failed run); only the first call counts."""
        logger, self.logger = self.logger, None
        return (logger.close(status) or {}) if logger is not None else {}

    def params_sha256(self) -> str:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state_sha256(sd)

    def _progress_bar(self):
        mode = self.cfg.trainer.progress_bar
        if not self.strategy.is_main or mode is False or (mode == "auto" and not sys.stderr.isatty()):
            return None
        from tqdm import tqdm

        return tqdm(total=self.total_steps, initial=self.step, desc="train", dynamic_ncols=True)


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 and t.is_floating_point() else t
