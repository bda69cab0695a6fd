"""Replica groups (strategy=ft) in one process against a real torchft Lighthouse: each quorum shows every group's
identity, so a group started with another config, or with a replica_id another group already runs as, is refused
in one line naming what differs, while the group that was there first trains on."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

pytest.importorskip("torchft")

from pitstop.errors import ConfigError  # noqa: E402
from conftest import ft_strategy  # noqa: E402
from pitstop.launch.replicas import start_lighthouse  # noqa: E402
from pitstop.strategy.ft import FT  # noqa: E402

CONFIG = {"model": {"width": 8}, "optim": {"lr": 0.1}, "trainer": {"batch_size": 4}, "paths": {"root_dir": "/a"}}


@pytest.fixture
def lighthouse():
    server = start_lighthouse(SimpleNamespace(min_replicas=1, heartbeat_ms=250))
    yield server.address()
    server.shutdown()


def start_group(address: str, replica_id: int, quorum_timeout: float = 20, **changes) -> FT:
    cfg = OmegaConf.create({**CONFIG, "strategy": {"replica_id": replica_id, "lighthouse": address}})
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value)
    group = ft_strategy(replicas=2, replica_id=replica_id, lighthouse=address, timeout=2,
                        quorum_timeout=quorum_timeout, cpu_threads=1)  # fmt: skip
    group.expect_config(cfg)
    group.setup()
    group.wrap(nn.Linear(2, 1))
    return group


def train(group: FT, errors: list, committed: list, until: threading.Event | None = None, steps: int = 8) -> None:
    """``steps`` steps, or (``until``) steps until the event is set."""
    try:
        for _ in range(400 if until else steps):
            if until is not None and until.is_set():
                break
            group.begin_step()
            group._model(torch.ones(4, 2)).sum().backward()
            group.reduce_gradients(group._model)
            committed.append(group.commit())
    except Exception as e:  # noqa: BLE001 - what the test looks at
        errors.append(e)
        group.teardown()  # (as the refused process exits: its heartbeats stop)


def run_two(first: FT, start_second) -> tuple[list, list, list]:
    """The first group trains; the second starts (``start_second()``) and does its steps (or is refused); the
    first goes on alone."""
    second = first  # (until the second has started)
    errors: tuple[list, list] = ([], [])
    committed: tuple[list, list] = ([], [])
    done = threading.Event()
    one = threading.Thread(target=train, args=(first, errors[0], committed[0], done))
    try:
        one.start()
        deadline = time.monotonic() + 30
        while not committed[0] and one.is_alive() and time.monotonic() < deadline:  # the first trains, then
            time.sleep(0.01)  # the second joins
        second = start_second()
        train(second, errors[1], committed[1])
        at = len(committed[0])
        while len(committed[0]) < at + 3 and one.is_alive() and time.monotonic() < deadline + 30:  # ... and on
            time.sleep(0.01)
        done.set()
        one.join(60)
    finally:
        done.set()
        one.join(60)
        for g in (second, first):
            g.teardown()
    return errors[0], errors[1], committed[0]


def test_a_group_started_with_another_config_is_refused_naming_the_section(lighthouse):
    first = start_group(lighthouse, 0)
    changed = {"optim.lr": 0.2, "paths.root_dir": "/b"}  # (paths.root_dir: node-local, may differ)
    errors_first, errors_second, committed = run_two(first, lambda: start_group(lighthouse, 1, **changed))
    assert not errors_first and committed[-3:] == [True] * 3  # the first group trained on
    assert len(errors_second) == 1 and isinstance(errors_second[0], ConfigError), errors_second
    message = str(errors_second[0])
    assert "\n" not in message and message.startswith("strategy=ft: replica group 0 was started with another config")
    assert "they differ in optim:" in message and "same overrides" in message


def test_two_groups_with_one_replica_id_the_later_is_refused(lighthouse):
    first = start_group(lighthouse, 0)
    errors_first, errors_second, committed = run_two(first, lambda: start_group(lighthouse, 0))
    assert not errors_first and committed[-3:] == [True] * 3
    assert len(errors_second) == 1 and isinstance(errors_second[0], ConfigError), errors_second
    assert str(errors_second[0]).startswith("strategy.replica_id=0 is taken: another process runs as replica group 0")


def test_a_quorum_that_does_not_form_in_time_discards_the_step_and_the_group_goes_on(lighthouse):
    # a peer of the last quorum that still sends heartbeats but asks for no more quorums (a stalled group): the
    # Lighthouse waits for it and torchft's quorum times out after strategy.quorum_timeout; that step is
    # discarded and the process goes on
    first = start_group(lighthouse, 0, quorum_timeout=1)
    second = start_group(lighthouse, 1)
    errors, committed, theirs = [], [], []
    try:
        together = threading.Thread(target=train, args=(second, [], theirs), kwargs={"steps": 2})
        together.start()
        train(first, errors, committed, steps=2)
        together.join(30)
        train(first, errors, committed, steps=1)  # the second is "stalled" now: set up, heartbeating, not stepping
        second.teardown()
        time.sleep(0.5)  # (its heartbeats stop: the Lighthouse drops it)
        train(first, errors, committed, steps=2)
    finally:
        for g in (second, first):
            g.teardown()
    assert not errors, errors
    assert theirs == [True, True] and committed == [True, True, False, True, True], committed


def test_a_group_whose_peers_are_gone_for_good_ends_in_one_line_after_a_bounded_wait(lighthouse):
    """strategy.min_replicas=2 and the other group never comes (gone for good): each step is discarded, and each
    discarded step would look like progress to hang detection; the group ends after five times the longest wait for
    peers (quorum_timeout + 2 x timeout = 1 + 2 x 0.5 s here) instead of discarding steps forever."""
    from pitstop.strategy.ft_quorum import PeersGone

    cfg = OmegaConf.create({**CONFIG, "strategy": {"replica_id": 0, "lighthouse": lighthouse}})
    group = ft_strategy(replicas=2, replica_id=0, lighthouse=lighthouse, timeout=0.5, quorum_timeout=1, min_replicas=2,
                        cpu_threads=1)  # fmt: skip
    group.expect_config(cfg)
    group.setup()
    group.wrap(nn.Linear(2, 1))
    errors: list = []
    committed: list = []
    t0 = time.monotonic()
    train(group, errors, committed, steps=100_000)  # (ended by the error)
    took = time.monotonic() - t0
    assert not any(committed) and len(errors) == 1 and isinstance(errors[0], PeersGone), errors
    text = str(errors[0])
    assert "\n" not in text and "committed no step for" in text and "strategy.min_replicas=2" in text
    assert group.give_up_seconds() == 10 and 10 <= took < 10 + 3 * group.peer_wait_seconds()
