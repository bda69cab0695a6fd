"""A restart of a job on several nodes does not wait torch's rendezvous second for nothing
(:func:`pitstop.launch.rendezvous.poll_sooner`): the poll and the state cache of torch's dynamic rendezvous, in this
process.  If a torch release drops either piece, this test says so (the launcher then keeps torch's own).  Nor does
a rank wait out TCPStore's connect back-off for a rank 0 that listens a moment later
(:func:`pitstop.strategy.ddp.wait_listening`)."""

from __future__ import annotations

import time

from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

from pitstop.launch.rendezvous import poll_sooner


def test_the_rendezvous_polls_and_caches_for_a_tenth_of_a_second_on_few_nodes_and_as_torch_at_scale(monkeypatch):
    monkeypatch.setattr(dr, "_delay", dr._delay)  # (torch's own again after the test)
    monkeypatch.setattr(dr._BackendRendezvousStateHolder, "__init__", dr._BackendRendezvousStateHolder.__init__)
    torch_poll = dr._delay
    assert poll_sooner(2) == 0.1
    assert poll_sooner(2) == 0.1 and dr._delay.pitstop_original is torch_poll  # (twice: not wrapped twice)
    t0 = time.monotonic()
    dr._delay(seconds=1)  # (the wait for the other nodes' joins)
    assert time.monotonic() - t0 < 0.5
    holder = dr._BackendRendezvousStateHolder(backend=None, settings=None)
    assert holder._cache_duration == 0.1
    t0 = time.monotonic()
    dr._delay(seconds=0.2)  # (other waits are torch's)
    assert time.monotonic() - t0 >= 0.19
    t0 = time.monotonic()
    for _ in range(20):  # (a first restart's jitter: up to 0.03 s each now, 0.3 s each in torch: ~3 s in all)
        dr._delay(seconds=(0, 0.3))
    assert time.monotonic() - t0 < 1.5
    assert poll_sooner(400) == 0.4 and poll_sooner(4096) == 1.0
    assert dr._BackendRendezvousStateHolder(backend=None, settings=None)._cache_duration == 1.0


def test_a_rank_connects_to_rank_0s_store_as_soon_as_it_listens_not_after_tcpstores_back_off(monkeypatch):
    # Rank 1 asks for the round's store 0.05 s before rank 0 listens (real TCPStores, loopback): it asks TCPStore to
    # connect only once rank 0 listens, so it connects at once, where TCPStore's own back-off would connect it
    # 0.25..0.75 s later (measured: ~0.4 s).
    import socket
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from pitstop.strategy.ddp import DDP, loopback_store, wait_listening

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    made, asked = dist.TCPStore, []

    def store(*args, **kwargs):  # (torch's own, noting when each side asked for it)
        asked.append((kwargs["is_master"], time.monotonic()))
        return made(*args, **kwargs)

    monkeypatch.setattr(dist, "TCPStore", store)
    listening: dict = {}

    def rank0() -> None:
        time.sleep(0.05)
        listening["from"] = time.monotonic()  # (loopback_store listens first, then makes the TCPStore)
        listening["store"] = loopback_store(port, 2, timedelta(seconds=10), wait_for_workers=False)

    late = threading.Thread(target=rank0)
    late.start()
    rank1 = DDP(nproc_per_node=2, timeout=10)
    rank1.rank, rank1.world_size = 1, 2
    client = rank1._store()
    connected = time.monotonic()
    late.join()
    client.set("k", "v")
    assert listening["store"].get("k") == b"v"  # (the store rank 0 hosts)
    when = [t for master, t in asked if not master]
    assert len(when) == 1 and when[0] >= listening["from"], (when, listening["from"])  # (not before it listens)
    assert connected - listening["from"] < 1.0, connected - listening["from"]  # (at once: loose, for a loaded machine)
    # nothing listens: it gives up after the timeout (TCPStore's own error follows, as before)
    with socket.socket() as bound:  # (a port held but not listening: refused)
        bound.bind(("127.0.0.1", 0))
        t0 = time.monotonic()
        assert wait_listening("127.0.0.1", bound.getsockname()[1], 0.2, 2) is False
        assert 0.1 <= time.monotonic() - t0 < 1.0
        assert wait_listening("[::1]", bound.getsockname()[1], 0.2, 2) is False  # (an IPv6 literal: refused, or none)
