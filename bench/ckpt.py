"""What a checkpoint costs the training loop, per backend, side by side in one run.

    python bench/ckpt.py [--repeats 3] [--rss-saves 50] [--steps 6]

Models: torchvision ResNet-50 + AdamW (BatchNorm; ~283 MB of model + optimizer state) and a ViT of similar
size without BatchNorm (torchvision ``VisionTransformer``, 8 layers x 512, patch 4 on 32x32 images).
Rows, each driven through the runner's own loop on the same state:

- pitstop's backends; the async ones with the thread and with the process checkpointer; DCP tensors in
  ``ckpt.format=raw`` (the default), and one row with ``ckpt.format=torch_save`` (DCP's own format) to show
  what the format changes;
- peer, torchtitan's ``async_with_pinned_mem`` mode, as its ``components/checkpoint.py`` makes the calls:
  ``gc.collect(1)``, its model state dict made once and cached, the optimizer's each save,
  ``dcp.async_save`` with ``DefaultStager(StagingOptions(pinned, shared, async staging, non-blocking))`` and
  a checkpoint process, and a wait for staging right before ``optimizer.step()`` (pinned memory and
  non-blocking copies need CUDA, so they are off on CPU, as torchtitan's stager also turns them off);
- peer, a plain ``torch.save`` of the same state into one file, with fsync.

Per row: ``block`` is the loop's blocking time per save (inside ``maybe_save`` plus waiting for staging
before ``optimizer.step()``, as the runner accounts it), median of steady-state saves; ``extra`` is the loop
time from the save until it is durable minus the same number of steps without saving (blocking + slowed
steps); ``first`` is the first save's blocking time; ``durable`` is seconds until the save is committed.
The memory-copy bound (one copy of the state's bytes; on a GPU device -> pinned host) is measured in the same
run.  Then: the same on a
200 MB/s throttled target (ResNet-50), what checksums cost (each row with and without them, alternating, and
what verification reads per second), what signing costs (``--only signing``: the key set and unset,
alternating), steps/s with a save after every step (steady state: the first saves
are not timed), and RSS over many saves.  ``BENCH_DIR=/dev/shm`` puts every checkpoint on tmpfs, which takes
the disk out of the figures.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import time

from common import compose, ensure_data, median

# What bench/results/ckpt_signing.json's figures are, and the code they measure (read by the docs' results page,
# bench/figures.py, without running this script). (The tables' other figures are printed, not kept in a result.)
ABOUT = {"ckpt_signing": "What signing checkpoints (PITSTOP_CKPT_KEY) costs a save and a verification, per backend."}
FIGURES = {
    "model": ("", "the model saved (with its AdamW state)", None),
    "repeats": ("", "saves timed per row, signed and unsigned alternating", None),
    "*.block_ratio": ("x", "the loop's blocking time per save, signed over unsigned (median)", None),
    "*.durable_ratio": ("x", "seconds until the save is durable, signed over unsigned (median)", None),
    "*.durable_signed_s": ("s", "seconds until a signed save is durable (median)", None),
    "*.durable_unsigned_s": ("s", "seconds until an unsigned save is durable (median)", None),
    "verify_unsigned_gbps": (
        "GB/s",
        "the checksum check's read rate without the key (CRC32C; pitstop.ckpt.integrity.verify, "
        "what python -m pitstop.ckpt.verify runs)",
        None,
    ),
    "verify_signed_gbps": ("GB/s", "the same with the key set (SHA-256 of every byte, and the HMAC)", None),
}
MEASURES = ["src/pitstop/ckpt"]

DATA = ["data.channels=3", "data.image_size=32", "data.mean=[0.5,0.5,0.5]", "data.std=[0.5,0.5,0.5]", "optim=adamw"]
MODELS = {
    "ResNet-50 (BatchNorm)": [
        "model=resnet18",
        "model._target_=torchvision.models.resnet50",
        "~model.in_channels",
        *DATA,
    ],
    "ViT-25M (no BatchNorm)": [
        "model=resnet18",
        "model._target_=torchvision.models.VisionTransformer",
        "~model.in_channels",
        "+model.image_size=32",
        "+model.patch_size=4",
        "+model.num_layers=8",
        "+model.num_heads=8",
        "+model.hidden_dim=512",
        "+model.mlp_dim=2048",
        *DATA,
    ],
}
BASE = [
    "logger=none",
    "trainer.progress_bar=false",
    "trainer.batch_size=8",
    "loader.num_workers=1",
    "trainer.eval_every_steps=100000",
    "trainer.eval_max_batches=1",
]
ROWS = {  # label -> ckpt overrides, or a peer
    "sync_save": ["ckpt=sync_save"],
    "sync_dcp": ["ckpt=sync_dcp"],
    "async_dcp (thread)": ["ckpt=async_dcp", "ckpt.checkpointer=thread"],
    "async_dcp (process)": ["ckpt=async_dcp", "ckpt.checkpointer=process"],
    "async_dcp_pinned (process)": ["ckpt=async_dcp_pinned", "ckpt.checkpointer=process"],
    "  same, format=torch_save": ["ckpt=async_dcp_pinned", "ckpt.checkpointer=process", "ckpt.format=torch_save"],
    "peer: torchtitan pinned": "titan",
    "peer: torch.save": "torch.save",
}
EVERY_WARM = 2  # saves before the save-every-step runs are timed
WARM_STEPS = 3  # steps before the first save (a run saves after ckpt.interval_steps, never at its first step)
NEVER = 10**9  # the rows' interval: the bench decides when to save (save(r)); between saves the loop calls
# maybe_save every step as the runner does (async backends prepare host buffers there)


# ---- peers ----------------------------------------------------------------------------------------------
def peer(kind: str, ckpt_dir: str, throttle_mbps: float | None):
    """A peer's save path as a CheckpointManager, so the runner's loop drives and accounts it like ours."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from pitstop.ckpt.contract import Pending
    from pitstop.ckpt.manager import CheckpointManager
    from pitstop.ckpt.formats import encode_json
    from pitstop.ckpt.storage import open_write
    from pitstop.ckpt.sync_dcp import dcp_writer

    class TitanPinned(CheckpointManager):
        name, is_async = "torchtitan async_with_pinned_mem", True

        def _setup_backend(self):
            if not dist.is_initialized():
                self.strategy.init_local_group(os.path.join(tempfile.gettempdir(), f"bench-pg-{os.getpid()}"))
                self.group = self.strategy.ckpt_group()
            cuda = torch.cuda.is_available()
            self.stager = DefaultStager(StagingOptions(cuda, True, True, cuda))
            self.model_sd = None

        def _app_state(self, target):
            if self.model_sd is None:  # torchtitan's ModelWrapper: made once, kept
                self.model_sd = get_model_state_dict(target.model)
            return {
                "model": self.model_sd,
                "optim": get_optimizer_state_dict(target.model, target.optimizer),
                f"train.rank{self.rank}": encode_json(target.state.state_dict()),
            }

        def _write(self, app_state, record):
            gc.collect(1)
            out = dcp.async_save(
                app_state,
                storage_writer=dcp_writer(record.path, record.throttle_mbps, "torch_save"),
                process_group=self.group,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=self.stager,
            )
            return Pending(record, upload=out.upload_completion, staging=out.staging_completion)

        def _shutdown(self):
            self.stager.close()

    class TorchSave(CheckpointManager):
        name = "torch.save"

        def _write(self, app_state, record):
            os.makedirs(record.path, exist_ok=True)
            with open_write(os.path.join(record.path, "state.pt"), record.throttle_mbps) as f:
                torch.save(app_state, f)
                f.flush()
                os.fsync(f.fileno())
            return None

    cls = TitanPinned if kind == "titan" else TorchSave
    return cls(dir=ckpt_dir, interval_steps=NEVER, keep_last_k=2, throttle_mbps=throttle_mbps)


