"""Replica groups (strategy=ft) against elastic DDP restarts, under the same failures, side by side in one run.

    python bench/ft.py [--epochs 50] [--mtbf 8] [--seed 7] [--nproc 1]   # needs torchft (the dev or ft extra)

The recovery bench's job (SmallCNN on digits, ``--epochs`` epochs at batch 64 per process, ``ckpt=async_dcp``
every 7 steps), two processes either way. Both do the same work, the same epochs of samples: while a group is down,
ft's other group takes the whole of each step's data, so ft needs more (smaller) steps for the epochs, where a run of
``trainer.max_steps`` would book a half-size step as a whole one. The summaries' ``samples_seen`` are printed side by
side to show it. What it leaves out: one machine's 2 cores (groups and ranks share them), gloo, a small model.
- ``ft``:  ``strategy=ft strategy.replicas=2``: a SIGKILLed group is restarted alone by its supervisor and heals
  from the other group, which goes on.
- ``ddp``: ``strategy=ddp strategy.nproc_per_node=2`` with ``trainer.max_restarts``: torch's elastic agent restarts
  both ranks, and they resume from the newest checkpoint.
``--nproc N``: groups of N ranks (DDP inside each) against ddp(2N); a failure kills rank 0 of the drawn group (its
group's agent restarts the group's N ranks), in ddp rank 0.
The failures are the same in both: this script SIGKILLs a process at seeded times on the job's clock (from its
launch; gaps ~ Exponential(``--mtbf``)): in ft the group drawn for that failure, in ddp rank 0 (any rank's death
restarts all). A failure whose target is still starting waits until it runs. (``fault=random`` draws its times per
attempt and per group, so two jobs would not see the same failures.)
And both without failures: the step rate of ft against ddp (the price of a quorum per step).

Goodput: productive seconds / wall seconds, summed over the processes (ft: every group's ledger; ddp: rank 0's
ledger covers the job). Per failure of a group (ft): the healthy group's pause (its longest step around the kill,
less its median step), its discarded steps, whether it restarted (target: never), and the heal (restart to the
first committed step). Targets (issue 25): pause median <= 1 s; 0 restarts of healthy groups; <= 1 lost step per
failure; ft goodput >= ddp goodput + 15 points; no-failure step rate ft / ddp >= 0.9.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from common import ROOT, ensure_data, save_result

# What bench/results/ft.json's figures are, and the code they measure (read by the docs' results page,
# bench/figures.py, without running this script). Targets: issue 25's.
FIGURES = {
    "epochs": ("", "epochs of the digits trained by each job", None),
    "mtbf_seconds": ("s", "mean time between the injected SIGKILLs (gaps ~ Exponential(mtbf))", None),
    "seed": ("", "the seed of the failure times (the same for both jobs)", None),
    "ranks_per_group": ("", "ranks per replica group (ddp runs twice as many)", None),
    "goodput.ft": (
        "%",
        "productive seconds over wall seconds, strategy=ft (2 replica groups)",
        ">= goodput.ddp + 0.15",
    ),
    "goodput.ddp": ("%", "the same for ddp with elastic restarts of every rank", None),
    "goodput_without_failures.*": ("%", "goodput of the same job with no failure", None),
    "failures.*": ("", "SIGKILLs the job received", None),
    "wall_seconds.*": ("s", "wall clock of the job, for the same epochs", None),
    "samples_seen.*": ("", "samples trained (equal work: the same epochs)", None),
    "pause_median_seconds": (
        "s",
        "the healthy group's pause per failure (its longest step around the kill, less its median step), median",
        "<= 1",
    ),
    "healthy_restarts": ("", "restarts of a group that was not killed", "== 0"),
    "lost_steps_per_failure": ("", "steps a healthy group discarded per failure", "<= 1"),
    "heal_median_seconds": ("s", "a killed group's heal: its restart to its first committed step, median", None),
    "no_failure_step_rate.ft": (
        "steps/s",
        "steps per second without failures, strategy=ft (a quorum per step)",
        ">= 0.9 * no_failure_step_rate.ddp",
    ),
    "no_failure_step_rate.ddp": ("steps/s", "the same for ddp", None),
}
MEASURES = ["src/pitstop/strategy", "src/pitstop/launch", "src/pitstop/data/loader/replica.py"]

JOB = ["logger=none", "trainer.progress_bar=false", "trainer.batch_size=64", "trainer.eval_every_steps=null",
       "loader.num_workers=0", "ckpt=async_dcp", "ckpt.interval_steps=7", "data.record_sample_ids=true"]  # fmt: skip


def command(run_dir: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "recipe.train", *JOB, *args, f"run_dir={run_dir}"]


def train(run_dir: str, args: list[str], timeout: float = 3600) -> float:
    t0 = time.perf_counter()
    cmd = command(run_dir, args)
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[3:])} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return time.perf_counter() - t0


def schedule(mtbf: float, seed: int, groups: int, horizon: float = 3600) -> list[tuple[float, int]]:
    """(seconds after launch, group) of each failure: gaps ~ Exponential(mtbf), the group drawn uniformly."""
    rng, t, out = random.Random(seed), 0.0, []
    while t < horizon:
        t += rng.expovariate(1 / mtbf)
        out.append((t, rng.randrange(groups)))
    return out


def current_pid(ledger_path: str, dead: set[int]) -> int | None:
    """The pid of the attempt now running (its ledger record is written as it starts), unless already killed."""
    try:
        with open(ledger_path) as f:
            attempt = json.load(f)["attempts"][-1]
    except (OSError, ValueError, KeyError, IndexError):
        return None
    if attempt.get("status") != "running" or attempt["pid"] in dead:
        return None  # (killed already, or ended: its pid may be another process's by now)
    return attempt["pid"]


def train_with_kills(run_dir: str, args: list[str], failures: list[tuple[float, int]], target) -> tuple[float, list]:
    """Run the job and SIGKILL ``target(run_dir, group)``'s attempt at each failure's time; (wall, kills)."""
    t0 = time.perf_counter()
    cmd = command(run_dir, args)
    log = open(os.path.join(os.path.dirname(run_dir), os.path.basename(run_dir) + ".log"), "w")
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    dead: set[int] = set()
    kills: list[tuple[float, int]] = []  # (wall-clock time of the kill, group)
    for at, k in failures:
        while p.poll() is None and time.perf_counter() - t0 < at:
            time.sleep(0.02)
        pid = None
        while p.poll() is None and pid is None:  # the target is (re)starting: the failure waits for it
            pid = current_pid(target(run_dir, k), dead)
            if pid is None:
                time.sleep(0.02)
        if p.poll() is not None:
            break
        dead.add(pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue  # (it ended on its own just now: no failure)
        kills.append((time.time(), k))
    p.wait()
    log.close()
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[3:])} failed ({p.returncode}): see {log.name}")
    return time.perf_counter() - t0, kills


def lines(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(x) for x in f if x.startswith("{")]


def ledger(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "goodput.json")) as f:
        return json.load(f)


def step_rate(run_dir: str) -> float:
    """Committed steps per second of the loop (compute + data wait + quorum + checkpoint blocking)."""
    t = ledger(run_dir)["totals"]
    busy = t["productive"] + t["data_wait"] + t["checkpoint"] + t.get("quorum", 0.0) + t.get("discarded", 0.0)
    steps = max(r["step"] for r in lines(os.path.join(run_dir, "metrics.jsonl")) if "loss" in r)
    return steps / busy


def ft_failures(run: str, groups: int, killed: list[tuple[float, int]]) -> dict:
    """Per failure of a group: the healthy groups' pause, discarded steps and restarts, and the heal."""
    pauses, discarded, healthy_restarts, heals, failures = [], 0, 0, [], 0
    kills = {k: [t for t, g in killed if g == k] for k in range(groups)}
    commits = {
        k: [r for r in lines(os.path.join(run, f"replica{k}", "samples.rank0.jsonl")) if "commit" in r]
        for k in range(groups)
    }
    for k in range(groups):
        attempts = ledger(os.path.join(run, f"replica{k}"))["attempts"]
        healthy_restarts += max(0, len(attempts) - 1 - len(kills[k]))
        text = open(os.path.join(run, f"replica{k}", "train.log")).read()
        heals += [float(s) for s in re.findall(r"healed from a live peer at step \d+ in ([\d.]+)s", text)]
    for k, times in kills.items():
        for t in times:
            failures += 1
            for h in (h for h in range(groups) if h != k):
                c = [r for r in commits[h] if r.get("t")]
                gaps = [(b["t"] - a["t"], a["t"]) for a, b in zip(c, c[1:])]
                if not gaps:
                    continue
                normal = statistics.median(g for g, _ in gaps)
                around = [g for g, start in gaps if t - 1.0 <= start <= t + 5.0]
                if around:
                    pauses.append(max(around) - normal)
                # (each discarded step once: to the last kill of another group before it, within 5 s; kills a
                # fraction of a second apart have overlapping windows)
                discarded += sum(
                    1
                    for r in commits[h]
                    if not r["ok"]
                    and t - 1.0 <= r["t"] <= t + 5.0
                    and t == max((u for u, g in killed if g != h and u - 1.0 <= r["t"]), default=None)
                )
    return {"failures": failures, "pauses": pauses, "discarded": discarded, "healthy_restarts": healthy_restarts,
            "heals": heals}  # fmt: skip


