"""The wire of the local tier's peer copy (:mod:`pitstop.ckpt.peer_copy`): a checkpoint's files between two ranks of a
dedicated gloo group, as raw bytes, in chunks.

Every transfer is a fixed sequence that both sides always finish, whatever either finds wrong, so a sender never
waits for gloo's timeout on a receiver that gave up:

1. a header of fixed size (``2 + 2 * files in the manifest`` int64, known to both from the manifest they share):
   how many files, their indices in the manifest and their sizes (``-1`` files: the sender cannot read its own), and
   the sender's chunk size;
2. the receiver's answer (1: send, 0: refused), after it checked the header against the manifest and against what it
   expects of that sender (exactly the files of the ranks it holds for: none missing, none more; each size the
   manifest's; the same chunk size as its own) and opened the files it will write: nothing is allocated, removed or
   written before that, and a refused sender sends nothing more;
3. the bytes, in chunks of at most :data:`CHUNK` (a sender reads each chunk into one buffer, a receiver receives
   into one buffer and appends to the file: two chunks in memory however large a shard); a receiver that cannot
   write a chunk goes on receiving the rest;
4. each received file checked (length and CRC32C, :func:`pitstop.ckpt.integrity.check_file`).

A rank that both sends and receives (the ring) posts each step's send and receive together, so the ring never waits
on itself.  The findings (:class:`CheckpointError`, :class:`CorruptCheckpoint`, OSError) are raised once the
transfer is over, naming the peer rank.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from pitstop.ckpt import integrity, peer
from pitstop.errors import CheckpointError, CorruptCheckpoint

CHUNK = 32 << 20  # bytes per message of a file's bytes: what each side holds of a file at a time
FINDINGS = (CorruptCheckpoint, CheckpointError, OSError)  # what a transfer can find wrong (gloo's own errors stop it)
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _pair(send: torch.Tensor | None, to: int | None, recv: torch.Tensor | None, of: int | None, group) -> None:
    """Send ``send`` to ``to`` and receive ``recv`` from ``of`` at once (either None: not that side)."""
    works = []
    if send is not None and to is not None:
        works.append(dist.isend(send, to, group=group))
    if recv is not None and of is not None:
        works.append(dist.irecv(recv, of, group=group))
    for w in works:
        w.wait()


def one_int(value: int | None, to: int | None, of: int | None, group) -> int:
    """Send ``value`` to ``to`` and receive one int64 from ``of``; what was received (0 when none)."""
    got = torch.zeros(1, dtype=torch.int64)
    _pair(None if value is None else torch.tensor([value], dtype=torch.int64), to, got, of, group)
    return int(got)


def sent_by(files: dict[str, dict], ranks: list[int]) -> list[str]:
    """The files of a manifest that a transfer of ``ranks``' files carries (the manifest itself travels before)."""
    return [n for n in peer.files_of(sorted(files), ranks) if n != integrity.MANIFEST]


def check_head(
    head: list[int], files: dict[str, dict], of: int, expect: list[str], chunk: int
) -> list[tuple[str, int]]:  # fmt: skip
    """The files (name, bytes) that header ``head`` announces, checked against the manifest ``files`` and the files
    ``expect``-ed of that sender; a CheckpointError naming peer rank ``of`` for a count, an index or a size that is
    not the manifest's, a set of files that is not exactly ``expect`` (a copy cut short would count as whole; a file
    this rank holds would be replaced), or a chunk size that is not ``chunk``."""
    names, total = sorted(files), len(files)
    n = head[0]
    if n == -1:
        raise CheckpointError(f"the peer rank {of} could not read its checkpoint files (its log says why)")
    if not 0 <= n <= total:
        raise CheckpointError(f"the peer rank {of} announced {n} files of a checkpoint whose manifest lists {total}")
    if head[-1] != chunk:
        raise CheckpointError(
            f"the peer rank {of} sends in chunks of {head[-1]} bytes, this rank receives in chunks of {chunk} "
            f"(peer_wire.CHUNK): run the same pitstop on every node"
        )
    index, sizes = head[1 : 1 + n], head[1 + total : 1 + total + n]
    if len(set(index)) != n or any(not 0 <= i < total for i in index):
        raise CheckpointError(
            f"the peer rank {of} announced file indices {index[:8]} of a manifest of {total} files (out of range or "
            f"twice): not a checkpoint of this job"
        )
    named = {names[i] for i in index}
    if named != set(expect):
        missing, more = sorted(set(expect) - named), sorted(named - set(expect))
        raise CheckpointError(
            f"the peer rank {of} announced {n} files, not the {len(expect)} of the ranks this rank receives from it "
            f"(missing: {missing[:4]}, not theirs: {more[:4]}): refused, nothing written"
        )
    out = []
    for i, size in zip(index, sizes):
        if size != files[names[i]]["bytes"]:
            raise CheckpointError(
                f"the peer rank {of} announced {names[i]} as {size} bytes; the checkpoint's manifest says "
                f"{files[names[i]]['bytes']}"
            )
        out.append((names[i], size))
    return out


