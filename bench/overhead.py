"""Framework overhead: steps/s of recipe.train vs a minimal hand-written PyTorch loop, side by side.

    python bench/overhead.py [--steps 300] [--repeats 3]                       # CPU: SmallCNN on digits
    python bench/overhead.py --only mlflow --steps 1500 --repeats 2               # MLflow's cost past its start-up
    python bench/overhead.py --model resnet50 --data synthetic --precision bf16 --channels-last --compile \
        --batch 128 --workers 8 --steps 200 --only settings                     # what bench/device_check.sh runs

Both loops train the same model on the same shards with the same batch size, optimizer, schedule, decode function,
worker count, intra-op thread count (pitstop's CPU budget: the cores the workers leave), precision (autocast), memory
format and compilation; the hand-written one uses webdataset's own reader
and one plain ``DataLoader`` with persistent workers for the whole run (pinned memory and non-blocking copies on
CUDA), so neither loop starts workers at an epoch boundary. What it leaves out: the two read the samples in
different orders (pitstop's seeded shard and sample shuffle, webdataset's file order); both drop an epoch's last
partial batch (every step is ``trainer.batch_size`` samples in both); and only the loop is timed (start-up, restore
and the final save are not). Runs alternate (framework, hand, framework, hand, ...) and the medians are compared,
whole run and second half (steady state: after compilation). Targets: ratio >= 0.99 with every option off (CPU), >=
0.97 with bf16 + channels_last (+ compile) on a GPU. Then (default settings only) bf16 autocast on CPU, reported,
and the MLflow cost: per-step time the loop spends handing metrics to the logger, as % of step time, and steps/s
with logger=mlflow vs logger=none (target < 1%)."""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
import time

from common import compose, ensure_data, median, save_result

# What bench/results/overhead*.json's figures are, and the code they measure (read by the docs' results page,
# bench/figures.py, without running this script). "hand": the minimal hand-written PyTorch loop, same settings.
ABOUT = {"overhead_mlflow": "What logger=mlflow costs the training loop past the tracker's start-up: the time the "
         "loop spends handing metrics over, and steps/s against logger=none."}  # fmt: skip
FIGURES = {
    "settings": ("", "the settings both loops ran with", None),
    "steps": ("", "steps per run", None),
    "repeats": ("", "runs of each loop, alternating", None),
    "*.steps_per_s": ("steps/s", "pitstop's loop, whole run (median over the runs)", None),
    "*.hand_steps_per_s": ("steps/s", "the hand-written loop, whole run", None),
    "*.steady_steps_per_s": ("steps/s", "pitstop's loop, second half of the run (steady state)", None),
    "*.hand_steady_steps_per_s": ("steps/s", "the hand-written loop, second half", None),
    "main.ratio_steady": ("x", "pitstop's steps/s over the hand loop's, steady state, every option off (CPU)",
                          ">= 0.99"),
    "*.ratio_steady": ("x", "pitstop's steps/s over the hand loop's, steady state", None),
    "*.ratio_whole": ("x", "pitstop's steps/s over the hand loop's, whole run", None),
    "mlflow.log_every_steps": ("", "steps between two metric hand-overs (trainer.log_every_steps)", None),
    "mlflow.enqueue_us_per_step": ("µs", "the loop's time handing metrics to the logger, per step", None),
    "mlflow.enqueue_share_of_step": ("%", "that time as a share of a step", "< 0.01"),
    "mlflow.steady_cost": ("%", "1 - steps/s with logger=mlflow over logger=none, second half of the run", None),
    "mlflow.whole_run_cost": ("%", "the same over the whole run (includes the logger process starting on the "
                              "same cores)", None),
}  # fmt: skip
MEASURES = ["src/pitstop/train", "src/pitstop/parts", "src/pitstop/data/loader", "src/pitstop/telemetry",
            "src/pitstop/strategy/base.py", "src/pitstop/strategy/single.py"]  # fmt: skip

# (loader.drop_last: every step of both loops is a full batch, the same work per step; else pitstop's epoch-end
# remainders are smaller steps than the hand loop's and its steps/s would flatter it)
BASE = ["logger=none", "ckpt=none", "trainer.progress_bar=false", "trainer.log_every_steps=10", "loader.drop_last=true"]


