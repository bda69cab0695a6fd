"""pitstop.audit: which steps survive restarts, and what it reports (the sample logs of real runs are audited in
tests/system/test_nodes.py and others, and ``python -m pitstop.audit`` runs as a process in tests/system/test_s3.py);
here logs written by hand pin down the rules, including the failures it must catch. Its ``main`` runs in-process:
its printed report and the exit status that ``python -m pitstop.audit`` would end with are the contract.
"""

from __future__ import annotations

import contextlib
import io
import json
import types

from pitstop.audit import main


def write_run(run_dir, attempts, epoch_of, samples=8, epochs=None):
    """attempts: [(attempt id, resumed_from, world, {rank: {step: [keys]}})]"""
    run_dir.mkdir()
    files = {}
    for attempt, resumed, world, ranks in attempts:
        for rank, steps in ranks.items():
            f = files.setdefault(rank, open(run_dir / f"samples.rank{rank}.jsonl", "a"))
            f.write(
                json.dumps(
                    {
                        "attempt": attempt,
                        "resumed_from": resumed,
                        "rank": rank,
                        "world_size": world,
                        "epoch_samples": samples,
                        "epochs": epochs,
                    }
                )
                + "\n"
            )
            for step, keys in steps.items():
                f.write(json.dumps({"step": step, "keys": keys}) + "\n")
    for f in files.values():
        f.close()
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step, epoch in epoch_of.items():
            f.write(json.dumps({"step": step, "epoch": epoch, "loss": 1.0}) + "\n")