# ---- the loop ---------------------------------------------------------------------------------------------
def make_runner(model: str, row: str, run_dir: str, extra: list[str] = (), steps: int = 100000):
    from pitstop.train.runner import Runner
    from pitstop.train.state import Batches

    spec = ROWS.get(row, row)
    ckpt = (spec if isinstance(spec, list) else ["ckpt=sync_dcp"]) + [
        f"ckpt.interval_steps={NEVER}",
        "ckpt.keep_last_k=2",
    ]
    if row == "none":
        ckpt = ["ckpt=none"]
    cfg = compose([*BASE, *MODELS[model], *ckpt, f"trainer.max_steps={steps}", f"run_dir={run_dir}", *extra])
    r = Runner(cfg, run_dir)
    r.setup()
    if isinstance(spec, str) and row != "none":
        r.ckpt.close()
        throttle = next((float(x.split("=")[1]) for x in extra if x.startswith("ckpt.throttle_mbps=")), None)
        r.ckpt = peer(spec, os.path.join(run_dir, "checkpoints"), throttle)
        r.ckpt.setup(r.strategy, lambda *_: None)
    r.restore()
    r.batches = Batches(r.loader, r.watchdog)
    for _ in range(WARM_STEPS):  # also initialises AdamW's state, so the saved state is complete
        step(r)
    return r


