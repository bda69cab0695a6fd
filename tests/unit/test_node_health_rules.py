"""The pure rules of node health (pitstop.launch.health, pitstop.launch.vetting) and fault=bad_node's checks: the
matmul's reference, memory and room, the SLURM node list, which node is not used and what follows (the job goes on
without it or stops in one line), and the ledger's health bucket."""

from __future__ import annotations

import json
import time

import pytest
from omegaconf import OmegaConf

from pitstop.errors import ConfigError, PitstopError
from pitstop.goodput.ledger import JOB_BUCKETS, Ledger
from pitstop.launch import vetting
from pitstop.launch.health import Outcome, Report, mem_available, reference, room, too_slow
from pitstop.resilience import node_book
from pitstop.resilience.bad_node import check_node, expand_nodelist, unwritable
from pitstop.resilience.node_book import NodeExcluded

BAD = {"_target_": "pitstop.resilience.bad_node.BadNode", "node": "n2", "how": "fail"}
SYNC = {"_target_": "pitstop.ckpt.sync_save.SyncSave"}


def test_the_matmul_reference_is_the_faster_of_the_peers_median_and_the_nodes_own_past():
    assert reference([], {}) is None  # nothing on record: the first check passes and becomes the reference
    assert reference([2.0, 4.0, 3.0], {}) == 3.0
    assert reference([], {"a": [1.0, 5.0, 3.0], "b": [7.0], "c": [2.0]}) == 3.0  # median of medians 3, 7, 2
    assert reference([10.0], {"a": [1.0]}) == 1.0  # a node that got slow is held to its peers' pace
    assert reference([1.0], {"a": [10.0]}) == 1.0  # and to its own past when the peers are all slow
    assert not too_slow(2.9, 1.0, 3.0) and too_slow(3.1, 1.0, 3.0) and not too_slow(99.0, None, 3.0)


def test_free_memory_is_memavailable_and_room_names_the_dir_and_both_sizes():
    assert mem_available("MemTotal: 100 kB\nMemAvailable:    2048 kB\n") == 2048 * 1024
    assert mem_available("MemTotal: 100 kB\n") is None
    ok = room("/ckpt", 10, 11)
    bad = room("/ckpt", 3 * 1024**3, 1024**3)
    assert ok.ok and not bad.ok and "/ckpt has 1.00 GiB free, a checkpoint needs 3.00 GiB" in bad.said


def test_a_report_names_the_node_and_the_first_failed_check_in_one_line():
    r = Report("n2", [Outcome("dirs", True, "ok"), Outcome("matmul", False, "slow"), Outcome("memory", False, "x")])
    assert r.line() == "slow (node n2 failed its health check 'matmul')"
    assert Report.from_dict(json.loads(json.dumps(r.to_dict()))).line() == r.line()
    assert Report("n1", [Outcome("dirs", True, "fine")], 0.5).failed is None


def test_a_slurm_node_list_expands_as_scontrol_does():
    assert expand_nodelist("n[1-2]") == ["n1", "n2"]
    assert expand_nodelist("gpu[07-09,11],cpu3") == ["gpu07", "gpu08", "gpu09", "gpu11", "cpu3"]


def test_fault_node_must_be_a_node_of_the_job():
    cfg = OmegaConf.create(BAD)
    check_node(cfg, 2, SYNC, {"SLURM_JOB_NODELIST": "n[1-2]"})
    with pytest.raises(ConfigError, match=r"^fault.node=n2 is not a node of this SLURM job \(n1, n3\)"):
        check_node(cfg, 2, SYNC, {"SLURM_JOB_NODELIST": "n[1,3]"})
    check_node(cfg, 1, SYNC, {"PITSTOP_NODE_NAME": "n2"})  # one node, outside SLURM: this node
    with pytest.raises(ConfigError, match="^fault.node=n2 but this one-node job runs on node n1"):
        check_node(cfg, 1, SYNC, {"PITSTOP_NODE_NAME": "n1"})
    check_node(cfg, 2, SYNC, {"PITSTOP_NODE_NAME": "n1"})  # several nodes, outside SLURM: cannot tell
    with pytest.raises(ConfigError, match="^fault.how=unwritable .* but ckpt=none has none"):
        check_node(OmegaConf.create({**BAD, "how": "unwritable"}), 1, {"_target_": "x.NoCheckpoint"}, {})
    assert unwritable(OmegaConf.create({**BAD, "how": "unwritable"}), "n2")
    assert not unwritable(OmegaConf.create({**BAD, "how": "unwritable"}), "n1") and not unwritable(cfg, "n2")


