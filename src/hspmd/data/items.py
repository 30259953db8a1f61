"""Batches of any items: a user's dataset (``--dataset FILE.py:FACTORY``), collated by step.

The factory returns a map-style dataset (``__len__`` and ``__getitem__``: index -> item) or
an iterable of items. An item is a tensor, a tuple of tensors, or a dict of name -> tensor
(a Python number counts as a 0-d tensor). Its tensors are the *fields* of the batch, named
``input`` (one tensor), ``input0``, ``input1``.. (a tuple) or by their keys (a dict); a
field's global batch stacks the items' tensors on a new dim 0::

    item {"image": (1, 8, 8) float32, "label": () int64}  x 6  ->  image (6, 1, 8, 8), label (6,)

Order (DESIGN decision 17): global batch ``g`` (pass ``j`` of step ``k``: ``g = (k - 1) *
grad_accum + j``) takes positions ``g * G .. (g + 1) * G - 1`` of an endless sequence of
items; a map-style dataset of ``N`` items visits them, epoch ``e = position // N`` after
epoch, in the order ``torch.randperm(N)`` draws from a generator seeded by ``(seed, e)``. An
iterable is read in its own order, again from its start when it ends (it must give the
same items each time). So a batch depends on the seed and its number only: every strategy,
switch, recovery and resume reads the reference's.

>>> layout = ItemLayout.of({"image": torch.zeros(1, 2, 2), "label": 3})
>>> print(layout)
dict: image (1, 2, 2) float32, label () int64
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from hspmd.data.errors import DataError
from hspmd.userfiles import import_file, user_frame

__all__ = ["FieldSpec", "ItemLayout", "UserDataset", "open_dataset"]

Structure = Literal["tensor", "tuple", "dict"]


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """One tensor of an item: its name, its shape in one item, its dtype (``float32``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __str__(self) -> str:
        return f"{self.name} ({', '.join(map(str, self.shape))}{',' * (len(self.shape) == 1)}) {self.dtype}"


@dataclass(frozen=True, slots=True)
class ItemLayout:
    """The structure of every item: a tensor, a tuple or a dict, and its fields in order."""

    structure: Structure
    fields: tuple[FieldSpec, ...]

    @staticmethod
    def of(item: Any, *, where: str = "item 0") -> ItemLayout:
        """The layout of one item (DataError: an item hspmd cannot collate)."""
        structure, named = _named(item, where)
        fields = tuple(
            FieldSpec(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))
            for name, t in named
        )
        return ItemLayout(structure, fields)

    def flatten(self, item: Any, where: str) -> tuple[torch.Tensor, ...]:
        """The item's tensors in field order, checked against this layout (one line)."""
        structure, named = _named(item, where)
        names = [n for n, _ in named]
        if structure != self.structure or names != [f.name for f in self.fields]:
            raise DataError(
                f"--dataset: {where} is a {structure} of {names}, item 0 a {self.structure} "
                f"of {[f.name for f in self.fields]}: give every item the same structure"
            )
        for spec, (_, t) in zip(self.fields, named, strict=True):
            dtype = str(t.dtype).removeprefix("torch.")
            if tuple(t.shape) != spec.shape or dtype != spec.dtype:
                raise DataError(
                    f"--dataset: {where}'s {spec.name} is {list(t.shape)} {dtype}, item 0's "
                    f"{list(spec.shape)} {spec.dtype}: give every item the same shape and "
                    "dtype (pad or resize in the dataset)"
                )
        return tuple(t for _, t in named)

    def __str__(self) -> str:
        return f"{self.structure}: {', '.join(map(str, self.fields))}"


def _named(item: Any, where: str) -> tuple[Structure, list[tuple[str, torch.Tensor]]]:
    if isinstance(item, Mapping):
        return "dict", [(str(k), _tensor(v, f"{where}[{k!r}]")) for k, v in item.items()]
    if isinstance(item, tuple | list):
        return "tuple", [(f"input{i}", _tensor(v, f"{where}[{i}]")) for i, v in enumerate(item)]
    return "tensor", [("input", _tensor(item, where))]


def _tensor(value: Any, where: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, bool | int | float):
        return torch.as_tensor(value)
    raise DataError(
        f"--dataset: {where} is a {type(value).__name__}: an item holds tensors (a tensor, a "
        "tuple or a dict of tensors; numbers count as 0-d tensors), not nested structures"
    )


