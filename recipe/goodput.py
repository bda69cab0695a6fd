"""Expected goodput for a failure rate, save cost, restart cost and checkpoint interval; the best interval.

    python -m recipe.goodput                                   # the published case: 8.6 failures/day
    python -m recipe.goodput --failures-per-day 8.6 --interval 2h 30min --save-cost 60 --restart-cost 10min
    python -m recipe.goodput --mtbf 3h --save-cost 2 --write-lag 40 --interval 10min
    python -m recipe.goodput --mtbf 8 --interval 2.5 --save-cost 0.05 --recovery-gap 0.5 --program-start 0 \
        --init 0.3 --restore 0.1 --local-interval 0.4 --local-cost 0.02 --local-share 1

The model (pitstop.goodput): goodput(T) = T/(T+C) * (1 - (R + (T+C)/2 + W)/MTBF), best near sqrt(2 C MTBF);
also printed: the exact value for exponential failures, T e^-(R+W)/M / (M (e^((T+C)/M) - 1)).
R is the restart cost per failure, or the sum of its parts (the ledger's buckets): --recovery-gap,
--program-start, --init, --restore. With a local checkpoint tier (ckpt.local: --local-interval, --local-cost,
--local-lag, --local-share = the share of failures it survives) the two-tier model is printed too.
"""

from __future__ import annotations

import argparse
import sys

from pitstop.goodput import (best_interval, exact_goodput, expected_goodput, fmt_duration, parse_duration,
                             two_tier_goodput, young_daly)

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
    a = p.parse_args(argv)
    try:
        mtbf = parse_duration(a.mtbf) if a.mtbf else 86400.0 / (a.failures_per_day or 8.6)
        intervals = [parse_duration(t) for t in a.interval]
        c, r, w = parse_duration(a.save_cost), parse_duration(a.restart_cost), parse_duration(a.write_lag)
        parts = {k: parse_duration(getattr(a, k)) for k in PARTS if getattr(a, k) is not None}
        local = None if a.local_interval is None else (parse_duration(a.local_interval), parse_duration(a.local_cost),
                                                       parse_duration(a.local_lag))
    except ValueError as e:
        p.error(str(e))
    if parts:
        if r:
            p.error("give --restart-cost or its parts (--recovery-gap, --program-start, --init, --restore), not both")
        r = sum(parts.values())
    if mtbf <= 0 or any(t <= 0 for t in intervals):
        p.error("--mtbf/--failures-per-day and --interval must be positive")

    print(f"MTBF {fmt_duration(mtbf)} ({86400 / mtbf:.1f} failures/day); save cost C={fmt_duration(c)}, "
          f"restart R={fmt_duration(r)}, write lag W={fmt_duration(w)}")
    if parts:
        print("R = " + " + ".join(f"{k} {fmt_duration(v)}" for k, v in parts.items()))
    print(f"{'interval':>12}  {'goodput':>8}  {'exact, exponential failures':>28}")
    for t in intervals:
        print(f"{fmt_duration(t):>12}  {expected_goodput(t, mtbf, c, r, w) * 100:7.1f}%  "
              f"{exact_goodput(t, mtbf, c, r, w) * 100:27.1f}%")
    if local is not None:
        tl, cl, wl = local
        print(f"\nwith a local tier every {fmt_duration(tl)} (blocks {fmt_duration(cl)}, complete after "
              f"{fmt_duration(wl)}), surviving {a.local_share:.0%} of failures (Young–Daly for it: "
              f"{fmt_duration(young_daly(cl, mtbf))}):")
        for t in intervals:
            print(f"{fmt_duration(t):>12}  {two_tier_goodput(tl, t, mtbf, cl, c, r, wl, w, a.local_share) * 100:7.1f}%")
    if c > 0:
        yd, best = young_daly(c, mtbf), best_interval(mtbf, c, r, w)
        print(f"optimal interval: Young–Daly sqrt(2*C*MTBF) = {fmt_duration(yd)} -> "
              f"{expected_goodput(yd, mtbf, c, r, w) * 100:.1f}%; model optimum {fmt_duration(best)} -> "
              f"{expected_goodput(best, mtbf, c, r, w) * 100:.1f}%")
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


if __name__ == "__main__":
    sys.exit(main())
