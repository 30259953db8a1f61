"""A captured graph as picklable data: what a launcher sends its workers, so that no rank
captures the model again (a capture runs the forward under ``torch.export``: seconds of CPU
per process, more than a tiny test model's whole training).

``GraphModule`` pickles as its generated code and traces that again on load, which loses
every node's ``meta``: the module stack, the user's source line, the symbolic sizes
(``val``) that checks read. ``pack`` keeps them. Each node is a record pickled on its own
(arguments name earlier nodes; ATen overloads go by name); a fake tensor or a symbolic size
travels as sympy expressions, and ``unpack`` builds them again over one fresh ``ShapeEnv``,
so sizes equal in the capture stay one symbol::

    captured (one process)          PortableGraph (pickled)           unpack (another)
    placeholder tokens  val (s0,s1)  ('fake', (s0, s1), ...) -> FakeTensor (s0, s1)
    get_attr embed.weight (meta)     Parameter on meta                 the same
    call_function aten.embedding     ('op', 'aten.embedding.default')  torch.ops.aten...

>>> import pickle
>>> gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 3, device="meta"))
>>> copy = unpack(pickle.loads(pickle.dumps(pack(gm))))
>>> [(n.op, str(n.target)) for n in copy.graph.nodes]
[('placeholder', 'input'), ('get_attr', 'weight'), ('get_attr', 'bias'), ('call_function', '<built-in function linear>'), ('output', 'output')]
>>> copy.weight.shape, type(copy.weight).__name__
(torch.Size([3, 2]), 'Parameter')
"""

from __future__ import annotations

import io
import pickle
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import sympy
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

__all__ = ["PortableGraph", "Sent", "captured_cache", "pack", "receive", "sending", "unpack"]

_SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)


@dataclass(frozen=True, slots=True)
class PortableGraph:
    """A ``GraphModule`` as bytes: one pickled record per node (``op, name, target, args,
    kwargs, type, meta``), the tensors its ``get_attr`` nodes read, and the hints of the
    symbols its sizes use."""

    class_name: str
    nodes: tuple[bytes, ...]
    tensors: Mapping[str, torch.Tensor]
    hints: Mapping[str, int]


def pack(gm: torch.fx.GraphModule) -> PortableGraph:
    """``gm`` as picklable data (module docstring)."""
    hints: dict[str, int] = {}
    records = []
    for node in gm.graph.nodes:
        buffer = io.BytesIO()
        record = (node.op, node.name, node.target, node.args, node.kwargs, node.type, node.meta)
        _Packer(buffer, hints).dump(record)
        records.append(buffer.getvalue())
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "get_attr"]
    tensors = {target: _attribute(gm, target) for target in dict.fromkeys(targets)}
    return PortableGraph(type(gm).__name__, tuple(records), tensors, hints)


def unpack(portable: PortableGraph) -> torch.fx.GraphModule:
    """The ``GraphModule`` that ``pack`` was given, meta included; its symbolic sizes live in
    a fresh ``ShapeEnv`` of their own."""
    symbols = _Symbols(portable.hints)
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    for data in portable.nodes:
        op, name, target, args, kwargs, type_expr, meta = _Unpacker(data, env, symbols).load()
        node = graph.create_node(op, target, args, kwargs, name=name, type_expr=type_expr)
        assert node.name == name, f"node {name} was renamed {node.name}"
        node.meta = meta
        env[name] = node
    return torch.fx.GraphModule(dict(portable.tensors), graph, class_name=portable.class_name)


def _attribute(gm: torch.fx.GraphModule, target: str) -> torch.Tensor:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    assert isinstance(value, torch.Tensor), f"get_attr {target} reads a {type(value).__name__}"
    return value


