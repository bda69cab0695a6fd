"""The manual a user reads (README.md, then the docs site's pages in nav order), as the tests read it: its commands
and the output excerpts it shows beside them.

An **output excerpt** is a fenced block whose info string is ``text title="Output..."`` (rendered with that title). It
shows what the last ``python -m`` command of the fenced block before it prints, and a test checks it against a real
run of that command: ``tests/system/test_readme.py`` for the commands it runs, else the test that runs the command
and calls :func:`page_output` (``tests/unit/test_docs_outputs.py`` fails an excerpt no test checks). Each line of an
excerpt must be a line the run printed (stdout or stderr), where

- a log line's ``[time][logger][LEVEL] - `` prefix (``[time][rank0][logger][LEVEL] - `` on a rank) is left out on
  either side (pages show the message);
- any number stands for any number (runs are shrunk: 25 steps where the page says 100);
- ``…`` (or ``...``) stands for any text in a line, and a line of only ``…`` for lines left out;
- a run of spaces stands for any run of spaces (aligned columns).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Pages of the site that are not the manual's commands: the home page, reference (generated), internals, and the
# own-task tutorial (tests/system/test_own_task.py runs its code in an empty folder as the page says).
NOT_MANUAL = re.compile(r"^(index\.md|architecture\.md|own-task\.md|reference/.*)$")
FENCE = re.compile(r"^[ \t]*```([^\n]*)\n(.*?)^[ \t]*```[ \t]*$", re.S | re.M)
OUTPUT = re.compile(r'^text\s+title="Output[^"]*"\s*$')
LOG_PREFIX = re.compile(r"^(?:\[[^\]]*\]){2,3}\[[A-Z]+\] - ")  # [time][rank0][logger][LEVEL]: a rank's line
NUMBER = r"\d+(?:\.\d+)?"
ELLIPSIS = ("…", "...")


# Commands this machine cannot run, with why (matched by substring).
SKIP = {
    "hydra/launcher=slurm": "asks for a GPU node (slurm.yaml: 16 CPUs, 8 GPUs, 256 GB); the same commands run with "
    "a node's size of the local cluster in system/test_slurm.py (a sweep with a preempted job, and the two-node "
    "command for ddp and fsdp)",
}

# Commands that exercise nothing another test does not already run at these settings, with the test that does:
# composed only here (unit/test_readme_compose.py composes and validates every one of them).
COMPOSED_ONLY = {
    "-m optim=sgd,adamw model=cnn,resnet18": "a -m sweep runs in "
    "system/test_cli.py::test_multirun_sweep_over_two_options and with the report in this file's ckpt x loader "
    "sweep; resnet18 trains in experiment=digits_resnet18 below",
    "trainer.compile=true": "compiled runs train, save and resume in system/test_accel_kills.py "
    "(test_compiled_run_resumes_an_eager_checkpoint_and_back)",
    "fault=bug fault.step=6": "exits 2 on purpose; the same command runs in "
    "system/test_crash_loop_launchers.py (two attempts, one line)",
    "fault=nonfinite": "system/test_instability.py runs it (ddp(2): the step skipped on both ranks, the quick start's "
    "accuracy reached); integration/test_instability_runs.py in one process",
    "pitstop.audit outputs/runs/nan": "system/test_instability.py audits that run (the skipped step's samples apart)",
    "fault=poison": "integration/test_instability_runs.py runs it (the sample quarantined, the audit clean over two "
    "epochs)",
    "pitstop.audit outputs/runs/poison": "integration/test_instability_runs.py audits that run (pitstop.audit's main)",
    "optim.lr=1e6": "exits 2 on purpose; system/test_instability.py runs it (stops in one line, no restart)",
    "fault=bitflip": "system/test_sdc_ddp.py runs it (named, undone, the uninterrupted run's parameters); without a "
    "checkpoint it exits 2 on purpose (integration/test_rollback.py: nothing to roll back to)",
    "fault=slow_rank": "system/test_straggler.py runs it (rank 1 named within two windows, its wait booked)",
    "+callbacks.best._target_=my_callbacks.BestAccuracy": "needs the page's my_callbacks.py in the folder it runs "
    "from: system/test_callbacks.py writes it there from the page and runs the command, checking its excerpt",
    "--peer bench/results/peer_restore.json": "reads the checkout's benchmark result (a user's project dir has none): "
    "unit/test_goodput_model.py runs it in the checkout and checks its excerpt",
    "python -m pytest tests/unit/test_schedule.py": "runs in the checkout (a user's project dir has no tests): "
    "system/test_testing_guide.py runs it there",
    "model=resnet18 optim=adamw trainer.epochs=3": "resnet18 with adamw trains in experiment=digits_resnet18 below; "
    "trainer.epochs mode in integration/test_determinism.py and system/test_nodes.py",
}


def not_run(cmd: str) -> str | None:
    """Why tests/system/test_readme.py does not run ``cmd`` (None: it runs it)."""
    return next((why for key, why in {**SKIP, **COMPOSED_ONLY}.items() if key in cmd), None)


def manual_pages() -> list[Path]:
    """README.md, then the docs site's pages a user follows, in its nav order (mkdocs.yml)."""
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = re.findall(r"(?:^\s*-\s*|:\s*)([\w/-]+\.md)\s*$", nav, re.M)
    return [ROOT / "README.md", *(ROOT / "docs" / p for p in pages if not NOT_MANUAL.match(p))]