def _healthy(node: str = "n2") -> Report:
    return Report(node, [Outcome("dirs", True, "fine")])


def test_which_node_is_not_used_and_why(tmp_path):
    run = str(tmp_path)
    assert vetting.verdict(run, "n2", (1, 2), _healthy) is None
    failing = Report("n2", [Outcome("shm", False, "full")])
    assert vetting.verdict(run, "n2", (1, 2), lambda: failing) == (
        "full (node n2 failed its health check 'shm')",
        "health",
    )
    node_book.record_failure(run, "n2", "RuntimeError: boom")
    assert vetting.verdict(run, "n2", (1, 2), _healthy) is None  # one failure: used again
    node_book.record_failure(run, "n2", "RuntimeError: boom")
    why, by = vetting.verdict(run, "n2", (1, 2), _healthy)
    assert by == "failures" and why.startswith("2 attempts failed on it (the last: RuntimeError: boom")
    assert vetting.verdict(run, "n2", (1, 1), _healthy) is None  # a job of one node: its restart budget decides
    assert vetting.verdict(run, "n2", (2, 2), _healthy) is None  # one that cannot go on without it: likewise
    suspects = {"suspects": [{"rank": 1, "step": 40, "how": "digest", "host": "n1"}]}
    (tmp_path / "suspects.json").write_text(json.dumps(suspects))
    assert vetting.verdict(run, "n1", (1, 2), _healthy) == (
        "the silent-corruption check named it at step 40 (suspects.json)",
        "sdc",
    )
    node_book.exclude(run, "n3", "too slow", "straggler")
    assert vetting.verdict(run, "n3", (1, 1), _healthy) == (
        "it was excluded from this run by straggler (too slow)",
        "straggler",
    )


