"""A local dir as a stand-in for a network volume (``ckpt.throttle_mbps``; no torch): every write of a checkpoint file
goes through :class:`ThrottledFile`, which sleeps so that the writer never exceeds the given rate (a token bucket over
wall-clock time), and every read of a file under a :func:`slow_volume` (a restore's checks and its load, through
:func:`pitstop.ckpt.integrity.open_regular`) through :class:`ThrottledReader` at the same rate: a volume is slow both
ways (but for a ``torch.save`` checkpoint's load, which maps its file into memory: its checks are throttled).  Used
by the benchmarks (a restore from the durable tier at a network volume's speed) and by tests that need a
save to take long enough to be killed mid-write.
"""

from __future__ import annotations

import io
import os
import time
from typing import IO


MB_CHUNK = 1 << 20  # bytes passed to the file at a time, each followed by its wait


class _Paced(io.RawIOBase):
    """A file whose bytes pass at most ``mbps`` MB/s (1 MB = 1e6 bytes): a token bucket over wall-clock time."""

    def __init__(self, raw: IO[bytes], mbps: float):
        super().__init__()
        self.raw, self.rate = raw, float(mbps) * 1e6
        self.t0, self.moved = time.monotonic(), 0

    def _pace(self, n: int) -> None:
        """``n`` more bytes passed: wait until the rate allows them."""
        self.moved += n
        ahead = self.moved / self.rate - (time.monotonic() - self.t0)
        if ahead > 0:
            time.sleep(ahead)

    def tell(self) -> int:
        return self.raw.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.raw.seek(offset, whence)

    def fileno(self) -> int:
        return self.raw.fileno()

    def seekable(self) -> bool:
        return self.raw.seekable()

    def close(self) -> None:
        if not self.raw.closed:
            self.raw.flush()  # (a writer's last bytes; nothing for a reader)
            self.raw.close()
        super().close()


class ThrottledFile(_Paced):
    """A writable file that passes bytes through at most ``mbps`` MB/s."""

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[override]
        view = memoryview(b).cast("B")
        for i in range(0, len(view), MB_CHUNK):
            part = view[i : i + MB_CHUNK]
            self.raw.write(part)
            self._pace(len(part))
        return len(view)

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()


class ThrottledReader(_Paced):
    """A readable file (seekable, as DCP's reads need) that passes bytes through at most ``mbps`` MB/s."""

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[override]
        """Fills ``b`` as a file on a disk does (a short read only at the end of the file: callers read a small file
        whole with one ``read(n)``), :data:`MB_CHUNK` at a time, each followed by its wait."""
        view, n = memoryview(b).cast("B"), 0
        while n < len(view):
            got = self.raw.readinto(view[n : n + MB_CHUNK]) or 0
            if not got:
                break
            n += got
            self._pace(got)
        return n


_SLOW: dict[str, float] = {}  # a dir's real path -> MB/s: reads of files under it are throttled (slow_volume)


def slow_volume(root: str, mbps: float | None) -> None:
    """Make ``root`` (a local dir: the durable tier with ``ckpt.throttle_mbps``) read like a network volume of
    ``mbps`` MB/s in this process (None: at full speed again); its writes are throttled where they are made."""
    key = os.path.realpath(root)
    if mbps:
        _SLOW[key] = float(mbps)
    else:
        _SLOW.pop(key, None)


def reader(path: str, raw: io.FileIO) -> io.RawIOBase:
    """``raw`` (a file opened at ``path`` for reading), throttled when it lies under a :func:`slow_volume`."""
    if _SLOW:
        where = os.path.realpath(os.path.dirname(path))
        for root, mbps in _SLOW.items():
            if where == root or where.startswith(root + os.sep):
                return ThrottledReader(raw, mbps)
    return raw
