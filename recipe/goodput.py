"""Expected goodput for a failure rate, save cost, restart cost and checkpoint interval; the best interval.

    python -m recipe.goodput                                   # the published case: 8.6 failures/day
    python -m recipe.goodput --failures-per-day 8.6 --interval 2h 30min --save-cost 60 --restart-cost 10min
    python -m recipe.goodput --mtbf 3h --save-cost 2 --write-lag 40 --interval 10min
    python -m recipe.goodput --mtbf 8 --interval 2.5 --save-cost 0.05 --recovery-gap 0.5 --program-start 0 \
        --init 0.3 --restore 0.1 --local-interval 0.4 --local-cost 0.02 --local-share 1

A run's time line (its attempts on one clock, coloured by the ledger's buckets; also for a killed run):
    python -m recipe.goodput --timeline outputs/runs/RUN

At scale (N nodes, each failing every --node-mtbf; inputs C, W and R from a real run's summary.json):
    python -m recipe.goodput --nodes --from outputs/runs/RUN --node-mtbf 240d --replace-cost 5min --plot scale.png
    python -m recipe.goodput --nodes --peer bench/results/peer_restore.json --interval 30min --local-interval 2min
    python -m recipe.goodput --nodes --ft --save-cost 60 --restart-cost 10min --step-time 2 --ft-pause 1

The model (pitstop.goodput.model): goodput(T) = T/(T+C) * (1 - (R + (T+C)/2 + W)/MTBF), best near sqrt(2 C MTBF);
also printed: the exact value for exponential failures, T e^-(R+W)/M / (M (e^((T+C)/M) - 1)).
R is the restart cost per failure, or the sum of its parts (the ledger's buckets): --recovery-gap,
--program-start, --init, --restore. With a local checkpoint tier (ckpt.local: --local-interval, --local-cost,
--local-lag, --local-share = the share of failures it survives) the two-tier model is printed too.
"""

from __future__ import annotations

import argparse
import sys

from pitstop.goodput.model import (
    best_interval,
    exact_goodput,
    expected_goodput,
    fmt_duration,
    parse_duration,
    two_tier_goodput,
    young_daly,
)

