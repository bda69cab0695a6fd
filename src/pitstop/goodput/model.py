"""The goodput model and the automatic checkpoint interval (Young–Daly).

A job saves after every ``T`` seconds of work, each save blocks the loop for ``C`` seconds, and becomes
durable ``W`` seconds after it started (0 for a synchronous save, the background write time for an async
one).  Failures arrive at random, on average every ``M`` seconds of wall clock; each costs the restart
``R`` plus the work since the last durable checkpoint — on average half a cycle, ``(T + C) / 2``, plus ``W``.
To first order::

    goodput(T) = T / (T + C) * (1 - (R + (T + C) / 2 + W) / M)

It is maximised near Young's interval ``T* = sqrt(2 C M)``.  With C = R = W = 0 and 8.6 failures a day
(M = 2.79 h): T = 2 h gives 64%, T = 30 min gives 91% — the figures published for Llama 3 training.
:func:`exact_goodput` is the same model without the first-order approximation (exponential failures);
the two differ once T, R or W are a sizeable fraction of M.
"""

from __future__ import annotations

import logging
import math
import re

log = logging.getLogger("pitstop.goodput.model")

ASSUMED_MTBF = 86400.0  # one failure a day, until a better figure is known


def expected_goodput(
    interval: float, mtbf: float, save_cost: float = 0.0, restart_cost: float = 0.0, write_lag: float = 0.0
) -> float:
    t, c = float(interval), float(save_cost)
    if t <= 0 or mtbf <= 0:
        return 0.0
    useful = t / (t + c)
    lost = (restart_cost + (t + c) / 2 + write_lag) / mtbf
    return max(0.0, useful * (1.0 - lost))


def exact_goodput(
    interval: float, mtbf: float, save_cost: float = 0.0, restart_cost: float = 0.0, write_lag: float = 0.0
) -> float:
    """Long-run goodput when failures are exponential (memoryless) and strike any time, restarts included.

    Each attempt survives its restart with probability exp(-R/M) and then keeps cycle k (its save durable at
    k(T+C)+W) with probability exp(-(k(T+C)+W)/M); an attempt lasts M on average. So::

        goodput = T * exp(-(R + W)/M) / (M * (exp((T + C)/M) - 1))

    It agrees with the first-order formula when T, C, R, W << M and stays right when they are not (then the
    first-order one overstates the loss: a failure tends to come early in a long cycle)."""
    t, c = float(interval), float(save_cost)
    if t <= 0 or mtbf <= 0:
        return 0.0
    return t * math.exp(-(restart_cost + write_lag) / mtbf) / (mtbf * math.expm1((t + c) / mtbf))


def two_tier_goodput(
    local_interval: float,
    durable_interval: float,
    mtbf: float,
    local_cost: float = 0.0,
    durable_cost: float = 0.0,
    restart_cost: float = 0.0,
    local_lag: float = 0.0,
    durable_lag: float = 0.0,
    local_share: float = 1.0,
) -> float:
    """First order, with a local tier (``ckpt.local``) saving every ``local_interval`` seconds of work next to
    the durable one: both tiers' saves block the loop; a failure the local tier survives (a share
    ``local_share`` of them: a crashed or killed process, a hang) loses half a local cycle, one it does not
    survive (the node is gone) half a durable cycle::

        goodput = (1 - C_l/(T_l + C_l) - C_d/(T_d + C_d))
                  * (1 - (R + p ((T_l+C_l)/2 + W_l) + (1-p) ((T_d+C_d)/2 + W_d)) / M)

    With ``local_share=0`` it is :func:`expected_goodput` of the durable tier alone (plus the local saves' cost)."""
    tl, td, p = float(local_interval), float(durable_interval), min(max(float(local_share), 0.0), 1.0)
    if tl <= 0 or td <= 0 or mtbf <= 0:
        return 0.0
    useful = 1.0 - local_cost / (tl + local_cost) - durable_cost / (td + durable_cost)
    lost = restart_cost + p * ((tl + local_cost) / 2 + local_lag) + (1 - p) * ((td + durable_cost) / 2 + durable_lag)
    return max(0.0, useful * (1.0 - lost / mtbf))


def young_daly(save_cost: float, mtbf: float) -> float:
    return math.sqrt(2.0 * max(save_cost, 0.0) * mtbf)


def best_interval(mtbf: float, save_cost: float = 0.0, restart_cost: float = 0.0, write_lag: float = 0.0) -> float:
    """The interval that maximises :func:`expected_goodput` (a fine log-spaced search)."""
    if save_cost <= 0:
        return 0.0  # free saves: save continuously
    grid = [young_daly(save_cost, mtbf) * 10 ** (k / 200) for k in range(-400, 401)]
    return max(grid, key=lambda t: expected_goodput(t, mtbf, save_cost, restart_cost, write_lag))


