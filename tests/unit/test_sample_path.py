"""The recipe's sample path: decode + augment + collate with little Python per sample. The augmentation draws its
shift and flip from the sample's 63-bit seed (no RNG object per sample), equals zero padding + crop (+ flip), and
covers every shift about equally; collate stacks once into uint8 (N, C, H, W) + int64 labels."""

from __future__ import annotations

import io
from collections import Counter

import numpy as np
import torch
from PIL import Image

from pitstop.parts.seed import derive_seed
from recipe.vision import ImageShards


def shards(channels: int, pad: int, hflip: bool) -> ImageShards:
    return ImageShards("unused", channels=channels, image_size=None, augment={"pad": pad, "hflip": hflip})


def encoded(array: np.ndarray, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format=fmt)
    return buf.getvalue()


def test_the_augmentation_is_padding_and_cropping_by_the_seeds_shift_and_flip():
    rng = np.random.default_rng(0)
    for channels, pad, hflip in ((1, 1, False), (3, 2, True), (3, 0, True)):
        ds = shards(channels, pad, hflip)
        x = rng.integers(1, 256, size=(channels, 5, 7), dtype=np.uint8)
        shifts, flips = Counter(), Counter()
        for k in range(4000):
            seed = derive_seed(3, 1, f"key{k}")
            got = ds._augment(x, seed)
            n = 2 * pad + 1
            dy, dx = seed % n, (seed // n) % n
            want = torch.nn.functional.pad(torch.from_numpy(x), (pad,) * 4)[:, dy : dy + 5, dx : dx + 7]
            flip = hflip and (seed >> 62) & 1
            want = want.flip(-1) if flip else want
            assert got.shape == x.shape and np.array_equal(got, want.numpy())
            shifts[dy, dx] += 1
            flips[flip] += 1
        assert len(shifts) == (2 * pad + 1) ** 2 and min(shifts.values()) > 0.7 * 4000 / len(shifts)
        if hflip:
            assert abs(flips[1] - 2000) < 200


def test_decode_and_collate_give_a_uint8_batch_and_int64_labels():
    rng = np.random.default_rng(1)
    for channels, fmt, ext in ((1, "PNG", "png"), (3, "PNG", "png"), (3, "JPEG", "jpg")):
        ds = shards(channels, 1, channels == 3)
        shape = (6, 4) if channels == 1 else (6, 4, 3)
        images = [rng.integers(0, 256, size=shape, dtype=np.uint8) for _ in range(3)]
        samples = [{"__key__": str(i), ext: encoded(a, fmt), "cls": str(i).encode()} for i, a in enumerate(images)]
        plain = [ds.decode(s, train=False, seed=0) for s in samples]
        x, y = ds.collate(plain)
        assert x.dtype == torch.uint8 and tuple(x.shape) == (3, channels, 6, 4)
        assert y.dtype == torch.int64 and y.tolist() == [0, 1, 2]
        if fmt == "PNG":  # lossless: the pixels themselves, channels first
            assert np.array_equal(x[1].numpy(), images[1][None] if channels == 1 else images[1].transpose(2, 0, 1))
        augmented = ds.collate([ds.decode(s, train=True, seed=derive_seed(0, 0, s["__key__"])) for s in samples])
        assert augmented[0].shape == x.shape
        again = ds.collate([ds.decode(s, train=True, seed=derive_seed(0, 0, s["__key__"])) for s in samples])
        assert torch.equal(augmented[0], again[0])


def test_odd_inputs_a_mislabelled_image_a_shift_beyond_the_image_and_flips_torch_can_take():
    rng = np.random.default_rng(2)
    ds = shards(3, 3, True)
    png = encoded(rng.integers(0, 256, size=(2, 2, 3), dtype=np.uint8), "PNG")
    x = ds.decode({"__key__": "k", "jpg": png, "cls": b"1"}, train=False, seed=0)[0].copy()  # PNG bytes as .jpg
    assert x.shape == (3, 2, 2)
    for k in range(64):  # pad 3 on a 2x2 image: shifts of the whole image or more leave zeros, no error
        seed = derive_seed(0, 0, f"k{k}")
        got = ds._augment(x, seed)
        n = 7
        want = torch.nn.functional.pad(torch.from_numpy(x), (3,) * 4)[:, seed % n : seed % n + 2, (seed // n) % n :]
        want = want[:, :, :2].flip(-1) if (seed >> 62) & 1 else want[:, :, :2]
        assert np.array_equal(got, want.numpy())
        assert torch.as_tensor(got).shape == (3, 2, 2)  # (no negative strides: torch takes it as it is)


def test_small_batch_tensors_travel_inline_and_come_back_as_they_were():
    # A worker's small tensors are pickled into the pipe as numpy (torch's shared memory costs a file descriptor
    # and a connection per tensor); large ones, bfloat16 and anything that is not a tensor stay as they are.
    from pitstop.data.loader.reader import Inline, from_transport, to_transport

    x, y = torch.randint(0, 255, (64, 1, 8, 8), dtype=torch.uint8), torch.arange(64)
    half, big = torch.ones(4, dtype=torch.bfloat16), torch.zeros(2 << 20, dtype=torch.uint8)
    batch = {"xy": [x, y], "pair": (half, big), "meta": "k", "arr": np.zeros(3)}
    sent = to_transport(batch, limit=1 << 20)
    assert isinstance(sent["xy"][0], Inline) and isinstance(sent["xy"][1], Inline)
    assert sent["pair"][0] is half and sent["pair"][1] is big and sent["meta"] == "k" and sent["arr"] is batch["arr"]
    import pickle

    back = from_transport(pickle.loads(pickle.dumps(sent)))
    assert type(back["xy"]) is list and type(back["pair"]) is tuple
    assert torch.equal(back["xy"][0], x) and back["xy"][0].dtype == torch.uint8
    assert torch.equal(back["xy"][1], y) and back["xy"][1].dtype == torch.int64
    assert torch.equal(back["pair"][1], big) and isinstance(back["arr"], np.ndarray)
    # what numpy cannot carry as it is keeps torch's way: sparse, conjugate views, subclasses
    sparse, conj = torch.eye(3).to_sparse(), torch.ones(2, dtype=torch.complex64).conj()
    param = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    assert all(to_transport(t) is t for t in (sparse, conj, param))


def test_decode_takes_the_first_image_key_a_sample_has_and_its_pixels_as_pil_gives_them():
    rng = np.random.default_rng(1)
    grey, rgb = rng.integers(0, 256, size=(6, 5), dtype=np.uint8), rng.integers(0, 256, size=(6, 5, 3), dtype=np.uint8)
    both = {"png": encoded(grey, "PNG"), "ppm": encoded(rgb, "PPM"), "cls": b"3"}
    only_ppm = {"ppm": encoded(rgb, "PPM"), "cls": b"4"}
    datasets = {k: ImageShards("unused", channels=1, image_size=None, image_keys=k) for k in ("png;ppm", "ppm;png")}
    for keys, sample, want in (  # (one data set per key order, in turn: the first key wins whatever came before)
        ("png;ppm", both, grey),
        ("png;ppm", only_ppm, np.asarray(Image.fromarray(rgb).convert("L"))),
        ("png;ppm", both, grey),
        ("ppm;png", only_ppm, np.asarray(Image.fromarray(rgb).convert("L"))),
        ("ppm;png", both, np.asarray(Image.fromarray(rgb).convert("L"))),
    ):
        x, _ = datasets[keys].decode(sample, train=False, seed=0)
        assert x.shape == (1, 6, 5) and x.dtype == np.uint8 and np.array_equal(x[0], want)
    ds = ImageShards("unused", channels=3, image_size=None, image_keys="ppm;png")
    x, y = ds.decode(both, train=False, seed=0)
    assert y == 3 and x.shape == (3, 6, 5) and np.array_equal(x, rgb.transpose(2, 0, 1))