PARTS = ("recovery_gap", "program_start", "init", "restore")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m recipe.goodput", description=__doc__.split("\n\n")[0])
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--failures-per-day", type=float, default=None, help="interruptions per day (default 8.6)")
    rate.add_argument("--mtbf", default=None, help="mean time between failures, e.g. 2.8h")
    p.add_argument("--interval", nargs="+", default=["2h", "30min"], help="checkpoint intervals to evaluate")
    p.add_argument("--save-cost", default="0", help="seconds the loop blocks per save (C)")
    p.add_argument("--restart-cost", default="0", help="restart + restore time per failure (R)")
    p.add_argument("--write-lag", default="0", help="async saves: save start -> durable (W)")
    for part in PARTS:
        p.add_argument(f"--{part.replace('_', '-')}", default=None, help=f"R's part: {part} (the ledger's bucket)")
    p.add_argument("--local-interval", default=None, help="local tier: seconds of work between its saves")
    p.add_argument("--local-cost", default="0", help="local tier: seconds the loop blocks per save")
    p.add_argument("--local-lag", default="0", help="local tier: save start -> complete")
    p.add_argument("--local-share", type=float, default=1.0, help="share of failures the local tier survives")
    p.add_argument(
        "--nodes",
        nargs="*",
        type=int,
        default=None,
        help="project for these node counts (none given: 1, 2, 4 ... 4096)",
    )
    p.add_argument(
        "--node-mtbf",
        default=None,
        help="one node's MTBF (default: Llama 3's 8.6 failures/day on 2,048 nodes of 8 GPUs, i.e. 238 days)",
    )
    p.add_argument("--from", dest="run_dir", default=None, help="take C, W and R from this run dir's summary.json")
    p.add_argument("--replace-cost", default="0", help="a lost node: seconds until a replacement joins, on top of R")
    p.add_argument("--replace-share", type=float, default=0.0, help="share of failures that lose a node")
    p.add_argument(
        "--straggler-share",
        type=float,
        default=None,
        help="with --nodes: share of the time spent waiting for slow ranks (default: the --from run's straggler "
        "bucket over its total, else 0)",
    )
    p.add_argument("--peer", default=None, metavar="JSON",
                   help="with --nodes: what a local tier's copy on a partner node buys (ckpt.local.replicas), from "
                   "bench/peer_restore.py's result (bench/results/peer_restore.json); the tiers save every "
                   "--local-interval and --interval (else at their Young-Daly intervals)")  # fmt: skip
    p.add_argument("--plot", default=None, help="also draw goodput against N into this PNG")
    p.add_argument("--ft", action="store_true", help="with --nodes: also the job as replica groups (strategy=ft)")
    p.add_argument("--nodes-per-group", type=int, default=1, help="--ft: nodes per replica group (default 1)")
    p.add_argument("--ft-pause", default="0.5", help="--ft: healthy groups' pause per failure (bench/ft.py)")
    p.add_argument("--ft-heal", default="0.1", help="--ft: a restarted group's heal from a live peer (bench/ft.py)")
    p.add_argument("--step-time", default="1", help="--ft: seconds per step (a failure discards the step in flight)")
    p.add_argument("--ft-quorum", default="0", help="--ft: each step's quorum cost, seconds")
    p.add_argument("--timeline", metavar="RUN_DIR", default=None,
                   help="draw this run's time line (attempts, buckets, steps, saves, evaluations, failures, heals) "
                   "into RUN_DIR/timeline.png (or --out), also for a killed run")  # fmt: skip
    p.add_argument("--out", default=None, help="--timeline: the PNG to write (default RUN_DIR/timeline.png)")
    a = p.parse_args(argv)
    if a.timeline is not None:
        from pitstop.goodput.timeline import draw

        try:
            print(draw(a.timeline, a.out))
        except (OSError, ValueError, KeyError) as e:
            p.error(f"--timeline {a.timeline}: {type(e).__name__}: {e}")
        return
    if a.nodes is not None:
        return scale(p, a)
    try:
        mtbf = parse_duration(a.mtbf) if a.mtbf else 86400.0 / (a.failures_per_day or 8.6)
        intervals = [parse_duration(t) for t in a.interval]
        c, r, w = parse_duration(a.save_cost), parse_duration(a.restart_cost), parse_duration(a.write_lag)
        parts = {k: parse_duration(getattr(a, k)) for k in PARTS if getattr(a, k) is not None}
        local = (
            None
            if a.local_interval is None
            else (parse_duration(a.local_interval), parse_duration(a.local_cost), parse_duration(a.local_lag))
        )
    except ValueError as e:
        p.error(str(e))
    if parts:
        if r:
            p.error("give --restart-cost or its parts (--recovery-gap, --program-start, --init, --restore), not both")
        r = sum(parts.values())
    if mtbf <= 0 or any(t <= 0 for t in intervals):
        p.error("--mtbf/--failures-per-day and --interval must be positive")

    print(
        f"MTBF {fmt_duration(mtbf)} ({86400 / mtbf:.1f} failures/day); save cost C={fmt_duration(c)}, "
        f"restart R={fmt_duration(r)}, write lag W={fmt_duration(w)}"
    )
    if parts:
        print("R = " + " + ".join(f"{k} {fmt_duration(v)}" for k, v in parts.items()))
    print(f"{'interval':>12}  {'goodput':>8}  {'exact, exponential failures':>28}")
    for t in intervals:
        print(
            f"{fmt_duration(t):>12}  {expected_goodput(t, mtbf, c, r, w) * 100:7.1f}%  "
            f"{exact_goodput(t, mtbf, c, r, w) * 100:27.1f}%"
        )
    if local is not None:
        tl, cl, wl = local
        print(
            f"\nwith a local tier every {fmt_duration(tl)} (blocks {fmt_duration(cl)}, complete after "
            f"{fmt_duration(wl)}), surviving {a.local_share:.0%} of failures (Young–Daly for it: "
            f"{fmt_duration(young_daly(cl, mtbf))}):"
        )
        for t in intervals:
            print(f"{fmt_duration(t):>12}  {two_tier_goodput(tl, t, mtbf, cl, c, r, wl, w, a.local_share) * 100:7.1f}%")
    if c > 0:
        yd, best = young_daly(c, mtbf), best_interval(mtbf, c, r, w)
        print(
            f"optimal interval: Young–Daly sqrt(2*C*MTBF) = {fmt_duration(yd)} -> "
            f"{expected_goodput(yd, mtbf, c, r, w) * 100:.1f}%; model optimum {fmt_duration(best)} -> "
            f"{expected_goodput(best, mtbf, c, r, w) * 100:.1f}%"
        )
    else:
        print("optimal interval: as often as possible (saves are free in this scenario: set --save-cost)")

    print("\nhow the figures move with save cost C and restart cost R (goodput per interval; best interval):")
    header = "".join(f"{fmt_duration(t):>10}" for t in intervals)
    print(f"{'C':>8} {'R':>8}{header}  {'best T':>10} {'at best':>8}")
    for cc in (0.0, 30.0, 300.0):
        for rr in (0.0, 300.0, 900.0):
            row = "".join(f"{expected_goodput(t, mtbf, cc, rr, w) * 100:9.1f}%" for t in intervals)
            if cc > 0:
                bt = best_interval(mtbf, cc, rr, w)
                tail = f"{fmt_duration(bt):>10} {expected_goodput(bt, mtbf, cc, rr, w) * 100:7.1f}%"
            else:
                tail = f"{'-> 0':>10} {'':>8}"
            print(f"{fmt_duration(cc):>8} {fmt_duration(rr):>8}{row}  {tail}")