def _chunks(sizes: list[int], chunk: int) -> list[tuple[int, int]]:
    """(file, length) of every message of files of ``sizes``, in order."""
    return [(i, min(chunk, size - at)) for i, size in enumerate(sizes) for at in range(0, size, chunk)]


def _fill(f, view: memoryview) -> int:
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def exchange(
    group, src: str, files: dict[str, dict], ranks: list[int], to: int | None, dst: str, of: int | None,
    expect: list[int], chunk: int = CHUNK,
) -> None:  # fmt: skip
    """Send the files of ``src`` written by ``ranks`` to rank ``to`` and receive rank ``of``'s into ``dst`` (either
    side None: none), checked against the manifest ``files`` that both sides hold: ``of`` must send exactly the files
    written by ranks ``expect``."""
    names, total = sorted(files), len(files)
    width = 2 + 2 * total
    readers, writers, mine, problem = [], [], None, None
    try:
        out = None
        sizes_out: list[int] = []
        if to is not None:
            out = torch.full((width,), -1, dtype=torch.int64)
            sent = sent_by(files, ranks)
            try:
                for name in sent:
                    readers.append(integrity.open_regular(os.path.join(src, name)))
                    size = os.fstat(readers[-1].fileno()).st_size
                    if size != files[name]["bytes"]:
                        raise CorruptCheckpoint(
                            f"checkpoint {src} is corrupt: {name} is {size} bytes, its manifest: {files[name]['bytes']}"
                        )
                sizes_out = [files[n]["bytes"] for n in sent]
                out[0] = len(sent)
                out[1 : 1 + len(sent)] = torch.tensor([names.index(n) for n in sent], dtype=torch.int64)
                out[1 + total : 1 + total + len(sent)] = torch.tensor(sizes_out, dtype=torch.int64)
                out[-1] = chunk
            except FINDINGS as e:
                mine, sizes_out = e, []
                out.fill_(-1)
        got = torch.zeros(width, dtype=torch.int64) if of is not None else None
        _pair(out, to, got, of, group)
        coming: list[tuple[str, int]] = []
        if got is not None:
            try:
                coming = check_head(got.tolist(), files, of, sent_by(files, expect), chunk)
                os.makedirs(dst, mode=0o700, exist_ok=True)
                for name, _ in coming:  # (a name that is a link to another file is replaced, never written through)
                    there = os.path.join(dst, name)
                    if os.path.lexists(there):
                        os.remove(there)
                    writers.append(os.open(there, _CREATE, 0o600))
            except FINDINGS as e:
                problem, coming = e, []
        answer = one_int(None if of is None else int(problem is None), of, to, group)
        if to is not None and not answer:
            sizes_out = []  # (refused: nothing more to send)
        short = _stream(group, readers, sizes_out, to, writers, [s for _, s in coming], of, chunk)
        for fd in writers:  # (as durable as the marker written after it; a failure drops the copy)
            try:
                os.fsync(fd)
            except OSError as e:
                short = (short[0], short[1] or str(e))
        while writers:  # (each fd leaves the list before it is closed: the finally never closes one twice)
            os.close(writers.pop())
        if problem is None and short[1] is not None:
            problem = OSError(f"writing the copy from peer rank {of} into {dst}: {short[1]}")
        for name, _ in coming if problem is None else []:
            try:
                integrity.check_file(dst, name, files[name])
            except CorruptCheckpoint as e:
                problem = CorruptCheckpoint(f"the file sent by peer rank {of} does not check: {e}")
                break
    finally:
        for f in readers:
            f.close()
        while writers:
            os.close(writers.pop())
    if problem is not None:
        raise problem
    if mine is not None:
        raise mine
    if short[0] is not None:
        raise CorruptCheckpoint(f"checkpoint {src}: {short[0]} while it was sent to rank {to}")
    if to is not None and not answer:
        raise CheckpointError(f"the peer rank {to} refused the files of {src} (its log says why)")


