"""A model's own initialization, recorded on the meta device as data (DESIGN decision 16).

``record(factory)`` calls the factory as it would run on the CPU (its ``reset_parameters``,
a Hugging Face model's ``_init_weights``, nanoGPT's scaled ``normal_``) but every tensor is
created on the meta device, and every ATen op that creates, views or writes one is kept:

    storage   origin (the op that made it)      writes, in order (view of the base, op)
    s0        empty((256, 32))                  (), normal_(0.0, 0.02)
                                                (select(0, 0),), zero_()
    s1        arange(0, 8, 2) / ... (inv_freq)  -

A parameter or buffer is then a ``TensorRef`` (its storage, the number of writes it had
seen, its view of the storage's base), and ``hspmd.models.replay`` computes its value, or
only a rank's slice of it, without building the module. Random fills are numbered in the
order they ran (``draw``): the replay keys its generator on (seed, draw), so values do not
depend on which rank computes them or which slice it asks for.

>>> from torch import nn
>>> rec = record(lambda: nn.Linear(4, 3))
>>> rec.refs["weight"], rec.storages[0].writes[0].op
(TensorRef(storage=0, version=1, view=()), 'aten.uniform_.default')
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

__all__ = ["Origin", "Recording", "StorageRecord", "TensorRef", "ViewStep", "Write", "record"]

META = torch.device("meta")
_SEEDED = torch.Tag.nondeterministic_seeded


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A recorded tensor where an op read it: after ``version`` writes to ``storage``, seen
    through ``view`` (ops applied to the storage's base tensor)."""

    storage: int
    version: int
    view: tuple[ViewStep, ...]


@dataclass(frozen=True, slots=True)
class ViewStep:
    """One view op (``select``, ``t``, ``split``...) minus its input; ``output``: which of
    a multi-output view (``split``) it is."""

    func: Any  # an OpOverload: compared by identity
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]
    output: int | None = None


@dataclass(frozen=True, slots=True)
class Origin:
    """The functional op that made a storage (its ``output``-th tensor), ``draw``: the
    index of its random draw, if it is a random op."""

    func: Any
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]
    output: int = 0
    draw: int | None = None


@dataclass(frozen=True, slots=True)
class Write:
    """An in-place op on ``view`` of a storage's base: ``func(view, *args, **kwargs)``."""

    view: tuple[ViewStep, ...]
    func: Any
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]
    draw: int | None = None

    @property
    def op(self) -> str:
        return str(self.func)


@dataclass(slots=True)
class StorageRecord:
    """One storage: made by ``origin`` (or a real tensor, ``constant``), then ``writes``.
    ``opaque``: written in a way the replay cannot follow (an ``out=`` argument)."""

    origin: Origin | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    constant: torch.Tensor | None = None
    writes: list[Write] = field(default_factory=list)
    opaque: str = ""


@dataclass(slots=True)
class Recording:
    """What ``record`` returns: the meta module, every storage, and ``refs``: each
    parameter's and buffer's ``TensorRef`` by name (``named_parameters`` then buffers, tied
    names included), or the real tensor where the factory made one on the CPU."""

    module: nn.Module
    storages: list[StorageRecord]
    refs: dict[str, TensorRef | torch.Tensor]
    draws: int
    # meta tensors kept as plain attributes (``module.path`` -> {attribute: ref})
    attributes: dict[str, dict[str, TensorRef]] = field(default_factory=dict)

    def aliases(self) -> dict[str, str]:
        """Tied names: each parameter name -> another name of the same tensor.

        >>> class Tied(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.a = nn.Linear(2, 2, bias=False)
        ...         self.b = nn.Linear(2, 2, bias=False)
        ...         self.b.weight = self.a.weight
        >>> record(Tied).aliases()
        {'a.weight': 'b.weight', 'b.weight': 'a.weight'}
        """
        groups: dict[int, list[str]] = {}
        for name, param in self.module.named_parameters(remove_duplicate=False):
            groups.setdefault(id(param), []).append(name)
        return {
            n: next(o for o in names if o != n)
            for names in groups.values()
            if len(names) > 1
            for n in names
        }