def measured(run_dir: str) -> tuple[float, float, float]:
    """C (blocking per save), W (save start -> durable) and R (per automatic restart) of a real run, from its
    ``summary.json`` (which carries the ledger's restarts and R)."""
    import os

    from pitstop.statefile import SUMMARY, Damaged, parse

    try:
        summary = parse(os.path.join(run_dir, "summary.json"), SUMMARY)
    except (OSError, Damaged) as e:  # (another shape: named, not a KeyError later)
        raise SystemExit(f"error: --from {run_dir}: summary.json: {e}; give a finished run dir") from None
    ckpt, ledger = summary.get("checkpoint") or {}, summary.get("goodput") or {}
    if not ckpt.get("saves"):
        raise SystemExit(f"error: --from {run_dir}: the run saved no checkpoint (ckpt=none?), so C is unknown")
    if not ledger.get("restarts"):
        raise SystemExit(
            f"error: --from {run_dir}: the run never restarted, so R is unknown; run it with a fault "
            f"(e.g. fault=crash_at_step trainer.max_restarts=1) or give --restart-cost"
        )
    return (
        float(ckpt["block_seconds_mean"]),
        float(ckpt.get("total_seconds_mean") or 0.0),
        float(ledger["restart_seconds"]),
    )


def measured_straggler_share(run_dir: str) -> float:
    """The share of a run's time booked as waiting for slow ranks (``summary.json``'s goodput totals)."""
    import os

    from pitstop.statefile import SUMMARY, Damaged, parse

    try:
        totals = parse(os.path.join(run_dir, "summary.json"), SUMMARY)["goodput"]["totals"]
    except (OSError, Damaged):
        return 0.0  # (measured() names a damaged summary first)
    return float(totals.get("straggler", 0.0)) / max(float(totals.get("total", 0.0)), 1e-9)