class _Packer(pickle.Pickler):
    """Nodes by name, ATen overloads by name, fake tensors and symbolic sizes as sympy."""

    def __init__(self, file: io.BytesIO, hints: dict[str, int]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._hints = hints

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.fx.Node):
            return ("node", obj.name)
        if isinstance(obj, torch._ops.OpOverload):
            return ("op", obj._schema.name, obj._overloadname)
        if isinstance(obj, FakeTensor):
            sizes = tuple(self._size(s) for s in obj.shape)
            strides = tuple(self._size(s) for s in obj.stride())
            offset = self._size(obj.storage_offset())
            return ("fake", sizes, strides, offset, obj.dtype, obj.device, obj.requires_grad)
        if isinstance(obj, _SYM_TYPES):
            return ("sym", type(obj).__name__, self._size(obj))
        return None

    def _size(self, value: Any) -> Any:
        if not isinstance(value, _SYM_TYPES):
            return value
        expr = value.node.expr
        var_to_val = value.node.shape_env.backed_var_to_val
        for symbol in expr.free_symbols:
            self._hints.setdefault(str(symbol), int(var_to_val[symbol]))
        return expr


class _Symbols:
    """The capture's symbols made again in one ``ShapeEnv`` (by name, with their hints)."""

    def __init__(self, hints: Mapping[str, int]) -> None:
        from torch._dynamo.source import ConstantSource
        from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

        self.shape_env = ShapeEnv(duck_shape=False)
        self.mode = FakeTensorMode(shape_env=self.shape_env, allow_non_fake_inputs=True)
        self._hints = dict(hints)
        self._fakes: dict[tuple[Any, ...], FakeTensor] = {}
        self._sizes: dict[tuple[str, sympy.Basic], Any] = {}
        self._by_name = {
            name: self.shape_env.create_symbol(
                hint, source=ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC
            )
            for name, hint in sorted(self._hints.items())
        }

    def size(self, value: Any, kind: str = "SymInt") -> Any:
        if not isinstance(value, sympy.Basic):
            return value
        if (kind, value) not in self._sizes:
            self._sizes[(kind, value)] = self._make(value, kind)
        return self._sizes[(kind, value)]

    def _make(self, value: sympy.Basic, kind: str) -> Any:
        expr = value.xreplace({s: self._by_name[str(s)] for s in value.free_symbols})
        hint = value.xreplace({s: self._hints[str(s)] for s in value.free_symbols})
        if kind == "SymInt":
            return self.shape_env.create_symintnode(expr, hint=int(hint))
        if kind == "SymFloat":
            return self.shape_env.create_symfloatnode(expr, hint=float(hint))
        return self.shape_env.create_symboolnode(expr)

    def fake(self, *described: Any) -> FakeTensor:
        """One fake tensor per description: nodes of equal shapes share it (a node's
        ``val`` is read, never changed; building one costs milliseconds)."""
        if described not in self._fakes:
            self._fakes[described] = self._fake(*described)
        return self._fakes[described]

    def _fake(self, sizes: tuple[Any, ...], strides: tuple[Any, ...], offset: Any,
              dtype: torch.dtype, device: torch.device, requires_grad: bool) -> FakeTensor:  # fmt: skip
        with self.mode:
            made = torch.empty_strided(
                [self.size(s) for s in sizes], [self.size(s) for s in strides],
                dtype=dtype, device=device,
            )  # fmt: skip
            if offset:
                made = made.as_strided(made.shape, made.stride(), self.size(offset))
        made.requires_grad_(requires_grad)
        assert isinstance(made, FakeTensor)
        return made


class _Unpacker(pickle.Unpickler):
    def __init__(self, data: bytes, env: Mapping[str, torch.fx.Node], symbols: _Symbols) -> None:
        super().__init__(io.BytesIO(data))
        self._env = env
        self._symbols = symbols

    def persistent_load(self, pid: Any) -> Any:
        kind, *rest = pid
        loaders: dict[str, Callable[..., Any]] = {
            "node": self._env.__getitem__,
            "op": _overload,
            "fake": self._symbols.fake,
            "sym": lambda kind, expr: self._symbols.size(expr, kind),
        }
        return loaders[kind](*rest)


def _overload(qualified: str, overload: str) -> torch._ops.OpOverload:
    namespace, name = qualified.split("::")
    packet = getattr(getattr(torch.ops, namespace), name)
    return getattr(packet, overload or "default")


# -- a cache of captures that a launcher sends to its workers ----------------------------------

P = ParamSpec("P")
R = TypeVar("R")

Sent = tuple[tuple[str, Hashable, Any], ...]
"""Captures as a launcher sends them: (the capturing function, its arguments, the value with
every ``GraphModule`` in it as a ``PortableGraph``)."""

