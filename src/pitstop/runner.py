"""The generic training loop, assembled from the config.  It knows nothing about images.

    Runner(cfg, run_dir).run()
      setup()    strategy -> seed -> data -> model -> optimizer/schedule -> loaders -> logger -> checkpointer
      restore()  the checkpointer loads the newest complete checkpoint (if any) into TrainState
      fit()      fetch -> step -> record -> (eval) -> (save), until total_steps
      finish()   final eval and save, wait for in-flight saves, summary.json

Every component is built with ``hydra.utils.instantiate`` from its config group, so a new model, data
set, optimizer, loader, strategy or checkpoint backend is a new YAML file (and module), not an edit here.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import torch
from pitstop.build import build
from omegaconf import DictConfig, OmegaConf

from pitstop.config import flatten, validate
from pitstop.digest import state_sha256
from pitstop.ledger import GoodputLog, Ledger, table
from pitstop.metrics import MetricsFile, write_json_atomic
from pitstop.seed import rng_state, seed_everything, set_rng_state

log = logging.getLogger("pitstop")


class TrainState:
    """Everything besides model and optimizer tensors that a checkpoint must restore (``Stateful``)."""

    def __init__(self, runner: "Runner"):
        self.runner = runner

    def state_dict(self) -> dict:
        r = self.runner
        return {"step": r.step, "samples_seen": r.samples_seen, "loader": r.loader.state_dict(),
                "scheduler": r.scheduler.state_dict(), "rng": rng_state(), "fingerprint": r.fingerprint()}

    def load_state_dict(self, state: dict, peers: list[dict] | None = None) -> None:
        """``peers``: every saved rank's state (needed when the number of ranks changed)."""
        r = self.runner
        r.step, r.samples_seen = int(state["step"]), int(state["samples_seen"])
        r.loader.load_state_dict(state["loader"], peers=[p["loader"] for p in peers] if peers else None)
        r.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])


