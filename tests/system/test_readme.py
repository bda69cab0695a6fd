"""Every command of the manual (README.md, then the docs site's guides in their nav order), run for real, in that
order, in one fresh project dir — as a new user would.

Commands are extracted from those pages (fenced blocks and inline code: ``conftest.readme_commands``): every
``python -m recipe.*`` and ``python -m pitstop.*`` line. Only size-shrinking overrides are added
(``trainer.max_steps``, smaller synthetic data); the trainer, loader (2 workers per rank), evaluation and tracker
settings are the defaults users get: no ``debug=tiny`` here. Placeholders (``DIR``, ``K``, the slowstore's port) are
filled in; a command that needs something this machine cannot give is in ``SKIP`` with the reason."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import warm
from conftest import readme_commands, COLD as COLD_ALL
from manual import assert_shows, not_run, page_outputs
from conftest import ROOT, assert_accuracy_counts, image_tree, warm_server

README = ROOT / "README.md"

# The commands a new user runs first stay cold (a fresh interpreter, its imports and program start); the others
# run warm (tests/warm.py: the same program in a real process, forked from a pre-imported interpreter).
COLD = {"python -m recipe.prepare", "python -m recipe.train"}
# The quick start's command (`make train` runs it) runs whole, not shrunk: README promises its accuracy.
QUICK_START, QUICK_START_FLOOR = "python -m recipe.train", 0.97
# Size-shrinking overrides per entry point: replace the value where the command sets the key, else append.
SHRINK = {
    "recipe.train": {"trainer.max_steps": "25"},  # one epoch is 23 steps: crosses an epoch boundary + evaluation
    "recipe.prepare": {"data.num_samples": "96", "data.image_size": "32"},  # only where the command sets them
}


def fill(cmd: str, env: dict) -> str:
    cmd = cmd.replace("[--dtype bfloat16]", "--dtype bfloat16")
    cmd = re.sub(r"\bDIR\b", env["tree"], cmd)
    cmd = re.sub(r"\bSHARDS\b", env["shards"], cmd)
    cmd = re.sub(r"data\.num_classes=K\b", "data.num_classes=3", cmd)
    return cmd.replace("127.0.0.1:8000", f"127.0.0.1:{env['port']}").replace("--port 8000", f"--port {env['port']}")


def shrink(argv: list[str]) -> list[str]:
    module = argv[2]
    rules = dict(SHRINK.get(module, {}))
    accum = next((int(a.split("=", 1)[1]) for a in argv if a.startswith("trainer.grad_accum_steps=")), 1)
    if module == "recipe.train" and accum > 1:  # the same batches, so the same epoch boundary and evaluation
        rules["trainer.max_steps"] = str(-(-int(rules["trainer.max_steps"]) // accum))
    if "data=imagefolder" in argv or "data=webdataset" in argv:  # 30 images: one step per epoch
        rules["trainer.max_steps"] = "3"
    out, seen = [], set()
    for a in argv:
        key = a.split("=", 1)[0]
        if key in rules:
            a, _ = f"{key}={rules[key]}", seen.add(key)
        out.append(a)
    if module == "recipe.train":
        out += [f"{k}={v}" for k, v in rules.items() if k not in seen]
    return out


def summaries_after(cwd: Path, before: set[Path]) -> list[Path]:
    runs = set(cwd.glob("outputs/runs/*/summary.json")) | set(cwd.glob("outputs/multirun/*/*/summary.json"))
    return sorted(runs - before)


def webdataset_shards(tree: Path, out: Path) -> Path:
    """SHARDS: the tree's images as webdataset shards written by webdataset's ShardWriter (class-sorted):
    train-0000..0002.tar (8 per class), val-0000.tar (2 per class)."""
    import webdataset as wds

    out.mkdir()
    classes = sorted(p.name for p in tree.iterdir())
    files = [(c, sorted((tree / c).iterdir())) for c in classes]
    for split, pick in (("train", slice(0, 8)), ("val", slice(8, None))):
        with wds.ShardWriter(str(out / f"{split}-%04d.tar"), maxcount=8, verbose=0) as w:
            for label, (c, paths) in enumerate(files):
                for path in paths[pick]:
                    w.write({"__key__": f"{c}_{path.stem}", path.suffix[1:]: path.read_bytes(), "cls": label})
    return out


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A fresh project dir (the user's cwd), an ImageFolder tree for DIR, a free port for the slowstore."""
    cwd = tmp_path_factory.mktemp("user")
    tree = image_tree(cwd / "my_images", per_class=10)
    shards = webdataset_shards(tree, cwd / "my_shards")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "PITSTOP_CACHE_DIR": str(cwd / ".cache" / "shards"),
    }
    env.pop("RANK", None)
    servers: list[subprocess.Popen] = []
    yield {"cwd": cwd, "tree": str(tree), "shards": str(shards), "port": port, "env": env, "servers": servers}
    for srv in servers:
        srv.terminate()
        srv.wait(10)


