"""The local tier's peer copy on the wire (``ckpt.local.replicas=1``; :mod:`pitstop.ckpt.peer_wire` and the
:class:`~pitstop.ckpt.peer_copy.Replicator`), between two real processes over real gloo (group timeout 30 s): files
larger than a chunk travel in chunks with bounded memory and check; a peer that announces a wrong count, a size
the manifest does not list, an index out of range, fewer files than its own or another rank's file, another chunk
size, bytes that fail their CRC, or a manifest too large, damaged or for a linked dir is named by the receiver
(nothing of it written, nothing it held removed) and neither side waits for the timeout; so does a transfer whose
read or write fails partway; a node leader's write that fails (a file where its copy dir goes) stops the copies on
every rank, in agreement, and the saves made after it are restorable as the nodes' own; what the nodes hold travels
as int64 values (no pickles), a marker that is a link or a FIFO counting as not held.  The scenarios run once, in
one pair of processes (``results``); each test reads its part."""

from __future__ import annotations

import os
import resource
import signal
import socket
import threading
import time
import traceback

import pytest
import torch.multiprocessing as mp

import ranks

pytestmark = pytest.mark.slow  # (two processes, a real gloo group)

TIMEOUT = 30  # seconds: the gloo group's; every scenario must end well within it
CHUNK = 1000  # bytes per message in these tests (the product's: peer_wire.CHUNK)
BIG = 32 << 20  # a file's bytes in the memory scenario, sent in 1-MiB chunks


def _file(rank: int, n: int, i: int = 0) -> bytes:
    return bytes((rank * 31 + i * 7 + k) % 251 for k in range(n))


def _checkpoint(path: str, sizes: dict[str, int]) -> dict:
    """A checkpoint dir of files of ``sizes`` (each the same bytes on every rank) and its manifest."""
    from pitstop.ckpt import integrity

    os.makedirs(path, exist_ok=True)
    files = {}
    for i, (name, n) in enumerate(sorted(sizes.items())):
        data = _file(0, n, i)
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
        files[name] = integrity.entry(n, integrity.crc(data))
    integrity.write_manifest(path, files)
    return integrity.read_manifest(path)


def _big(path: str, me: int) -> dict:
    """Two files of BIG bytes (``__0_0``, ``__1_0``), this rank's written 1 MiB at a time, the other's only summed: no
    copy of a whole file is ever in this process's memory."""
    from pitstop.ckpt import integrity

    os.makedirs(path, exist_ok=True)
    files = {}
    for r in (0, 1):
        running, piece = integrity.Running(), bytes([r + 1]) * (1 << 20)
        with open(os.path.join(path, f"__{r}_0.distcp"), "wb") if r == me else open(os.devnull, "wb") as f:
            for _ in range(BIG >> 20):
                f.write(piece)
                running.update(piece)
        files[f"__{r}_0.distcp"] = running.entry()
    integrity.write_manifest(path, files)
    return integrity.read_manifest(path)