def scale(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    from pitstop.goodput.model import at_scale, ft_at_scale

    try:
        node_mtbf = parse_duration(a.node_mtbf) if a.node_mtbf else 2048 * 86400.0 / 8.6
        c, w, r = parse_duration(a.save_cost), parse_duration(a.write_lag), parse_duration(a.restart_cost)
        replace = parse_duration(a.replace_cost)
        fixed = parse_duration(a.interval[0]) if a.interval != p.get_default("interval") else None
        ft = {k: parse_duration(getattr(a, k)) for k in ("ft_pause", "ft_heal", "step_time", "ft_quorum")}
    except ValueError as e:
        p.error(str(e))
    if a.nodes_per_group < 1 or ft["step_time"] <= 0:
        p.error("--nodes-per-group must be >= 1 and --step-time positive")
    slow = a.straggler_share
    if a.run_dir:
        c, w, r = measured(a.run_dir)
        slow = measured_straggler_share(a.run_dir) if slow is None else slow
    slow = slow or 0.0
    if node_mtbf <= 0 or not 0 <= a.replace_share <= 1 or not 0 <= slow < 1:
        p.error("--node-mtbf must be positive, --replace-share within [0, 1] and --straggler-share within [0, 1)")
    nodes = a.nodes or [2**k for k in range(13)]
    print(
        f"per node MTBF {fmt_duration(node_mtbf)}; C={fmt_duration(c)} W={fmt_duration(w)} R={fmt_duration(r)} "
        f"(process restart){f' from {a.run_dir}' if a.run_dir else ''}; a lost node ({a.replace_share:.0%} of "
        f"failures) adds {fmt_duration(replace)}"
    )
    rows = [at_scale(n, node_mtbf, c, r, w, replace, a.replace_share, fixed, slow) for n in nodes]
    if slow:
        print(f"waiting for slow ranks: {slow:.1%} of the time (the ledger's straggler bucket), on every row")
    what = f"at {fmt_duration(fixed)}" if fixed else "at best T"
    if a.ft:
        k = a.nodes_per_group
        print(
            f"strategy=ft: replica groups of {k} node(s); per failure the others pause {fmt_duration(ft['ft_pause'])} "
            f"and discard the step in flight ({fmt_duration(ft['step_time'])}), the failed group restarts (R, and a "
            f"replacement where the node is lost) and heals ({fmt_duration(ft['ft_heal'])}); each step's quorum "
            f"{fmt_duration(ft['ft_quorum'])}; the same durable saves (C every T) for a whole job's loss"
        )
        for row in rows:  # (one group is no replica: every failure is the whole job's)
            row["ft"] = ft_at_scale(row["nodes"], node_mtbf, k, ft["ft_pause"], ft["ft_heal"], row["restart"],
                                    ft["step_time"], ft["ft_quorum"], c, row["interval"])  # fmt: skip
    head = f" {'ft':>7} {'ft - restart':>12}" if a.ft else ""
    print(
        f"{'nodes':>6} {'job MTBF':>10} {'fail/day':>9} {'Young-Daly':>11} {'best T':>10} "
        f"{'goodput ' + what:>18} {'exact':>7}{head}"
    )
    for row in rows:
        tail = ""
        if a.ft:
            tail = (
                f" {row['ft'] * 100:>6.1f}% {(row['ft'] - row['goodput']) * 100:>+11.1f}"
                if row["nodes"] >= 2 * a.nodes_per_group
                else f" {'-':>7} {'(1 group)':>12}"
            )
        print(
            f"{row['nodes']:>6} {fmt_duration(row['mtbf']):>10} {row['failures_per_day']:>9.2f} "
            f"{fmt_duration(row['young_daly']):>11} {fmt_duration(row['best']):>10} {row['goodput'] * 100:>17.1f}% "
            f"{row['exact'] * 100:>6.1f}%{tail}"
        )
    if a.peer:
        peer_rows(p, a, node_mtbf, nodes, r, replace)
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([x["nodes"] for x in rows], [x["goodput"] * 100 for x in rows], marker="o", label=f"goodput {what}")
        if a.ft:
            many = [x for x in rows if x["nodes"] >= 2 * a.nodes_per_group]
            ax.plot([x["nodes"] for x in many], [x["ft"] * 100 for x in many], marker="s", label="strategy=ft")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("nodes")
        ax.set_ylabel("goodput %")
        ax.set_ylim(0, 100)
        ax.grid(True, alpha=0.3)
        ax.set_title(f"C={fmt_duration(c)}, R={fmt_duration(r)}, node MTBF {fmt_duration(node_mtbf)}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot)
        print(f"plot: {a.plot}")


def peer_rows(p: argparse.ArgumentParser, a: argparse.Namespace, node_mtbf: float, nodes, r: float, replace: float):
    """``--peer``: the job with a local tier, without and with its copy on a partner node, from the figures that
    bench/peer_restore.py measured (what a lost node's recovery from the peer and from the durable tier adds to a
    restart: without the restart, which ``--restart-cost`` gives at the job's scale, and without the steps done again;
    each tier's save cost, the local one with and without its copy); the tiers' intervals from
    ``--local-interval`` and ``--interval`` (else Young–Daly at each N)."""
    import json

    from pitstop.goodput.model import replicated_at_scale

    try:
        with open(a.peer) as f:
            fig = json.load(f)["figures"]
        parts = {k: fig["parts"][k] for k in ("peer", "durable")}
        recovery = {k: fig["recovery"][k] - v["redone"] - v["restart"] for k, v in parts.items()}
        tl = parse_duration(a.local_interval) if a.local_interval else None
        td = parse_duration(a.interval[0]) if a.interval != p.get_default("interval") else None
        local = (fig["local_save"]["block"], fig["local_save"]["lag"], tl)
        replicated = (fig["replicated_save"]["block"], fig["replicated_save"]["lag"], tl)
        durable = (fig["durable_save"]["block"], fig["durable_save"]["lag"], td)
    except (OSError, ValueError, KeyError, TypeError) as e:
        p.error(f"--peer {a.peer}: {type(e).__name__}: {e}; give bench/results/peer_restore.json")
    for k in [k for k, v in recovery.items() if v < 0]:  # (its parts overlap: the ledger's and the clock's edges)
        print(f"{a.peer}: recovery.{k} is {-recovery[k]:.2f} s shorter than its restart and redone parts: counted as 0")
        recovery[k] = 0.0
    q = a.replace_share  # (Llama 3: 58.7% of the unexpected interruptions were GPU-related, so lost a node)
    every = (
        f"local saves every {fmt_duration(tl) if tl else 'Young-Daly'}, durable every "
        f"{fmt_duration(td) if td else 'Young-Daly'}"
    )
    print(
        f"\nwith a local tier ({every}) and its copy on a partner node (ckpt.local.replicas=1), measured in "
        f"{a.peer}: {q:.1%} of failures lose a node; after its replacement and the restart its ranks recover from "
        f"the peer in {fmt_duration(recovery['peer'])}, from the durable tier in {fmt_duration(recovery['durable'])} "
        f"(to the first step, then half a cycle of that tier done again); a local save blocks {fmt_duration(local[0])} "
        f"({fmt_duration(replicated[0])} with its copy) and is complete after {fmt_duration(local[1])} "
        f"({fmt_duration(replicated[1])})"
    )
    print(f"{'nodes':>6} {'job MTBF':>10} {'local only':>11} {'with copy':>10} {'gain':>7}")
    for n in nodes:
        common = (n, node_mtbf, q, replace, r)
        alone = replicated_at_scale(*common, local, durable, recovery["peer"], recovery["durable"], replicas=False)
        copy = replicated_at_scale(*common, replicated, durable, recovery["peer"], recovery["durable"], replicas=True)
        print(
            f"{n:>6} {fmt_duration(alone['mtbf']):>10} {alone['goodput'] * 100:>10.1f}% {copy['goodput'] * 100:>9.1f}% "
            f"{(copy['goodput'] - alone['goodput']) * 100:>+6.1f}"
        )


if __name__ == "__main__":
    sys.exit(main())
