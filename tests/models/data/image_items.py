"""A small image-style model and synthetic datasets for ``--dataset`` (tests/train/test_items.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, width)
        return x + self.down(torch.relu(self.up(self.norm(x))))


class ImageNet(nn.Module):
    """8x8 one-channel images -> one of ``classes``: a conv stem, MLP blocks, a head."""

    tp_rules = {"layers.*.up.*": "column", "layers.*.down.weight": "row"}

    def __init__(self, width: int = 16, depth: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 4, 3, padding=1)
        self.proj = nn.Linear(4 * 8 * 8, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, image: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        x = self.proj(torch.relu(self.stem(image)).flatten(1))  # (B, width)
        for block in self.layers:
            x = block(x)
        return F.cross_entropy(self.head(x), label)


def make(width: int = 16, depth: int = 2) -> ImageNet:
    return ImageNet(width, depth)


class Images(torch.utils.data.Dataset):
    """``count`` synthetic items ``{"image": (1, 8, 8) float32, "label": () int64}``."""

    def __init__(self, count: int, *, as_tuple: bool = False) -> None:
        g = torch.Generator().manual_seed(1234)
        self.images = torch.randn(count, 1, 8, 8, generator=g)
        self.labels = torch.randint(0, 10, (count,), generator=g)
        self.as_tuple = as_tuple

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        if self.as_tuple:
            return self.images[i], self.labels[i]
        return {"image": self.images[i], "label": self.labels[i]}


def images() -> Images:
    return Images(40)


def pairs() -> Images:
    """Tuple items ``(image, label)``: the forward takes them positionally."""
    return Images(40, as_tuple=True)


class Stream(torch.utils.data.IterableDataset):
    """An iterable (no ``__len__``): the same 24 items each time it is read."""

    def __iter__(self):
        data = Images(24)
        return iter(data[i] for i in range(len(data)))


def stream() -> Stream:
    return Stream()


def few() -> Images:
    return Images(3)


def ragged():
    data = Images(8)
    return [data[i] if i != 5 else {"image": torch.zeros(1, 8, 7), "label": 1} for i in range(8)]


def broken():
    return [{"image": torch.zeros(1, 8, 8)}][1]  # raises IndexError here


def renamed():
    """Dict items whose keys the forward does not take."""
    data = Images(8)
    return [{"pixels": data[i]["image"], "label": data[i]["label"]} for i in range(8)]


class Leaky(ImageNet):
    """Reads the image again after the blocks: a pipeline cannot pass it to both ends."""

    def forward(self, image: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        x = self.proj(torch.relu(self.stem(image)).flatten(1))
        for block in self.layers:
            x = block(x)
        return F.cross_entropy(self.head(x) + image.flatten(1)[:, :10], label)


def make_leaky() -> Leaky:
    return Leaky()


def once():
    """A generator: it cannot be read a second time."""
    data = Images(8)
    return (data[i] for i in range(8))
