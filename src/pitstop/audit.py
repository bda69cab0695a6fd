"""Was every training sample consumed exactly once per epoch, across restarts and changes of world size?

    python -m pitstop.audit RUN_DIR            # exit status 1 on any repeated or missing sample

Reads the run's sample logs (``data.record_sample_ids=true``: ``samples.rank{R}.jsonl``, one header per
attempt and rank, then each step's sample keys) and ``metrics.jsonl`` (which epoch each step belongs to).
A step computed by an attempt counts only if no later attempt went back behind it: an attempt's step ``s``
survives iff ``s`` is at most the step every later attempt resumed from (a step redone after a restart
counts once, in the attempt that redid it; a rank that did not come back loses its steps after the
checkpoint the others resumed from). Per epoch it prints the samples expected (the train split), consumed
once, repeated and missing; the last epoch of a run that ended by ``trainer.max_steps`` may be partial. Samples of a
step whose update was not applied (a non-finite or spiking loss), or of steps a rollback skipped, are counted as
skipped, and samples quarantined (``RUN_DIR/instability.json``) as quarantined: neither consumed nor missing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from pitstop.statefile import INSTABILITY, SAMPLE_RECORD, Shape, integer, optional, read_records, read_state, record


@dataclass
class EpochAudit:
    """One epoch's verdict: samples ``expected`` (the train split), consumed ``once``, ``repeated`` and
    ``missing``; :attr:`ok` unless one was repeated or missing (missing is allowed in a ``partial`` last epoch)."""

    epoch: int
    expected: int
    once: int = 0
    repeated: int = 0
    missing: int = 0
    partial: bool = False
    skipped: int = 0  # taken by a step whose update was not applied, or by steps a rollback skipped: never consumed
    quarantined: int = 0  # a sample found to be non-finite every time it is seen: never fed again
    examples: list[str] = field(default_factory=list)  # a few repeated keys, for the message

    @property
    def ok(self) -> bool:
        return self.repeated == 0 and (self.missing == 0 or self.partial)


# metrics.jsonl: only the step and its epoch are read here
METRIC = record({}, {"step": integer(0), "epoch": optional(integer(0))})


def _records(path: str, shape: Shape) -> list[dict]:
    """The lines of ``path`` that have ``shape``; others (a line cut by a kill, one of another shape) are skipped
    and named in one warning (the audit reads the user's run dir: it never moves a file). A sample log's skipped
    line loses its keys, which the verdict then counts as missing, never as consumed."""
    return list(read_records(path, shape, then="skipped; the verdict below counts their samples as not consumed"))


def _dirs(run_dir: str) -> list[str]:
    """The dirs with sample logs: the run dir, or a ``strategy=ft`` job's ``replica*/`` groups."""
    groups = sorted(
        os.path.join(run_dir, n) for n in os.listdir(run_dir) if n.startswith("replica") and n[7:].isdigit()
    )
    return groups if groups and not any(n.startswith("samples.rank") for n in os.listdir(run_dir)) else [run_dir]


Keys = dict[tuple[int, int | None], list[str]]


def surviving_keys(run_dir: str, skipped_out: Keys | None = None) -> tuple[Keys, dict]:
    """``{(step, epoch): [sample keys, all ranks]}`` of the steps that survive, and the last header. ``epoch`` is
    the one a micro-batch's line names (written where a step may run into the next epoch: gradient accumulation),
    else None (metrics.jsonl says the step's). ``skipped_out`` gets the keys skipped, the same way: those of a step
    whose update was not applied (a ``skip`` line after its keys) under that step, those of steps a rollback threw
    away keeping the data position (a ``rollback`` line) under the step rolled back to (they stay skipped whenever
    its checkpoint is restored); a later attempt that resumed from before that step takes them back."""
    names = sorted(
        os.path.join(d, n)
        for d in _dirs(run_dir)
        for n in os.listdir(d)
        if n.startswith("samples.rank") and n.endswith(".jsonl")
    )
    if not names:
        raise SystemExit(f"error: no samples.rank*.jsonl in {run_dir}: train with data.record_sample_ids=true")
    resumed: dict[float, int] = {}
    healed: set[float] = set()  # attempts that resumed from a live peer (strategy=ft): they roll nobody back
    decided: dict[float, float] = {}  # when an attempt restored (its header's clock; older logs: its start)
    rows: list[tuple[float, int, int, int | None, list[str]]] = []  # (attempt, rank, step, epoch, keys)
    skipped: list[tuple[float, int, int, int | None, list[str]]] = []  # the same, of keys skipped
    header: dict = {}
    last_t: dict[float, float] = {}  # an attempt's last commit line's wall clock (strategy=ft)
    committed: set[tuple[int, int]] = set()  # (step, quorum) that some replica group committed (strategy=ft)
    orphans: list[tuple[list, int]] = []  # (rows, quorum): a group's last step, written before it died
    for name in names:
        attempt, pending = None, None  # pending: (rows, quorum) of a strategy=ft step not yet decided
        for r in _records(name, SAMPLE_RECORD):
            if "attempt" in r:
                if pending is not None:
                    orphans.append(pending)
                    pending = None
                attempt, header = r["attempt"], max(header, r, key=lambda h: h.get("attempt", 0))
                resumed[attempt] = int(r["resumed_from"])
                decided[attempt] = float(r.get("t", attempt))
                if r.get("healed"):
                    healed.add(attempt)
                rank = int(r["rank"])
            elif attempt is None:
                raise SystemExit(
                    f"error: {os.path.basename(name)} has steps before any attempt header: it was written by an "
                    f"older pitstop; audit runs that this version trained"
                )
            elif "commit" in r:  # the step's outcome: its keys were consumed only if it committed
                last_t[attempt] = max(last_t.get(attempt, 0.0), float(r.get("t", 0.0)))
                if pending is not None and r["ok"]:
                    rows.extend(pending[0])
                    committed.add((int(r["commit"]), int(r["quorum"])))
                pending = None
            elif "skip" in r:  # the step whose keys were written last was not applied: they were skipped
                step = int(r["skip"])
                if pending is not None:  # (strategy=ft: its rows wait for an outcome that a skip replaces)
                    skipped.extend((a_, r_, s_, e_ if e_ is not None else r.get("epoch"), k_)
                                   for a_, r_, s_, e_, k_ in pending[0])  # fmt: skip
                    pending = None
                while rows and rows[-1][:3] == (attempt, rank, step):
                    a_, r_, s_, e_, k_ = rows.pop()
                    skipped.append((a_, r_, s_, e_ if e_ is not None else r.get("epoch"), k_))
            elif "rollback" in r:  # steps (to, from] of this attempt were thrown away
                to, epochs = int(r["rollback"]), r.get("epochs", {})
                mine = lambda row: row[:2] == (attempt, rank) and row[2] > to  # noqa: E731
                gone = [row for row in rows if mine(row)] + [row for row in skipped if mine(row)]
                rows = [row for row in rows if not mine(row)]
                skipped = [row for row in skipped if not mine(row)]
                if r["keep_data"]:  # the data position stayed: skipped, as long as the checkpoint of `to` is kept
                    skipped.extend((a_, r_, to, e_ if e_ is not None else epochs.get(str(s_)), k_)
                                   for a_, r_, s_, e_, k_ in gone)  # fmt: skip
            else:
                row = (attempt, rank, int(r["step"]), r.get("epoch"), r["keys"])
                if "quorum" in r:  # (a step's micro-batches: one line each)
                    pending = ([*pending[0], row] if pending else [row], int(r["quorum"]))
                else:
                    rows.append(row)
        if pending is not None:
            orphans.append(pending)
    # A group killed between its step's all-reduce and the line saying it committed: its share was consumed iff
    # another group of the same quorum committed that step (their all-reduce had its gradients).
    rows.extend(row for step_rows, quorum in orphans for row in step_rows if (row[2], quorum) in committed)
    # How far an attempt's steps are kept: the lowest resume point of any later attempt that restored from a
    # checkpoint (not healed from a live peer) after this one had ended. (An attempt of a strategy=ft group
    # says when it last committed; a later one that restored while it was still running did not roll it back, and
    # one that started before it died but restored after, when no live peer was left to heal from, did.)
    keep: dict[float, float] = {}
    for a in resumed:
        ended = last_t.get(a, float("-inf"))
        later = [
            resumed[b] for b in resumed if b != a and b not in healed and decided[a] < decided[b] and ended < decided[b]
        ]
        keep[a] = min(later, default=float("inf"))
    steps: Keys = defaultdict(list)
    for attempt, _, step, epoch, keys in rows:
        if step <= keep[attempt]:
            steps[step, epoch].extend(keys)
    for attempt, _, step, epoch, keys in skipped:
        if step <= keep[attempt] and skipped_out is not None:
            skipped_out.setdefault((step, epoch), []).extend(keys)
    return steps, header


def epochs_of(run_dir: str) -> dict[int, int]:
    """step -> epoch, from metrics.jsonl (the last record of a step: the attempt whose step survived)."""
    out: dict[int, int] = {}
    for d in _dirs(run_dir):
        if not os.path.exists(os.path.join(d, "metrics.jsonl")):  # (a group that never trained a step)
            continue
        for r in _records(os.path.join(d, "metrics.jsonl"), METRIC):
            if "loss" in r and "epoch" in r:
                out[int(r["step"])] = int(r["epoch"])
    return out


def quarantined(run_dir: str) -> set[str]:
    """The sample keys quarantined in this run (``RUN_DIR/instability.json``; none if there is none, or it is
    damaged: said in one warning)."""
    doc = read_state(os.path.join(run_dir, "instability.json"), INSTABILITY, keep_aside=False, then="ignored")
    return set(doc.get("quarantined", [])) if doc else set()


def audit(run_dir: str) -> list[EpochAudit]:
    """Every epoch of the run in ``run_dir`` (a run trained with ``data.record_sample_ids=true``), counted from its
    sample logs as the module says: what ``python -m pitstop.audit RUN_DIR`` prints, one :class:`EpochAudit` per
    epoch. Raises ``SystemExit`` with a one-line message when the logs cannot say (no readable header, steps
    missing from ``metrics.jsonl``)."""
    skipped: Keys = {}
    steps, header = surviving_keys(run_dir, skipped)
    if not header:  # (every header line damaged: nothing says what an epoch holds)
        raise SystemExit(f"error: the sample logs in {run_dir} have no readable attempt header: nothing to audit")
    epoch_of = epochs_of(run_dir)
    unknown = sorted(s for s, e in (*steps, *skipped) if e is None and s not in epoch_of)
    if unknown:
        raise SystemExit(f"error: steps {unknown[:5]} of the sample logs are not in {run_dir}/metrics.jsonl")
    per_epoch: dict[int, Counter] = defaultdict(Counter)
    for (step, epoch), keys in steps.items():
        per_epoch[epoch_of[step] if epoch is None else epoch].update(keys)
    per_skip: dict[int, Counter] = defaultdict(Counter)
    for (step, epoch), keys in skipped.items():
        per_skip[epoch_of[step] if epoch is None else epoch].update(keys)
    held = quarantined(run_dir)
    expected = int(header["epoch_samples"])
    complete = header.get("epochs")  # epochs mode: every epoch up to it must be complete
    last = max((*per_epoch, *per_skip), default=-1)
    out = []
    for e in range(last + 1):
        counts, skips = per_epoch.get(e, Counter()), per_skip.get(e, Counter())
        a = EpochAudit(epoch=e, expected=expected, partial=(e == last and complete is None))
        # (a key both consumed and skipped, or skipped twice, in one epoch was fed where it must not be: repeated)
        twice = [k for k in (*counts, *(k for k in skips if k not in counts)) if counts[k] + skips[k] > 1]
        a.once = sum(1 for k, c in counts.items() if c == 1 and not skips[k])
        a.skipped = sum(1 for k, c in skips.items() if c == 1 and not counts[k])
        a.repeated = len(twice)
        a.quarantined = len(held - set(counts) - set(skips))
        a.missing = max(0, expected - len(set(counts) | set(skips)) - a.quarantined)
        a.examples = twice[:3]
        out.append(a)
    if complete is not None:
        out.extend(EpochAudit(epoch=e, expected=expected, missing=expected) for e in range(last + 1, complete))
    return out


def _shown(key: str) -> str:
    """A key as it reads, or as JSON where it holds what would break the line (a newline, a lone surrogate)."""
    return key if key.isprintable() else json.dumps(key)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pitstop.audit", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    a = p.parse_args(argv)
    if not os.path.isdir(a.run_dir):
        print(f"error: {a.run_dir} is not a run dir", file=sys.stderr)
        return 2
    rows = audit(a.run_dir)
    extra = any(r.skipped or r.quarantined for r in rows)  # (a run without instability: the columns as they were)
    head = f"{'epoch':>5} {'expected':>9} {'once':>9} {'repeated':>9} {'missing':>9}"
    print(head + (f" {'skipped':>9} {'quarantined':>11}" if extra else ""))
    for r in rows:
        note = " (partial: the run ended by trainer.max_steps)" if r.partial and r.missing else ""
        note += f" e.g. {', '.join(_shown(k) for k in r.examples)}" if r.examples else ""
        more = f" {r.skipped:>9} {r.quarantined:>11}" if extra else ""
        print(f"{r.epoch:>5} {r.expected:>9} {r.once:>9} {r.repeated:>9} {r.missing:>9}{more}{note}")
    bad = [r for r in rows if not r.ok]
    print(
        "every sample exactly once"
        if not bad
        else f"FAILED: epochs {[r.epoch for r in bad]} have repeated or missing samples"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
