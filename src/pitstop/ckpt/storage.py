"""Storage targets for checkpoints: local files with fsync, optionally bandwidth-limited (``ckpt.throttle_mbps``:
:mod:`pitstop.ckpt.throttle`), and their sizes."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint.filesystem import FileSystem

from pitstop.ckpt.throttle import ThrottledFile


@contextmanager
def open_write(path: str | os.PathLike, throttle_mbps: float | None):
    with open(path, "wb") as raw:
        yield ThrottledFile(raw, throttle_mbps) if throttle_mbps else raw


class ThrottledFileSystem(FileSystem):
    """DCP's local FileSystem, with writes limited to ``mbps`` (picklable for process-based savers)."""

    def __init__(self, mbps: float):
        super().__init__()
        self.mbps = float(mbps)

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str):
        if "w" not in mode and "a" not in mode:
            with super().create_stream(path, mode) as s:
                yield s
            return
        with Path(path).open(mode) as raw:
            yield ThrottledFile(raw, self.mbps)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def dir_bytes(path: str) -> int:
    from pitstop import fsurl

    if fsurl.is_url(path):
        fs, p = fsurl.filesystem(path)
        try:
            fs.invalidate_cache(p)
            return int(fs.du(p, total=True))
        except (OSError, ValueError):
            return 0
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total
