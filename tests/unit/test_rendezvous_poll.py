"""A restart of a job on several nodes does not wait torch's rendezvous second for nothing
(:func:`pitstop.launch.rendezvous.poll_sooner`): the poll and the state cache of torch's dynamic rendezvous, in this
process.  If a torch release drops either piece, this test says so (the launcher then keeps torch's own)."""

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