def _stream(
    group, readers: list, sizes_out: list[int], to: int | None, writers: list[int], sizes_in: list[int],
    of: int | None, chunk: int,
) -> tuple[str | None, str | None]:  # fmt: skip
    """The bytes both ways, chunk by chunk; (what went wrong reading, what went wrong writing), each None when
    nothing did.  A short read sends zeros (the receiver's CRC check then fails), a failed write drops the rest
    of what is received: either way every announced byte travels."""
    out, into = _chunks(sizes_out, chunk), _chunks(sizes_in, chunk)
    send_buf = bytearray(max((n for _, n in out), default=0))
    send_all = torch.frombuffer(send_buf, dtype=torch.uint8) if send_buf else None
    recv_all = torch.empty(max((n for _, n in into), default=0), dtype=torch.uint8)
    recv_view = memoryview(recv_all.numpy())
    read_bad = write_bad = None
    for k in range(max(len(out), len(into))):
        send = recv = None
        if k < len(out):
            i, n = out[k]
            view = memoryview(send_buf)[:n]
            got = 0
            try:
                got = _fill(readers[i], view) if read_bad is None else 0
            except OSError as e:  # (an unreadable disk: the rest is sent as zeros)
                read_bad = str(e)
            if got < n:
                view[got:] = bytes(n - got)
                read_bad = read_bad or f"a file ended {n - got} bytes early"
            send = send_all[:n]
        if k < len(into):
            recv = recv_all[: into[k][1]]
        _pair(send, to, recv, of, group)
        if recv is not None and write_bad is None:
            i, n = into[k]
            try:
                view = recv_view[:n]
                while view:
                    view = view[os.write(writers[i], view) :]
            except OSError as e:
                write_bad = str(e)
    return read_bad, write_bad


def send_step(group, src: str, ranks: list[int], to: int, chunk: int = CHUNK) -> None:
    """The manifest of checkpoint dir ``src`` and the files of ``ranks`` to rank ``to`` (a restore's transfer): the
    manifest's size, the receiver's answer, its bytes, its answer, then :func:`exchange`."""
    data, files, mine = b"", {}, None
    try:
        data = integrity.read_file(os.path.join(src, integrity.MANIFEST), integrity.MANIFEST_MAX)
        files = integrity.read_manifest(src)
    except FINDINGS as e:
        data, mine = b"", e
    if not one_int(len(data), to, to, group):
        if mine is not None:
            raise mine
        raise CheckpointError(f"the peer rank {to} refused the manifest of {src} (its log says why)")
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    _pair(buf, to, None, None, group)
    if not one_int(None, None, to, group):
        raise CheckpointError(f"the peer rank {to} refused the manifest of {src} (its log says why)")
    exchange(group, src, files, ranks, to, src, None, [], chunk)


def recv_step(group, dst: str, of: int, ranks: list[int], chunk: int = CHUNK) -> None:
    """Receive what :func:`send_step` sends into checkpoint dir ``dst``: the manifest (kept if ``dst`` has none; one
    that differs from ``dst``'s own is refused; ``dst`` must be a dir of its own, not a link; the manifest is checked
    from the bytes received before it is written, and removed again when it does not read back as a manifest), then
    the files of ``ranks``, checked against it."""
    size = one_int(None, None, of, group)
    ok = 0 < size <= integrity.MANIFEST_MAX
    one_int(int(ok), of, None, group)
    if not ok:
        raise CheckpointError(f"the peer rank {of} could not send the checkpoint's manifest ({size} bytes)")
    buf = torch.empty(size, dtype=torch.uint8)
    _pair(None, None, buf, of, group)
    problem, files, wrote = None, {}, False
    have = os.path.join(dst, integrity.MANIFEST)
    try:
        if os.path.lexists(dst):
            integrity.check_dir(dst)  # (a link: never written through)
        data = buf.numpy().tobytes()
        integrity.unseal(data, dst, f"the {integrity.MANIFEST} sent by peer rank {of}")
        os.makedirs(dst, mode=0o700, exist_ok=True)
        if os.path.lexists(have) and integrity.read_file(have, integrity.MANIFEST_MAX) != data:
            raise CorruptCheckpoint(f"checkpoint {dst}: its {integrity.MANIFEST} is not the one rank {of} sent")
        if not os.path.lexists(have):
            integrity.write_durable(dst, integrity.MANIFEST, data, sync_dir=False)
            wrote = True
        files = integrity.read_manifest(dst)
    except FINDINGS as e:
        problem = e
        if wrote:  # (a manifest that does not read back must not stay: a later restore of this step would refuse)
            try:
                os.remove(have)
            except OSError:
                pass
    one_int(int(problem is None), of, None, group)
    if problem is not None:
        raise problem
    exchange(group, dst, files, [], None, dst, of, ranks, chunk)
