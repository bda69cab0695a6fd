"""The generic training loop, assembled from the config.  It knows nothing about images.

    Runner(cfg, run_dir, launch).run()
      setup()    strategy -> seed -> data -> model -> optimizer/schedule -> loaders -> checkpointer -> logger -> fault
      restore()  the checkpointer loads the newest complete checkpoint (if any) into the train state
      fit()      step (fetch -> forward/backward, per micro-batch -> optimizer) -> record -> (eval) -> (save)
      finish()   final eval and save, wait for in-flight saves, summary.json

The Runner runs the loop; its helpers own the bookkeeping: ``assembly`` builds what a step needs, ``metering``
measures and records the steps, ``steps`` plans how many there are, ``state`` is what a checkpoint restores,
``sample_log`` proves exactly-once, ``summary`` writes the end, ``resilience.preempt`` decides the save on a
notice. Each component kind has one contract (``Strategy``, ``ShardLoader``, ``Checkpointer``, ``Logger``,
``Fault``) and gets the few collaborators it uses passed in; callbacks get a read-only ``RunView``. What ``setup()``
acquires is released in reverse order however the run ends (``self._resources``), also if setup fails half-way.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import ExitStack, closing
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pitstop.ckpt.contract import SaveResult, Target, save_errors
from pitstop.config import flatten, secrets, validate
from pitstop.config.build import build, target_modules
from pitstop.data.loader import server as worker_server
from pitstop.goodput.ledger import Ledger
from pitstop.resilience.health_record import record_timing
from pitstop.resilience.node_book import node_name
from pitstop.resilience.preempt import Preempted, PreemptionNotice, save_for_notice
from pitstop.strategy.nodes import all_reduce_latency, check_nodes
from pitstop.train import assembly, process, steps, summary
from pitstop.parts.digest import model_sha256
from pitstop.parts.launch_facts import LaunchFacts, facts_from_env, record_error
from pitstop.train.metering import progress_bar
from pitstop.train.records import Records
from pitstop.train.instability import Guard, Instability
from pitstop.train.rollback import Rollback, RunDirState
from pitstop.train.sdc import SdcCheck
from pitstop.parts.seed import seed_everything
from pitstop.train.state import Batches, Progress, StepResult, TrainState, live_state, load_live_state
from pitstop.train.step import Stepper
from pitstop.train import straggler_groups

log = logging.getLogger("pitstop")


class Runner:
    def __init__(self, cfg: DictConfig, run_dir: str, launch: LaunchFacts | None = None):
        """``launch``: how this attempt was launched (from the environment when not given: a person's run)."""
        validate(cfg)
        self.cfg, self.run_dir = cfg, os.path.abspath(run_dir)
        self.launch = launch if launch is not None else facts_from_env(os.environ)
        self.ledger = Ledger(self.launch.program_start, self.launch.health_seconds)
        self.progress = Progress()
        self.resumed_from: int | None = None
        self.callbacks: list[Any] = []
        self.last_eval: dict[str, float] = {}
        self._resources = ExitStack()
        self._finished = self._preempted = False
        self.records = Records()
        self.watchdog = assembly.watchdog(cfg.trainer.hang)
        self.stepper: Stepper | None = None  # (setup builds it)
        self._pins: dict[str, int | None] = {}  # (what each kind of rollback needs retention to keep)
        self._batches: Batches | None = None  # (fit's batch stream: a rollback restarts it)

    @property
    def step(self) -> int:
        return self.progress.step

    # ---- setup ------------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg, t, hold = self.cfg, self.cfg.trainer, self._resources
        hold.callback(process.frozen_heap())
        process.log_thread_failures()
        if OmegaConf.select(cfg, "loader.num_workers", default=0):
            # The data workers' fork server, forked now while this process has no threads of its own yet
            # (none may exist at a fork) and already has the components' modules: ready at once, no imports.
            with self.ledger.measure("init"):
                log.debug("data workers' fork server: %s", worker_server.start(target_modules(cfg)))
        # A launcher (the supervisor, the elastic agent, torchrun) restarts a process that exits on a hang.
        rank = int(os.environ.get("RANK", 0))
        world = int(os.environ.get("WORLD_SIZE", 1))  # (the ranks a hang report compares: see _where)
        hold.callback(self.watchdog.start(rank, self.run_dir, self._on_hang, self.launch.launched, world, self._where))
        with self.ledger.measure("init"), self.watchdog.phase("setup"):
            self.preempt = PreemptionNotice(t.preempt_signals, t.preempt_grace_seconds, self.launch.agent_pid)
            hold.callback(self.preempt.install())  # a notice from here on stops the job after a step
            # (read before the process group forms: no rank's attempt is on record yet, on any rank)
            fresh = not os.path.exists(os.path.join(self.run_dir, "goodput.json"))
            self.strategy = build(cfg.strategy)
            hold.callback(self.strategy.teardown)  # released last: the others may still need the group
            self.groups = self.strategy.groups  # (strategy=ft: the replica groups; else one group that commits)
            self.groups.expect_config(cfg)
            self.strategy.share_cores(int(OmegaConf.select(cfg, "loader.num_workers", default=0) or 0))
            self.strategy.setup()
            self.watchdog.at_least("peers", self.groups.peer_wait_seconds())
            check_nodes(self.strategy, cfg, self.run_dir)  # same config, shared run dir, node-local caches
            if t.health.enabled and self.strategy.world_size > 1:  # (node health's check that needs the group)
                latency = all_reduce_latency(self.strategy)
                if self.strategy.is_main and latency is not None:
                    log.info("health: a one-element all-reduce over %d ranks takes %.2f ms", self.strategy.world_size,
                             latency * 1e3)  # fmt: skip
            seed_everything(cfg.seed, deterministic=t.deterministic)
            os.makedirs(self.run_dir, exist_ok=True)
            self.records.goodput = assembly.build_goodput_log(self.run_dir, self.ledger, self.strategy, self.launch)
            hold.push(self._record_failure)
            parts = assembly.build_step_parts(cfg, self.strategy, self.groups, fresh=fresh)
            self.precision, self.accum, self.data, self.task = parts.precision, parts.accum, parts.data, parts.task
            self.model, self.compile_clock, self.optimizer = parts.model, parts.compile_clock, parts.optimizer
            self.loader, self.eval_loader = parts.loader, parts.eval_loader
            hold.callback(self.loader.close)  # (strategy=ft's loader: its worker pool ends before the process does)
            self.total_steps = steps.total_steps(t, self.loader, self.accum)
            self.scheduler = build(cfg.optim.scheduler)(self.optimizer, total_steps=self.total_steps)
            self.length = steps.RunLength(t, self.loader, self.accum, self.scheduler, self.groups, self.strategy)
            self.evals = steps.EvalSchedule(t.eval_every_steps, self.loader)
            fp = assembly.fingerprint(cfg, self.data, self.accum)
            self.state = TrainState(self.progress, self.loader, self.scheduler, fp, self.precision)
            self.target = Target(self.model, self.optimizer, self.state)
            self.run_state = RunDirState(self.run_dir, self.strategy.is_main)  # (RUN_DIR/instability.json)
            self.groups.attach(
                lambda: live_state(self.target),
                lambda sd: load_live_state(self.target, sd),
                lambda phase, limit: self.watchdog.phase(phase, first=limit),
            )
            tele = assembly.build_telemetry(cfg, self.run_dir, self.strategy, self.total_steps, hold)
            self.records.metrics_file, self.records.logger = tele.metrics_file, tele.logger
            self.profiler, self.throughput, self.meter = tele.profiler, tele.throughput, tele.meter
            hold.callback(self.records.close_tracker, "FAILED")  # a no-op once finish() closed it
            self.ckpt = build(cfg.ckpt)
            hold.callback(self._release_ckpt)
            goodput = self.records.goodput
            intervals = assembly.interval_policy(cfg, goodput.failures(), goodput.job_seconds())
            self.ckpt.setup(self.strategy, self.records.report, intervals, node_name())
            self.rollbacks = Rollback(self.strategy, self.ckpt, self.target, self.loader, self.run_state)
            self.records.samples = assembly.build_sample_log(
                cfg, self.run_dir, self.strategy, self.accum, self._taking, self.loader, hold
            )
            self.fault = assembly.build_fault(
                cfg, self.run_dir, self.strategy, self.groups, self.total_steps, self.ledger, self.ckpt, hold,
                self.data, model=self.model, optimizer=self.optimizer,
            )  # fmt: skip
            settings = t.instability
            guard = None
            if settings.enabled:
                shares = self.groups.shares_data_order
                guard = Guard(settings, self.strategy, self.precision, self.task, self.fault, shares)
            self.instability = Instability(
                settings,
                self.run_state,
                self.loader,
                self._skipped,
                lambda at, why: self.rollback(at, why),
                lambda step: self._pin("instability", step),
            )
            # (its hooks on the parameters are in place before the first backward)
            self.straggler = straggler_groups.build(
                t.straggler, self.strategy, self.groups, self.model, self.records.straggler
            )
            # (a table of the step's collaborators, one name each)
            self.stepper = Stepper(
                progress=self.progress, strategy=self.strategy, groups=self.groups, model=self.model,
                optimizer=self.optimizer, scheduler=self.scheduler, precision=self.precision, task=self.task,
                data=self.data, loader=self.loader, ckpt=self.ckpt, fault=self.fault, ledger=self.ledger,
                watchdog=self.watchdog, meter=self.meter, accum=self.accum, batch_size=t.batch_size,
                grad_clip=t.grad_clip, channels_last=t.channels_last, guard=guard, straggler=self.straggler,
            )  # fmt: skip
            self.sdc = SdcCheck(
                t.sdc.enabled, t.sdc.interval, self.strategy, self.model, self.optimizer, self.ledger, self.run_dir,
                self.records.sdc_found, lambda at_most, why: self.rollback(at_most, why, keep_data=False, bucket="sdc"),
                replay=t.sdc.replay, target=self.target, retake=self._retake,
                pin=lambda step: self._pin("sdc", step), groups=self.groups,
            )  # fmt: skip
            self.callbacks = [build(c) for c in (cfg.get("callbacks") or {}).values() if c]
            self.view = summary.RunView(self)
            if self.launch.matmul_seconds is not None:  # (the node's health check let this attempt set up: a reference)
                record_timing(self.run_dir, node_name(), self.launch.matmul_seconds)

    def _taking(self) -> tuple[int, int]:
        micro = self.stepper.micro if self.stepper is not None else 1
        return self.step + 1, micro  # the step being taken, its micro-batch

    def _where(self) -> tuple[int, int, str | None]:
        """Where this rank's loop is, for the hang watchdog (its thread reads it about once a second): the last step
        done, the collectives entered, the one it is in."""
        strategy = getattr(self, "strategy", None)  # (not before setup builds it)
        count = strategy.collectives if strategy is not None else None
        return self.step, count.entered if count is not None else 0, count.inside if count is not None else None

    def _on_hang(self, message: str) -> None:
        """The watchdog's thread, on a hang: the attempt is recorded as hung (the main thread is stuck)."""
        self.records.hung(self.step)
        if self.launch.supervised:  # the supervisor names the cause of the restart
            record_error(self.run_dir, message)

    def close(self) -> None:
        """Release what setup() acquired (``run()`` does this itself; for callers that drive the steps)."""
        self._resources.close()

    def _record_failure(self, exc_type: type | None, exc: BaseException | None, tb: object) -> bool:
        self.records.failed(exc, self.step, self._preempted)
        return False

    def _release_ckpt(self) -> None:
        try:
            self.ckpt.close()  # a save in flight becomes durable (or fails) before the process goes down
        except save_errors() as e:  # noqa: BLE001 - the original error matters more
            if not self._finished:
                log.error("while failing, the checkpoint in flight also failed: %s", e)
            else:
                raise

    # ---- the run ----------------------------------------------------------------------------------
    def run(self) -> dict:
        with self._resources:  # however it ends, what setup() acquired is released, in reverse order
            self.setup()
            self.restore()
            self.fit()
            return self.finish()

    def restore(self) -> None:
        with self.ledger.measure("restore"), self.watchdog.phase("restore"):
            healed = self.groups.join()  # (strategy=ft) healed from a live peer's state: no checkpoint is read
            if healed:
                self.resumed_from = self.step
            else:
                self.resumed_from = self.ckpt.restore(self.target)
                if self.resumed_from is not None:
                    self.rollbacks.apply_skip(self.resumed_from)  # (data a rollback to it skipped stays skipped)
                self.groups.restored(self.step)
        self.evals.resumed()
        self.sdc.started(self.step)  # (every rank holds the same state here)
        self.straggler.restarted(self.step)
        t = self.cfg.trainer
        if self.resumed_from is not None:
            self.total_steps = self.length.after_resume(self.step, self.total_steps)
        epochs = int(t.epochs) if t.max_steps is None else None
        self.records.started(
            self.step,
            self.resumed_from,
            healed,
            self.strategy.world_size,
            self.data.index.num_samples("train"),
            epochs,
            self.ckpt.restored_from,
        )
        self.loader.warm()  # (loader=cached) the position's first shards, if not asked for at build
        if self.strategy.is_main:
            tags = summary.run_tags(self.cfg, self.strategy.name, self.ckpt.name, self.loader.kind)
            self.records.logger.start(self.run_dir, secrets.redact(flatten(self.cfg)), tags=tags)

    def fit(self) -> None:
        ledger, meter, watch = self.ledger, self.meter, self.watchdog
        batches = self._batches = Batches(self.loader, self.watchdog)
        bar = progress_bar(self.cfg.trainer.progress_bar, self.strategy.is_main, self.total_steps, self.step)
        meter.start(self.records.logger, bar, lambda: self.loader.stats)
        for cb in self.callbacks:
            cb.on_train_start(self.view)
        # closing(): the loader's workers stop when the loop ends, also on an error (a traceback kept by the
        # caller would otherwise keep them alive)
        with closing(batches), watch.phase("step", timed=False):  # each iteration is timed by beat()
            while self.step < self.total_steps:
                watch.beat()  # 0. a step has ended (hang detection)
                self.profiler.before_step(self.step + 1)
                t0 = time.perf_counter()
                out = self.train_step(batches)  # 1. fetch + step (syncs on loss.item())
                took = time.perf_counter() - t0
                ledger.add("quorum", out.quorum)
                if not out.committed:  # (strategy=ft) a peer failed during the step: it is redone next
                    ledger.add("discarded", took - out.quorum)
                    self.records.outcome(self.step + 1, False, self.groups.quorum_id)
                    self._stop_if_noticed()  # (a notice: stop at the last step committed, not in a quorum that may
                    continue  # never form again)
                if out.skipped is not None:  # an unstable step: not applied (trainer.instability)
                    ledger.add("instability", took - out.quorum)
                    rolled = self.instability.skipped(self.step + 1, out.skipped, out.loss, out.culprits, out.keys)
                    if not rolled:  # (epochs: its batches are behind the loader; a rollback re-planned already)
                        self.total_steps = self.length.after_resume(self.step, self.total_steps, "a step skipped")
                    if self.step >= self.total_steps and self.ckpt.last_started != self.step:  # (it was the last)
                        self._save(last=True)
                    self._stop_if_noticed()
                    continue
                compiling = self.compile_clock.take() if self.compile_clock is not None else 0.0
                compute = took - out.data_wait - out.staging - compiling - out.quorum
                ledger.add("data_wait", out.data_wait)
                ledger.add("compute", compute)
                ledger.add("compile", compiling)
                self.progress.step += 1
                self.records.outcome(self.step, True, self.groups.quorum_id)
                self.total_steps = self.length.after_step(self.step, self.total_steps)
                self.rollbacks.stepped(self.step, self.loader.epoch)
                self.progress.samples_seen += out.samples * self.strategy.world_size * self.groups.participants
                meter.step_done(out.samples, out.data_wait, compute, compiling)
                if not meter.flops_counted:
                    with ledger.measure("init"):
                        meter.count_flops(self.cfg, self.task.loss, self.run_dir, self.strategy.is_main, self.accum)
                self.profiler.after_step(self.step)
                with ledger.measure("logging"):  # 2. record
                    lr = self.optimizer.param_groups[0]["lr"]
                    meter.record(self.step, self.total_steps, self.loader.epoch, out.loss, lr, out.data_wait, compute)
                    self.straggler.book(ledger, self.straggler.after_step(self.step))  # (every window: compare)
                if self.sdc.after_step(self.step, self.step >= self.total_steps):  # 2b. the replicas differed:
                    continue  # rolled back to a checkpoint before the corruption, the same steps again
                if self.evals.due(self.step, self.total_steps):  # 3. evaluate
                    self.evaluate()
                saved = self._save(last=self.step >= self.total_steps)  # 4. save
                if saved.started == self.step:
                    self.records.flush()  # what a resume would not redo is on disk
                    self.records.goodput.mark(self.step)
                self.records.goodput.tick(self.step)
                self.fault.after_step(self.step)
                for cb in self.callbacks:
                    cb.on_step_end(self.view)
                self._stop_if_noticed()  # 5. a preemption notice on any rank
                self._exclude_if_slow()  # 6. (trainer.straggler.action=exclude) a rank slow for too long
        if bar is not None:
            bar.close()

    def _save(self, last: bool) -> SaveResult:
        """A save of this step when one is due (``strategy=ft``: one group writes them), its blocking time to the
        ledger's ``checkpoint``."""
        with self.watchdog.phase("checkpoint"):
            saves = self.groups.saves_checkpoints()
            saved = self.ckpt.maybe_save(self.target, self.step, last=last) if saves else SaveResult()
        self.ledger.add("checkpoint", saved.blocked)
        return saved

    def _stop_if_noticed(self) -> None:
        """Every rank stops here for a preemption notice that any rank got."""
        if self.strategy.agree(self.preempt.received is not None):
            self._stop_for_preemption()

    def _stop_for_preemption(self) -> None:
        """Every rank is here after the same step: save if it fits the grace period, wait until it is durable,
        write down where the time went, and leave with the 'requeue me' exit status."""
        why = self.preempt.received.name if self.preempt.received is not None else "a peer's notice"
        if self.groups.saves_checkpoints():  # (strategy=ft: the group that writes the durable checkpoints)
            save_for_notice(self.ckpt, self.target, self.step, self.preempt.grace, why, self.ledger, self.watchdog)
        self.records.flush()
        self.records.goodput.write(self.step, status="preempted")
        self._preempted = True
        self.preempt.forward()  # a launcher's own handler (submitit: requeue, then exit) runs after our save
        raise Preempted(f"preempted ({why}) after step {self.step}; run the same command again to resume")

    def _exclude_if_slow(self) -> None:
        """(``trainer.straggler.action=exclude``) A rank slow for longer than ``exclude_after_seconds``, decided the
        same on every rank at the same window: save this step and wait until it is durable, record its node as
        excluded, and leave (``train.straggler.leave``: that node's ranks exit ``EXCLUDED_EXIT``, the others
        ``REFORM_EXIT``); the launchers re-form the job without the node. Under replica groups only the slow group
        leaves the quorum (``REFORM_EXIT``), to rejoin by healing (``train.straggler_groups``)."""
        flag = self.straggler.overdue()
        if flag is None:
            return
        ckpt = self.ckpt
        if self.groups.saves_checkpoints() and ckpt.root is not None and ckpt.last_durable != self.step:
            with self.watchdog.phase("checkpoint"):
                self.ledger.add("checkpoint", ckpt.maybe_save(self.target, self.step, force=True).blocked)
        with self.ledger.measure("checkpoint"), self.watchdog.phase("checkpoint"):
            ckpt.wait()  # (durable before any rank goes)
        self.records.flush()
        self.records.goodput.write(self.step, status="reformed")
        self._preempted = True  # (a planned exit, no failure: the attempt is recorded as re-formed)
        raise self.straggler.leave(flag, self.run_dir, self.step)

    def _skipped(self, step: int, why: str, loss: float) -> None:
        self.records.skipped(step, self.loader.epoch, why, loss)

    def rollback(self, at_most_step: int, why: str, keep_data: bool = True, bucket: str = "instability") -> int:
        """Back, in-process, to the newest verified checkpoint of a step at most ``at_most_step`` (every rank takes
        the same one; ``train.rollback``); ``keep_data``: the data position stays where it is (the data in between
        is skipped exactly once, also after a restart or at another world size), else the checkpoint's (it is
        trained on again). The steps thrown away and the restore are booked in ledger ``bucket``. Returns the step
        the run goes on from; raises ``NoRollbackPoint`` (exit status 2, nothing deleted) when there is none."""
        frm, t0 = self.step, time.perf_counter()
        with self.ledger.measure(bucket), self.watchdog.phase("restore"):
            to = self.rollbacks(at_most_step, why, keep_data, self._batches, self.groups.saves_checkpoints())
            self.groups.restored(to)
        self.total_steps = self.length.after_resume(to, self.total_steps, "rolled back")
        self.straggler.restarted(to)
        self.evals.resumed()
        epochs = self.rollbacks.epochs
        self.records.rolled_back(to, frm, keep_data, epochs, why, bucket, time.perf_counter() - t0)
        return to

    def train_step(self, batches: Batches) -> StepResult:
        """One optimizer step (``step.Stepper``); ``trainer.sdc.replay`` keeps a sampled step's batches."""
        return self.stepper(self.sdc.before_step(self.step + 1, batches, self.step + 1 >= self.total_steps))

    def _pin(self, who: str, step: int | None) -> None:
        """Retention keeps the newest checkpoint at or before the earliest step a rollback of ``who`` (instability,
        sdc) may go back to (``None``: ``who`` needs none now)."""
        self._pins[who] = step
        held = [s for s in self._pins.values() if s is not None]
        self.ckpt.pinned = min(held) if held else None

    def _retake(self, batches: Any) -> None:
        """(``trainer.sdc.replay``) The step just taken, again, on its own batches, from the state before it."""
        self.progress.step -= 1
        try:
            self.stepper(batches)
        finally:
            self.progress.step += 1

    def evaluate(self) -> dict[str, float]:
        with self.ledger.measure("eval"), self.watchdog.phase("eval"):
            during = self.fault.during_eval
            out = self.stepper.evaluate(
                self.eval_loader, self.cfg.trainer.eval_max_batches, lambda i: during(self.step, i)
            )
        if self.compile_clock is not None:  # the first evaluation compiles the model in eval mode
            self.ledger.move("eval", "compile", self.compile_clock.take())
        self.last_eval = out
        self.records.report(out, self.step)
        log.info("step %d: %s", self.step, ", ".join(f"{k}={v:.4f}" for k, v in out.items()))
        return out

    def finish(self) -> dict:
        if not self.last_eval:  # e.g. restarted after the last step: report the final model anyway
            self.evaluate()
        with self.ledger.measure("checkpoint"), self.watchdog.phase("checkpoint"):
            self.ckpt.close()  # never report success with a save still in flight
        self._finished = True
        self.fault.close()
        account = self.records.goodput.write(self.step, status="finished")
        self.records.logger.log_metrics(summary.goodput_metrics(account), self.step)
        digest = model_sha256(self.model)  # (its time in the wall clock; if it fails, the tracker run says FAILED)
        for cb in self.callbacks:
            cb.on_train_end(self.view)
        if self.strategy.is_main:
            self.records.logger.log_metrics({f"time_{k}": v for k, v in self.ledger.split().items()}, self.step)
        tracker = self.records.close_tracker("FINISHED")
        self.records.metrics_file.close()
        return summary.write_summary(self.view, account, tracker, self.ledger.split(), digest)