@dataclass(eq=False)
class UserDataset:
    """A user's dataset, opened: its items by position (module docstring)."""

    source: str
    items: Any
    length: int | None  # None: an iterable
    layout: ItemLayout
    _stream: Iterator[Any] | None = field(default=None, repr=False)
    _at: int = 0  # the position of the stream's next item
    # ranks draw the next steps on a worker thread (hspmd.train.loop): one reader at a time
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def batch(self, number: int, *, size: int, seed: int) -> tuple[torch.Tensor, ...]:
        """Global batch ``number`` (0, 1, ..) of ``size`` items, one stacked tensor per field."""
        positions = range(number * size, (number + 1) * size)
        flat = [self.layout.flatten(*self._item(p, seed)) for p in positions]
        return tuple(torch.stack(column) for column in zip(*flat, strict=True))

    def check_step(self, rows: int, *, seed: int = 0) -> None:
        """One line if the dataset holds fewer than ``rows`` items (one step), or if the
        items of the first step do not collate (structure, shape, dtype)."""
        if self.length is not None and self.length < rows:
            raise DataError(
                f"--dataset {self.source}: {self.length} items, fewer than one step's {rows} "
                "(--global-batch x --grad-accum): give more items or a smaller batch"
            )
        if self.length is None:
            count = sum(1 for _ in zip(range(rows), iter(self.items), strict=False))
            if count < rows:
                raise DataError(
                    f"--dataset {self.source}: the iterable gives {count} items, fewer than "
                    f"one step's {rows} (--global-batch x --grad-accum): give more items or "
                    "a smaller batch"
                )
        self.batch(0, size=rows, seed=seed)  # the first step's items, as the run reads them

    def _item(self, position: int, seed: int) -> tuple[Any, str]:
        """The item at ``position`` of the order, and its name for errors."""
        if self.length is None:
            return self._next(position), f"item {position}"
        epoch, place = divmod(position, self.length)
        index = int(_order(self.length, _epoch_seed(seed, epoch))[place])
        return self.items[index], f"item {index}"

    def _next(self, position: int) -> Any:
        """The iterable's item at ``position``, read on from the last one asked for."""
        with self._lock:
            return self._read(position)

    def _read(self, position: int) -> Any:
        if self._stream is None or position < self._at:
            self._stream, self._at = iter(self.items), 0
        fresh = self._at == 0  # nothing read from the stream since it (re)started
        while True:
            try:
                item = next(self._stream)
            except StopIteration:
                if fresh:
                    raise DataError(
                        f"--dataset {self.source}: the iterable gave no item when read "
                        f"{'again' if self._at else 'first'}: return one that can be read "
                        "more than once (a list, a Dataset, a class with __iter__), not a "
                        "generator"
                    ) from None
                self._stream, fresh = iter(self.items), True  # the next epoch: from its start
                continue
            fresh = False
            self._at += 1
            if self._at - 1 == position:
                return item


def _epoch_seed(seed: int, epoch: int) -> int:
    digest = hashlib.sha256(f"hspmd.items/{seed}/{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@functools.lru_cache(maxsize=4)
def _order(length: int, seed: int) -> torch.Tensor:
    return torch.randperm(length, generator=torch.Generator().manual_seed(seed))


# -- opening a factory ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def open_dataset(source: str) -> UserDataset:
    """Call the factory ``source`` names (``FILE.py:FUNCTION`` or ``package.module:FUNCTION``)
    and read its first item's layout; DataError (one line) if it cannot."""
    factory = _factory(source)
    try:
        items = factory()
        length = len(items) if hasattr(items, "__getitem__") and hasattr(items, "__len__") else None
        if length is None and not isinstance(items, Iterable):
            raise DataError(
                f"--dataset {source}: the factory returned a {type(items).__name__}: return a "
                "map-style dataset (__len__, __getitem__) or an iterable of items"
            )
        if length is None and iter(items) is items:
            raise DataError(
                f"--dataset {source}: the factory returned an iterator ({type(items).__name__}), "
                "which can be read once only: return something that can be read more than "
                "once (a list, a Dataset, a class with __iter__)"
            )
        if length == 0:
            raise DataError(f"--dataset {source}: the dataset is empty")
        first = items[0] if length is not None else next(iter(items), None)
    except DataError:
        raise
    except Exception as error:
        where = user_frame(error)
        raise DataError(
            f"--dataset {source}: the factory raised {type(error).__name__}: {error}"
            f"{f' at {where}' if where else ''}"
        ) from error
    if first is None:
        raise DataError(f"--dataset {source}: the iterable gave no item")
    return UserDataset(source, items, length, ItemLayout.of(first))


def _factory(source: str) -> Any:
    where, sep, attr = source.rpartition(":")
    if not sep or not where or not attr:
        raise DataError(
            f"--dataset {source!r}: name a factory as FILE.py:FUNCTION or package.module:FUNCTION"
        )
    try:
        module = (
            _load_file(Path(where)) if where.endswith(".py") else importlib.import_module(where)
        )
    except DataError:
        raise
    except Exception as error:
        at = user_frame(error)
        raise DataError(
            f"--dataset {source}: {where} failed to import: {error!r}{f' at {at}' if at else ''}"
        ) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise DataError(f"--dataset {source!r}: {where} has no callable {attr!r}")
    return factory


def _load_file(path: Path) -> Any:
    path = path.expanduser().resolve()
    if not path.is_file():
        raise DataError(f"--dataset: no file {path}: give the path of a Python file")
    return import_file(path, "hspmd_data_")