def _items(kwargs: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(kwargs.items()))


class _Recorder(TorchDispatchMode):
    """Runs every op on the meta device and records it (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: list[StorageRecord] = []
        self.by_storage: dict[int, int] = {}  # untyped storage id -> index
        self.views: dict[
            tuple[int, int, tuple[int, ...], tuple[int, ...]], tuple[ViewStep, ...]
        ] = {}
        self.alive: list[torch.Tensor] = []  # keeps storage ids from being reused
        self.draws = 0

    # -- tensors to references ---------------------------------------------------------------

    def ref(self, tensor: torch.Tensor) -> TensorRef | torch.Tensor:
        """A meta tensor as a reference; a real one (data from Python) as itself."""
        if not tensor.is_meta:
            return tensor.detach().clone()
        key = tensor.untyped_storage()._cdata
        index = self.by_storage.get(key)
        if index is None:  # a meta tensor made outside the recording: nothing to replay
            index = self._new(None, tensor, opaque="made outside the recorded factory")
        geometry = (
            index,
            int(tensor.storage_offset()),
            tuple(tensor.shape),
            tuple(tensor.stride()),
        )
        view = self.views.get(geometry)
        if view is None:
            base = self.storages[index]
            if tuple(tensor.shape) != base.shape or tensor.storage_offset() != 0:
                self.storages[index].opaque = f"a view {list(tensor.shape)} of unknown origin"
            view = ()
        return TensorRef(index, len(self.storages[index].writes), view)

    def _new(self, origin: Origin | None, tensor: torch.Tensor, *, opaque: str = "") -> int:
        index = len(self.storages)
        self.storages.append(
            StorageRecord(origin, tuple(tensor.shape), tensor.dtype, None, [], opaque)
        )
        self.by_storage[tensor.untyped_storage()._cdata] = index
        self._view(tensor, index, ())
        return index

    def _view(self, tensor: torch.Tensor, index: int, view: tuple[ViewStep, ...]) -> None:
        self.alive.append(tensor)
        geometry = (
            index,
            int(tensor.storage_offset()),
            tuple(tensor.shape),
            tuple(tensor.stride()),
        )
        self.views.setdefault(geometry, view)

    def _refs(self, value: Any) -> Any:
        return tree_map(lambda v: self.ref(v) if isinstance(v, torch.Tensor) else v, value)

    # -- the dispatch --------------------------------------------------------------------------

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        schema = func._schema
        if any(a.name == "device" for a in schema.arguments):
            kwargs["device"] = META  # made where the factory asked: here, on meta
        given = self._refs((args, kwargs))  # real tensors (data from Python) as themselves
        if any(isinstance(a, torch.Tensor) and a.is_meta for a in tree_leaves((args, kwargs))):
            args, kwargs = tree_map(_to_meta, (args, kwargs))  # they join meta ones as meta
        written = [
            i for i, a in enumerate(schema.arguments) if a.alias_info and a.alias_info.is_write
        ]
        if written:
            return self._write(func, written, args, kwargs, given)
        if schema.returns and schema.returns[0].alias_info is not None:
            return self._alias(func, args, kwargs, given)
        return self._make(func, args, kwargs, given)

    def _write(
        self, func: Any, written: list[int], args: tuple[Any, ...], kwargs: dict[str, Any],
        given: tuple[Any, Any],
    ) -> Any:  # fmt: skip
        target = args[0] if args else None
        seeded = _SEEDED in func.tags
        if written != [0] or not isinstance(target, torch.Tensor) or not target.is_meta:
            for ref in tree_leaves(given):
                if isinstance(ref, TensorRef):
                    self.storages[ref.storage].opaque = f"written by {func} (out=)"
            return func(*args, **kwargs)
        ref = given[0][0]
        assert isinstance(ref, TensorRef)
        draw = self._draw() if seeded else None
        self.storages[ref.storage].writes.append(
            Write(ref.view, func, given[0][1:], _items(given[1]), draw)
        )
        if seeded:  # a meta random fill computes nothing (and its kernel imports dynamo)
            return target
        return func(*args, **kwargs)

    def _alias(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], given: tuple[Any, Any]
    ) -> Any:
        out = func(*args, **kwargs)
        ref = given[0][0] if given[0] else None
        if not isinstance(ref, TensorRef):  # a view of a real tensor: real
            return out
        outs = out if isinstance(out, list | tuple) else [out]
        for i, tensor in enumerate(outs):
            step = ViewStep(func, given[0][1:], _items(given[1]), i if out is not tensor else None)
            self._view(tensor, ref.storage, (*ref.view, step))
        return out

    def _make(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], given: tuple[Any, Any]
    ) -> Any:
        seeded = _SEEDED in func.tags
        out = _random_meta(func, args, kwargs) if seeded else None
        if out is None:
            out = func(*args, **kwargs)
        draw = self._draw() if seeded else None
        outs = out if isinstance(out, list | tuple) else [out]
        for i, tensor in enumerate(outs):
            if not isinstance(tensor, torch.Tensor) or not tensor.is_meta:
                continue
            if tensor.untyped_storage()._cdata in self.by_storage:  # its input, returned
                continue
            self._new(Origin(func, given[0], _items(given[1]), i, draw), tensor)
        return out

    def _draw(self) -> int:
        self.draws += 1
        return self.draws - 1


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and not value.is_meta:
        return value.to(META)
    return value


_LIKE = {"randn_like", "rand_like", "normal_like"}


def _random_meta(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The meta output of ``randn``/``rand`` (and their ``_like``) without their kernels."""
    name = func._schema.name.split("::")[-1]
    if name in ("randn", "rand") and args and isinstance(args[0], list | tuple):
        return torch.empty(args[0], dtype=kwargs.get("dtype"), device=META)
    if name in _LIKE and args and isinstance(args[0], torch.Tensor):
        return torch.empty_like(args[0], dtype=kwargs.get("dtype"), device=META)
    return None


