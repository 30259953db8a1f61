"""The values of a recorded initialization (``hspmd.models.record``): whole, or one slice.

``Replay(recording, seed).value(name, region)`` computes parameter ``name``'s box
``region`` (``((start, stop), ...)`` per dim; None: the whole tensor) from the ops the
factory ran, on the CPU, and nothing else of the model. Random fills are counter-based: the
element at flat index ``i`` of draw ``d`` is a function of ``(seed, d, i)`` (SplitMix64 of
the index, keyed by a hash of seed and draw; a normal value is the normal quantile of
the uniform one, ``sqrt(2) erfinv(2u - 1)``), so a slice computed alone equals the same
slice of the whole tensor::

    >>> from torch import nn
    >>> from hspmd.models.record import record
    >>> replay = Replay(record(lambda: nn.Linear(6, 4)), seed=0)
    >>> whole = replay.value("weight")
    >>> bool((replay.value("weight", ((1, 3), (2, 6))) == whole[1:3, 2:6]).all())
    True

Two paths. A tensor made by ``empty``/``zeros``/``ones``/``full``/``randn``/``rand`` and
then only filled (``normal_``, ``uniform_``, ``fill_``, ``zero_``) or changed element-wise
by scalars (``mul_``, ``erfinv_``, ``clamp_``: ``trunc_normal_``) is computed on the slice
alone: a rank holds nothing of it beyond its shard. Anything else (a write to a view, such
as an embedding's padding row; ``copy_`` from another tensor; ``orthogonal_``) is replayed
whole, one tensor at a time, then sliced. Other random ops (``bernoulli_``, ``randperm``)
draw from torch's generator seeded by (seed, draw).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_map

from hspmd.errors import HspmdError
from hspmd.models.record import Recording, TensorRef, ViewStep, Write

__all__ = ["Region", "Replay", "ReplayError", "unit_values"]

Region = tuple[tuple[int, int], ...]
CPU = torch.device("cpu")
_CHUNK = 1 << 20  # elements drawn per numpy pass (bounds the temporaries)
_MEMO_LIMIT = 1 << 16  # storages read by other ops (RoPE tables) are kept up to this size

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


class ReplayError(HspmdError, ValueError):
    """A recorded initialization that cannot be replayed (an ``out=`` write, say)."""


def _key(seed: int, draw: int) -> np.uint64:
    digest = hashlib.blake2b(f"hspmd-init:{seed}:{draw}".encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(digest, "little"))


def unit_values(key: np.uint64, index: np.ndarray) -> np.ndarray:
    """Uniform float64 values in (0, 1), one per (key, index): SplitMix64's finalizer
    (in place on a copy of ``index``: one temporary of its size).

    >>> unit_values(_key(0, 0), np.arange(3, dtype=np.uint64)).round(4).tolist()
    [0.4889, 0.5336, 0.8266]
    """
    z = index.astype(np.uint64)
    z *= _GOLDEN
    z += key
    shifted = z >> np.uint64(30)
    z ^= shifted
    z *= _MIX1
    np.right_shift(z, np.uint64(27), out=shifted)
    z ^= shifted
    z *= _MIX2
    np.right_shift(z, np.uint64(31), out=shifted)
    z ^= shifted
    z >>= np.uint64(11)
    out = z.astype(np.float64)
    out += 0.5
    out *= 2.0**-53
    return out


def _indices(shape: tuple[int, ...], region: Region) -> Iterator[tuple[int, int, np.ndarray]]:
    """The flat indices (in ``shape``, row-major) of ``region``'s elements, in chunks:
    ``(first, last, indices)`` over the region's own flat order."""
    if not shape:
        yield 0, 1, np.zeros(1, dtype=np.uint64)
        return
    strides = np.cumprod((*shape[1:], 1)[::-1])[::-1].astype(np.int64)
    # leading dims of length one and trailing dims taken whole: one contiguous range
    inner = len(region)
    while inner > 1 and region[inner - 1] == (0, shape[inner - 1]):
        inner -= 1
    if all(hi - lo == 1 for lo, hi in region[: inner - 1]):
        first = sum(lo * int(st) for (lo, _), st in zip(region, strides, strict=True))
        size = (region[inner - 1][1] - region[inner - 1][0]) * int(strides[inner - 1])
        for start in range(0, size, _CHUNK):
            stop = min(size, start + _CHUNK)
            yield start, stop, np.arange(first + start, first + stop, dtype=np.uint64)
        return
    (lo, hi), width = region[-1], region[-1][1] - region[-1][0]
    offsets = np.zeros(1, dtype=np.int64)
    for (start, stop), stride in zip(region[:-1], strides[:-1], strict=True):
        offsets = (offsets[:, None] + np.arange(start, stop, dtype=np.int64) * stride).ravel()
    columns = np.arange(lo, hi, dtype=np.int64)
    rows = max(1, _CHUNK // max(width, 1))
    for first in range(0, len(offsets), rows):
        block = offsets[first : first + rows]
        yield first * width, (first + len(block)) * width, (block[:, None] + columns).ravel()


def positional(
    kind: str, a: float, b: float, *, key: np.uint64, shape: tuple[int, ...], region: Region,
    dtype: torch.dtype, out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """``region`` of a ``shape`` tensor filled with ``uniform(a, b)`` or ``normal(a, b)``
    (mean a, std b) values of draw ``key``; written into ``out`` if given (contiguous,
    of the region's shape), else into a new tensor."""
    if out is None:
        out = torch.empty([hi - lo for lo, hi in region], dtype=dtype)
    flat = out.view(-1)
    for first, last, index in _indices(shape, region):
        unit = torch.from_numpy(unit_values(key, index))
        if kind == "uniform":
            values = unit.mul_(b - a).add_(a)
        else:  # the normal quantile: sqrt(2) erfinv(2u - 1) (erfinv: 3x faster than ndtri)
            values = unit.mul_(2.0).sub_(1.0).erfinv_().mul_(b * math.sqrt(2.0)).add_(a)
        flat[first:last] = values
    return out


def _bound(func: Any, args: tuple[Any, ...], kwargs: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    """Arguments by schema name, defaults filled in (``self`` left out for in-place ops)."""
    names = [a for a in func._schema.arguments]
    given = dict(kwargs)
    out: dict[str, Any] = {}
    offset = 1 if names and names[0].name == "self" and func._schema.is_mutable else 0
    for i, arg in enumerate(names[offset:]):
        if i < len(args):
            out[arg.name] = args[i]
        elif arg.name in given:
            out[arg.name] = given[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    return out


def _name(func: Any) -> str:
    """An ATen op's name without namespace and overload (``normal_``), or a function's."""
    schema = getattr(func, "_schema", None)
    return schema.name.split("::")[-1] if schema is not None else str(func.__name__)


def _fill(write: Write) -> tuple[str, float, float] | None:
    """``(kind, a, b)`` of a counter-based fill, for ``normal_``/``uniform_``."""
    name = _name(write.func)
    if name not in ("normal_", "uniform_"):
        return None
    bound = _bound(write.func, write.args, write.kwargs)
    if name == "normal_":
        return "normal", float(bound["mean"]), float(bound["std"])
    return "uniform", float(bound["from"]), float(bound["to"])


_CREATE = {"empty", "zeros", "ones", "full", "randn", "rand", "empty_strided"}


class Replay:
    """Values of one recording under one seed (module docstring)."""

    def __init__(self, recording: Recording, *, seed: int) -> None:
        self.rec, self.seed = recording, seed
        self._memo: dict[tuple[int, int], torch.Tensor] = {}

    def value(self, name: str, region: Region | None = None) -> torch.Tensor:
        """Parameter or buffer ``name``'s value, or its box ``region`` (a new tensor)."""
        ref = self.rec.refs[name]
        if isinstance(ref, torch.Tensor):  # made on the CPU by the factory itself
            return _box(ref, region).clone()
        storage = self.rec.storages[ref.storage]
        if storage.opaque:
            raise ReplayError(f"{name}: {storage.opaque}")
        origin = storage.origin
        whole = any(not w.view for w in storage.writes[: ref.version])
        if origin is not None and _name(origin.func).startswith("empty") and not whole:
            raise ReplayError(f"{name}: made by torch.empty and never filled whole here")
        if region is not None and not ref.view and self._elementwise(ref):
            return self._region(ref, region)
        return _box(self.tensor(ref), region).clone()

    # -- the slice path ------------------------------------------------------------------------

    def _elementwise(self, ref: TensorRef) -> bool:
        storage = self.rec.storages[ref.storage]
        origin = storage.origin
        if origin is None or _name(origin.func) not in _CREATE:
            return False
        for write in storage.writes[: ref.version]:
            if write.view:
                return False
            scalars = all(
                isinstance(a, torch.Tensor) and a.dim() == 0  # a Python number, wrapped
                for a in _leaves((write.args, write.kwargs))
                if isinstance(a, TensorRef | torch.Tensor)
            )
            if _fill(write) is not None or (scalars and _pointwise(write.func)):
                continue
            return False
        return True

    def _region(self, ref: TensorRef, region: Region) -> torch.Tensor:
        storage = self.rec.storages[ref.storage]
        origin = storage.origin
        assert origin is not None
        name = _name(origin.func)
        shape, dtype = storage.shape, storage.dtype
        local = [hi - lo for lo, hi in region]
        if name in ("randn", "rand"):
            key = _key(self.seed, origin.draw or 0)
            kind, a, b = ("normal", 0.0, 1.0) if name == "randn" else ("uniform", 0.0, 1.0)
            out = positional(kind, a, b, key=key, shape=shape, region=region, dtype=dtype)
        elif name in ("zeros", "ones"):
            out = (torch.zeros if name == "zeros" else torch.ones)(local, dtype=dtype)
        elif name == "full":
            out = torch.full(
                local, _bound(origin.func, origin.args, origin.kwargs)["fill_value"], dtype=dtype
            )
        else:
            out = torch.empty(local, dtype=dtype)
        writes = storage.writes[: ref.version]
        # a fill overwrites every element without reading it: the writes before it are dead
        last = max((i for i, w in enumerate(writes) if _overwrites(w)), default=0)
        for write in writes[last:]:
            self._apply(out, write, shape=shape, region=region)
        return out

    # -- the whole-tensor path -----------------------------------------------------------------

    def tensor(self, ref: TensorRef) -> torch.Tensor:
        """The whole value of ``ref`` (its storage's base after ``version`` writes, viewed)."""
        out = self._base(ref.storage, ref.version)
        for step in ref.view:
            out = _view(out, step, self._arg)
        return out

    def _base(self, index: int, version: int) -> torch.Tensor:
        memo = self._memo.get((index, version))
        if memo is not None:
            return memo
        storage = self.rec.storages[index]
        if storage.opaque:
            raise ReplayError(f"a tensor the initialization reads: {storage.opaque}")
        origin = storage.origin
        assert origin is not None, "a recorded storage without an origin is opaque"
        name = _name(origin.func)
        whole = tuple((0, n) for n in storage.shape)
        if name in ("randn", "rand"):
            kind = "normal" if name == "randn" else "uniform"
            out = positional(
                kind, 0.0, 1.0, key=_key(self.seed, origin.draw or 0), shape=storage.shape,
                region=whole, dtype=storage.dtype,
            )  # fmt: skip
        else:
            out = self._call(origin.func, origin.args, origin.kwargs, origin.draw)
            if isinstance(out, list | tuple):
                out = out[origin.output]
        for write in storage.writes[:version]:
            target = out
            for step in write.view:
                target = _view(target, step, self._arg)
            self._apply(target, write, shape=tuple(target.shape), region=None)
        if out.numel() <= _MEMO_LIMIT:
            self._memo[(index, version)] = out
        return out

    def _apply(
        self, target: torch.Tensor, write: Write, *, shape: tuple[int, ...], region: Region | None
    ) -> None:
        """Run ``write`` on ``target`` (``region`` of a ``shape`` tensor; None: all of it)."""
        fill = _fill(write)
        if fill is not None:
            kind, a, b = fill
            box = region or tuple((0, n) for n in shape)
            key = _key(self.seed, write.draw or 0)
            with torch.no_grad():
                target.copy_(
                    positional(kind, a, b, key=key, shape=shape, region=box, dtype=target.dtype)
                )
            return
        with torch.no_grad():
            self._call(write.func, (target, *write.args), write.kwargs, write.draw)

    def _arg(self, value: Any) -> Any:
        if isinstance(value, TensorRef):
            return self.tensor(value)
        if isinstance(value, torch.device) and value.type == "meta":
            return CPU
        return value

    def _call(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: tuple[tuple[str, Any], ...],
        draw: int | None,
    ) -> Any:
        real_args = tree_map(self._arg, args)
        real_kwargs = {k: tree_map(self._arg, v) for k, v in kwargs}
        if draw is None:
            return func(*real_args, **real_kwargs)
        seed = int(_key(self.seed, draw) % np.uint64(2**63))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            real_kwargs.pop("generator", None)
            return func(*real_args, **real_kwargs)


def _overwrites(write: Write) -> bool:
    """A write of the whole tensor that reads none of its values (a fill)."""
    return not write.view and (_fill(write) is not None or _name(write.func) in ("fill_", "zero_"))


def _leaves(value: Any) -> list[Any]:
    from torch.utils._pytree import tree_leaves

    return tree_leaves(value)


def _pointwise(func: Any) -> bool:
    tags = getattr(func, "tags", ())
    return torch.Tag.pointwise in tags or _name(func) in ("fill_", "zero_")


def _view(tensor: torch.Tensor, step: ViewStep, arg: Any) -> torch.Tensor:
    out = step.func(
        tensor, *tree_map(arg, step.args), **{k: tree_map(arg, v) for k, v in step.kwargs}
    )
    return out[step.output] if step.output is not None else out


def _box(tensor: torch.Tensor, region: Region | None) -> torch.Tensor:
    if region is None:
        return tensor
    return tensor[tuple(slice(lo, hi) for lo, hi in region)]
