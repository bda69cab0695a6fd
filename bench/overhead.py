"""Framework overhead: steps/s of recipe.train vs a minimal hand-written PyTorch loop, side by side.

    python bench/overhead.py [--steps 300] [--repeats 3]

Both loops train the same SmallCNN on the same digits shards with the same batch size, optimizer,
schedule, decode function and worker count; the hand-written one uses webdataset's own reader. Runs
alternate (framework, hand, framework, hand, ...) and the medians are compared. Target: ratio >= 0.97.
Then the MLflow cost: per-step time the loop spends handing metrics to the logger, as % of step time,
and steps/s with logger=mlflow vs logger=none (target < 1%).
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
import time

from common import compose, ensure_data, median

BASE = ["logger=none", "ckpt=none", "trainer.progress_bar=false", "trainer.log_every_steps=10"]


class Mark:
    """A runner callback noting when step N ended (to time the steady state after start-up)."""

    def __init__(self, step: int):
        self.step, self.t = step, None

    def on_train_start(self, runner) -> None:
        pass

    def on_step_end(self, runner) -> None:
        if runner.step == self.step:
            self.t = time.perf_counter()

    def on_train_end(self, runner) -> None:
        pass


def framework_run(steps: int, extra: list[str], run_dir: str) -> dict:
    from pitstop.runner import Runner

    cfg = compose([*BASE, f"trainer.max_steps={steps}", f"trainer.eval_every_steps={steps}", f"run_dir={run_dir}", *extra])
    r = Runner(cfg, run_dir)
    r.setup()
    r.restore()
    half = Mark(steps // 2)
    r.callbacks.append(half)
    t0 = time.perf_counter()
    r.fit()
    t1 = time.perf_counter()
    fit = t1 - t0
    logging = r.ledger.seconds["logging"]
    enqueue = getattr(r.logger, "enqueue_seconds", 0.0)
    summary = r.finish()
    return {"steps_per_s": steps / fit, "step_s": fit / steps, "steady_steps_per_s": (steps - half.step) / (t1 - half.t), "logging_s": logging, "enqueue_s": enqueue, "summary": summary}


def hand_run(steps: int) -> dict:
    import torch
    import webdataset as wds
    from torch.utils.data import DataLoader

    from pitstop.schedule import warmup_cosine
    from pitstop.seed import derive_seed
    from recipe.vision import ImageShards, SmallCNN

    cfg = compose(BASE)
    torch.manual_seed(cfg.seed)
    ds = ImageShards(**{k: v for k, v in cfg.data.items() if k != "_target_"})
    urls = [ds.index.resolve(s) for s in ds.index.shards("train")]

    def decode(sample):
        return ds.decode(sample, train=True, seed=derive_seed(cfg.seed, sample["__key__"]))

    def batches():
        for epoch in itertools.count():
            pipe = (wds.WebDataset(urls, shardshuffle=False, nodesplitter=None, empty_check=False)
                    .map(decode).batched(cfg.trainer.batch_size))
            yield from DataLoader(pipe, batch_size=None, num_workers=cfg.loader.num_workers,
                                  prefetch_factor=cfg.loader.prefetch_factor)

    model = SmallCNN(in_channels=1, num_classes=10, width=cfg.model.width, dropout=cfg.model.dropout)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    sched = warmup_cosine(opt, steps, warmup_steps=20, min_lr_ratio=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    it = batches()
    t0 = time.perf_counter()
    for _ in range(steps):
        x, y = ds.on_device(next(it))
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        loss.item()
    fit = time.perf_counter() - t0
    return {"steps_per_s": steps / fit}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--log-every", type=int, default=10, help="trainer.log_every_steps for the MLflow comparison")
    args = ap.parse_args()
    ensure_data()
    tmp = tempfile.mkdtemp(prefix="pitstop-bench-")
    fw, hand = [], []
    hand_run(20), framework_run(20, [], os.path.join(tmp, "warm"))  # warm-up (imports, page cache)
    for i in range(args.repeats):
        fw.append(framework_run(args.steps, [], os.path.join(tmp, f"fw{i}"))["steps_per_s"])
        hand.append(hand_run(args.steps)["steps_per_s"])
    f, h = median(fw), median(hand)
    print(f"# overhead: {args.steps} steps x {args.repeats} alternating repeats, digits, SmallCNN, batch 64, 2 workers")
    print(f"recipe.train (no ckpt, no logger)   steps/s  median {f:8.2f}   runs {', '.join(f'{x:.2f}' for x in fw)}")
    print(f"hand-written loop (webdataset)      steps/s  median {h:8.2f}   runs {', '.join(f'{x:.2f}' for x in hand)}")
    print(f"ratio recipe/hand = {f / h:.3f}   (target >= 0.97)")

    none, ml = [], []
    uri = f"sqlite:///{tmp}/mlflow.db"
    framework_run(20, ["logger=mlflow", f"logger.tracking_uri={uri}"], os.path.join(tmp, "mlwarm"))
    every = args.log_every
    for i in range(args.repeats):
        none.append(framework_run(args.steps, [f"trainer.log_every_steps={every}"], os.path.join(tmp, f"n{i}")))
        ml.append(framework_run(args.steps, ["logger=mlflow", f"logger.tracking_uri={uri}", f"trainer.log_every_steps={every}"],
                                os.path.join(tmp, f"m{i}")))
    step = median([r["step_s"] for r in none])
    enq = median([r["enqueue_s"] / args.steps for r in ml])
    log_none = median([r["logging_s"] / args.steps for r in none])
    log_ml = median([r["logging_s"] / args.steps for r in ml])
    sps_none, sps_ml = median([r["steps_per_s"] for r in none]), median([r["steps_per_s"] for r in ml])
    print(f"# MLflow logging every {every} step(s) (default 10), 7 metrics per log step, sqlite store, {args.steps} steps")
    print(f"loop time handing metrics to MLflow: {enq * 1e6:.1f} us/step = {100 * enq / step:.3f}% of a {step * 1e3:.2f} ms step")
    print(f"record() incl. metrics.jsonl: none {log_none * 1e6:.1f} us/step, mlflow {log_ml * 1e6:.1f} us/step "
          f"({100 * (log_ml - log_none) / step:+.3f}% of step)")
    st_none = median([r["steady_steps_per_s"] for r in none])
    st_ml = median([r["steady_steps_per_s"] for r in ml])
    print(f"steps/s, whole run:        logger=none {sps_none:.2f}  logger=mlflow {sps_ml:.2f}  "
          f"({100 * (1 - sps_ml / sps_none):+.2f}%: includes the logger process starting up on the same 2 cores)")
    print(f"steps/s, second half only: logger=none {st_none:.2f}  logger=mlflow {st_ml:.2f}  "
          f"({100 * (1 - st_ml / st_none):+.2f}% per-step cost in steady state)")


if __name__ == "__main__":
    main()