def audit(run_dir) -> types.SimpleNamespace:
    """``python -m pitstop.audit run_dir``, in-process: its exit status, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(run_dir)])
        except SystemExit as e:  # (what the interpreter does with a SystemExit: a message goes to stderr, status 1)
            code = e.code if isinstance(e.code, int) else 1
            if not isinstance(e.code, int):
                print(e.code, file=err)
    return types.SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def test_redone_steps_count_once_and_a_rank_that_did_not_come_back_loses_its_steps(tmp_path):
    # world 2 computes steps 1-3 (2 samples per rank per step... 1 here), is killed after step 3 with a checkpoint
    # at step 2; the job resumes at world 1 from step 2, and redoes step 3 with the samples rank 1 had.
    a1 = {0: {1: ["a"], 2: ["b"], 3: ["c"]}, 1: {1: ["e"], 2: ["f"], 3: ["g"]}}
    a2 = {0: {3: ["c", "g"], 4: ["d", "h"]}}
    write_run(tmp_path / "ok", [(1.0, 0, 2, a1), (2.0, 2, 1, a2)], {1: 0, 2: 0, 3: 0, 4: 0}, epochs=1)
    p = audit(tmp_path / "ok")
    assert p.returncode == 0 and "every sample exactly once" in p.stdout, p.stdout + p.stderr
    # a resume that went back behind an earlier one (a corrupt newest checkpoint): attempt 2's steps after it drop
    a3 = {0: {2: ["b", "f"], 3: ["c", "g"], 4: ["d", "h"]}}
    write_run(
        tmp_path / "fallback", [(1.0, 0, 2, a1), (2.0, 2, 1, a2), (3.0, 1, 1, a3)], {1: 0, 2: 0, 3: 0, 4: 0}, epochs=1
    )
    assert audit(tmp_path / "fallback").returncode == 0


def test_repeats_and_misses_fail_and_a_partial_last_epoch_does_not(tmp_path):
    a1 = {0: {1: ["a", "b"], 2: ["c", "a"]}}  # "a" twice
    write_run(tmp_path / "repeat", [(1.0, 0, 1, a1)], {1: 0, 2: 0}, samples=4, epochs=1)
    p = audit(tmp_path / "repeat")
    assert p.returncode == 1 and "e.g. a" in p.stdout and "FAILED: epochs [0]" in p.stdout
    a1 = {0: {1: ["a", "b"], 2: ["c", "d"], 3: ["a"]}}  # epoch 1 stops after one step
    write_run(tmp_path / "partial", [(1.0, 0, 1, a1)], {1: 0, 2: 0, 3: 1}, samples=4, epochs=None)
    p = audit(tmp_path / "partial")
    assert p.returncode == 0 and "(partial: the run ended by trainer.max_steps)" in p.stdout, p.stdout
    write_run(tmp_path / "short", [(1.0, 0, 1, a1)], {1: 0, 2: 0, 3: 1}, samples=4, epochs=2)  # epochs mode: whole
    assert audit(tmp_path / "short").returncode == 1
    p = audit(tmp_path / "nothing_here")
    assert p.returncode == 2 and "is not a run dir" in p.stderr


# Sample keys as tar member names hold them: a person's name, quotes, a backslash, a newline, non-ASCII, and a lone
# surrogate (a name that was not UTF-8, decoded with surrogateescape).
ODD_KEYS = ["o'brien_001", 'say "hi"', "back\\slash", "two\nlines", "zoë_☃_名前", "bytes_\udcff", "it's \"both\"'"]


def log_run(run_dir, steps, accum=1, quorum=None):
    """A run's sample log as the trainer writes it (``SampleLog``), one attempt on rank 0: ``steps`` {step: keys},
    each step's keys split over ``accum`` micro-batches; ``quorum``: a replica group's, each step committed."""
    from pitstop.train.sample_log import SampleLog

    run_dir.mkdir()
    at = [0, 0]
    log = SampleLog(str(run_dir), 0, 1.0, accum, lambda: tuple(at), (lambda: quorum) if quorum else None, lambda: 0)
    log.header(None, 1, sum(len(k) for k in steps.values()), 1)
    for step, keys in steps.items():
        for micro in range(accum):
            at[:] = [step, micro]
            log.write(keys[micro::accum])
        if quorum:
            log.outcome(step, True, quorum)
    log.close()
    with open(run_dir / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps({"step": s, "epoch": 0, "loss": 1.0}) + "\n" for s in steps)


def test_sample_keys_holding_quotes_backslashes_newlines_and_unicode_are_json_and_audited(tmp_path):
    for name, accum, quorum in (("plain", 1, None), ("accum", 2, None), ("ft", 2, 7)):
        log_run(tmp_path / name, {1: ODD_KEYS[:4], 2: ODD_KEYS[4:]}, accum, quorum)
        lines = (tmp_path / name / "samples.rank0.jsonl").read_text().splitlines()
        written = [k for r in map(json.loads, lines) if "keys" in r for k in r["keys"]]  # (every line is JSON)
        assert sorted(written) == sorted(ODD_KEYS) and all(line.isascii() for line in lines)
        p = audit(tmp_path / name)
        assert p.returncode == 0 and "every sample exactly once" in p.stdout, p.stdout + p.stderr
        assert f"    0 {len(ODD_KEYS):>9} {len(ODD_KEYS):>9}         0         0" in p.stdout
    # the verdict is the same on such keys: one repeated is caught and shown on its one line
    log_run(tmp_path / "repeat", {1: ODD_KEYS[:4], 2: [*ODD_KEYS[4:], "o'brien_001", "two\nlines"]})
    p = audit(tmp_path / "repeat")
    assert p.returncode == 1 and "FAILED: epochs [0]" in p.stdout, p.stdout + p.stderr
    assert 'e.g. o\'brien_001, "two\\nlines"' in p.stdout


def test_a_damaged_line_of_a_sample_log_is_named_and_its_samples_count_as_missing(tmp_path, caplog):
    log_run(tmp_path / "run", {1: ["a", "b"], 2: ["c", "d"], 3: ["e", "f"]})
    path = tmp_path / "run" / "samples.rank0.jsonl"
    rows = path.read_text().splitlines()
    rows[2] = '{"step": 2, "keys": "cd"}'  # (valid JSON, another shape: a string where the list of keys belongs)
    path.write_text("\n".join(rows) + '\n{"step": 4, "ke\n')  # (and a last line cut by a kill)
    with caplog.at_level("WARNING", "pitstop.state"):
        p = audit(tmp_path / "run")
    assert p.returncode == 1 and "FAILED: epochs [0]" in p.stdout
    assert "    0         6         4         0         2" in p.stdout  # (c and d: missing, never consumed)
    assert f"{path} has 2 damaged line(s) (first: line 3: keys: a list belongs there" in caplog.text
    assert path.read_text().endswith('{"step": 4, "ke\n')  # (the audit never rewrites the user's log)