class Runner:
    def __init__(self, cfg: DictConfig, run_dir: str):
        validate(cfg)
        self.cfg, self.run_dir = cfg, os.path.abspath(run_dir)
        self.ledger = Ledger()
        self.step, self.samples_seen, self.resumed_from = 0, 0, None
        self.callbacks: list[Any] = []
        self.last_eval: dict[str, float] = {}
        self._last_io: dict[str, float] = {}

    # ---- assembly ---------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        with self.ledger.measure("startup"):
            self.strategy = build(cfg.strategy)
            self.strategy.setup()
            seed_everything(cfg.seed, deterministic=cfg.trainer.deterministic)
            os.makedirs(self.run_dir, exist_ok=True)
            self.goodput = GoodputLog(self.run_dir, self.ledger, enabled=self.strategy.is_main)
            self.data = build(cfg.data, _convert_="partial")
            self.task = build(cfg.task)
            self.model = self.strategy.wrap(build(cfg.model))
            self.optimizer = build(cfg.optim.optimizer)(self.model.parameters())
            common = dict(dataset=self.data, batch_size=cfg.trainer.batch_size, seed=cfg.seed,
                          rank=self.strategy.rank, world_size=self.strategy.world_size,
                          pin_memory=self.strategy.pin_memory)
            self.loader = build(cfg.loader, split="train", train=True, **common)
            self.eval_loader = build(cfg.loader, split=cfg.trainer.eval_split, train=False, **common)
            self.total_steps = self._total_steps()
            self.scheduler = build(cfg.optim.scheduler)(self.optimizer, total_steps=self.total_steps)
            self.state = TrainState(self)
            # Buffers (BatchNorm running stats) change in forward, so an async save's staging must finish
            # before the next forward; without buffers it may overlap forward/backward until optimizer.step().
            self.forward_mutates_state = any(True for _ in self.model.buffers())
            self.ckpt = build(cfg.ckpt)
            self.ckpt.bind(self)
            main = self.strategy.is_main
            self.logger = build(cfg.logger) if main else build({"_target_": "pitstop.logger.base.NullLogger"})
            self.metrics_file = MetricsFile(os.path.join(self.run_dir, "metrics.jsonl"), enabled=main)
            if cfg.data.get("record_sample_ids"):
                self._open_sample_log()
            self.fault = build(cfg.fault)
            self.fault.bind(self)
            self.callbacks = [build(c) for c in (cfg.get("callbacks") or {}).values() if c]

    def _total_steps(self) -> int:
        t = self.cfg.trainer
        if t.max_steps is not None:
            return int(t.max_steps)
        return sum(self.loader.steps_per_epoch(e) for e in range(int(t.epochs)))

    def fingerprint(self) -> dict:
        """Config parts that must not change across a resume."""
        cfg = self.cfg
        return {**self.data.fingerprint(), "seed": int(cfg.seed),
                "model": OmegaConf.to_yaml(cfg.model, resolve=True), "batch_size": int(cfg.trainer.batch_size)}

    def _open_sample_log(self) -> None:
        path = os.path.join(self.run_dir, f"samples.rank{self.strategy.rank}.jsonl")
        f = open(path, "a", buffering=1 << 16)
        self._sample_file = f
        self.loader.sample_log = lambda keys: f.write(f'{{"step":{self.step + 1},"keys":{keys!r}}}\n'.replace("'", '"'))

    # ---- the run ----------------------------------------------------------------------------------
    def run(self) -> dict:
        self.setup()
        try:
            self.restore()
            self.fit()
            return self.finish()
        except BaseException:
            try:
                if getattr(self, "ckpt", None) is not None:
                    self.ckpt.wait()  # let a save in flight become durable before going down
            except BaseException as e:  # noqa: BLE001 - the original error matters more
                log.error("while failing, the checkpoint in flight also failed: %s", e)
            if getattr(self, "goodput", None) is not None:
                self.goodput.write(self.step, status="failed")
            self._close(status="FAILED")
            raise

    def restore(self) -> None:
        with self.ledger.measure("startup"):
            self.resumed_from = self.ckpt.restore(self)
        self.goodput.resumed(self.resumed_from)
        self.goodput.write(self.step)
        if self.resumed_from is not None:
            log.info("resumed from step %d", self.resumed_from)
            self.metrics_file.write({"event": "resume", "step": self.step})
        if self.strategy.is_main:
            tags = {"strategy": self.strategy.name, "ckpt": self.ckpt.name, "loader": self.loader.kind}
            sweep = self.cfg.get("sweep")
            if sweep:  # mlflow ui: filter tags.sweep = '<id>' and compare the jobs side by side
                tags.update({"sweep": str(sweep.id), "sweep_job": str(sweep.job), "sweep_overrides": str(sweep.overrides)})
            self.logger.start(self.run_dir, flatten(self.cfg), tags=tags)

    def fit(self) -> None:
        cfg, ledger = self.cfg.trainer, self.ledger
        batches = iter(self.loader)
        bar = self._progress_bar()
        window = {"t": time.perf_counter(), "samples": 0, "fetch": 0.0, "compute": 0.0, "n": 0}
        for cb in self.callbacks:
            cb.on_train_start(self)
        while self.step < self.total_steps:
            t0 = time.perf_counter()
            batch = next(batches)                                   # 1. fetch
            batch = self.data.on_device(self.strategy.to_device(batch))
            t1 = time.perf_counter()
            loss = self.train_step(batch)                           # 2. step (syncs on loss.item())
            t2 = time.perf_counter()
            ledger.add("data_wait", t1 - t0)
            ledger.add("compute", t2 - t1)
            self.step += 1
            n = len(batch[-1]) if isinstance(batch, (list, tuple)) else cfg.batch_size
            self.samples_seen += n * self.strategy.world_size
            window["samples"] += n
            window["fetch"] += t1 - t0
            window["compute"] += t2 - t1
            window["n"] += 1
            with ledger.measure("logging"):                         # 3. record
                self.record(loss, t1 - t0, t2 - t1, window, bar)
            if self._eval_due():                                    # 4. evaluate
                self.evaluate()
            last = self.step >= self.total_steps
            ledger.add("checkpoint", self.ckpt.maybe_save(self.state, self.step, last=last))  # 5. save
            if getattr(self.ckpt, "saved_step", None) == self.step:
                self._flush_logs()  # what a resume would not redo is on disk
                self.goodput.mark(self.step)
            self.goodput.tick(self.step)
            self.fault.after_step(self)
            for cb in self.callbacks:
                cb.on_step_end(self)
        if bar is not None:
            bar.close()

    def train_step(self, batch: Any) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        if self.forward_mutates_state:  # e.g. BatchNorm statistics: background staging must be done first
            self.ledger.add("checkpoint", self.ckpt.wait_staging())
        loss = self.task.loss(self.model, batch)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss is {loss.item()} at step {self.step + 1}; lower optim.lr or check the data")
        loss.backward()
        if self.cfg.trainer.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.trainer.grad_clip)
        self.ledger.add("checkpoint", self.ckpt.wait_staging())  # staging must finish before params change
        self.optimizer.step()
        self.scheduler.step()
        return loss.item()

    def record(self, loss: float, fetch: float, compute: float, window: dict, bar: Any) -> None:
        lr = self.optimizer.param_groups[0]["lr"]
        self.metrics_file.write({"step": self.step, "epoch": self.loader.epoch, "loss": loss, "lr": lr,
                                 "fetch_seconds": round(fetch, 6), "compute_seconds": round(compute, 6)})
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", epoch=self.loader.epoch, refresh=False)
        if self.step % self.cfg.trainer.log_every_steps == 0 or self.step == self.total_steps:
            now = time.perf_counter()
            elapsed = max(now - window["t"], 1e-9)
            self.logger.log_metrics({
                "loss": loss, "lr": lr, "epoch": self.loader.epoch,
                "samples_per_s": window["samples"] * self.strategy.world_size / elapsed,
                "fetch_seconds": window["fetch"] / window["n"], "compute_seconds": window["compute"] / window["n"],
                "data_wait_fraction": window["fetch"] / elapsed,
            }, self.step)
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
        self.logger.log_metrics(metrics, step)
        self.metrics_file.write({"step": step, **metrics})

    def _flush_logs(self) -> None:
        self.metrics_file.flush()
        if getattr(self, "_sample_file", None) is not None:
            self._sample_file.flush()

    def _eval_due(self) -> bool:
        every = self.cfg.trainer.eval_every_steps
        if every:
            return self.step % every == 0 or self.step == self.total_steps
        return self.loader.batches >= self.loader.steps_per_epoch() or self.step == self.total_steps

    def evaluate(self) -> dict[str, float]:
        with self.ledger.measure("eval"):
            batches = (self.data.on_device(self.strategy.to_device(b)) for b in self.eval_loader.iterate_once())
            out = self.task.evaluate(self.model, batches, self.strategy.all_reduce_sum, self.strategy.device,
                                     self.cfg.trainer.eval_max_batches)
        self.last_eval = out
        self.logger.log_metrics(out, self.step)
        self.metrics_file.write({"step": self.step, **out})
        log.info("step %d: %s", self.step, ", ".join(f"{k}={v:.4f}" for k, v in out.items()))
        return out

    def finish(self) -> dict:
        if not self.last_eval:  # e.g. restarted after the last step: report the final model anyway
            self.evaluate()
        with self.ledger.measure("checkpoint"):
            self.ckpt.close()                     # never report success with a save still in flight
        self.fault.close()
        account = self.goodput.write(self.step, status="finished")
        self.logger.log_metrics({"goodput": account["goodput"], "restarts": account["restarts"],
                                 **{f"goodput_{k}_seconds": v for k, v in account["totals"].items()}}, self.step)
        digest = self.params_sha256()
        summary = {
            "final_step": self.step, "total_steps": self.total_steps, "epoch": self.loader.epoch,
            "samples_seen": self.samples_seen, "resumed_from": self.resumed_from,
            "metrics": self.last_eval, "params_sha256": digest,
            "data": {**self.loader.stats, "data_wait_fraction": self._data_wait_fraction()},
            "checkpoint": self.ckpt.stats(), "strategy": self.strategy.name, "world_size": self.strategy.world_size,
            "goodput": {k: account[k] for k in ("goodput", "totals", "restarts", "failures")},
        }
        for cb in self.callbacks:
            cb.on_train_end(self)
        summary.update(self._close(status="FINISHED"))
        split = self.ledger.split()
        summary["wall_clock"] = split
        summary["samples_per_s"] = self.samples_seen / max(split["total"], 1e-9)
        if self.strategy.is_main:
            write_json_atomic(os.path.join(self.run_dir, "summary.json"), summary)
            log.info("done: step %d, %s, params_sha256=%s", self.step,
                     ", ".join(f"{k}={v:.4f}" for k, v in self.last_eval.items()), digest[:16])
            log.info("%s", table(account))
        return summary

    def _data_wait_fraction(self) -> float:
        """Share of step time (fetch + compute) spent waiting for the next batch."""
        wait, compute = self.ledger.seconds["data_wait"], self.ledger.seconds["compute"]
        return round(wait / max(wait + compute, 1e-9), 4)

    def _close(self, status: str) -> dict:
        out: dict = {}
        if getattr(self, "logger", None) is not None:
            if self.strategy.is_main and status == "FINISHED":
                self.logger.log_metrics({f"time_{k}": v for k, v in self.ledger.split().items()}, self.step)
            out = self.logger.close(status) or {}
            self.logger = None
        if getattr(self, "metrics_file", None) is not None:
            self.metrics_file.close()
        if getattr(self, "_sample_file", None) is not None:
            self._sample_file.close()
        if getattr(self, "strategy", None) is not None:
            self.strategy.teardown()
        return out

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
