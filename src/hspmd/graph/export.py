"""Capture below Python: a training step's forward as a graph of ATen ops (DESIGN decision 1).

``capture_step(module, call=...)`` runs the module's real forward once on meta tensors
under ``torch.export`` (non-strict, training IR: ATen ops before autograd, without
decompositions), so Python control flow (``if targets is None``, asserts on sizes,
``x.device``) is evaluated, not traced, and ``split``/``chunk``/rotary code/HF masks are
recorded as the ops they run. The batch and sequence dims are symbolic: sizes are
``aten.sym_size.int`` nodes of the inputs, so one graph serves every length.

The graph is then put in the form the rest of hspmd reads:

    export's form                              hspmd's form
    placeholder p_model_h_0_w (PARAMETER)      get_attr h.0.w  (the module's own name)
    placeholders of user inputs                placeholders tokens, targets (segments; or
                                               the names of ``inputs``: a dataset's fields)
    torch.ops.hspmd.marker(x, name)            hspmd.markers.reshard(x, name)
    torch.ops.hspmd.rms_norm(x, ...) etc.      the function it stands for (markers.record_as)
    split(x, 64, 2) + getitem(.., i)           slice(x, 2, 64 i, 64 (i + 1))
    unbind(x, d) + getitem(.., i)              select(x, d, i)
    device(type='meta') arguments              getattr(tokens, "device")
    _assert_tensor_metadata                    (dropped)

>>> import torch
>>> net = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8))
>>> def step(m, tokens, targets):
...     return torch.nn.functional.cross_entropy(m(tokens).flatten(0, 1), targets.flatten())
>>> with torch.device("meta"):
...     net = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8))
>>> gm = capture_step(net, call=step)
>>> [str(n.target) for n in gm.graph.nodes if n.op == "get_attr"]
['0.weight', '1.weight', '1.bias']
>>> [n.name for n in gm.graph.nodes if n.op == "placeholder"]
['tokens', 'targets']
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

from hspmd.errors import HspmdError
from hspmd.markers import capturing, eager_function, reshard
from hspmd.userfiles import user_frame

__all__ = [
    "SEGMENTS_INPUT", "TOKEN_INPUTS", "ExportError", "GraphInput", "LengthRangeError", "StepCall",
    "capture_step", "sample_batch", "user_frame",
]  # fmt: skip

StepCall = Callable[..., torch.Tensor]
"""How one training step calls the module: ``(module, *inputs) -> scalar loss`` (the
inputs in ``GraphInput`` order: ``tokens, targets`` by default; with packed documents
``tokens, targets, segments``, segments the (B, T) document ids)."""

SAMPLE_BATCH, SAMPLE_LENGTH = 3, 7
"""The meta inputs' sizes at capture: odd primes, so that no model constant is mistaken
for a symbolic size (export gives equal sizes one symbol)."""


@dataclass(frozen=True, slots=True)
class GraphInput:
    """One input of the captured step: its name (the placeholder's), its shape after the
    batch dim (``None``: the symbolic sequence length) and its dtype.

    >>> GraphInput("image", (1, 8, 8), "float32").sample(3).shape
    torch.Size([3, 1, 8, 8])
    """

    name: str
    trailing: tuple[int | None, ...]
    dtype: str = "int64"

    def sample(self, batch: int, length: int = SAMPLE_LENGTH) -> torch.Tensor:
        """A meta tensor of this input at ``batch`` rows (and ``length`` positions)."""
        shape = (batch, *(length if d is None else d for d in self.trailing))
        return torch.zeros(shape, dtype=getattr(torch, self.dtype), device="meta")

    def dims(self, max_length: int | None = None) -> dict[int, Any]:
        """export's ``dynamic_shapes`` entry: the batch dim and any sequence dim symbolic
        (the latter up to ``max_length`` when given)."""
        auto = torch.export.Dim.AUTO
        length = auto if max_length is None else auto(max=max(max_length, SAMPLE_LENGTH))
        return {0: auto, **{i + 1: length for i, d in enumerate(self.trailing) if d is None}}


TOKEN_INPUTS = (GraphInput("tokens", (None,)), GraphInput("targets", (None,)))
"""The token protocol's inputs: ``tokens`` and ``targets``, (B, T) int64."""

SEGMENTS_INPUT = GraphInput("segments", (None,))
"""Packed documents' third input: ``segments``, (B, T) int64 document ids."""


def sample_batch(inputs: Sequence[GraphInput]) -> int:
    """The capture's batch size: ``SAMPLE_BATCH`` or the next prime that no static size of
    the inputs equals (a batch of 3 beside 3 channels would let export tie them)."""
    static = {d for i in inputs for d in i.trailing if d is not None}
    batch = SAMPLE_BATCH
    while batch in static or any(batch % k == 0 for k in range(2, batch)):
        batch += 2
    return batch


_ASSERTS = frozenset(
    {
        torch.ops.aten._assert_tensor_metadata.default,
        torch.ops.aten._assert_scalar.default,
        torch.ops.aten.sym_constrain_range_for_size.default,
    }
)


class ExportError(HspmdError, ValueError):
    """A forward that torch.export cannot run on meta tensors (names the user's line)."""


class LengthRangeError(ExportError):
    """A capture whose graph holds only for sequences shorter than the length it was given:
    the forward's Python decided something by the sample length (``upper``: the most it
    holds for)."""

    def __init__(self, message: str, upper: int) -> None:
        super().__init__(message)
        self.upper = upper


class _Step(nn.Module):
    """The module and its calling convention as one ``forward(*inputs) -> loss``."""

    def __init__(self, model: nn.Module, call: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self._call = call

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self._call(self.model, *inputs)


@contextmanager
def _block_markers(blocks: Sequence[nn.Module] | None) -> Iterator[None]:
    """Mark block ``i``'s first argument ``layers.{i}.input`` (pipeline cuts go there)."""
    handles = []
    for i, block in enumerate(blocks or ()):

        def mark(_: nn.Module, args: tuple[Any, ...], i: int = i) -> tuple[Any, ...] | None:
            if args and isinstance(args[0], torch.Tensor):
                return (reshard(args[0], f"layers.{i}.input"), *args[1:])
            return None

        handles.append(block.register_forward_pre_hook(mark))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def capture_step(
    module: nn.Module,
    *,
    call: StepCall | Callable[..., torch.Tensor],
    blocks: Sequence[nn.Module] | None = None,
    inputs: Sequence[GraphInput] = TOKEN_INPUTS,
    max_length: int | None = None,
) -> torch.fx.GraphModule:
    """The ATen graph of ``call(module, *inputs)`` (module docstring), one placeholder per
    input, named as it; ``blocks`` get ``layers.{i}.input`` markers on their first
    argument. ``module`` may live on meta. Packed documents: ``inputs`` end with
    ``SEGMENTS_INPUT``. ``max_length``: the sequence dim ranges up to it (the model's
    longest), and a graph that holds only for shorter sequences is a ``LengthRangeError``."""
    step = _Step(module, call)
    batch = sample_batch(inputs)
    samples = tuple(i.sample(batch) for i in inputs)
    dims = tuple(i.dims(max_length) for i in inputs)
    try:
        with capturing(), _block_markers(blocks):
            program = torch.export.export(
                step, samples, dynamic_shapes={"inputs": dims}, strict=False
            )
    except HspmdError:
        raise
    except Exception as error:
        where = user_frame(error)
        at = f" at {where}" if where else ""
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ExportError(
            f"{type(module).__name__}.forward cannot be captured{at}: {first}. The forward "
            "must run on meta tensors of any batch and length (no .item(), no data-dependent "
            "shapes)"
        ) from error
    if max_length is not None:
        _check_length_range(program, module, max_length)
    return _normalize(program, module, [i.name for i in inputs])


def _check_length_range(
    program: torch.export.ExportedProgram, module: nn.Module, max_length: int
) -> None:
    tokens = next(n for n in program.graph.nodes if n.op == "placeholder"
                  and n.name in program.graph_signature.user_inputs)  # fmt: skip
    length = tokens.meta["val"].shape[1]
    if not isinstance(length, torch.SymInt):
        upper = int(length)
    else:
        ranges = program.range_constraints.get(length.node.expr)
        upper = max_length if ranges is None or not ranges.upper.is_finite else int(ranges.upper)
    if upper < max_length:
        raise LengthRangeError(
            f"{type(module).__name__}.forward's capture holds for sequences of at most {upper} "
            f"tokens, not {max_length}",
            upper,
        )


# -- from export's form to hspmd's -------------------------------------------------------------


def _names(module: nn.Module) -> dict[int, str]:
    """Tensor id -> its first qualified name (tied weights take the first)."""
    found: dict[int, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        found.setdefault(id(param), name)
    for name, buffer in module.named_buffers(remove_duplicate=False):
        found.setdefault(id(buffer), name)
    return found


def _normalize(
    program: torch.export.ExportedProgram, module: nn.Module, input_names: Sequence[str]
) -> torch.fx.GraphModule:
    source = program.graph_module.graph
    names = _names(module)
    root: dict[str, Any] = {}
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, Any] = {}
    user_inputs = iter(input_names)
    specs = {spec.arg.name: spec for spec in program.graph_signature.input_specs}
    user = torch.export.graph_signature.InputKind.USER_INPUT
    placeholders = [n for n in source.nodes if n.op == "placeholder"]
    for node in placeholders:  # the inputs first: fx code takes them as arguments
        if specs[node.name].kind == user:
            name = next(user_inputs)
            optional = {"default_value": None} if name == "segments" else {}
            env[node] = graph.placeholder(name, **optional)
            env[node].meta = dict(node.meta)
    first = next(n for n in placeholders if specs[n.name].kind == user)
    device = graph.call_function(getattr, (env[first], "device"))
    for node in source.nodes:
        if node.op == "placeholder":
            spec = specs[node.name]
            if spec.kind == user:
                continue
            target = str(spec.target).removeprefix("model.")
            value = _lifted(program, module, spec)
            target = names.get(id(value), target) if spec.kind.name != "CONSTANT_TENSOR" else target
            target = target if spec.kind.name != "CONSTANT_TENSOR" else "_constants." + target
            root[target] = value
            env[node] = graph.get_attr(target)
            env[node].meta = dict(node.meta)
        elif node.op == "output":
            (loss,) = node.args[0]
            graph.output(env[loss])
        elif node.target in _ASSERTS:
            continue
        else:
            _copy(graph, node, env, device)
    _split_to_slices(graph)
    _drop_whole_slices(graph)
    graph.eliminate_dead_code()
    graph.lint()
    return torch.fx.GraphModule(root, graph, class_name=type(module).__name__)


def _lifted(program: torch.export.ExportedProgram, module: nn.Module, spec: Any) -> torch.Tensor:
    target = str(spec.target)
    if spec.kind.name in ("PARAMETER", "BUFFER"):
        name = target.removeprefix("model.")
        obj: Any = module
        for part in name.split("."):
            obj = getattr(obj, part)
        return obj
    value = program.constants[target]
    assert isinstance(value, torch.Tensor), f"constant {target} is a {type(value).__name__}"
    return value


def _copy(
    graph: torch.fx.Graph,
    node: torch.fx.Node,
    env: Mapping[torch.fx.Node, Any],
    device: torch.fx.Node,
) -> None:
    def arg(value: Any) -> Any:
        if isinstance(value, torch.fx.Node):
            return env[value]
        if isinstance(value, torch.device) and value.type == "meta":
            return device
        if isinstance(value, list | tuple):
            return type(value)(arg(v) for v in value)
        if isinstance(value, dict):
            return {k: arg(v) for k, v in value.items()}
        return value

    args, kwargs = arg(node.args), arg(node.kwargs)
    function = eager_function(node.target)
    if function is not None:
        args, kwargs = _function_arguments(node.target, function, args, kwargs)
        new = graph.call_function(function, args, kwargs)
    else:
        new = graph.call_function(node.target, args, kwargs)  # type: ignore[arg-type]
    new.meta = dict(node.meta)
    stack = node.meta.get("nn_module_stack")
    if stack is not None:
        new.meta["nn_module_stack"] = _module_stack(stack)
    new.name = node.name
    env[node] = new  # type: ignore[index]


def _function_arguments(
    op: Any, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A custom op's arguments as ``function`` takes them (the same names, its keyword-only
    ones by keyword): ``causal_attention(q, k, v, segments, enable_gqa=True)``."""
    names = [a.name for a in op._schema.arguments]
    bound = {**dict(zip(names, args, strict=False)), **kwargs}
    params = inspect.signature(function).parameters
    keyword = {n for n in names if params[n].kind is inspect.Parameter.KEYWORD_ONLY}
    positional = tuple(bound[n] for n in names if n not in keyword and n in bound)
    return positional, {n: bound[n] for n in names if n in keyword and n in bound}


def _module_stack(stack: Mapping[str, tuple[str, Any]]) -> dict[str, tuple[str, Any]]:
    """Export's stack (keys ``L__self__model.h.0``, paths under the ``_Step`` wrapper) as
    the user's module paths: ``{"h.0": ("h.0", Block)}``, the wrapper and the root left out."""
    out = {}
    for path, kind in stack.values():
        if path.startswith("model."):
            name = path.removeprefix("model.")
            out[name] = (name, kind)
    return out


_SPLITS = {
    torch.ops.aten.split.Tensor,
    torch.ops.aten.split_with_sizes.default,
    torch.ops.aten.unbind.int,
    torch.ops.aten.chunk.default,
}


def _split_to_slices(graph: torch.fx.Graph) -> None:
    """Multi-output splits become one single-output ``slice`` (or ``select``) per getitem,
    so that every tensor is one node with one annotation."""
    for node in list(graph.nodes):
        if node.target not in _SPLITS:
            continue
        x = node.args[0]
        assert isinstance(x, torch.fx.Node)
        shape = tuple(x.meta["val"].shape)
        bounds = _bounds(node, shape)
        if bounds is None:
            continue  # a split along a symbolic dim: left to the fallback
        dim, parts = bounds
        for user in list(node.users):
            if user.target is not operator.getitem:
                break
            i = user.args[1]
            assert isinstance(i, int)
            with graph.inserting_before(user):
                if parts is None:
                    new = graph.call_function(torch.ops.aten.select.int, (x, dim, i))
                else:
                    start, stop = parts[i]
                    new = graph.call_function(torch.ops.aten.slice.Tensor, (x, dim, start, stop))
            new.meta = dict(user.meta)
            user.replace_all_uses_with(new)
            graph.erase_node(user)
        if not node.users:
            graph.erase_node(node)


def _drop_whole_slices(graph: torch.fx.Graph) -> None:
    """``x[:, :, None]`` and HF's ``logits_to_keep=0`` record slices over a whole dim;
    eager skips them, and each one's backward would write zeros and copy the gradient in."""
    for node in list(graph.nodes):
        if node.target is not torch.ops.aten.slice.Tensor:
            continue
        args: list[Any] = [*node.args, None, 0, None, None, 1][:5]
        args[len(node.args) :] = [None, 0, None, None, 1][len(node.args) :]
        x, dim, start, end, step = args
        assert isinstance(x, torch.fx.Node)
        shape = x.meta["val"].shape
        length = shape[int(dim) % len(shape)]
        whole_end = end is None or (isinstance(end, int) and (end >= 1 << 62 or end == length))
        if start in (0, None) and step == 1 and whole_end:
            node.replace_all_uses_with(x)
            graph.erase_node(node)


def _bounds(
    node: torch.fx.Node, shape: tuple[Any, ...]
) -> tuple[int, list[tuple[int, int]] | None] | None:
    """``(dim, [(start, stop)] per output)``, ``(dim, None)`` for unbind; None if symbolic."""
    ndim = len(shape)
    if node.target is torch.ops.aten.unbind.int:
        dim = _int_arg(node, 1, "dim") % ndim
        return (dim, None) if isinstance(shape[dim], int) else None
    dim = _int_arg(node, 2, "dim") % ndim
    length = shape[dim]
    if not isinstance(length, int):
        return None
    how = node.args[1]
    if node.target is torch.ops.aten.chunk.default:
        assert isinstance(how, int)
        size = -(-length // how)
        sizes = [min(size, length - s) for s in range(0, length, size)]
    elif isinstance(how, int):
        sizes = [min(how, length - s) for s in range(0, length, how)]
    else:
        assert isinstance(how, list | tuple)
        sizes = [int(s) for s in how]  # type: ignore[arg-type]
    parts, start = [], 0
    for size in sizes:
        parts.append((start, start + size))
        start += size
    return dim, parts


def _int_arg(node: torch.fx.Node, position: int, name: str, default: int = 0) -> int:
    value = node.args[position] if len(node.args) > position else node.kwargs.get(name, default)
    assert isinstance(value, int), f"{node.format_node()}: {name} is {value!r}"
    return value