# torch.nn.init functions that return a meta tensor untouched (rejection sampling, QR):
# recorded as one write each, replayed whole with torch's generator seeded by (seed, draw)
_WHOLE_INITS = ("trunc_normal_", "orthogonal_", "sparse_", "dirac_", "eye_")


@contextmanager
def _whole_inits(recorder: _Recorder) -> Iterator[None]:
    originals = {name: getattr(nn.init, name) for name in _WHOLE_INITS}

    def wrap(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        @functools.wraps(original)
        def recorded(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if not tensor.is_meta:
                return original(tensor, *args, **kwargs)
            ref = recorder.ref(tensor)
            assert isinstance(ref, TensorRef)
            write = Write(ref.view, original, args, _items(kwargs), recorder._draw())
            recorder.storages[ref.storage].writes.append(write)
            return tensor

        return recorded

    try:
        for name, original in originals.items():
            setattr(nn.init, name, wrap(original))
        yield
    finally:
        for name, original in originals.items():
            setattr(nn.init, name, original)


def record(factory: Callable[[], nn.Module]) -> Recording:
    """Call ``factory`` with every tensor on the meta device, recording (module docstring)."""
    recorder = _Recorder()
    with _whole_inits(recorder), recorder:
        module = factory()
    refs: dict[str, TensorRef | torch.Tensor] = {}
    named = [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]
    for name, tensor in named:
        if tensor is not None:
            refs[name] = recorder.ref(tensor) if tensor.is_meta else tensor.detach()
    attributes: dict[str, dict[str, TensorRef]] = {}
    for path, sub in module.named_modules():
        for attr, value in vars(sub).items():
            if isinstance(value, torch.Tensor) and value.is_meta:
                ref = recorder.ref(value)
                assert isinstance(ref, TensorRef)
                attributes.setdefault(path, {})[attr] = ref
    return Recording(module, recorder.storages, refs, recorder.draws, attributes)