def _peak_reset() -> int:
    """This process's resident bytes now, its peak reset to it (``/proc/self/clear_refs``); -1 where that cannot be
    done."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return -1
    return _status("VmRSS")


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _scenarios(rank: int, tmp: str) -> dict:
    import torch
    import torch.distributed as dist

    from pitstop.ckpt import integrity, peer_wire, throttle
    from pitstop.ckpt.peer_wire import one_int, _pair

    other, out = 1 - rank, {}

    def run(name: str, work) -> None:
        dist.barrier()
        t0 = time.monotonic()
        try:
            got = work()
            out[name] = ("ok", got, time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - what each side raised is the result
            out[name] = (type(e).__name__, str(e), time.monotonic() - t0)

    sizes = {"__0_0.distcp": 5003, "__1_0.distcp": 4103, "__1_1.distcp": 0, ".metadata": 10}
    own = os.path.join(tmp, f"own{rank}")
    files = _checkpoint(own, sizes)
    names, width = sorted(files), 2 + 2 * len(files)

    def ring():  # both ways at once, 1000-byte chunks: each rank's files (larger than a chunk) into the other's dir
        got = os.path.join(tmp, f"copy{rank}")
        peer_wire.exchange(None, own, files, [rank], other, got, other, [other], CHUNK)
        return sorted(os.listdir(got)), [open(os.path.join(got, n), "rb").read() == _file(0, sizes[n], names.index(n))
                                         for n in sorted(os.listdir(got))]  # fmt: skip

    run("ring", ring)

    big = os.path.join(tmp, f"big{rank}")
    big_files = _big(big, rank)

    def memory():
        before = _peak_reset()
        peer_wire.exchange(None, big, big_files, [rank], other, os.path.join(tmp, f"bigcopy{rank}"), other, [other],
                           1 << 20)  # fmt: skip
        grew = _status("VmHWM") - before if before >= 0 else -1
        os.remove(os.path.join(tmp, f"bigcopy{rank}", f"__{other}_0.distcp"))
        return grew

    run("memory", memory)

    def bad(head, into="bad"):  # rank 0 announces ``head`` (then sends nothing unless told to), rank 1 receives
        if rank == 0:  # (what rank 0's files are: .metadata and __0_0.distcp)
            _pair(torch.tensor(head, dtype=torch.int64), 1, None, None, None)
            return one_int(None, None, 1, None)  # (the receiver's answer)
        return peer_wire.exchange(None, own, files, [], None, os.path.join(tmp, into), 0, [0], CHUNK)

    def head(*announced, chunk=CHUNK):  # ``announced``: (name, bytes) in the header's order
        index, sizes = [names.index(n) for n, _ in announced], [b for _, b in announced]
        pad = [-1] * (len(files) - len(announced))
        return [len(announced), *index, *pad, *sizes, *pad, chunk]

    run("count", lambda: bad([len(files) + 5, *[0] * (width - 1)]))
    run("size", lambda: bad(head((".metadata", 10), ("__0_0.distcp", 5004))))
    run("index", lambda: bad([1, len(files) + 3, *[-1] * (len(files) - 1), 5003, *[-1] * (len(files) - 1), CHUNK]))
    # a header that names fewer files than the sender's (a copy cut short would be marked whole)
    run("short", lambda: bad(head(("__0_0.distcp", 5003))))
    held = os.path.join(tmp, "held")  # one that names a file the receiver holds of another rank: never replaced
    if rank == 1:
        _checkpoint(held, sizes)
    run("foreign", lambda: bad(head((".metadata", 10), ("__0_0.distcp", 5003), ("__1_0.distcp", 4103)), "held"))
    out["foreign_kept"] = rank == 0 or open(os.path.join(held, "__1_0.distcp"), "rb").read() == _file(0, 4103, 2)
    run("chunk", lambda: bad(head((".metadata", 10), ("__0_0.distcp", 5003), chunk=CHUNK + 1)))

    def crc():  # rank 0's file changed after its manifest (same size): sent as it is, found by rank 1
        if rank == 0:
            path = os.path.join(own, "__0_0.distcp")
            data = bytearray(open(path, "rb").read())
            data[2500] ^= 0xFF
            open(path, "wb").write(bytes(data))
            return peer_wire.exchange(None, own, files, [0], 1, os.path.join(tmp, "x"), None, [], CHUNK)
        return peer_wire.exchange(None, own, files, [], None, os.path.join(tmp, "crc"), 0, [0], CHUNK)

    run("crc", crc)

    def unreadable():  # rank 0's file is gone: it announces that it cannot send, rank 1 expects nothing more
        if rank == 0:
            os.remove(os.path.join(own, "__0_0.distcp"))
            return peer_wire.exchange(None, own, files, [0], 1, os.path.join(tmp, "x"), None, [], CHUNK)
        return peer_wire.exchange(None, own, files, [], None, os.path.join(tmp, "unread"), 0, [0], CHUNK)

    run("unreadable", unreadable)

    def manifest():  # a restore's transfer whose manifest is announced beyond MANIFEST_MAX
        if rank == 0:
            return one_int(integrity.MANIFEST_MAX + 1, 1, 1, None)
        return peer_wire.recv_step(None, os.path.join(tmp, "man"), 0, [0], CHUNK)

    run("manifest", manifest)

    def differs():  # rank 1 holds another manifest for that step: it refuses; rank 0 hears it
        if rank == 0:
            return peer_wire.send_step(None, own, [1], 1, CHUNK)
        _checkpoint(os.path.join(tmp, "differs"), {"__0_0.distcp": 5})
        return peer_wire.recv_step(None, os.path.join(tmp, "differs"), 0, [1], CHUNK)

    run("differs", differs)

    def sent_manifest(data: bytes, dst: str):  # rank 0 sends ``data`` as a restore's manifest, rank 1 receives it
        if rank == 0:
            one_int(len(data), 1, 1, None)
            _pair(torch.frombuffer(bytearray(data), dtype=torch.uint8), 1, None, None, None)
            return one_int(None, None, 1, None)  # (the receiver's answer: 0, refused)
        return peer_wire.recv_step(None, dst, 0, [0], CHUNK)

    garbage, outside = os.path.join(tmp, "garbage"), os.path.join(tmp, "outside")
    run("garbage", lambda: sent_manifest(b"not a manifest\ncrc32c 00000000\n", garbage))
    out["garbage_left"] = os.path.exists(os.path.join(garbage, integrity.MANIFEST))
    sealed = integrity.manifest_bytes({"../escape": integrity.entry(1, 0)})  # (sealed right, a name out of its dir)
    run("escape", lambda: sent_manifest(sealed, garbage))
    out["escape_left"] = os.path.exists(os.path.join(garbage, integrity.MANIFEST))
    if rank == 1:  # the step dir is a link to a dir elsewhere: nothing is written through it
        os.makedirs(outside)
        os.symlink(outside, os.path.join(tmp, "linked"))
    good = open(os.path.join(own, integrity.MANIFEST), "rb").read()
    run("linked", lambda: sent_manifest(good, os.path.join(tmp, "linked")))
    out["linked_wrote"] = os.listdir(outside) if rank == 1 else []

    slow = os.path.join(tmp, f"slow{rank}")
    slow_files = _checkpoint(slow, {"__0_0.distcp": 200_000, ".metadata": 10})

    def read_fails():  # rank 0's disk fails while it reads __0_0.distcp (its fd turns into a dir's: EISDIR)
        if rank == 1:
            return peer_wire.exchange(None, slow, slow_files, [], None, os.path.join(tmp, "rf"), 0, [0], CHUNK)
        throttle.slow_volume(slow, 0.2)  # (200 kB/s: about a second for the file, read a chunk at a time)
        watch = threading.Thread(target=_fail_reads, args=(os.path.join(slow, "__0_0.distcp"), 3 * CHUNK))
        watch.start()
        try:
            return peer_wire.exchange(None, slow, slow_files, [0], 1, os.path.join(tmp, "x"), None, [], CHUNK)
        finally:
            watch.join()
            throttle.slow_volume(slow, None)

    run("read_fails", read_fails)

    def write_fails():  # rank 1's writes fail after 3000 bytes of a file (RLIMIT_FSIZE: EFBIG, as a full disk)
        if rank == 0:
            return peer_wire.exchange(None, slow, slow_files, [0], 1, os.path.join(tmp, "x"), None, [], CHUNK)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        before = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (3000, hard))
        try:
            return peer_wire.exchange(None, slow, slow_files, [], None, os.path.join(tmp, "wf"), 0, [0], CHUNK)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, before)

    run("write_fails", write_fails)

    def no_dir():  # rank 1's copy dir is a file: it cannot open what it would write, and refuses
        if rank == 0:
            return peer_wire.exchange(None, slow, slow_files, [0], 1, os.path.join(tmp, "x"), None, [], CHUNK)
        open(os.path.join(tmp, "nodir"), "w").close()
        return peer_wire.exchange(None, slow, slow_files, [], None, os.path.join(tmp, "nodir"), 0, [0], CHUNK)

    run("no_dir", no_dir)
    return out


def _fail_reads(path: str, after: int) -> None:
    """Once this process has read ``after`` bytes of ``path`` (its fd's offset, /proc/self/fdinfo), turn that fd into
    a dir's: every read after it fails (EISDIR), as a disk that fails mid-file does."""
    path, deadline = os.path.realpath(path), time.monotonic() + 20
    while time.monotonic() < deadline:
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{fd}") != path:
                    continue
                with open(f"/proc/self/fdinfo/{fd}") as f:
                    pos = int(next(line.split()[1] for line in f if line.startswith("pos:")))
            except OSError:  # (an fd closed meanwhile)
                continue
            if pos >= after:
                d = os.open(os.path.dirname(path), os.O_RDONLY)
                os.dup2(d, int(fd))
                os.close(d)
                return
        time.sleep(0.001)


def _replicator(rank: int, tmp: str, strategy) -> dict:
    """A real Replicator per rank, nodes a and b: a copy, a leader's write that fails, saves after it, the restore."""
    from pitstop.ckpt import layout, peer
    from pitstop.ckpt.peer_copy import Replicator

    out: dict = {}
    root = os.path.join(tmp, f"shm_{'ab'[rank]}")
    rep = Replicator(strategy, root, "ab"[rank], keep=4, timeout=TIMEOUT)
    rep.chunk = CHUNK

    def save(step: int) -> None:  # a local save of the job: each node's dir holds its rank's files, node a the rest
        d = layout.step_dir(root, step)
        sizes = {"__0_0.distcp": 3001 + step, "__1_0.distcp": 2999 + step, ".metadata": 12}
        _checkpoint(d, sizes)
        for name in ("__1_0.distcp",) if rank == 0 else ("__0_0.distcp", ".metadata", "CHECKSUMS"):
            os.remove(os.path.join(d, name))
        strategy.barrier()

    def timed(name, work):
        t0 = time.monotonic()
        out[name] = (work(), time.monotonic() - t0)

    save(4)
    timed("copy4", lambda: rep.copy(4, True).result())
    if rank == 1:  # node b's leader cannot make its copy dir for step 6 (a file is where peer/0 goes)
        layout.free_dir(os.path.join(root, peer.PEER_DIR, "0"))
        open(os.path.join(root, peer.PEER_DIR, "0"), "w").close()
    save(6)
    timed("copy6", lambda: rep.copy(6, True).result())
    out["broken"] = rep.broken
    save(8)
    timed("copy8", lambda: rep.copy(8, True).result())
    out["held"] = sorted((h.step, h.owner, h.where) for h in peer.holdings(root))
    if rank == 0:  # node a's step 10 is marked by a link (to a marker that would count) and b's copy by a FIFO
        fake = os.path.join(tmp, "fake_marker")
        open(fake, "wb").write(peer.marker(10, 0, 2, [0]))
        os.makedirs(layout.step_dir(root, 10))
        os.symlink(fake, os.path.join(layout.step_dir(root, 10), peer.REPLICATED))
        os.makedirs(peer.copy_dir(root, 1, 10))
        os.mkfifo(os.path.join(peer.copy_dir(root, 1, 10), peer.COPIED))
    else:  # (and node b's own step 10 is marked as b's: with a's markers counted, step 10 would be restored)
        os.makedirs(layout.step_dir(root, 10))
        open(os.path.join(layout.step_dir(root, 10), peer.OWN), "wb").write(peer.marker(10, 1, 2, [1]))
    strategy.barrier()
    timed("newest", lambda: rep.newest()[0])
    found = rep.newest()
    timed("assemble8", lambda: rep.assemble(*found))
    out["whole8"] = sorted(os.listdir(layout.step_dir(root, 8)))
    if rank == 1:  # node b comes back empty: what b saved while copies were off is nowhere now
        layout.free_dir(root)
    strategy.barrier()
    timed("newest_after_loss", lambda: rep.newest()[0])
    if rank == 0:  # and node a's copy of b's step 4 is damaged: no node can make step 4 whole
        path = os.path.join(peer.copy_dir(root, 1, 4), "__1_0.distcp")
        data = bytearray(open(path, "rb").read())
        data[100] ^= 1
        os.remove(path)
        open(path, "wb").write(bytes(data))
    strategy.barrier()
    timed("assemble4", lambda: rep.assemble(*rep.newest()))
    rep.close(False)
    return out


def _rank(rank: int, port: int, tmp: str, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK="0")
    from pitstop.strategy.ddp import DDP

    try:
        s = DDP(nproc_per_node=2, timeout=TIMEOUT, device="cpu", cpu_threads=1)
        s.setup()
        wire = _scenarios(rank, tmp)
        node = _replicator(rank, tmp, s)
        q.put((rank, {"wire": wire, "node": node}))
        s.teardown()
    except Exception:  # noqa: BLE001 - the test reports it
        q.put((rank, {"error": traceback.format_exc()}))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("wire")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = []
    for r in (0, 1):
        os.makedirs(tmp / str(r), exist_ok=True)
        procs.append(ctx.Process(target=_rank, args=(r, port, str(tmp), q)))
    got = ranks.results(procs, q, 240)
    for r in (0, 1):
        assert "error" not in got[r], got[r]["error"]
    return got


def test_files_larger_than_a_chunk_travel_both_ways_in_chunks_and_check(results):
    for r in (0, 1):
        kind, (names, same), _ = results[r]["wire"]["ring"]
        assert kind == "ok" and all(same), results[r]["wire"]["ring"]
        assert names == ([".metadata", "__0_0.distcp"] if r == 1 else ["__1_0.distcp", "__1_1.distcp"])
    for r in (0, 1):  # 32 MiB each way in 1-MiB chunks: the peak grows by a few chunks and the CRC check's reads
        # (integrity.READ_CHUNK), never by a whole file (the receiver held it about 3 times before)
        kind, grew, _ = results[r]["wire"]["memory"]
        assert kind == "ok", results[r]["wire"]["memory"]
        if grew < 0:
            pytest.skip("/proc/self/clear_refs cannot reset the peak here")
        assert grew < BIG * 3 // 4, f"rank {r}'s peak memory grew by {grew >> 20} MiB for a 32-MiB file"


@pytest.mark.parametrize(
    "case,error,said",
    [
        ("count", "CheckpointError", "the peer rank 0 announced 9 files of a checkpoint whose manifest lists 4"),
        ("short", "CheckpointError", "1 files, not the 2 of the ranks this rank receives from it (missing: ['.metad"),
        ("foreign", "CheckpointError", "not theirs: ['__1_0.distcp']): refused, nothing written"),
        ("chunk", "CheckpointError", "rank 0 sends in chunks of 1001 bytes, this rank receives in chunks of 1000 "),
        ("garbage", "CorruptCheckpoint", "the CHECKSUMS sent by peer rank 0 does not match its own checksum"),
        ("escape", "CorruptCheckpoint", "'../escape'"),
        ("linked", "CorruptCheckpoint", "linked is a symbolic link"),
        ("size", "CheckpointError", "the peer rank 0 announced __0_0.distcp as 5004 bytes; the checkpoint's manifest"),
        ("index", "CheckpointError", "the peer rank 0 announced file indices [7] of a manifest of 4 files"),
        ("crc", "CorruptCheckpoint", "the file sent by peer rank 0 does not check: checkpoint "),
        ("unreadable", "CheckpointError", "the peer rank 0 could not read its checkpoint files"),
        ("manifest", "CheckpointError", "the peer rank 0 could not send the checkpoint's manifest (67108865 bytes)"),
        ("differs", "CorruptCheckpoint", "CHECKSUMS is not the one rank 0 sent"),
    ],
)
def test_a_bad_peer_is_named_by_its_receiver_and_neither_side_waits_for_the_timeout(results, case, error, said):
    kind, text, seconds = results[1]["wire"][case]
    assert kind == error and said in text, (kind, text)
    sender = results[0]["wire"][case]
    assert sender[2] < 10 and seconds < 10, (sender, seconds)  # (the group's timeout: 30 s)
    if case in ("count", "size", "index", "short", "foreign", "chunk", "garbage", "escape", "linked"):
        assert sender[:2] == ("ok", 0), sender  # (the misbehaving sender was told no, and sent nothing more)
    if case == "foreign":  # the receiver's own good file of that name was neither removed nor written
        assert results[1]["wire"]["foreign_kept"] is True
    if case in ("garbage", "escape"):  # a manifest refused is not left in the step dir (a later restore would refuse)
        assert results[1]["wire"][case + "_left"] is False
    if case == "linked":  # nothing written through the link
        assert results[1]["wire"]["linked_wrote"] == []
    if case == "unreadable":
        assert sender[0] == "FileNotFoundError" and "own0/__0_0.distcp" in sender[1], sender
    if case == "differs":
        assert sender[0] == "CheckpointError" and "the peer rank 1 refused the manifest" in sender[1], sender


def test_a_transfer_whose_read_or_write_fails_partway_drains_and_both_sides_return_naming_it(results):
    sender, receiver = results[0]["wire"]["read_fails"], results[1]["wire"]["read_fails"]
    assert sender[0] == "CorruptCheckpoint" and "Is a directory while it was sent to rank 1" in sender[1], sender
    assert receiver[0] == "CorruptCheckpoint" and "the file sent by peer rank 0 does not check" in receiver[1], receiver
    assert max(sender[2], receiver[2]) < 10, (sender, receiver)  # (the group's timeout: 30 s)
    sender, receiver = results[0]["wire"]["write_fails"], results[1]["wire"]["write_fails"]
    assert receiver[0] == "OSError" and "writing the copy from peer rank 0 into" in receiver[1], receiver
    assert "File too large" in receiver[1], receiver
    assert sender[0] == "ok" and max(sender[2], receiver[2]) < 10, (sender, receiver)  # (it hears it in the agreement)
    sender, receiver = results[0]["wire"]["no_dir"], results[1]["wire"]["no_dir"]
    assert receiver[0] == "FileExistsError" and "nodir" in receiver[1], receiver
    assert sender[0] == "CheckpointError" and "the peer rank 1 refused the files of" in sender[1], sender
    assert max(sender[2], receiver[2]) < 10, (sender, receiver)


def test_a_leaders_failed_write_stops_every_ranks_copies_and_later_saves_restore_as_the_nodes_own(results):
    a, b = results[0]["node"], results[1]["node"]
    assert a["copy4"][0] is True and b["copy4"][0] is True
    assert a["copy6"][0] is False and b["copy6"][0] is False and max(a["copy6"][1], b["copy6"][1]) < 10
    assert "its copy dir cannot be written on node b" in b["broken"] and "on another node" in a["broken"]
    assert a["copy8"][0] is False and b["copy8"][0] is False  # (copies off: no collective, no wait)
    # steps 6 and 8 were saved while copies were off: each node holds its own files of them (OWN)
    assert a["held"] == [(4, 0, "own"), (4, 1, "peer"), (6, 0, "own"), (8, 0, "own")], a["held"]
    assert b["held"] == [(4, 1, "own"), (6, 1, "own"), (8, 1, "own")], b["held"]
    # (their holdings exchanged as int64 values; node a's step 10, marked by a link, and its FIFO-marked copy of b's
    # are not held, and neither stops the restore or makes it wait)
    assert a["newest"][0] == b["newest"][0] == 8 and max(a["newest"][1], b["newest"][1]) < 10
    assert a["assemble8"][0] == b["assemble8"][0] == "local"
    assert a["whole8"] == b["whole8"] == [".metadata", "CHECKSUMS", "OWN", "__0_0.distcp", "__1_0.distcp"]
    # node b lost: its own saves of 6 and 8 are gone with it; step 4 is held (b's files in a's copy)
    assert a["newest_after_loss"][0] == b["newest_after_loss"][0] == 4


def test_a_copy_that_does_not_check_at_the_restore_falls_back_on_every_rank_together(results):
    a, b = results[0]["node"], results[1]["node"]
    assert a["assemble4"][0] is None and b["assemble4"][0] is None  # (the sender too: the durable tier next)
    assert max(a["assemble4"][1], b["assemble4"][1]) < 10