def _commands(block: str) -> list[str]:
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        line = re.split(r"\s#\s", line, maxsplit=1)[0].strip()
        if line.startswith("python -m "):
            out.append(line)
    return out


def readme_commands() -> list[str]:
    """Every ``python -m`` command of the manual, in order (the lines of its bash/sh/plain fenced blocks, then its
    inline code); a command repeated on a later page is run once, where it first appears."""
    cmds: list[str] = []
    texts = [p.read_text() for p in manual_pages()]
    for text in texts:
        for info, block in FENCE.findall(text):
            if info.strip() in ("", "bash", "sh"):
                cmds += _commands(block)
    for text in texts:
        cmds += [inline.strip() for inline in re.findall(r"`(python -m [^`]+)`", text)]
    return list(dict.fromkeys(cmds))


def page_outputs(pages: list[Path] | None = None) -> list[tuple[Path, str | None, str]]:
    """(page, command, excerpt) for every output excerpt of ``pages`` (default: the manual and own-task.md);
    command is None where no command precedes the excerpt (a test fails that)."""
    found = []
    for page in pages or [*manual_pages(), ROOT / "docs" / "own-task.md"]:
        last: str | None = None
        for info, block in FENCE.findall(page.read_text()):
            if OUTPUT.match(info.strip()):
                found.append((page, last, block))
                last = None  # (one excerpt per command)
            elif info.strip() in ("", "bash", "sh"):
                last = (_commands(block) or [None])[-1]  # (a block with no command: its excerpt has none)
    return found


def page_output(key: str) -> str:
    """The output excerpt shown after the one command of the manual that contains ``key``."""
    hits = [(cmd, text) for _, cmd, text in page_outputs() if cmd and key in cmd]
    if len(hits) != 1:
        raise LookupError(f"{len(hits)} output excerpts follow a command containing {key!r}; expected one")
    return hits[0][1]


def _text(part: str) -> str:
    """Literal text, where a run of spaces matches any run of spaces (a column of numbers aligns differently as their
    widths change: `  productive      1.13 s` against `  productive     14.43 s`)."""
    return r"\s+".join(re.escape(word) for word in re.split(r"\s+", part))


def _pattern(line: str) -> re.Pattern:
    parts = re.split(rf"(…|\.\.\.|{NUMBER})", LOG_PREFIX.sub("", line.strip()))
    regex = "".join(".*" if p in ELLIPSIS else NUMBER if re.fullmatch(NUMBER, p) else _text(p) for p in parts if p)
    return re.compile(regex)


def excerpt_missing(excerpt: str, output: str) -> list[str]:
    """The excerpt's lines that no line of ``output`` matches (empty: the excerpt is true of this output)."""
    lines = [LOG_PREFIX.sub("", ln.strip()) for ln in output.splitlines()]
    missing = []
    for want in excerpt.splitlines():
        if not want.strip() or want.strip() in ELLIPSIS:
            continue
        pattern = _pattern(want)
        if not any(pattern.fullmatch(got) for got in lines):
            missing.append(want)
    return missing


def assert_shows(excerpt: str, output: str, what: str) -> None:
    """Fail, naming the lines, where the page's excerpt for ``what`` is not what the run printed."""
    missing = excerpt_missing(excerpt, output)
    assert not missing, (
        f"the page's output excerpt for {what} has lines this run did not print:\n"
        + "\n".join(missing)
        + f"\n--- the run printed (last 4000 chars):\n{output[-4000:]}"
    )
