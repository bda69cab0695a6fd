"""read_shard's direct walk over tar headers gives what tarfile gives: the same members, names, payloads and header
offsets for the tars that writers make (webdataset's TarWriter, tarfile's pax and ustar formats), and for anything
else (GNU long names, a truncated or corrupt tar) it hands over to tarfile, so the samples and the one-line errors
stay tarfile's."""

from __future__ import annotations

import io
import os
import random
import tarfile

import pytest
import webdataset as wds

from pitstop.data.shards import _members, _tarfile_members, read_shard
from pitstop.errors import DataError


def webdataset_tar(n: int = 12) -> bytes:
    buf = io.BytesIO()
    with wds.TarWriter(buf) as w:
        for i in range(n):
            w.write({"__key__": f"s{i:04d}", "png": os.urandom(50 + 37 * i), "cls": str(i % 3).encode()})
    return buf.getvalue()


def tarfile_tar(fmt: int) -> bytes:
    rng = random.Random(fmt)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        d = tarfile.TarInfo("dir")
        d.type = tarfile.DIRTYPE
        tf.addfile(d)
        for i in range(12):
            name = f"{'deep/' * 25 if i % 4 == 0 else 'x/'}k{i}.{'ü' if i % 3 == 0 else 'bin'}"  # long and non-ASCII
            payload = rng.randbytes(rng.randint(0, 1500))
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(payload), 1.5  # (a fractional mtime: pax writes a record for it)
            tf.addfile(info, io.BytesIO(payload))
        link = tarfile.TarInfo("lnk")
        link.type, link.linkname = tarfile.SYMTYPE, "x/k1.bin"
        tf.addfile(link)
    return buf.getvalue()


def outcome(data: bytes):
    try:
        return ("ok", _tarfile_members(data, "u"))
    except DataError as e:
        return ("error", str(e))


@pytest.mark.parametrize("kind", ["webdataset", "pax", "ustar"])
def test_the_walk_reads_what_tarfile_reads(kind):
    data = webdataset_tar() if kind == "webdataset" else tarfile_tar(getattr(tarfile, f"{kind.upper()}_FORMAT"))
    walked = _members(data)
    assert walked is not None and walked == _tarfile_members(data, "u")
    assert [s["__offset__"] for s in read_shard(data, "u")][:2] == [
        walked[0][0],
        walked[2 if kind == "webdataset" else 1][0],
    ]


def test_gnu_long_names_are_left_to_tarfile():
    data = tarfile_tar(tarfile.GNU_FORMAT)
    assert _members(data) is None
    assert [s["__key__"] for s in read_shard(data, "u")][:2] == ["deep/" * 25 + "k0", "x/k1"]


@pytest.mark.parametrize("kind", ["webdataset", "pax"])
def test_a_truncated_or_corrupt_tar_reads_as_tarfile_reads_it(kind):
    data = webdataset_tar() if kind == "webdataset" else tarfile_tar(tarfile.PAX_FORMAT)
    rng = random.Random(7)
    cuts = list(range(0, len(data), 512 * 3)) + [rng.randrange(len(data)) for _ in range(60)]
    damaged = [data[:c] for c in cuts]
    for _ in range(100):
        b = bytearray(data)
        for _ in range(3):
            b[rng.randrange(len(b))] = rng.randrange(256)
        damaged.append(bytes(b))
    for b in damaged:
        expected = outcome(b)
        walked = _members(b)
        if walked is not None:  # the walk read it: tarfile read the same, without an error
            assert expected == ("ok", walked)
        try:
            got = ("ok", [(s["__offset__"], s["__key__"]) for s in read_shard(b, "u")])
        except DataError as e:
            got = ("error", str(e))
        if expected[0] == "error":
            assert got == expected
        else:
            assert got[0] == "ok"


def test_a_negative_size_is_left_to_tarfile_instead_of_walking_backwards():
    # int(text, 8) takes a sign: a header claiming size -512 (checksum made valid) must not move the walk back
    # (it looped forever), and a pax record size=-1024 neither; tarfile then names the shard in one line.
    data = bytearray(webdataset_tar(3))
    pos = 0
    while data[pos + 156 : pos + 157] == b"x":  # the first member's own header, after its pax header
        pos += 512 + -(-int(data[pos + 124 : pos + 135], 8) // 512) * 512
    data[pos + 124 : pos + 136] = b"-0000001000\0"
    data[pos + 148 : pos + 156] = b" " * 8
    data[pos + 148 : pos + 156] = b"%06o\0 " % sum(data[pos : pos + 512])
    assert _members(bytes(data)) is None
    with pytest.raises(DataError, match="corrupt or truncated shard u"):
        read_shard(bytes(data), "u")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        info = tarfile.TarInfo("k.bin")
        info.size, info.pax_headers = 4, {"size": "-1024"}
        tf.addfile(info, io.BytesIO(b"abcd"))
    assert _members(buf.getvalue()) is None