def step(r) -> None:
    """One training step and the runner's per-step ``maybe_save`` (never due: the bench saves with save())."""
    r.train_step(r.batches)
    r.progress.step += 1
    r.ckpt.maybe_save(r.target, r.step)


def save(r) -> float:
    """A save now (as on a preemption notice); returns the seconds the call blocked."""
    return r.ckpt.maybe_save(r.target, r.step, force=True).blocked


def state_tensors(r) -> list:
    """The tensors of the model and optimizer state (what a save copies)."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(r.model, r.optimizer)
    return list(msd.values()) + [t for s in osd["state"].values() for t in s.values() if isinstance(t, torch.Tensor)]


def state_bytes(r) -> int:
    return sum(t.numel() * t.element_size() for t in state_tensors(r))


def memcpy_bound(r, repeats: int = 7) -> float:
    """One copy of the state's tensors into preallocated memory (the best a snapshot can do)."""
    import torch

    tensors = state_tensors(r)
    cuda = tensors[0].is_cuda
    # on a GPU: device -> pinned host memory (what a snapshot of device state must move), synchronized
    dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) if cuda else torch.empty_like(t) for t in tensors]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch._foreach_copy_(dst, tensors, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return median(times)


def measure_save(r) -> dict:
    """One save: its blocking time, the loop time of the window until it is durable (steps go on meanwhile:
    background staging overlaps their forward/backward and is waited for before their optimizer step), the
    number of steps in that window, and seconds until durable; then as many steps again without a save,
    timed one by one (the baseline for the extra loop time, see :func:`extra_loop_time`)."""
    before = r.ledger.seconds["checkpoint"]
    t0 = time.perf_counter()
    block = save(r)
    n = 0
    while True:
        step(r)
        n += 1
        p = r.ckpt.pending
        if p is None or p.upload.done():
            break
    r.ckpt.wait()
    window = time.perf_counter() - t0
    block += r.ledger.seconds["checkpoint"] - before
    r.ckpt._report_finished()
    rec = r.ckpt.records[-1] if getattr(r.ckpt, "records", None) else None
    durable = rec.total_seconds if rec is not None and rec.total_seconds else window
    plain = []
    for _ in range(max(n, 2)):
        t1 = time.perf_counter()
        step(r)
        plain.append(time.perf_counter() - t1)
    return {"block": block, "window": window, "n": n, "durable": durable, "plain": plain}


def extra_loop_time(saves: list[dict]) -> float:
    """Median over saves of (window - n x the median step time without a save, over all of this row's plain
    steps): a step time of ~0.5 s varies by ~10% from step to step here, so a per-save baseline of a few
    steps would be noisier than the quantity measured."""
    plain = median([t for s in saves for t in s["plain"]])
    return median([s["window"] - s["n"] * plain for s in saves])


def table(model: str, rows: list[str], extra: list[str], repeats: int, tmp: str, throttled: bool) -> None:
    tag = f"{list(MODELS).index(model)}{'t' if throttled else ''}"
    runners = {row: make_runner(model, row, os.path.join(tmp, f"{tag}-{i}"), extra) for i, row in enumerate(rows)}
    any_r = next(iter(runners.values()))
    nbytes, bound = state_bytes(any_r), memcpy_bound(any_r)
    first = {row: measure_save(r) for row, r in runners.items()}
    results: dict[str, list] = {row: [] for row in rows}
    for _ in range(repeats):  # rows alternate within each repeat
        for row, r in runners.items():
            results[row].append(measure_save(r))
    where = "200 MB/s throttled target" if throttled else "local disk + fsync"
    print(
        f"\n## {model}: {nbytes / 1e6:.0f} MB of model+optimizer state, {where}; memory-copy bound "
        f"{bound * 1e3:.1f} ms ({nbytes / bound / 1e9:.1f} GB/s); {repeats} steady saves per row",
        flush=True,
    )
    base = median([x["block"] for x in results["sync_save"]]) if "sync_save" in results else None
    print(
        f"{'row':<28}{'block':>9}{'x memcpy':>9}{'x sync_save':>12}{'extra':>9}{'x memcpy':>9}"
        f"{'first':>9}{'first/steady':>13}{'durable':>9}{'step':>8}"
    )
    for row in rows:
        block = median([x["block"] for x in results[row]])
        extra_t = extra_loop_time(results[row])
        durable = median([x["durable"] for x in results[row]])
        step_t = median([t for x in results[row] for t in x["plain"]])
        vs = f"{block / base:.3f}" if base else "-"
        print(
            f"{row:<28}{block * 1e3:>7.1f}ms{block / bound:>8.2f}x{vs:>11}x{extra_t * 1e3:>7.0f}ms"
            f"{extra_t / bound:>8.1f}x{first[row]['block'] * 1e3:>7.0f}ms"
            f"{first[row]['block'] / max(block, 1e-9):>12.1f}x{durable:>8.2f}s{step_t:>7.2f}s",
            flush=True,
        )
    for r in runners.values():
        r.ckpt.close()
        r.close()
    runners.clear()
    gc.collect()


def checksum_costs(model: str, repeats: int, tmp: str) -> None:
    """What checksums cost: each row saved with and without them (``pitstop.ckpt.integrity.ENABLED``, read as each
    save's writer is made and carried into a checkpoint process), the two alternating on the same runner; then
    what verifying a written checkpoint reads per second in one thread, and per CPU-second (files written through
    the page cache are read from memory; those written with O_DIRECT, from the disk: then the disk bounds it)."""
    from pitstop.ckpt import integrity

    rows = ["sync_save", "sync_dcp", "async_dcp (thread)", "async_dcp_pinned (process)"]
    runners = {row: make_runner(model, row, os.path.join(tmp, f"sum-{i}")) for i, row in enumerate(rows)}
    results: dict[tuple[str, bool], list] = {(row, on): [] for row in rows for on in (True, False)}
    try:
        for r in runners.values():
            measure_save(r)  # (the first save allocates buffers, may wait for a checkpoint process: not timed)
        for rep in range(repeats):
            for row, r in runners.items():
                for on in (True, False) if rep % 2 == 0 else (False, True):
                    integrity.ENABLED = on
                    results[(row, on)].append(measure_save(r))
    finally:
        integrity.ENABLED = True
    print(
        f"\n## {model}: checksums on vs off, local disk + fsync ({repeats} saves each, alternating); block: the loop's "
        f"blocking time per save; durable: seconds until committed",
        flush=True,
    )
    print(f"{'row':<28}{'block on':>10}{'off':>9}{'on/off':>8}{'durable on':>12}{'off':>9}{'on/off':>8}")
    for row in rows:
        b_on, b_off = (median([x["block"] for x in results[(row, on)]]) for on in (True, False))
        d_on, d_off = (median([x["durable"] for x in results[(row, on)]]) for on in (True, False))
        print(
            f"{row:<28}{b_on * 1e3:>8.1f}ms{b_off * 1e3:>7.1f}ms{b_on / max(b_off, 1e-9):>7.3f}x"
            f"{d_on:>11.3f}s{d_off:>8.3f}s{d_on / max(d_off, 1e-9):>7.3f}x",
            flush=True,
        )
    for row, r in runners.items():  # one more save, with checksums, to verify
        step(r)
        save(r)
        r.ckpt.wait()
        r.ckpt._report_finished()
        path = r.ckpt.records[-1].path
        t0, c0 = time.perf_counter(), time.process_time()
        nbytes = integrity.verify(path)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        print(
            f"verify {row:<28}{nbytes / 1e6:>5.0f} MB in {seconds:.3f} s: {nbytes / seconds / 1e9:.2f} GB/s "
            f"({nbytes / max(cpu, 1e-9) / 1e9:.2f} GB per CPU-second; one thread)"
        )
        r.ckpt.close()
        r.close()
    runners.clear()
    gc.collect()


def signing_costs(model: str, repeats: int, tmp: str) -> None:
    """What signing costs (``PITSTOP_CKPT_KEY``: each file's SHA-256 beside its CRC32C, the manifest sealed with an
    HMAC): each row saved with the key set and unset, alternating on the same runner, then what verifying one
    checkpoint costs with and without the key (its SHA-256 read over every byte).  Thread-based rows only: a
    checkpoint process reads the key once, when it starts, so it cannot alternate.  Leaves out a GPU (the hashes
    run on the host, in the writer, after staging) and a store (an upload that is slower than hashing hides it)."""
    from common import save_result

    from pitstop.ckpt import integrity

    rows = ["sync_save", "sync_dcp", "async_dcp (thread)"]
    runners = {row: make_runner(model, row, os.path.join(tmp, f"sig-{i}")) for i, row in enumerate(rows)}
    results: dict[tuple[str, bool], list] = {(row, on): [] for row in rows for on in (True, False)}
    key = "bench-signing-key-" + "0" * 32
    figures: dict = {"model": model, "repeats": repeats}
    try:
        for r in runners.values():
            measure_save(r)  # (the first save allocates buffers: not timed)
        for rep in range(repeats):
            for row, r in runners.items():
                for on in (True, False) if rep % 2 == 0 else (False, True):
                    os.environ[integrity.KEY_ENV] = key if on else ""
                    results[(row, on)].append(measure_save(r))
        print(f"\n## {model}: signed (PITSTOP_CKPT_KEY) vs unsigned, local disk + fsync ({repeats} saves each)")
        print(
            f"{'row':<24}{'block signed':>14}{'unsigned':>10}{'ratio':>8}"
            f"{'durable signed':>16}{'unsigned':>10}{'ratio':>8}"
        )
        for row in rows:
            b_on, b_off = (median([x["block"] for x in results[(row, on)]]) for on in (True, False))
            d_on, d_off = (median([x["durable"] for x in results[(row, on)]]) for on in (True, False))
            figures[row] = {"block_ratio": round(b_on / max(b_off, 1e-9), 3), "durable_ratio": round(d_on / d_off, 3),
                            "durable_signed_s": round(d_on, 3), "durable_unsigned_s": round(d_off, 3)}  # fmt: skip
            print(
                f"{row:<24}{b_on * 1e3:>12.1f}ms{b_off * 1e3:>8.1f}ms{b_on / max(b_off, 1e-9):>7.3f}x"
                f"{d_on:>15.3f}s{d_off:>9.3f}s{d_on / d_off:>7.3f}x",
                flush=True,
            )
        runners["sync_dcp"].ckpt._report_finished()
        path = runners["sync_dcp"].ckpt.records[-1].path
        for on in (False, True):
            os.environ[integrity.KEY_ENV] = key if on else ""
            if on:  # (the newest save's manifest must be signed to verify with the key)
                step(runners["sync_dcp"])
                save(runners["sync_dcp"])
                runners["sync_dcp"].ckpt._report_finished()
                path = runners["sync_dcp"].ckpt.records[-1].path
            t0 = time.perf_counter()
            nbytes = integrity.verify(path)
            seconds = time.perf_counter() - t0
            label = "signed" if on else "unsigned"
            figures[f"verify_{label}_gbps"] = round(nbytes / seconds / 1e9, 2)
            print(f"verify {label:<9}{nbytes / 1e6:>6.0f} MB in {seconds:.3f} s: {nbytes / seconds / 1e9:.2f} GB/s")
        save_result("ckpt_signing", figures)
    finally:
        os.environ.pop(integrity.KEY_ENV, None)
        for r in runners.values():
            r.ckpt.close()
            r.close()
        runners.clear()
        gc.collect()


def every_step(model: str, rows: list[str], steps: int, tmp: str) -> None:
    print(
        f"\n## {model}: steps/s with a save after every step ({steps} steps, after {EVERY_WARM} saves that are "
        f"not timed: the steady state) vs no saves, local disk"
    )
    none_sps = None
    for row in ["none", *rows]:
        d = tempfile.mkdtemp(dir=tmp)
        r = make_runner(model, row, d)
        for _ in range(EVERY_WARM):  # the first save allocates host buffers and may wait for a checkpoint process
            step(r)
            save(r)
        r.ckpt.wait()
        t0 = time.perf_counter()
        for _ in range(steps):
            step(r)
            save(r)
        r.ckpt.wait()
        sps = steps / (time.perf_counter() - t0)
        r.ckpt.close()
        none_sps = none_sps or sps
        print(f"{row:<28}{sps:8.3f} steps/s  ({sps / none_sps:.2f}x of no saves)", flush=True)
        r.close()
        shutil.rmtree(d, ignore_errors=True)


def rss_over_saves(model: str, row: str, saves: int) -> None:
    d = tempfile.mkdtemp(prefix="pitstop-bench-rss-", dir=os.environ.get("BENCH_DIR"))
    r = make_runner(model, row, d)
    marks = {}
    for i in range(1, saves + 1):
        save(r)
        step(r)
        if i in (1, 10, saves // 2, saves):
            r.ckpt.wait()
            gc.collect()
            marks[i] = tree_rss_mb()
    r.ckpt.close()
    growth = marks[saves] - marks[10]
    print(
        f"RSS {row:<28}"
        + "  ".join(f"save {k}: {v:6.0f} MB" for k, v in sorted(marks.items()))
        + f"   growth save 10->{saves}: {growth:+.0f} MB ({100 * growth / marks[10]:+.1f}%)",
        flush=True,
    )
    r.close()
    shutil.rmtree(d, ignore_errors=True)


def rss_mb(pid: int | None = None) -> float:
    with open(f"/proc/{pid or os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def tree_rss_mb() -> float:
    """RSS of this process plus its child processes (e.g. a checkpoint process)."""
    total = rss_mb()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                for child in f.read().split():
                    total += rss_mb(int(child))
        except OSError:
            pass
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--throttle-mbps", type=float, default=200.0)
    ap.add_argument("--rss-saves", type=int, default=50)
    ap.add_argument("--steps", type=int, default=6, help="steps for the save-every-step runs")
    ap.add_argument("--only", default=None, help="run only these parts: tables,throttled,every,rss,checksums,signing")
    ap.add_argument("--rss-only", nargs=2, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--models", default=None, help="only the models whose label contains one of these (comma list)")
    args = ap.parse_args()
    ensure_data()
    if args.rss_only:
        return rss_over_saves(*args.rss_only, args.rss_saves)
    parts = set((args.only or "tables,throttled,every,rss,checksums,signing").split(","))
    tmp = tempfile.mkdtemp(prefix="pitstop-bench-ckpt-", dir=os.environ.get("BENCH_DIR"))
    print("# bench/ckpt.py: what a save costs the loop (medians; rows alternate within each repeat)", flush=True)
    resnet = next(iter(MODELS))
    wanted = [m for m in MODELS if not args.models or any(w in m for w in args.models.split(","))]
    if "tables" in parts:
        for model in wanted:
            table(model, list(ROWS), [], args.repeats, tmp, throttled=False)
    if "throttled" in parts:
        rows = ["sync_save", "sync_dcp", "async_dcp (thread)", "async_dcp_pinned (process)", "peer: torchtitan pinned"]
        table(resnet, rows, [f"ckpt.throttle_mbps={args.throttle_mbps}"], args.repeats, tmp, throttled=True)
    if "checksums" in parts:
        checksum_costs(resnet, max(args.repeats, 4), tmp)
    if "signing" in parts:
        signing_costs(resnet, max(args.repeats, 4), tmp)
    if "every" in parts:
        every_step(resnet, list(ROWS), args.steps, tmp)
    if "rss" in parts:
        print(f"\n## {resnet}: RSS of the trainer and its checkpoint processes over {args.rss_saves} saves", flush=True)
        for row in ["sync_save", "sync_dcp", "async_dcp (thread)", "async_dcp_pinned (process)"]:
            out = subprocess.run(
                [sys.executable, __file__, "--rss-only", resnet, row, "--rss-saves", str(args.rss_saves)],
                capture_output=True,
                text=True,
            )
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RSS")]
            print(lines[-1] if lines else f"{row}: failed: {out.stderr.strip().splitlines()[-1:]}", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