class Mark:
    """A runner callback noting when steps ``step`` and ``until`` ended: the steady state after start-up (and
    compilation), before the last step's evaluation (which compiles the model again in eval mode)."""

    def __init__(self, step: int, until: int):
        self.step, self.until, self.t, self.t_until = step, until, None, None

    def on_train_start(self, runner) -> None:
        pass

    def on_step_end(self, runner) -> None:
        if runner.step == self.step:
            self.t = time.perf_counter()
        if runner.step == self.until:
            self.t_until = time.perf_counter()

    def on_train_end(self, runner) -> None:
        pass


def settings_overrides(opt: argparse.Namespace) -> list[str]:
    """The same settings for both loops, as recipe.train overrides."""
    out = [
        f"trainer.precision={opt.precision}",
        f"trainer.channels_last={str(opt.channels_last).lower()}",
        f"trainer.compile={str(opt.compile).lower()}",
    ]
    if opt.model == "resnet50":
        out += ["model=torchvision", "model.name=resnet50"]
    if opt.data == "synthetic":
        out += ["data=synthetic"]
    if opt.batch:
        out += [f"trainer.batch_size={opt.batch}"]
    if opt.workers is not None:
        out += [f"loader.num_workers={opt.workers}"]
    return out


def framework_run(steps: int, extra: list[str], run_dir: str) -> dict:
    from pitstop.train.runner import Runner

    cfg = compose(
        [*BASE, f"trainer.max_steps={steps}", f"trainer.eval_every_steps={steps}", f"run_dir={run_dir}", *extra]
    )
    r = Runner(cfg, run_dir)
    r.setup()
    r.restore()
    half = Mark(steps // 2, steps - 1)
    r.callbacks.append(half)
    t0 = time.perf_counter()
    r.fit()
    t1 = time.perf_counter()
    fit = t1 - t0
    logging = r.ledger.seconds["logging"]
    enqueue = getattr(r.records.logger, "enqueue_seconds", 0.0)
    summary = r.finish()
    return {
        "steps_per_s": steps / fit,
        "step_s": fit / steps,
        "steady_steps_per_s": (half.until - half.step) / (half.t_until - half.t),
        "logging_s": logging,
        "enqueue_s": enqueue,
        "summary": summary,
    }


def hand_run(steps: int, extra: list[str] = ()) -> dict:
    from contextlib import nullcontext

    import torch
    import webdataset as wds
    from torch.utils.data import DataLoader

    from pitstop.parts.lr import warmup_cosine
    from pitstop.parts.seed import derive_seed
    from pitstop.data.dataset import build_dataset
    from recipe.vision import SmallCNN

    cfg = compose([*BASE, *extra])
    t = cfg.trainer
    torch.manual_seed(cfg.seed)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    # (the same intra-op threads as pitstop's CPU budget, strategy.cpu_threads=auto: the cores the workers leave; set
    # here, not inherited from a framework run before it in this process)
    allowed = int(os.environ.get("OMP_NUM_THREADS") or 0) or (os.cpu_count() or 1)
    torch.set_num_threads(min(allowed, max(1, (os.cpu_count() or 1) - cfg.loader.num_workers)))
    ds = build_dataset(cfg.data)  # (the data set pitstop builds: the prepare step's keys left out)
    urls = [ds.index.resolve(s) for s in ds.index.shards("train")]

    def decode(sample):
        return ds.decode(sample, train=True, seed=derive_seed(cfg.seed, sample["__key__"]))

    def batches():
        pipe = (
            wds.WebDataset(urls, shardshuffle=False, nodesplitter=None, empty_check=False)
            .map(decode)
            .batched(t.batch_size, partial=False)
        )
        workers = cfg.loader.num_workers
        loader = DataLoader(  # one loader, its workers kept across epochs (as pitstop keeps its readers going)
            pipe,
            batch_size=None,
            num_workers=workers,
            prefetch_factor=cfg.loader.prefetch_factor if workers else None,
            persistent_workers=workers > 0,
            pin_memory=device.type == "cuda",
        )
        for _ in itertools.count():
            yield from loader

    if cfg.model._target_.endswith("torchvision_model"):
        import torchvision

        model = torchvision.models.get_model(cfg.model.name, weights=None, num_classes=cfg.data.num_classes)
    else:
        model = SmallCNN(
            in_channels=cfg.data.channels,
            num_classes=cfg.data.num_classes,
            width=cfg.model.width,
            dropout=cfg.model.dropout,
        )
    model = model.to(device)
    if t.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if t.compile:
        model.compile()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.precision)
    autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype else nullcontext
    scaler = torch.amp.GradScaler(device.type) if t.precision == "fp16" else None
    opt = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    sched = warmup_cosine(opt, steps, warmup_steps=20, min_lr_ratio=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    it = batches()
    t0 = time.perf_counter()
    for i in range(steps):
        if i == steps // 2:
            t_half = time.perf_counter()
        if i == steps - 1:
            t_until = time.perf_counter()
        x, y = next(it)
        x, y = ds.on_device((x.to(device, non_blocking=True), y.to(device, non_blocking=True)))
        if t.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = loss_fn(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        sched.step()
        loss.item()
    t1 = time.perf_counter()
    return {"steps_per_s": steps / (t1 - t0), "steady_steps_per_s": (steps - 1 - steps // 2) / (t_until - t_half)}


def compare(label: str, steps: int, repeats: int, extra: list[str], tmp: str) -> float:
    """Alternating framework and hand runs with the same settings; prints both and the ratio (steady state)."""
    fw, hand, sums = [], [], []
    hand_run(min(steps, 20), extra), framework_run(min(steps, 20), extra, os.path.join(tmp, "warm"))  # warm-up
    for i in range(repeats):
        r = framework_run(steps, extra, os.path.join(tmp, f"fw{i}"))
        fw.append(r), sums.append(r["summary"])
        hand.append(hand_run(steps, extra))
    f, h = median([r["steps_per_s"] for r in fw]), median([r["steps_per_s"] for r in hand])
    fs, hs = median([r["steady_steps_per_s"] for r in fw]), median([r["steady_steps_per_s"] for r in hand])
    batch = sums[0]["samples_seen"] / max(sums[0]["final_step"], 1)
    tp = sums[len(sums) // 2]["throughput"]
    mfu = f"{tp['mfu'] * 100:.1f}%" if tp.get("mfu") is not None else tp.get("mfu_note", "n/a")
    print(f"## {label}: {steps} steps x {repeats} alternating repeats, batch {batch:.0f}")
    runs_fw = ", ".join(f"{r['steps_per_s']:.2f}" for r in fw)
    runs_hand = ", ".join(f"{r['steps_per_s']:.2f}" for r in hand)
    print(f"recipe.train        steps/s  whole {f:8.2f}  steady {fs:8.2f}   runs {runs_fw}")
    print(f"hand-written loop   steps/s  whole {h:8.2f}  steady {hs:8.2f}   runs {runs_hand}")
    print(
        f"ratio recipe/hand   whole {f / h:.3f}   steady {fs / hs:.3f}   "
        f"samples/s/device {tp['samples_per_s_per_device']}   step p50 {tp.get('step_seconds_p50', 0) * 1e3:.1f} ms   "
        f"MFU {mfu}   ({tp.get('flops_per_step') or 0:.3g} FLOP/step)",
        flush=True,
    )
    return {"steps_per_s": f, "hand_steps_per_s": h, "steady_steps_per_s": fs, "hand_steady_steps_per_s": hs,
            "ratio_whole": f / h, "ratio_steady": fs / hs}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--log-every", type=int, default=10, help="trainer.log_every_steps for the MLflow comparison")
    ap.add_argument("--model", choices=["cnn", "resnet50"], default="cnn")
    ap.add_argument("--data", choices=["digits", "synthetic"], default="digits")
    ap.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    ap.add_argument("--channels-last", action="store_true")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument(
        "--only",
        choices=["settings", "mlflow"],
        default=None,
        help="settings: only the comparison at the given "
        "settings; mlflow: only the MLflow cost (e.g. with more --steps: past the tracker process's start-up)",
    )
    args = ap.parse_args()
    ensure_data([] if args.data == "digits" else ["data=synthetic"])
    tmp = tempfile.mkdtemp(prefix="pitstop-bench-")
    settings = settings_overrides(args)
    label = " ".join(o for o in settings if not o.endswith("=false") and o != "trainer.precision=fp32") or "defaults"
    print(f"# overhead: recipe.train vs a hand-written loop ({args.model}, {args.data})")
    figures = {"settings": label, "steps": args.steps, "repeats": args.repeats}
    if args.only != "mlflow":
        figures["main"] = compare(label, args.steps, args.repeats, settings, tmp)
        ratio = figures["main"]["ratio_steady"]
        print(f"ratio (steady) = {ratio:.3f}   (target >= 0.99 with every option off on CPU; >= 0.97 on a GPU)")
    if args.only == "settings":
        save_result(f"overhead_{args.model}_{args.data}_settings", figures)
        return
    if args.only is None and settings == settings_overrides(ap.parse_args([])):  # default settings: bf16 on CPU
        figures["bf16"] = compare(
            "trainer.precision=bf16 (autocast)", args.steps, args.repeats, [*settings, "trainer.precision=bf16"], tmp
        )

    none, ml = [], []
    uri = f"sqlite:///{tmp}/mlflow.db"
    framework_run(20, ["logger=mlflow", f"logger.tracking_uri={uri}"], os.path.join(tmp, "mlwarm"))
    every = args.log_every
    for i in range(args.repeats):
        none.append(framework_run(args.steps, [f"trainer.log_every_steps={every}"], os.path.join(tmp, f"n{i}")))
        ml.append(
            framework_run(
                args.steps,
                ["logger=mlflow", f"logger.tracking_uri={uri}", f"trainer.log_every_steps={every}"],
                os.path.join(tmp, f"m{i}"),
            )
        )
    step = median([r["step_s"] for r in none])
    enq = median([r["enqueue_s"] / args.steps for r in ml])
    log_none = median([r["logging_s"] / args.steps for r in none])
    log_ml = median([r["logging_s"] / args.steps for r in ml])
    sps_none, sps_ml = median([r["steps_per_s"] for r in none]), median([r["steps_per_s"] for r in ml])
    print(
        f"# MLflow logging every {every} step(s) (default 10), 9 metrics per log step, sqlite store, {args.steps} steps"
    )
    print(
        f"loop time handing metrics to MLflow: {enq * 1e6:.1f} us/step = {100 * enq / step:.3f}% "
        f"of a {step * 1e3:.2f} ms step"
    )
    print(
        f"record() incl. metrics.jsonl: none {log_none * 1e6:.1f} us/step, mlflow {log_ml * 1e6:.1f} us/step "
        f"({100 * (log_ml - log_none) / step:+.3f}% of step)"
    )
    st_none = median([r["steady_steps_per_s"] for r in none])
    st_ml = median([r["steady_steps_per_s"] for r in ml])
    print(
        f"steps/s, whole run:        logger=none {sps_none:.2f}  logger=mlflow {sps_ml:.2f}  "
        f"({100 * (1 - sps_ml / sps_none):+.2f}%: includes the logger process starting up on the same 2 cores)"
    )
    print(
        f"steps/s, second half only: logger=none {st_none:.2f}  logger=mlflow {st_ml:.2f}  "
        f"({100 * (1 - st_ml / st_none):+.2f}% per-step cost in steady state)"
    )
    figures["mlflow"] = {
        "log_every_steps": every,
        "enqueue_us_per_step": enq * 1e6,
        "enqueue_share_of_step": enq / step,
        "steady_cost": 1 - st_ml / st_none,
        "whole_run_cost": 1 - sps_ml / sps_none,
    }
    name = "overhead" if args.model == "cnn" and args.data == "digits" else f"overhead_{args.model}"
    save_result(name if args.only is None else f"{name}_{args.only}", figures)


if __name__ == "__main__":
    main()
