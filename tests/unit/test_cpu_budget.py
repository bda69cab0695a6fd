"""The CPU budget of a run on the CPU (strategy.cpu_threads=auto): the loop's intra-op threads are the cores the
loader's workers leave, so that adding a worker never slows the step; a pinned count is kept."""

from __future__ import annotations

import logging

import pytest
import torch

from pitstop.errors import ConfigError
from pitstop.strategy.single import Single


@pytest.fixture
def cores(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr("pitstop.strategy.single._THREADS_ALLOWED", 8)  # (what OMP_NUM_THREADS allows: auto's cap)
    yield lambda n: monkeypatch.setattr("os.cpu_count", lambda: n)
    torch.set_num_threads(before)


@pytest.mark.parametrize(("n_cores", "workers", "threads"), [(8, 0, 8), (8, 2, 6), (2, 2, 1), (2, 5, 1), (16, 2, 8)])
def test_auto_gives_the_loop_the_cores_the_workers_leave(cores, n_cores, workers, threads, caplog):
    cores(n_cores)
    s = Single(device="cpu")
    s.share_cores(workers)
    with caplog.at_level(logging.INFO, logger="pitstop.strategy"):
        s.setup()
    assert torch.get_num_threads() == threads  # (16 cores, 2 workers: 8, the cap OMP_NUM_THREADS set)
    assert f"CPU budget: {threads} intra-op thread(s) for the loop, {workers} loader worker(s)" in caplog.text
    assert ("is more than this machine's" in caplog.text) == (workers > n_cores)  # a warning naming both


def test_a_pinned_count_is_kept_and_a_bad_one_refused(cores):
    cores(2)
    s = Single(device="cpu", cpu_threads=3)
    s.share_cores(2)
    s.setup()
    assert torch.get_num_threads() == 3
    for bad in (0, -1, 1.5, "many"):
        with pytest.raises(ConfigError, match=r"^strategy.cpu_threads must be auto or a positive integer"):
            Single(cpu_threads=bad)


def test_auto_does_not_depend_on_what_an_earlier_run_in_the_process_chose(cores):
    cores(8)
    for workers, threads in ((6, 2), (0, 8)):  # (a later run with fewer workers gets its cores back)
        s = Single(device="cpu")
        s.share_cores(workers)
        s.setup()
        assert torch.get_num_threads() == threads