def test_an_excluded_node_leaves_a_job_that_can_go_on_and_stops_one_that_cannot(tmp_path, monkeypatch):
    for var in ("SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        monkeypatch.delenv(var, raising=False)
    run = str(tmp_path)
    gone = vetting.refuse(run, "n2", "node n2 failed its health check 'dirs': x", "health", (1, 2), "1:2")
    assert isinstance(gone, NodeExcluded) and str(gone) == (
        "node n2 is not used: node n2 failed its health check 'dirs': x; the job goes on without it (1 node(s) left, "
        "strategy.nnodes=1:2)"
    )
    assert node_book.excluded(run)["n2"]["by"] == "health"
    stop = vetting.refuse(run, "n1", "2 attempts failed on it", "failures", (1, 2), "1:2")
    assert type(stop) is PitstopError and str(stop).startswith(
        "the job cannot go on: 2 node(s) excluded (n1: 2 attempts failed on it; n2: node n2 failed its health check "
        "'dirs': x) and strategy.nnodes=1:2 needs 1, 0 left"
    )
    assert (tmp_path / ".crash_loop").read_text() == str(stop)  # (the other launchers stop with the same line)
    one = vetting.refuse(
        str(tmp_path / "one"), "n1", "node n1 failed its health check 'memory': low", "health", (1, 1), "1"
    )
    assert str(one) == (
        "node n1 failed its health check 'memory': low; the job has no other node (strategy.nnodes=1): fix the node "
        "and run again"
    )
    assert not (tmp_path / "one" / "nodes.json").exists()  # (a one-node job marks nothing for later)


def test_under_slurm_the_nodes_left_are_the_allocations_less_the_excluded(tmp_path):
    node_book.exclude(str(tmp_path), "n9", "elsewhere", "health")  # (not in this allocation: it costs nothing)
    node_book.exclude(str(tmp_path), "n2", "bad", "health")
    assert vetting.nodes_left(str(tmp_path), 2, {"SLURM_JOB_NODELIST": "n[1-3]"}) == (["n2", "n9"], 2)
    assert vetting.nodes_left(str(tmp_path), 3, {}) == (["n2", "n9"], 1)


def test_a_nodes_failures_count_once_per_attempt_and_exclude_it_at_the_second_in_a_job_of_several(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("PITSTOP_NODE_NAME", "nX")
    run = str(tmp_path)
    assert not vetting.failed_here(run, "boom", (1, 2), tag="[agent 7 restart 0]")
    assert not vetting.failed_here(run, "boom", (1, 2), tag="[agent 7 restart 0]")  # its other local rank
    assert node_book.failures(run, "nX") == 1
    assert vetting.failed_here(run, "boom", (1, 2), tag="[agent 7 restart 1]")
    assert not vetting.failed_here(run, "boom", (1, 1))  # one node: recorded, never excluded
    assert not vetting.failed_here(run, "boom", (2, 2))  # nor where the job cannot go on without it
    assert node_book.failures(run, "nX") == 4


def test_reformations_are_counted_per_agent_and_restart(tmp_path):
    run = str(tmp_path)
    for restart in (0, 0, 2):  # (two local ranks of restart 0)
        vetting.note_reform(run, 41, restart)
    vetting.note_reform(run, 42, 0)
    assert vetting.reforms(run, 41) == 2 and vetting.reforms(run, 42) == 1 and vetting.reforms(run, 43) == 0


def test_the_health_checks_time_is_its_own_bucket_out_of_program_start():
    ledger = Ledger(time.time() - 2.0, health=0.5)
    assert "health" in JOB_BUCKETS
    assert ledger.seconds["health"] == 0.5 and 1.45 < ledger.seconds["program_start"] < 1.6
    assert Ledger(time.time() - 0.2, health=5.0).seconds["health"] <= 0.21  # (never more than the start it is in)


def _supervise(tmp_path, codes: list[int], nodes: tuple[int, int] = (1, 1), restarts: int = 0, during=None):
    """pitstop's supervisor's attempts() over attempts that end with ``codes`` in turn (the last: finished);
    ``during()`` runs in each attempt (what it does to the run dir)."""
    from pitstop.config import schema
    from pitstop.config.schema_loop import Health
    from pitstop.launch.mode import LaunchMode
    from pitstop.launch.plan import LaunchPlan
    from pitstop.launch.supervisor import attempts

    ends = iter(codes)
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "summary.json").write_text('{"final_step": 3}')

    class Child:
        pid, exitcode = 4242, None

        def __init__(self, **kw):
            pass

        def start(self):
            pass

        def join(self, timeout=None):
            if during is not None:
                during()
            self.exitcode = next(ends)

        def is_alive(self):
            return False

    class Ctx:
        Process = Child

        @staticmethod
        def get_start_method():
            return "fake"

    trainer = schema.Trainer(health=Health(enabled=False))  # (the checks themselves: tests/integration)
    job = LaunchPlan(LaunchMode.SUPERVISED, trainer, schema.Single(), nodes=nodes, restarts=restarts)
    return attempts(Ctx, "{}", str(tmp_path), job, time.time())


def test_the_supervisor_restarts_a_reformation_at_once_without_using_the_restart_budget(tmp_path):
    from pitstop.resilience.node_book import REFORM_EXIT

    assert _supervise(tmp_path, [REFORM_EXIT, REFORM_EXIT, 0], restarts=0) == {"final_step": 3}
    with pytest.raises(PitstopError, match=r"its restarts are used up \(1 failure\(s\): 1 of trainer.max_restarts=0"):
        _supervise(tmp_path, [REFORM_EXIT, 1, 0], restarts=0)  # (a real failure still costs one)


def test_the_supervisor_does_not_start_an_excluded_node_again(tmp_path, monkeypatch):
    from pitstop.resilience.node_book import EXCLUDED_EXIT

    monkeypatch.setenv("PITSTOP_NODE_NAME", "n2")
    for var in ("SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        monkeypatch.delenv(var, raising=False)

    def slow(run_dir):  # (as the straggler detector's rank does before it exits EXCLUDED_EXIT)
        return lambda: node_book.exclude(str(run_dir), "n2", "too slow", "straggler")

    a, b = tmp_path / "a", tmp_path / "b"
    with pytest.raises(NodeExcluded, match=r"^node n2 is not used: too slow; the job goes on without it \(1 node"):
        _supervise(a, [EXCLUDED_EXIT, 0], nodes=(1, 2), restarts=5, during=slow(a))
    with pytest.raises(PitstopError, match="^too slow; the job has no other node"):
        _supervise(b, [EXCLUDED_EXIT, 0], restarts=5, during=slow(b))
    # and a node already excluded is not started at all
    with pytest.raises(NodeExcluded, match=r"^node n2 is not used: it was excluded from this run by straggler"):
        _supervise(tmp_path / "a", [0], nodes=(1, 2), restarts=5)


def test_fault_lose_node_names_a_node_of_the_job_and_corrupts_every_file_of_the_copies_held_for_it(tmp_path):
    from pitstop.resilience.node_loss import corrupt, held_for

    lose = OmegaConf.create({"_target_": "pitstop.resilience.node_loss.NodeLoss", "node": "n3", "step": 5})
    with pytest.raises(ConfigError, match=r"^fault.node=n3 is not a node of this SLURM job \(n1, n2\)"):
        check_node(lose, 2, SYNC, {"SLURM_JOB_NODELIST": "n[1-2]"})
    copy = tmp_path / "peer" / "1" / "step_00000010"  # (node 1's copy, held by node 2 of the ring)
    copy.mkdir(parents=True)
    (copy / "__0_0.distcp").write_bytes(bytes(range(10)))
    (copy / "CHECKSUMS").write_bytes(b"sums")
    (tmp_path / "peer" / "0" / "step_00000010").mkdir(parents=True)  # (another node's copy: not the lost node's)
    assert held_for(str(tmp_path), 1) == [str(copy)] and held_for(str(tmp_path), 9) == []
    assert corrupt(str(copy)) == 1  # the data, not the manifest: only the checksums can tell
    assert (copy / "__0_0.distcp").read_bytes() == bytes([0, 1, 2, 3, 4, 5 ^ 0xFF, 6, 7, 8, 9])
    assert (copy / "CHECKSUMS").read_bytes() == b"sums"


def test_fault_lose_node_kills_and_clears_the_lost_node_and_its_partner_only_as_told(tmp_path, monkeypatch):
    # real processes (forked), real SIGKILLs and dirs; the ring of ckpt.local.replicas over nodes n1, n2, n3: n2's
    # copies are held by n3
    import json
    import logging
    import os
    import signal
    from types import SimpleNamespace

    from pitstop.ckpt.peer import ring
    from pitstop.resilience.fault import FaultContext
    from pitstop.resilience.node_loss import NodeLoss

    nodes = ring(["n1", "n2", "n3"])

    runs = iter(range(100))

    def run(
        here: str, partner: str, copies: dict | None = None, wait: bool = True, last: int = 5, broken: str | None = None
    ) -> tuple[int | None, bool, str]:
        """``after_step(4..last)`` in a process on node ``here`` (its own run dir), its replicator acknowledging a copy
        of save ``s`` after step ``k`` for each ``k: s`` of ``copies`` (None: one of step 5 before step 5 ends), the
        job's ranks agreeing as this one does (one process: ``any`` is its own flag): how it ended (a signal, or None),
        whether its local dir is left, and what it logged."""
        run_dir = tmp_path / f"{here}_{partner}_{next(runs)}"
        root = run_dir / "shm"
        (root / "step_00000005").mkdir(parents=True)
        copier = SimpleNamespace(ring=nodes, broken=broken, copies=[], strategy=SimpleNamespace(any=bool))
        ckpt = SimpleNamespace(local=SimpleNamespace(root=str(root)), replicator=copier)
        ctx = FaultContext(str(run_dir), 0, 3, 10, 1, 0.0, ckpt)
        monkeypatch.setenv("PITSTOP_NODE_NAME", here)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            said = logging.FileHandler(run_dir / "said")
            logging.getLogger("pitstop").addHandler(said)
            fault = NodeLoss("n2", 5, partner, wait)
            fault.bind(ctx)
            for step in range(4, last + 1):
                acked = {4: 5} if copies is None else copies
                copier.copies += [(s, 0.1, 10) for k, s in acked.items() if k == step - 1]
                fault.after_step(step)
                said.flush()
            fault.close()
            said.flush()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        said = (run_dir / "said").read_text() if (run_dir / "said").exists() else ""
        return (os.WTERMSIG(status) if os.WIFSIGNALED(status) else None), root.exists(), said

    lost, left, said = run("n2", "keep")  # the lost node
    assert (lost, left) == (signal.SIGKILL, False)
    assert "SIGKILL (node n2 lost at step 5; its partner holds its copy of step 5)" in said
    # no copy acknowledged by step 5: it waits for one (said once), and goes at the end of the step that finds it
    lost, left, said = run("n2", "keep", copies={7: 5}, last=9)
    assert (lost, left) == (signal.SIGKILL, False)
    assert said.count("is lost once its partner holds a copy") == 1, said
    assert "node n2 lost at step 8; its partner holds its copy of step 5" in said
    # no copy ever: the run ends without the loss, said
    lost, left, said = run("n2", "keep", copies={}, last=9)
    assert (lost, left) == (None, True) and "n2 was not lost: the run ended before" in said, said
    # copies stopped (a partner gone): at once; not waited for: at fault.step, whatever is held
    lost, left, said = run("n2", "keep", copies={}, broken="gone")
    assert (lost, left) == (signal.SIGKILL, False) and "SIGKILL (node n2 lost at step 5)" in said, said
    lost, left, said = run("n2", "keep", copies={}, wait=False)
    assert (lost, left) == (signal.SIGKILL, False) and "SIGKILL (node n2 lost at step 5)" in said, said
    assert run("n3", "keep")[:2] == (None, True) and run("n3", "corrupt")[:2] == (None, True)  # its partner, kept
    assert run("n3", "lost")[:2] == (signal.SIGKILL, False)  # its partner, lost too
    assert run("n1", "lost")[:2] == (None, True)  # not its partner
    # corrupt: as the job restarts (the loss on record), the partner's first rank corrupts the copies it holds, once
    run_dir = tmp_path / "n3_corrupt"
    copy = run_dir / "shm" / "peer" / "1" / "step_00000005"
    copy.mkdir(parents=True)
    (copy / "__1_0.distcp").write_bytes(b"abc")
    (run_dir / "faults.jsonl").write_text(json.dumps({"key": "lose_node@5/n2/rank1", "time": 0, "pid": 1}) + "\n")
    copier = SimpleNamespace(ring=nodes, broken=None, copies=[], strategy=SimpleNamespace(any=bool))
    ckpt = SimpleNamespace(local=SimpleNamespace(root=str(run_dir / "shm")), replicator=copier)
    monkeypatch.setenv("PITSTOP_NODE_NAME", "n3")
    for _ in range(2):  # (the next restart does not flip it back)
        NodeLoss("n2", 5, "corrupt").bind(FaultContext(str(run_dir), 2, 3, 10, 1, 0.0, ckpt))
    assert (copy / "__1_0.distcp").read_bytes() == b"a" + bytes([ord("b") ^ 0xFF]) + b"c"