def samples_seen(run: str) -> int:
    """The job's samples trained (its summary.json; ft: the job's, every group's steps together)."""
    with open(os.path.join(run, "summary.json")) as f:
        return int(json.load(f)["samples_seen"])


def goodput_ft(run: str, groups: int) -> float:
    docs = [ledger(os.path.join(run, f"replica{k}"))["totals"] for k in range(groups)]
    return sum(d["productive"] for d in docs) / sum(d["total"] for d in docs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=50, help="the work of each job (digits: ~11 ddp(2) steps each)")
    ap.add_argument("--mtbf", type=float, default=8.0, help="mean seconds between failures of the job")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--nproc", type=int, default=1, help="ranks per replica group (ddp gets twice as many)")
    a = ap.parse_args()
    ensure_data()
    tmp = tempfile.mkdtemp(prefix="pitstop-bench-ft-")
    steps = [f"trainer.epochs={a.epochs}", "trainer.max_steps=null"]
    ft = ["strategy=ft", "strategy.replicas=2", f"strategy.nproc_per_node={a.nproc}", "strategy.max_restarts=100"]
    ddp = ["strategy=ddp", f"strategy.nproc_per_node={2 * a.nproc}", "trainer.max_restarts=100"]
    if a.nproc > 1:  # (more processes than this machine's cores: allowed for the comparison)
        ft.append("strategy.oversubscribe=true")
        ddp.append("strategy.oversubscribe=true")
    failures = schedule(a.mtbf, a.seed, 2)
    walls = {}
    walls["ft_clean"] = train(f"{tmp}/ft_clean", [*ft, *steps])
    walls["ddp_clean"] = train(f"{tmp}/ddp_clean", [*ddp, *steps])
    walls["ft"], kills_ft = train_with_kills(
        f"{tmp}/ft", [*ft, *steps], failures, lambda run, k: os.path.join(run, f"replica{k}", "goodput.json")
    )
    walls["ddp"], kills_ddp = train_with_kills(
        f"{tmp}/ddp", [*ddp, *steps], failures, lambda run, k: os.path.join(run, "goodput.json")
    )
    rate_ft = statistics.mean(step_rate(f"{tmp}/ft_clean/replica{k}") for k in (0, 1))
    rate_ddp = step_rate(f"{tmp}/ddp_clean")
    f = ft_failures(f"{tmp}/ft", 2, kills_ft)
    d = ledger(f"{tmp}/ddp")
    g_ft, g_ddp = goodput_ft(f"{tmp}/ft", 2), d["goodput"]
    clean_ft, clean_ddp = goodput_ft(f"{tmp}/ft_clean", 2), ledger(f"{tmp}/ddp_clean")["goodput"]
    print(f"strategy=ft (2 replica groups of {a.nproc}) vs ddp({2 * a.nproc}) with elastic restarts: {a.epochs} "
          f"epochs, async_dcp every 7, the same SIGKILLs at seeded times (gaps ~ Exponential({a.mtbf:g} s), "
          f"seed {a.seed}); 2 CPU cores, gloo")  # fmt: skip
    print("| | ft | ddp | target |\n|---|---|---|---|")
    print(f"| goodput | {g_ft:.1%} | {g_ddp:.1%} | ft >= ddp + 15 points ({(g_ft - g_ddp) * 100:+.1f}) |")
    print(f"| goodput without failures | {clean_ft:.1%} | {clean_ddp:.1%} | |")
    print(f"| failures (SIGKILLs) | {len(kills_ft)} | {len(kills_ddp)} | the same times |")
    per = [(clean_ft - g_ft) / max(len(kills_ft), 1), (clean_ddp - g_ddp) / max(len(kills_ddp), 1)]
    print(f"| goodput lost per failure | {per[0] * 100:.2f} points | {per[1] * 100:.2f} points | |")
    print(f"| wall seconds for the same epochs | {walls['ft']:.1f} | {walls['ddp']:.1f} | |")
    seen_ft, seen_ddp = samples_seen(f"{tmp}/ft"), samples_seen(f"{tmp}/ddp")
    print(f"| samples trained (equal work) | {seen_ft} | {seen_ddp} | the same epochs |")
    pause = statistics.median(f["pauses"]) if f["pauses"] else float("nan")
    print(f"| healthy group's pause per failure, median (max) | {pause:.2f} s ({max(f['pauses'], default=0):.2f}) "
          f"| every rank restarts: R = {d.get('restart_seconds') or 0:.2f} s | <= 1 s |")  # fmt: skip
    print(f"| restarts of healthy groups | {f['healthy_restarts']} | {d['restarts']} (all ranks) | 0 |")
    lost = f["discarded"] / max(f["failures"], 1)
    print(f"| lost steps on healthy groups per failure | {lost:.2f} | since the last checkpoint | <= 1 |")
    heal = statistics.median(f["heals"]) if f["heals"] else float("nan")
    print(f"| heal (quorum + state from the peer), median | {heal:.2f} s | restore from a checkpoint | |")
    print(f"| no-failure step rate | {rate_ft:.1f}/s | {rate_ddp:.1f}/s | ft / ddp >= 0.9 ({rate_ft / rate_ddp:.2f}) |")
    print(f"(runs in {tmp})")
    save_result("ft", {
        "epochs": a.epochs, "mtbf_seconds": a.mtbf, "seed": a.seed, "ranks_per_group": a.nproc,
        "goodput": {"ft": g_ft, "ddp": g_ddp}, "goodput_without_failures": {"ft": clean_ft, "ddp": clean_ddp},
        "failures": {"ft": len(kills_ft), "ddp": len(kills_ddp)},
        "wall_seconds": {"ft": walls["ft"], "ddp": walls["ddp"]},
        "samples_seen": {"ft": seen_ft, "ddp": seen_ddp}, "pause_median_seconds": pause,
        "healthy_restarts": f["healthy_restarts"], "lost_steps_per_failure": lost, "heal_median_seconds": heal,
        "no_failure_step_rate": {"ft": rate_ft, "ddp": rate_ddp},
    })  # fmt: skip


if __name__ == "__main__":
    main()