_CACHES: dict[str, _CaptureCache] = {}
_RECEIVED: dict[tuple[str, Hashable], Any] = {}  # sent by the launcher, unpacked on first use
_LOCK = threading.Lock()
_LOCAL = threading.local()  # the keys a ``sending`` block reads, in this thread


class _CaptureCache:
    """``functools.lru_cache`` of a capturing function, keyed by its arguments, that also
    answers from what a launcher sent (``receive``) and says which keys a ``sending`` block
    read."""

    def __init__(self, fn: Callable[..., Any], maxsize: int | None) -> None:
        self.fn, self.maxsize = fn, maxsize
        self.name = f"{fn.__module__}.{fn.__qualname__}"
        self.values: OrderedDict[Hashable, Any] = OrderedDict()
        self.packed: dict[Hashable, Any] = {}

    def __call__(self, *args: Any) -> Any:
        reading = getattr(_LOCAL, "reading", None)
        if reading is not None:
            reading.append((self, args))
        with _LOCK:
            if args in self.values:
                self.values.move_to_end(args)
                return self.values[args]
            sent = _RECEIVED.pop((self.name, args), None)
        value = self.fn(*args) if sent is None else _unpacked(sent)
        with _LOCK:
            self.values[args] = value
            while self.maxsize is not None and len(self.values) > self.maxsize:
                evicted, _ = self.values.popitem(last=False)
                self.packed.pop(evicted, None)
        return value

    def cache_clear(self) -> None:
        with _LOCK:
            self.values.clear()
            self.packed.clear()

    def pack(self, args: Hashable) -> Any:
        """The value of ``args`` (computed) with its graphs packed, once per process."""
        if args not in self.packed:
            self.packed[args] = _packed(self(*args))  # type: ignore[misc]
        return self.packed[args]


def captured_cache(maxsize: int | None) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a function of hashable, picklable positional arguments that captures a
    graph (it returns a ``GraphModule`` or a tuple holding some): its values are cached
    like ``functools.lru_cache(maxsize)``'s (None: unbounded), and a launcher sends them to
    its workers (``sending``, ``receive``)."""

    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        cache = _CaptureCache(fn, maxsize)
        _CACHES[cache.name] = cache
        return cache  # type: ignore[return-value]

    return wrap


class _Reading:
    def __init__(self) -> None:
        self.read: list[tuple[_CaptureCache, Hashable]] = []

    def sent(self) -> Sent:
        """The captures read in the block, packed (those whose values do not pickle are
        left out: the workers capture them again)."""
        out = []
        for cache, args in dict.fromkeys(self.read):
            try:
                out.append((cache.name, args, cache.pack(args)))
            except (pickle.PicklingError, TypeError, AttributeError):
                continue
        return tuple(out)


@contextmanager
def sending() -> Iterator[_Reading]:
    """Note the captures the block reads (``captured_cache`` functions); ``.sent()`` after
    it gives them as data for ``receive`` in another process::

        with sending() as reading:
            model_graph(config.model_config())
        launch(work, 4, args=(reading.sent(), ...))   # work calls receive(sent) first
    """
    outer = getattr(_LOCAL, "reading", None)
    reading = _Reading()
    _LOCAL.reading = reading.read
    try:
        yield reading
    finally:
        _LOCAL.reading = outer
        if outer is not None:
            outer.extend(reading.read)


def receive(sent: Sent) -> None:
    """Take the captures a launcher sent: the first call of their function with the same
    arguments unpacks one instead of capturing."""
    with _LOCK:
        for name, args, value in sent:
            if name in _CACHES and args not in _CACHES[name].values:
                _RECEIVED[(name, args)] = value


def _packed(value: Any) -> Any:
    if isinstance(value, torch.fx.GraphModule):
        portable = pack(value)
        pickle.dumps(portable.tensors)  # fails here, not in the launch, if a tensor does not
        return portable
    if isinstance(value, tuple):
        return tuple(_packed(v) for v in value)
    pickle.dumps(value)
    return value


def _unpacked(value: Any) -> Any:
    if isinstance(value, PortableGraph):
        return unpack(value)
    if isinstance(value, tuple):
        return tuple(_unpacked(v) for v in value)
    return value