def at_scale(
    nodes: int,
    node_mtbf: float,
    save_cost: float,
    restart_cost: float,
    write_lag: float = 0.0,
    replace_cost: float = 0.0,
    replace_share: float = 0.0,
    interval: float | None = None,
    straggler_share: float = 0.0,
) -> dict:
    """The job on ``nodes`` nodes, each failing on average every ``node_mtbf`` seconds (independently: the
    job's MTBF is ``node_mtbf / nodes``). A share ``replace_share`` of the failures takes a node away (a
    replacement must join: ``replace_cost`` more than a process restart ``restart_cost``); the rest restart the
    processes in place. Checkpoints every ``interval`` seconds of work, or at the best interval for this N.
    ``straggler_share``: the share of the job's time it waits for slow ranks (the ledger's ``straggler`` bucket over
    its total, as measured): every step is that much longer, so goodput is ``(1 - straggler_share)`` of the rest
    (:func:`with_stragglers`)."""
    mtbf = node_mtbf / nodes
    r = restart_cost + replace_share * replace_cost
    best = best_interval(mtbf, save_cost, r, write_lag)
    t = interval if interval is not None else best
    return {
        "nodes": nodes,
        "mtbf": mtbf,
        "failures_per_day": 86400.0 / mtbf,
        "restart": r,
        "young_daly": young_daly(save_cost, mtbf),
        "best": best,
        "interval": t,
        # (free saves: save continuously, only the restarts cost)
        "goodput": with_stragglers(
            expected_goodput(t, mtbf, save_cost, r, write_lag) if t > 0 else max(0.0, 1 - (r + write_lag) / mtbf),
            straggler_share,
        ),
        "exact": with_stragglers(
            exact_goodput(t, mtbf, save_cost, r, write_lag) if t > 0 else math.exp(-(r + write_lag) / mtbf),
            straggler_share,
        ),
        "straggler_share": straggler_share,
    }


def with_stragglers(goodput: float, straggler_share: float) -> float:
    """Goodput when a share ``straggler_share`` of the job's time is spent waiting for a slow rank (the ledger's
    ``straggler`` bucket: compute that the median ranks' pace would not have needed)."""
    return max(0.0, goodput * (1.0 - min(max(straggler_share, 0.0), 1.0)))


def ft_at_scale(
    nodes: int,
    node_mtbf: float,
    nodes_per_group: int,
    pause: float,
    heal: float,
    restart_cost: float,
    step: float,
    quorum: float = 0.0,
    save_cost: float = 0.0,
    interval: float = 0.0,
) -> float:
    """First-order goodput of the same job as :func:`at_scale` run as replica groups (``strategy=ft``) of
    ``nodes_per_group`` nodes: a node's failure takes its group away; the other groups pause ``pause`` seconds
    (detection, the new quorum) and discard at most the ``step`` in flight, the failed group restarts
    (``restart_cost``), heals from a live peer (``heal``) and rejoins, its share of the work done by the others
    meanwhile. Per failure, in seconds of the whole job (``G`` groups)::

        L = (G - 1)/G * (pause + step) + (restart_cost + heal + step)/G

        goodput = T/(T + C) * step/(step + quorum) * (1 - L * nodes/node_mtbf)

    ``quorum``: each step's quorum cost; ``C`` every ``T`` seconds of work: the durable saves that remain for a
    whole job's loss (0 for ``T``: none counted). One group (G = 1) is no replica: every failure is the
    whole job's (:func:`at_scale`)."""
    groups = max(1, nodes // max(1, nodes_per_group))
    if groups < 2 or node_mtbf <= 0 or step <= 0:
        return 0.0
    per_failure = (groups - 1) / groups * (pause + step) + (restart_cost + heal + step) / groups
    useful = (interval / (interval + save_cost) if interval > 0 else 1.0) * step / (step + quorum)
    return max(0.0, useful * (1.0 - per_failure * nodes / node_mtbf))


_UNITS = {"s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600, "hr": 3600, "d": 86400, "day": 86400}


def parse_duration(text: str | float) -> float:
    """Seconds from ``90``, ``90s``, ``30min``, ``2h``, ``1.5d``."""
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*", str(text).lower())
    if not m or (m.group(2) and m.group(2) not in _UNITS):
        raise ValueError(f"{text!r} is not a duration; use e.g. 90s, 30min, 2h")
    return float(m.group(1)) * _UNITS.get(m.group(2) or "s", 1)


def fmt_duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.2f} s"


def replicated_at_scale(
    nodes: int,
    node_mtbf: float,
    node_share: float,
    replace_cost: float,
    restart_cost: float,
    local: tuple[float, float, float | None],
    durable: tuple[float, float, float | None],
    peer_recovery: float,
    durable_recovery: float,
    replicas: bool,
) -> dict:
    """The job of :func:`at_scale` with a local tier (``ckpt.local``), with or without its copy on a partner node
    (``ckpt.local.replicas=1``). ``local`` and ``durable``: each tier's (blocking cost C, save start -> complete W,
    interval T or None for its Young–Daly interval at the job's MTBF) per save, as measured (the local one with its
    copy when ``replicas``). A share ``node_share`` of the failures takes a node: a replacement joins after
    ``replace_cost``, the job restarts (``restart_cost``) and restores in ``peer_recovery`` more (its ranks read the
    partner's copy, and half a local cycle is done again) or, without the copy, ``durable_recovery`` more (the durable
    tier, and half a durable cycle): what each tier adds to a restart, as measured, without the restart itself and
    without the steps done again (the model adds them).  The other failures restart the processes (``restart_cost``,
    the local restore included) and redo half a local cycle.  A node and its partner lost within one recovery is left
    out (its share is that recovery over the partner's MTBF: ~1e-6). :func:`two_tier_goodput` gives the goodput."""
    mtbf = node_mtbf / nodes
    (cl, wl, tl), (cd, wd, td) = local, durable
    q = min(max(float(node_share), 0.0), 1.0)
    r = (1 - q) * restart_cost + q * (replace_cost + restart_cost + (peer_recovery if replicas else durable_recovery))
    tl = tl or max(young_daly(cl, mtbf), wl, 1e-3)
    td = td or max(young_daly(cd, mtbf), wd, tl)
    return {
        "nodes": nodes,
        "mtbf": mtbf,
        "restart": r,
        "local_interval": tl,
        "durable_interval": td,
        "goodput": two_tier_goodput(tl, td, mtbf, cl, cd, r, wl, wd, 1.0 if replicas else 1.0 - q),
    }
