"""The cluster launch recipes (SLURM multi-node, the Kubernetes manifest) compose into the config they claim, so
they cannot rot: their exact overrides are read from the files and composed with the real conf/.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from conftest import CONF, ROOT, compose_cfg


def manifest() -> tuple[dict, dict]:
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "k8s" / "train-2nodes.yaml").read_text()))
    service = next(d for d in docs if d["kind"] == "Service")
    job = next(d for d in docs if d["kind"] == "Job")
    return service, job


def test_the_kubernetes_manifest_runs_the_documented_multi_node_command(tmp_path):
    from pitstop.launch.plan import plan

    service, job = manifest()
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    command = container["command"]
    assert command[:3] == ["python", "-m", "recipe.train"]
    cfg = compose_cfg([*command[3:], f"paths.root_dir={tmp_path}"], tmp_path)
    low, high = plan(cfg, {}).nodes
    # one pod per node, all started together; node 0's stable DNS name hosts the rendezvous on the Service's port
    assert (
        job["spec"]["completionMode"] == "Indexed" and job["spec"]["parallelism"] == job["spec"]["completions"] == high
    )
    host, port = cfg.strategy.rdzv_endpoint.split(":")
    assert host == f"{job['metadata']['name']}-0.{pod['subdomain']}" and service["metadata"]["name"] == pod["subdomain"]
    assert service["spec"]["clusterIP"] == "None" and int(port) in [p["port"] for p in service["spec"]["ports"]]
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert cfg.strategy.nproc_per_node == container["resources"]["limits"]["nvidia.com/gpu"]
    # the eviction's SIGTERM leaves pitstop its save grace, with room to flush and exit
    assert pod["terminationGracePeriodSeconds"] >= cfg.trainer.preempt_grace_seconds + 30
    assert "SIGTERM" in list(cfg.trainer.preempt_signals)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}

    def volume_of(path: str) -> dict:
        mount = max((m for m in mounts if path.startswith(m.rstrip("/") + "/")), key=len)
        return volumes[mounts[mount]]

    assert "persistentVolumeClaim" in volume_of(cfg.run_dir)  # shared by every pod: checkpoints, ledger
    assert cfg.ckpt.dir.startswith(cfg.run_dir)
    cache = next(e["value"] for e in container["env"] if e["name"] == "PITSTOP_CACHE_DIR")
    assert "emptyDir" in volume_of(cache)  # node-local: one download per shard per node
    assert cfg.trainer.max_restarts >= 1 and low < high  # elastic: the surviving pod goes on


def slurm_command() -> list[str]:
    """The multi-node command documented in conf/hydra/launcher/slurm.yaml (its comment lines)."""
    text = (Path(CONF) / "hydra" / "launcher" / "slurm.yaml").read_text()
    lines = [ln.lstrip("# ").rstrip() for ln in text.splitlines() if ln.startswith("#")]
    start = next((i for i, ln in enumerate(lines) if "hydra.launcher.nodes=" in ln), None)
    assert start is not None, "the multi-node SLURM command is missing from slurm.yaml"
    command = [lines[start]]
    while command[-1].endswith("\\"):
        command[-1] = command[-1][:-1]
        command.append(lines[start + len(command)])
    m = re.search(r"python -m recipe\.train -m hydra/launcher=slurm .*", " ".join(command))
    assert m, command
    return shlex.split(m.group(0))[4:]  # the overrides


def test_the_slurm_multi_node_recipe_composes_one_agent_per_node(tmp_path):
    from hydra import compose, initialize_config_dir

    from pitstop.launch.plan import plan

    overrides = slurm_command()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, f"paths.root_dir={tmp_path}"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher") and launcher.tasks_per_node == 1  # one agent per node
    assert plan(cfg, {}).nodes == (launcher.nodes, launcher.nodes) and cfg.strategy.rdzv_endpoint == "slurm"
    assert "SIGUSR2" in list(cfg.trainer.preempt_signals)  # submitit's notice before the time limit


def test_the_rendezvous_endpoint_comes_from_the_slurm_allocation(make_cfg, monkeypatch):
    from pitstop.errors import ConfigError
    from pitstop.launch.plan import plan
    from pitstop.launch.rendezvous import first_host, hosts_store, rendezvous, slurm_endpoint

    assert first_host("gpu[07-08,11],cpu3") == "gpu07" and first_host("node5,node6") == "node5"
    assert first_host("a-b[001-004]") == "a-b001"
    env = {"SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "4242"}
    assert slurm_endpoint(env) == "gpu07:24242" and slurm_endpoint(env, 29500) == "gpu07:29500"
    with pytest.raises(ConfigError, match="outside a SLURM allocation"):
        slurm_endpoint({})
    # only the first node's agent hosts the store (torch's own guess says yes on every node that shares a machine)
    assert [hosts_store({**env, "SLURMD_NODENAME": n}, "gpu07:24242") for n in ("gpu07", "gpu08")] == [True, False]
    assert hosts_store({**env, "SLURMD_NODENAME": "gpu08"}, "10.0.0.7:29500") is None  # an address: torch's guess
    assert hosts_store({}, "gpu07:24242") is None  # not under SLURM
    strategy = plan(make_cfg("strategy=ddp", "strategy.nnodes=2", "strategy.rdzv_endpoint=slurm"), {}).strategy
    for key, value in {**env, "SLURM_STEP_NUM_NODES": "2"}.items():
        monkeypatch.setenv(key, value)
    endpoint, run_id = rendezvous(strategy, "/shared/runs/exp1", 2)
    assert endpoint == "gpu07:24242" and run_id == rendezvous(strategy, "/elsewhere/exp1", 2)[1]  # same name, same job
    with pytest.raises(ConfigError, match="runs on 2 nodes but strategy.nnodes=1"):
        rendezvous(plan(make_cfg("strategy=ddp"), {}).strategy, "/shared/runs/exp1", 1)


def test_a_slurm_sweep_that_cannot_reach_slurm_is_refused_in_one_line_before_submitting(monkeypatch, tmp_path, capsys):
    # hydra/launcher=slurm's callback (conf/train.yaml), before the first sbatch: no sbatch on PATH, or a sinfo that
    # fails (a stand-in script here; the real one retries for 60 s on a bad SLURM_CONF, so the check gives up at 10 s)
    from omegaconf import OmegaConf

    from pitstop.launch.slurm import SlurmReachable

    sweep = lambda launcher: OmegaConf.create({"hydra": {"launcher": {"_target_": launcher}}})  # noqa: E731
    slurm = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    monkeypatch.setenv("PATH", str(tmp_path))
    SlurmReachable().on_multirun_start(sweep("hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"))
    with pytest.raises(SystemExit) as e:  # (Hydra turns any other exception of a callback into a warning)
        SlurmReachable().on_multirun_start(sweep(slurm))
    assert e.value.code == 2 and capsys.readouterr().err == (
        "error: hydra/launcher=slurm: SLURM is not reachable from here (no sbatch on PATH): run the sweep where "
        "SLURM's commands are (a login node), or use hydra/launcher=submitit_local on this machine\n"
    )
    for name, body in (
        ("sbatch", "exit 0"),
        ("sinfo", "echo 'sinfo: error: Unable to contact slurm controller' >&2; exit 1"),
    ):
        (tmp_path / name).write_text(f"#!/bin/sh\n{body}\n")
        (tmp_path / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    with pytest.raises(SystemExit) as e:
        SlurmReachable().on_multirun_start(sweep(slurm))
    assert e.value.code == 2 and capsys.readouterr().err == (
        "error: hydra/launcher=slurm: SLURM is not reachable from here: sinfo says 'sinfo: error: Unable to contact "
        "slurm controller': is slurmctld up, and SLURM_CONF right?\n"
    )