def two_nodes(argv: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    """A command the README runs on every node: two agents on this machine (HOST0 = 127.0.0.1, a free port, one
    rank each on 2 cores), each with its own node-local cache; node 1's result, after both finished."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [re.sub(r"HOST0:\d+", f"127.0.0.1:{port}", a) for a in argv]
    argv = [("strategy.nproc_per_node=1" if a.startswith("strategy.nproc_per_node=") else a) for a in argv]
    if any(a.startswith("strategy.nnodes=") and ":" in a for a in argv):  # elastic: node 1 may start seconds late
        argv.append("strategy.last_call_seconds=15")  # on a busy machine; the job is to form at 2 nodes
    procs = []
    for node in (0, 1):
        node_env = {**env, "PITSTOP_CACHE_DIR": str(cwd / f".cache_node{node}")}
        procs.append(
            subprocess.Popen(
                argv,
                cwd=cwd,
                env=node_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                stdin=subprocess.DEVNULL,
            )
        )
        time.sleep(1.5)  # node 0's agent hosts the rendezvous store
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=600))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{' '.join(argv[1:])} did not finish in 600 s on two nodes")
    failed = next((i for i, q in enumerate(procs) if q.returncode != 0), 1)
    return subprocess.CompletedProcess(argv, procs[failed].returncode, outs[failed][0], outs[failed][1])


COMMANDS = readme_commands()
OUTPUTS = page_outputs()


@pytest.mark.slow
@pytest.mark.parametrize("cmd", COMMANDS, ids=[c[len("python -m ") :][:60] for c in COMMANDS])
def test_readme_command(cmd, project):
    skip = not_run(cmd)
    if skip:
        pytest.skip(skip)
    cwd, env = project["cwd"], project["env"]
    line = fill(cmd, project)
    background = line.endswith("&")
    argv = [sys.executable, *shlex.split(line.rstrip("& "))[1:]]
    if background:  # a server the next commands use: start it, wait until it answers
        srv = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        project["servers"].append(srv)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", project["port"])) == 0:
                    return
            assert srv.poll() is None, srv.stderr.read().decode()[-2000:]
            time.sleep(0.2)
        pytest.fail(f"{line} did not start listening")
    if line != QUICK_START:
        argv = shrink(argv)
    before = set(summaries_after(cwd, set()))
    if any(a.startswith("strategy.nnodes=") for a in argv):  # "on every node": two agents, node 0 first
        p = two_nodes(argv, cwd, env)
    else:
        try:  # (under the suite's 900 s per test: a hung command fails with its own output, not the suite's dump)
            if cmd in COLD or COLD_ALL:
                p = subprocess.run(
                    argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL
                )
            else:
                p = warm.run(warm_server(), argv, cwd, env, timeout=600)
        except subprocess.TimeoutExpired as e:
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
            pytest.fail(f"{' '.join(argv[1:])} did not finish in 600 s\n{err[-3000:]}")
    assert p.returncode == 0, f"{' '.join(argv[1:])}\n{p.stderr[-3000:]}"
    for page, _, excerpt in (o for o in OUTPUTS if o[1] == cmd):  # what the page says it prints
        assert_shows(excerpt, f"{p.stdout}\n{p.stderr}", f"{cmd!r} on {page.name}")
    module, args = argv[2], argv[3:]
    sweep = "-m" in args or "--multirun" in args
    if module == "recipe.train" and "--cfg" not in args:
        pinned = next((a.split("=", 1)[1] for a in argv if a.startswith("run_dir=")), None)
        new = [cwd / pinned / "summary.json"] if pinned else summaries_after(cwd, before)
        jobs = 1
        if sweep:  # a sweep: one job per combination of the comma-separated options
            jobs = int(
                np.prod(
                    [
                        len(a.split("=", 1)[1].split(","))
                        for a in args
                        if "=" in a and "," in a and not a.split("=", 1)[1].startswith("[")
                    ]
                )
            )
        assert len(new) == jobs and all(s.is_file() for s in new), (line, new)
        for s in new:
            summary = json.loads(s.read_text())
            steps = next((int(a.split("=")[1]) for a in reversed(argv) if a.startswith("trainer.max_steps=")), None)
            assert summary["final_step"] == (steps or summary["total_steps"])
            assert_accuracy_counts(summary["metrics"])
            if line == QUICK_START:  # README: "at least 97% validation accuracy"
                assert summary["metrics"]["val_accuracy"] >= QUICK_START_FLOOR, summary["metrics"]
            if sweep:
                assert (s.parent.parent / "report.md").is_file()
    elif module == "recipe.export":
        assert (cwd / argv[4]).is_file()
    elif module == "recipe.goodput" and "--timeline" in argv:
        assert (cwd / p.stdout.strip().splitlines()[-1]).is_file() and p.stdout.strip().endswith("timeline.png")
    elif module == "recipe.goodput":
        assert "%" in p.stdout
