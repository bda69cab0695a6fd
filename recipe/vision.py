"""Image-specific pieces of the recipe: shard decoding + augmentation, models, accuracy."""

from __future__ import annotations

import functools
import io

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch import nn

from pitstop.data.dataset import ShardedDataset
from pitstop.errors import ConfigError, DataError

IMAGE_EXTS = ("png", "jpg", "jpeg", "webp", "bmp", "ppm")
_FORMATS = {"png": ["PNG"], "jpg": ["JPEG"], "jpeg": ["JPEG"], "webp": ["WEBP"], "bmp": ["BMP"], "ppm": ["PPM"]}


class ImageShards(ShardedDataset):
    """Image + class-label shards (``KEY.png|jpg`` and ``KEY.cls``), as ``recipe.prepare`` writes them or any
    webdataset shards (``image_keys``: the image member's extensions, first found wins; ``label_key``: the
    label's, an integer as text)."""

    def __init__(
        self,
        root: str,
        name: str = "digits",
        num_classes: int = 10,
        channels: int = 3,
        image_size: int | None = None,
        mean=None,
        std=None,
        augment: dict | None = None,
        image_keys: str | list = IMAGE_EXTS,
        label_key: str = "cls",
        skip_corrupt: bool = False,
        record_sample_ids: bool = False,
    ):
        super().__init__(root, name, skip_corrupt=skip_corrupt, record_sample_ids=record_sample_ids)
        keys = image_keys.split(";") if isinstance(image_keys, str) else list(image_keys)
        self.image_keys, self.label_key = tuple(k.strip().lower() for k in keys if k.strip()), str(label_key)
        self.num_classes, self.channels, self.image_size = int(num_classes), int(channels), image_size
        self.mean = torch.tensor(list(mean or [0.5] * self.channels)).view(-1, 1, 1)
        self.std = torch.tensor(list(std or [0.5] * self.channels)).view(-1, 1, 1)
        augment = dict(augment or {})
        self.pad, self.hflip = int(augment.get("pad", 0)), bool(augment.get("hflip", False))
        self._mode = "L" if self.channels == 1 else "RGB"
        self.prepare_hint = f"python -m recipe.prepare data={name} data.root={root}"

    def decode(self, sample: dict, *, train: bool, seed: int) -> tuple[np.ndarray, int]:
        """One sample as a (C, H, W) uint8 array (read-only when not augmented: copy it before writing to it) and
        its label. Little Python per sample: PIL decodes (told the format), a conversion only when the mode
        differs, the pixels taken as bytes (``np.asarray`` of a PIL image makes the same copy through its array
        interface, ~4 us slower per call), the augmentation draws its offsets from ``seed`` itself (no RNG object
        per sample) and writes the shifted image into a zeroed array; :meth:`collate` makes the batch tensor
        once, so no per-sample tensors."""
        first = self.image_keys[0]
        ext = first if first in sample else self.image_member(sample)
        try:
            img = Image.open(io.BytesIO(sample[ext]), formats=_FORMATS.get(ext))  # (no probing of other formats)
        except UnidentifiedImageError:  # a member named for another format (PNG bytes in .jpg): PIL's probing
            img = Image.open(io.BytesIO(sample[ext]))
        mode = self._mode
        if img.mode != mode:
            img = img.convert(mode)
        if self.image_size and img.size != (self.image_size, self.image_size):
            img = img.resize((self.image_size, self.image_size), Image.BILINEAR)
        w, h = img.size
        x = np.frombuffer(img.tobytes(), np.uint8)  # (L: 1 byte per pixel, RGB: 3)
        x = x.reshape(1, h, w) if mode == "L" else x.reshape(h, w, 3).transpose(2, 0, 1)  # (a view)
        if train and (self.pad or self.hflip):
            x = self._augment(x, seed)
        return x, self.label(sample)  # uint8: 4x less to move from workers and to the device than float32

    def collate(self, items: list) -> list[torch.Tensor]:
        """A batch from decoded samples: one stack into uint8 ``(N, C, H, W)`` and one label tensor."""
        xs = np.stack([x for x, _ in items])
        return [torch.from_numpy(xs), torch.tensor([y for _, y in items], dtype=torch.int64)]

    def image_member(self, sample: dict) -> str:
        """The extension of the sample's image (the first of ``image_keys`` it has)."""
        ext = next((e for e in self.image_keys if e in sample), None)
        if ext is None:
            raise ValueError(
                f"no image member {'/'.join(self.image_keys)} (has "
                f"{sorted(k for k in sample if not k.startswith('__'))}; set data.image_keys)"
            )
        return ext

    def label(self, sample: dict) -> int:
        raw = sample.get(self.label_key)
        if raw is None:
            raise ValueError(
                f"no label member .{self.label_key} (has "
                f"{sorted(k for k in sample if not k.startswith('__'))}; set data.label_key)"
            )
        try:
            label = int(raw.decode().strip())
        except ValueError:
            raise ValueError(f"label .{self.label_key} is {raw[:20]!r}, not an integer") from None
        if not 0 <= label < self.num_classes:
            raise ValueError(f"label {label} outside [0, {self.num_classes}): set data.num_classes")
        return label

    def check(self, url: str, key: str, sample: dict) -> None:
        """While indexing existing shards: every sample has an image and a label in range."""
        try:
            self.image_member(sample)
            self.label(sample)
        except ValueError as e:
            raise DataError(f"shard {url}, sample {key!r}: {e}") from None

    def on_device(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        x = (x.float().div_(255.0) - self.mean.to(x.device)) / self.std.to(x.device)
        return x, y

    def _augment(self, x: np.ndarray, seed: int) -> np.ndarray:
        """Random translation by up to ``pad`` pixels (zero pad + crop) and, with ``hflip``, a horizontal flip
        half the time. The draws are digits of the sample's 63-bit ``seed`` (a hash of run seed, epoch and key):
        the same after any restart and whichever worker reads the sample."""
        if self.pad:
            n = 2 * self.pad + 1
            out = np.zeros(x.shape, dtype=x.dtype)
            dst, src = _shift(seed % n - self.pad, (seed // n) % n - self.pad, *x.shape[1:])
            out[dst] = x[src]
            x = out
        if self.hflip and (seed >> 62) & 1:  # (of a contiguous copy: a flip of the transposed view is numpy's
            x = np.ascontiguousarray(x)[:, :, ::-1].copy()  # slow path; and no negative strides for torch)
        return x


@functools.lru_cache(maxsize=1024)
def _shift(dy: int, dx: int, h: int, w: int) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
    """The slices of a shift by (dy, dx) with zero fill: ``out[dst] = x[src]`` makes ``out[i, j] = x[i + dy, j + dx]``
    where that pixel exists (the pad + crop of ``pad`` pixels, without the padded copy)."""
    dy, dx = max(-h, min(h, dy)), max(-w, min(w, dx))  # (a shift by the whole size or more leaves only zeros)
    dst = (slice(None), slice(max(0, -dy), h - max(0, dy)), slice(max(0, -dx), w - max(0, dx)))
    src = (slice(None), slice(max(0, dy), h + min(0, dy)), slice(max(0, dx), w + min(0, dx)))
    return dst, src


class GlobalAvgPool(nn.Module):
    """(N, C, H, W) -> (N, C): the mean over height and width. Bitwise what ``AdaptiveAvgPool2d(1)`` + ``Flatten``
    compute (the same mean kernel, forward and backward), but a tensor of its own, not a view: a unit under FSDP2
    that returns a view makes it warn (an in-place op on the view would skip the unit's pre-backward all-gather)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean((-2, -1))


class SmallCNN(nn.Module):
    """A compact conv net; adaptive pooling makes it work for any input size (8x8 digits and up)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 32, dropout: float = 0.1):
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)
            )

        self.features = nn.Sequential(
            block(in_channels, width),
            block(width, 2 * width),
            nn.MaxPool2d(2),
            block(2 * width, 4 * width),
            GlobalAvgPool(),
        )
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(4 * width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def resnet18(num_classes: int = 10, in_channels: int = 3) -> nn.Module:
    """torchvision's ResNet-18 from scratch (no pretrained weights); a 1-channel stem when asked."""
    import torchvision

    model = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    if in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model


def torchvision_model(
    name: str, num_classes: int = 10, in_channels: int = 3, image_size: int | None = None, **kwargs
) -> nn.Module:
    """Any torchvision classification model by name (``resnet50``, ``vit_b_16``, ``convnext_tiny``,
    ``efficientnet_b0``, ...), from scratch (never downloads weights), with ``num_classes`` outputs and its
    first convolution adapted to ``in_channels``; ``kwargs`` go to the model's builder."""
    import torchvision

    names = torchvision.models.list_models(module=torchvision.models)  # the classifiers only
    if name not in names:
        import difflib

        near = difflib.get_close_matches(str(name), names, n=4, cutoff=0.5) or [
            "resnet50",
            "vit_b_16",
            "convnext_tiny",
            "efficientnet_b0",
        ]
        raise ConfigError(
            f"model.name={name!r} is not a torchvision classification model; e.g. {', '.join(near[:6])} "
            f"(all {len(names)}: torchvision.models.list_models(module=torchvision.models))"
        )
    kw = {"weights": None, "num_classes": int(num_classes), **kwargs}
    if name.startswith("vit_"):  # a ViT's positional embedding is sized for one input size
        patch = int(name.rsplit("_", 1)[1])
        if not image_size or image_size % patch:
            raise ConfigError(
                f"model.name={name} needs data.image_size divisible by its patch size {patch} "
                f"(got {image_size}); e.g. data=synthetic data.image_size=224"
            )
        kw["image_size"] = int(image_size)
    model = torchvision.models.get_model(name, **kw)
    if in_channels != 3:
        _adapt_stem(model, int(in_channels), name)
    return model


def _adapt_stem(model: nn.Module, in_channels: int, name: str) -> None:
    """Replace the first convolution (the one that reads the image) by one with ``in_channels`` inputs."""
    path, conv = next(((n, m) for n, m in model.named_modules() if isinstance(m, nn.Conv2d)), (None, None))
    if conv is None or conv.in_channels != 3 or conv.groups != 1:
        raise ConfigError(
            f"model.name={name}: found no 3-channel input convolution to adapt to "
            f"in_channels={in_channels}; use 3-channel data (data.channels=3)"
        )
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(
        parent,
        attr,
        nn.Conv2d(
            in_channels,
            conv.out_channels,
            conv.kernel_size,
            conv.stride,
            conv.padding,
            conv.dilation,
            1,
            conv.bias is not None,
            conv.padding_mode,
        ),
    )


def top1_correct(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Number of samples whose arg-max class is the target (summed by the evaluator into accuracy)."""
    return (outputs.argmax(dim=1) == targets).sum()


def topk_correct(outputs: torch.Tensor, targets: torch.Tensor, k: int = 5) -> torch.Tensor:
    """Number of samples whose target is among the ``k`` highest scores (all of them when there are <= k classes)."""
    k = min(int(k), outputs.shape[1])
    return (outputs.topk(k, dim=1).indices == targets.unsqueeze(1)).any(dim=1).sum()
