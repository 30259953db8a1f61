"""Any ``nn.Module`` as an hspmd model: load it, read its metadata, capture its graph.

``load_model("my_model.py:make_model", {"num_layers": 4})`` calls the factory on the meta
device and returns a ``ModuleModel`` (``hspmd.models.spec``): plain data that every process
can rebuild the module from. What hspmd reads from the module (docs/models.md):

- ``forward(tokens, targets)`` -> the mean loss, tokens and targets (B, T) int64; or, with
  ``items=`` (``--dataset``), the fields of a dataset's items (``hspmd.data.items``), one
  graph input each, and a ``(B, ...)`` stream between the blocks;
- the blocks: the ``nn.ModuleList`` named by the module's ``hspmd_blocks`` attribute, or
  its one longest ``ModuleList``; block ``i``'s first argument is the stream ``(B, T, H)``
  and gets the pipeline marker ``layers.{i}.input`` (unless the module places its own
  ``hspmd.reshard`` markers of that name);
- ``tp_rules`` (optional): ``{fnmatch pattern: "column" | "row" | "vocab" | "replicate"}``
  over parameter names, first match wins, unmatched parameters replicate. A column or row
  weight must feed ``F.linear`` (``nn.Linear``) and a vocab weight ``F.linear`` or
  ``F.embedding``; hspmd then inserts the markers Megatron's layout needs: ``*.tp_in``
  before a column layer's input (its gradient is all-reduced) and ``*.tp_out`` after a
  row layer or a vocab-parallel embedding (the partial sums are all-reduced; a row
  layer's bias is added after that);
- ``vocab_size`` and ``max_seq_len`` attributes (optional: else the rows of the embedding
  that reads the tokens, and no limit);
- initial weights: the factory's own initialization, recorded on the meta device and
  replayed per slice from the seed (``hspmd.models.initial``); ``hf:DIR`` (a Hugging Face
  folder: ``hspmd.models.hf``) starts from its safetensors weights;
- packed documents (``load_model(..., packed=True)``): the graph takes ``segments`` too and
  every causal SDPA runs per document (``hspmd.graph.documents``); a model whose attention
  takes a mask, or that calls no SDPA, must take ``segments`` itself, else it is refused;
- attention heads: every SDPA on ``(B, heads, T, hd)`` gets the markers where context
  parallelism trades the sequence split for a heads split (``hspmd.models.heads``).

>>> import torch
>>> model = load_model("hspmd.models.examples:gpt2", {"num_layers": 2})
>>> model.num_layers, model.hidden_size, model.param_kind("layers.0.attn.q.weight")
(2, 32, 'column')
>>> [str(m) for m in model.markers()][2:5]
['layers.0.attn.q.tp_in L0 dup (B,T,32)', 'layers.0.attn.q L0 heads (B,T,4,8)', 'layers.0.attn.k L0 heads (B,T,4,8)']
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.overrides import TorchFunctionMode

from hspmd.errors import HspmdError
from hspmd.graph.capture import CaptureError, source_line
from hspmd.graph.documents import keep_documents_apart
from hspmd.graph.export import (
    SEGMENTS_INPUT,
    TOKEN_INPUTS,
    ExportError,
    GraphInput,
    LengthRangeError,
    capture_step,
    user_frame,
)
from hspmd.graph.portable import captured_cache
from hspmd.markers import is_reshard_node, reshard
from hspmd.models.calling import (
    check_fields,
    convention_of,
    document_arguments,
    fields_call,
    step_call,
)
from hspmd.models.heads import PLACEMENT, insert_head_markers
from hspmd.models.hf import build_hf, hf_config, hf_directory, training_masks
from hspmd.models.spec import (
    NO_LIMIT,
    TIED_LAYER,
    TP_KINDS,
    BatchField,
    MarkerSpec,
    ModelSpecError,
    ModuleModel,
    ParamInfo,
    Placement,
    kind_by_rules,
)
from hspmd.models.tp_structure import structural_kinds
from hspmd.userfiles import import_file

__all__ = [
    "build_module",
    "capture_model",
    "load_factory",
    "load_model",
    "on_meta",
]

CAPTURE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""The compute dtypes a graph is captured in, by their ``--dtype`` names."""


class FactoryError(ModelSpecError):
    """The user's factory raised (its own exception is the cause)."""


def load_factory(source: str) -> Callable[..., nn.Module]:
    """The callable ``source`` names: ``path/to/file.py:NAME``, ``package.module:NAME``, or
    ``hf:DIR`` (a Hugging Face folder's config: ``hspmd.models.hf``)."""
    directory = hf_directory(source)
    if directory is not None:
        return functools.partial(build_hf, directory)
    where, sep, attr = source.rpartition(":")
    if not sep or not where or not attr:
        raise ModelSpecError(
            f"--model {source!r}: name a factory as FILE.py:FUNCTION or package.module:FUNCTION "
            "(or a preset: llama-tiny, llama-small)"
        )
    if where.endswith(".py"):
        module = _load_file(Path(where))
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as error:
            raise ModelSpecError(f"--model {source!r}: cannot import {where}: {error}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ModelSpecError(
            f"--model {source!r}: {where} has no callable {attr!r} "
            f"(it defines {', '.join(n for n in dir(module) if not n.startswith('_'))})"
        )
    return factory


def _load_file(path: Path) -> Any:
    path = path.expanduser().resolve()
    if not path.is_file():
        raise ModelSpecError(f"--model: no file {path}: give the path of a Python file")
    try:
        return import_file(path, "hspmd_user_")
    except Exception as error:
        raise ModelSpecError(f"--model: {path} failed to import: {error!r}") from error


# In-place random fills whose meta-device kernels are Python references behind
# ``torch._disable_dynamo``: the first call imports torch._dynamo (8-13 s per process here).
_RANDOM_FILLS = frozenset({"normal_", "exponential_", "log_normal_", "cauchy_", "geometric_"})


class _SkipRandomFillsOnMeta(TorchFunctionMode):
    """Return a meta tensor unchanged from an in-place random fill: on the meta device it
    computes nothing, and its shape and dtype stay what they were."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _RANDOM_FILLS:  # torch.nn.init passes keywords
            first = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(first, torch.Tensor) and first.is_meta:
                return first
        return func(*args, **kwargs)


@contextmanager
def on_meta() -> Iterator[None]:
    """Build modules on the meta device, skipping the random fills of their initializers.

    >>> with on_meta():
    ...     layer = nn.Embedding(4, 2)
    >>> layer.weight.is_meta, tuple(layer.weight.shape)
    (True, (4, 2))
    """
    with torch.device("meta"), _SkipRandomFillsOnMeta():
        yield


def build_module(source: str, kwargs: Mapping[str, Any]) -> nn.Module:
    """Call the factory (on the default device: wrap in ``on_meta()`` for shapes)."""
    factory = load_factory(source)
    try:
        module = factory(**kwargs)
    except TypeError as error:
        raise ModelSpecError(
            f"--model {source}: the factory rejected {dict(kwargs)}: {error}"
        ) from None
    except HspmdError:
        raise
    except Exception as error:
        where = user_frame(error)
        raise FactoryError(
            f"--model {source}: the factory raised {type(error).__name__}: {error}"
            f"{f' at {where}' if where else ''}"
        ) from error
    if not isinstance(module, nn.Module):
        raise ModelSpecError(
            f"--model {source}: the factory returned a {type(module).__name__}, not an nn.Module"
        )
    return module


# -- capture with the markers hspmd inserts ----------------------------------------------------


def _blocks(module: nn.Module, source: str) -> tuple[str, nn.ModuleList]:
    named = getattr(module, "hspmd_blocks", None)
    if isinstance(named, str):
        found = module.get_submodule(named) if named else None
        if not isinstance(found, nn.ModuleList):
            raise ModelSpecError(f"{source}: hspmd_blocks={named!r} is not an nn.ModuleList")
        return named, found
    lists = [(n, m) for n, m in module.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ModelSpecError(
            f"{source}: {type(module).__name__} has no nn.ModuleList of blocks: put the blocks "
            "in one (pipeline stages cut between them) or set hspmd_blocks"
        )
    longest = max(len(m) for _, m in lists)
    best = [(n, m) for n, m in lists if len(m) == longest]
    if len(best) > 1:
        raise ModelSpecError(
            f"{source}: several ModuleLists of {longest} modules ({', '.join(n for n, _ in best)}): "
            "set the module's hspmd_blocks to the name of the blocks"
        )
    return best[0]


def _prefix(param: str) -> str:
    return param.rsplit(".", 1)[0] if "." in param else param


_LINEAR = torch.ops.aten.linear.default
_EMBEDDING = torch.ops.aten.embedding.default


def _weight_of(user: torch.fx.Node) -> Any:
    """The weight argument of a linear (``(x, w, b)``) or an embedding (``(w, ids)``)."""
    return user.args[1] if user.target is _LINEAR else user.args[0]


def _insert_tp_markers(gm: torch.fx.GraphModule, kinds: Mapping[str, str], source: str) -> None:
    """The markers of Megatron's layout around every column, row and vocab parameter's op."""
    graph = gm.graph
    inputs_marked: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in list(graph.nodes):
        kind = kinds.get(str(node.target)) if node.op == "get_attr" else None
        if kind is None or kind == "replicate":
            continue
        for user in list(node.users):
            _check_tp_use(node, user, kind, source)
            if _weight_of(user) is not node:
                continue  # the bias of a column layer: split with its weight, nothing to add
            if kind == "row" or user.target is _EMBEDDING:
                _mark_output(graph, user, f"{_prefix(str(node.target))}.tp_out")
            else:  # column, or a vocab-parallel head: its input is duplicate in the stage
                x = user.args[0]
                assert isinstance(x, torch.fx.Node)
                if x not in inputs_marked:
                    with graph.inserting_after(x):
                        marked = graph.call_function(
                            reshard, (x, f"{_prefix(str(node.target))}.tp_in")
                        )
                    inputs_marked[x] = marked
                user.replace_input_with(x, inputs_marked[x])
    graph.lint()
    gm.recompile()


def _check_tp_use(param: torch.fx.Node, user: torch.fx.Node, kind: str, source: str) -> None:
    allowed = (_LINEAR,) if kind == "row" else (_LINEAR, _EMBEDDING)
    if user.target in allowed:
        return
    where = source_line(user) or source
    raise ModelSpecError(
        f"{param.target} is {kind}-parallel by the model's tp_rules, but it feeds "
        f"{getattr(user.target, '__name__', user.target)} at {where}: hspmd splits only "
        "weights of nn.Linear (and vocab-parallel nn.Embedding); use one, or make it replicate"
    )


def _mark_output(graph: torch.fx.Graph, user: torch.fx.Node, name: str) -> None:
    """``reshard(user, name)`` in place of ``user``; a row layer's bias moves after it."""
    bias = user.args[2] if user.target is _LINEAR and len(user.args) > 2 else None
    if user.target is _LINEAR and bias is not None:
        user.args = (user.args[0], user.args[1])
        user.kwargs = {}
    with graph.inserting_after(user):
        marked = graph.call_function(reshard, (user, name))
    last = marked
    if isinstance(bias, torch.fx.Node):
        with graph.inserting_after(marked):
            last = graph.call_function(torch.ops.aten.add.Tensor, (marked, bias))
    user.replace_all_uses_with(last, delete_user_cb=lambda n: n is not marked)


Items = tuple[str, tuple[BatchField, ...]]
"""A dataset's items as a model's inputs: how the forward takes them, and their fields."""


def capture_model(
    module: nn.Module, kinds: Mapping[str, str], source: str, items: Items | None = None,
    *, packed: bool = False,
) -> tuple[torch.fx.GraphModule, bool]:  # fmt: skip
    """The module's graph with hspmd's markers; True if the module placed its own.
    ``items``: the module is called with a dataset's fields, not (tokens, targets); the
    fields the first block's input depends on come first among the graph's inputs.
    ``packed``: the step takes ``segments`` and keeps documents apart (module docstring)."""
    _, blocks = _blocks(module, source)
    call = step_call(convention_of(module))
    inputs = TOKEN_INPUTS + ((SEGMENTS_INPUT,) if packed else ())
    if items is not None:
        structure, fields = items
        check_fields(module, structure, [f.name for f in fields], source)
        call = fields_call(structure, [f.name for f in fields])
        inputs = tuple(GraphInput(f.name, f.shape, f.dtype) for f in fields)
    gm = _export(module, list(blocks), source, call, inputs, items is not None)
    names = [str(n.args[1]) for n in gm.graph.nodes if is_reshard_node(n)]
    own = len(names) != len(set(names))  # the module's own layers.{i}.input and ours
    if own:
        gm = _export(module, None, source, call, inputs, items is not None)
    _first_inputs_first(gm)
    if packed:
        _keep_documents_apart(gm, module, source)
    _insert_tp_markers(gm, kinds, source)
    if items is None:  # the heads of every attention, for context parallelism
        insert_head_markers(gm, kinds)
    _split_tied(gm)
    return gm, own


def _first_inputs_first(gm: torch.fx.GraphModule) -> None:
    """Move the inputs block 0's input depends on before the others: a stage's first
    input is the one a later stage replaces by the activation it receives."""
    before = _before_first_block(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    ordered = sorted(placeholders, key=lambda n: n not in before)
    if ordered == placeholders:
        return
    anchor = next(n for n in gm.graph.nodes if n.op != "placeholder")
    for node in ordered:  # each moved to the end of the placeholders, in order
        anchor.prepend(node)
    for node in ordered[:-1]:  # a default only on the last (packed ids read before block 0)
        node.args = ()
    gm.graph.lint()
    gm.recompile()


def _export(
    module: nn.Module, blocks: list[nn.Module] | None, source: str, call: Any,
    inputs: tuple[GraphInput, ...], fields: bool,
) -> torch.fx.GraphModule:  # fmt: skip
    """``capture_step`` of ``call`` on ``inputs``; a Hugging Face model's masks as eager
    builds them for training (``hspmd.models.hf.training_masks``), unless that holds only
    for some of its lengths. ``fields``: the inputs are a dataset's."""
    try:
        if convention_of(module) != "hf" or fields:
            return capture_step(module, call=call, blocks=blocks, inputs=inputs)
        try:
            with training_masks(causal_skip=True):
                return capture_step(module, call=call, blocks=blocks, inputs=inputs,
                                    max_length=_max_len(module))  # fmt: skip
        except LengthRangeError:  # e.g. a sliding window shorter than the longest length
            with training_masks(causal_skip=False):
                return capture_step(module, call=call, blocks=blocks, inputs=inputs)
    except ExportError as error:
        hint = "" if fields else " (a forward of other inputs than tokens: give --dataset)"
        raise CaptureError(f"{source}: {error}{hint}") from error


def _keep_documents_apart(gm: torch.fx.GraphModule, module: nn.Module, source: str) -> None:
    segments = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.target == "segments")
    segments.args = ()  # required: a packed step always has its documents' ids
    found = keep_documents_apart(gm.graph, segments)
    gm.recompile()
    convention = convention_of(module)
    if "segments" in document_arguments(module, convention):
        return  # the forward keeps documents apart itself where its attention has a mask
    if found.dropped:
        return  # refused in one line before launch: hspmd.train.packing.check_packed_dropout
    if found.masked:
        where = source_line(found.masked[0]) or found.masked[0].name
        why = f"its attention at {where} takes a mask, which hspmd cannot keep to one document"
    elif not found.replaced:
        why = "its graph has no F.scaled_dot_product_attention to run per document"
    else:
        return
    raise ModelSpecError(
        f"{source} cannot train on packed documents (--tokens-per-step): {why}. A model must "
        "call F.scaled_dot_product_attention(q, k, v, is_causal=True) without a mask (hspmd "
        "runs it per document), or take `segments` in its forward and keep documents apart "
        "itself"
    )


def _split_tied(gm: torch.fx.GraphModule) -> None:
    """A weight read both before the first block (the embedding) and after it (a tied
    head) gets a second ``get_attr`` node for the later reads, so that each stage's copy
    has a node of its own (``hspmd.specialize.cut.tied_annotations``)."""
    graph = gm.graph
    before = _before_first_block(gm)
    if not before:
        return
    params = {name for name, _ in gm.named_parameters()}
    for node in list(graph.nodes):
        if node.op != "get_attr" or node not in before or str(node.target) not in params:
            continue  # buffers (rotary tables) are constants every stage computes
        later = [user for user in node.users if user not in before]
        if not later:
            continue
        with graph.inserting_after(node):
            second = graph.get_attr(str(node.target))
        second.meta = {**node.meta, TIED_LAYER: "last"}
        for user in later:
            user.replace_input_with(node, second)
    graph.lint()
    gm.recompile()


def _tied(gm: torch.fx.GraphModule, num_layers: int) -> tuple[tuple[str, int], ...]:
    return tuple(
        (str(n.target), num_layers - 1)
        for n in gm.graph.nodes
        if n.op == "get_attr" and n.meta.get(TIED_LAYER) == "last"
    )


# -- metadata ------------------------------------------------------------------------------------


# Megatron's layout by the projection names most decoder families use (Llama, Mistral,
# Qwen2, Gemma; nanoGPT's and GPT-2's MLP), for a model that gives no tp_rules. Only a
# parameter of an nn.Linear (or nn.Embedding for vocab) takes its kind: HF GPT-2's Conv1D
# of the same name stays replicate, and fused projections (c_attn, qkv_proj) are not named.
COMMON_TP_RULES: tuple[tuple[str, str], ...] = (
    ("*.q_proj.*", "column"), ("*.k_proj.*", "column"), ("*.v_proj.*", "column"),
    ("*.o_proj.weight", "row"),
    ("*.gate_proj.*", "column"), ("*.up_proj.*", "column"), ("*.down_proj.weight", "row"),
    ("*.mlp.c_fc.*", "column"), ("*.mlp.c_proj.weight", "row"),
    ("*embed_tokens.weight", "vocab"), ("lm_head.weight", "vocab"), ("*.wte.weight", "vocab"),
)  # fmt: skip


def _rules(module: nn.Module, source: str) -> tuple[tuple[str, str], ...]:
    rules = getattr(module, "tp_rules", None)
    if rules is None:
        return _common_rules(module)
    if not isinstance(rules, Mapping):
        raise ModelSpecError(f"{source}: tp_rules must be a dict of pattern -> kind, not {rules!r}")
    return _checked(tuple((str(p), str(k)) for p, k in rules.items()), source)


def _common_rules(module: nn.Module) -> tuple[tuple[str, str], ...]:
    """``COMMON_TP_RULES`` as exact names, kept where the parameter's module is one hspmd
    splits (``nn.Linear``; ``nn.Embedding`` or ``nn.Linear`` for a vocab weight)."""
    found = []
    for name, _ in module.named_parameters():
        kind = kind_by_rules(name, COMMON_TP_RULES)
        owner = module.get_submodule(_prefix(name)) if "." in name else module
        fits = isinstance(owner, nn.Linear) or (kind == "vocab" and isinstance(owner, nn.Embedding))
        if kind != "replicate" and fits:
            found.append((name, kind))
            bias = getattr(owner, "bias", None) if kind == "vocab" else None
            if isinstance(bias, nn.Parameter):  # a vocab-parallel head's bias: split with it
                found.append((f"{_prefix(name)}.bias", kind))
    return tuple(found)


def _with_structure(
    module: nn.Module, blocks: str, rules: tuple[tuple[str, str], ...], capture: tuple[Any, ...]
) -> tuple[tuple[str, str], ...]:
    """``rules`` (the common names) with the blocks' linears' kinds as the graph captured
    with them shows Megatron's pairs (``hspmd.models.tp_structure``); a module's own
    ``tp_rules`` as they are."""
    if getattr(module, "tp_rules", None) is not None:
        return rules
    # the arguments of _load's own capture (its cache keys them as given, dtype included):
    # where the graph confirms the names, that capture is this one
    source, kwargs, items, packed, dtype = capture
    gm = _capture(source, kwargs, rules, items, packed, dtype)[0]
    found = structural_kinds(gm, module, blocks)
    named = dict(rules)
    kept = tuple((n, k) for n, k in rules if n not in found)
    out = kept + tuple((n, k) for n, k in found.items() if k != "replicate" or n in named)
    return rules if dict(out) == named else out  # the same kinds: the same capture


def _checked(rules: tuple[tuple[str, str], ...], source: str) -> tuple[tuple[str, str], ...]:
    for pattern, kind in rules:
        if kind not in TP_KINDS:
            raise ModelSpecError(
                f"{source}: tp_rules[{pattern!r}] = {kind!r}: choose one of {', '.join(TP_KINDS)}"
            )
    return rules


def _shapes(
    gm: torch.fx.GraphModule, samples: tuple[torch.Tensor, ...]
) -> dict[str, tuple[int, ...]]:
    """Output shape of every marker on the inputs ``samples``, run on the meta device."""
    found: dict[str, tuple[int, ...]] = {}

    class Recorder(torch.fx.Interpreter):
        def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
            out = super().call_function(target, args, kwargs)
            if target is reshard:
                found[str(args[1])] = tuple(out.shape)
            return out

        def run_node(self, n: torch.fx.Node) -> Any:
            try:
                return super().run_node(n)
            except Exception as error:
                raise _not_symbolic(n, samples, error) from error

    recorder = Recorder(gm)
    recorder.extra_traceback = False  # the error is one line of ours
    recorder.run(*samples)
    return found


def _not_symbolic(
    node: torch.fx.Node, samples: tuple[torch.Tensor, ...], error: Exception
) -> ModelSpecError:
    """A graph captured at one length that fails at another: the forward's Python made
    its shapes from the sample's sizes (a loop over positions, a scan unrolled)."""
    where = source_line(node)
    at = f" at {where}" if where else ""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return ModelSpecError(
        f"the captured forward fails on inputs of shape {list(samples[0].shape)}{at}: "
        f"{first}. Its shapes follow the capture's sample sizes, not the batch and the "
        "length (a Python loop over positions, such as an unrolled scan): write it with "
        "tensor ops over the whole sequence"
    )


def _samples(
    gm: torch.fx.GraphModule, rows: tuple[int, ...], items: Items | None, packed: bool = False
) -> tuple[torch.Tensor, ...]:
    """Meta inputs of ``rows`` leading dims: tokens and targets (and packed documents'
    segments), or a dataset's fields."""
    if items is None:
        tokens = torch.zeros(rows, dtype=torch.long, device="meta")
        return (tokens, tokens, tokens) if packed else (tokens, tokens)
    fields = {f.name: f for f in items[1]}
    return tuple(
        GraphInput(str(n.target), fields[str(n.target)].shape, fields[str(n.target)].dtype).sample(rows[0])
        for n in gm.graph.nodes if n.op == "placeholder"
    )  # fmt: skip


aten_sym_size = torch.ops.aten.sym_size.int


def _ancestors_of(gm: torch.fx.GraphModule, marker: str) -> set[torch.fx.Node]:
    """The marker ``marker`` and every node it depends on (empty: no such marker)."""
    first = next((n for n in gm.graph.nodes if is_reshard_node(n) and n.args[1] == marker), None)
    before: set[torch.fx.Node] = set()
    stack = [] if first is None else [first]
    while stack:
        node = stack.pop()
        if node not in before:
            before.add(node)
            stack.extend(node.all_input_nodes)
    return before


def _before_first_block(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The ``layers.0.input`` marker and every node it depends on (empty: no such marker)."""
    return _ancestors_of(gm, "layers.0.input")


def params_before_first_block(gm: torch.fx.GraphModule) -> set[str]:
    """The ``get_attr`` targets (parameters, buffers) that block 0's input depends on."""
    return {str(n.target) for n in _before_first_block(gm) if n.op == "get_attr"}


def _param_layers(
    gm: torch.fx.GraphModule, names: list[str], num_layers: int, blocks: str
) -> dict[str, int]:
    """Block ``i``'s parameters (``{blocks}.{i}.*``): layer i; others: layer 0 if the first block's input
    depends on them, else the last layer."""
    used_before = params_before_first_block(gm)
    layers = {}
    depth = blocks.count(".") + 1
    for name in names:
        parts = name.split(".")
        if name.startswith(blocks + ".") and parts[depth].isdigit():
            layers[name] = int(parts[depth])
        else:
            layers[name] = 0 if name in used_before else num_layers - 1
    return layers


def load_model(
    source: str,
    kwargs: Mapping[str, Any] | None = None,
    *,
    tp_rules: tuple[tuple[str, str], ...] | None = None,
    items: Items | None = None,
    packed: bool = False,
    dtype: str = "fp32",
) -> ModuleModel:
    """Read the model ``source`` names (module docstring) into a ``ModuleModel``;
    ``tp_rules`` go before the module's own (a plan's per-parameter annotations);
    ``items``: it trains on a dataset's items (``--dataset``), not on tokens; ``packed``:
    its graph (``model_graph``) takes packed documents' ``segments``; ``dtype``: the
    compute dtype its graph is captured in (``--dtype``: ``_capture``)."""
    kwargs = dict(kwargs or {})
    if dtype not in CAPTURE_DTYPES:
        raise ModelSpecError(f"dtype {dtype!r}: give one of {', '.join(CAPTURE_DTYPES)}")
    items_key = _items_key(_in_dtype(items, dtype))
    return _load(source, tuple(sorted(kwargs.items())), tp_rules, items_key, packed, dtype)


def _items_key(items: Items | None) -> Items | None:
    """The fields by name, layers unset: one capture however they were listed."""
    if items is None:
        return None
    structure, fields = items
    return structure, tuple(
        sorted((BatchField(f.name, f.shape, f.dtype) for f in fields), key=lambda f: f.name)
    )


@functools.lru_cache(maxsize=16)
def _load(
    source: str, kwargs: tuple[tuple[str, Any], ...],
    override: tuple[tuple[str, str], ...] | None, items: Items | None, packed: bool, dtype: str,
) -> ModuleModel:  # fmt: skip
    with on_meta():
        module = build_module(source, dict(kwargs))
    path, blocks = _blocks(module, source)
    rules = _with_structure(
        module, path, _rules(module, source), (source, kwargs, items, packed, dtype)
    )
    if override is not None:
        rules = _checked(override, source) + rules
    names = [n for n, _ in module.named_parameters()]
    kinds = {n: kind_by_rules(n, rules) for n in names}
    gm, own = _capture(source, kwargs, rules, items, packed, dtype)
    num_layers = len(blocks)
    max_len = NO_LIMIT if items is not None else _max_len(module)
    rows = (2,) if items is not None else (2, min(8, max_len))
    markers = _marker_shapes(gm, rows, items, source, packed)
    block_inputs = {shape for name, shape in markers if name.endswith(".input")}
    if len(block_inputs) != 1 or (items is None and len(next(iter(block_inputs))) != 1):
        what = "(B, T, H)" if items is None else "(B, ...)"
        raise ModelSpecError(
            f"{source}: the blocks' inputs have shapes {sorted(block_inputs)} after "
            f"{'(B, T)' if items is None else 'B'}; a pipeline stage receives one {what} stream: "
            "give every block the same"
        )
    stream = next(iter(block_inputs))
    layers_of, placements = _marker_layers(gm), _placements(gm)
    post = _post([name for name, _ in markers], path, num_layers)
    layers = _param_layers(gm, names, num_layers, path)
    shared = len(list(module.named_parameters(remove_duplicate=False))) > len(names)
    params = tuple(
        ParamInfo(n, tuple(p.shape), kinds[n], layers[n]) for n, p in module.named_parameters()
    )
    return ModuleModel(
        source=source,
        kwargs=kwargs,
        name=f"{type(module).__name__} ({source})",
        num_layers=num_layers,
        hidden_size=stream[-1] if stream else 1,
        vocab_size=_vocab_size(module, gm) if items is None else 0,
        max_seq_len=max_len,
        params=params,
        marker_specs=tuple(
            _marker_spec(name, trailing, layers_of, placements, post=name in post)
            for name, trailing in markers
        ),
        tp_rules=rules,
        tie_embeddings=shared,
        user_markers=own,
        blocks=path,
        convention=convention_of(module),
        tied=_tied(gm, num_layers),
        hf_config=_hf_config(module, source, dict(kwargs)),
        **_batch_fields(gm, items, num_layers, stream, source),
        ignore_index=_ignore_index(gm),
        packed=packed,
        dtype=dtype,
    )


def _marker_shapes(
    gm: torch.fx.GraphModule, rows: tuple[int, ...], items: Items | None, source: str,
    packed: bool,
) -> list[tuple[str, tuple[int, ...]]]:  # fmt: skip
    """Every marker's name and its shape after the ``rows`` dims (B, T; or B alone)."""
    shapes = _shapes(gm, _samples(gm, rows, items, packed))
    markers = []
    for node in gm.graph.nodes:
        if not is_reshard_node(node):
            continue
        name = str(node.args[1])
        shape = shapes[name]
        if shape[: len(rows)] != rows:
            what = "(batch, seq, ...)" if len(rows) == 2 else "(batch, ...)"
            raise ModelSpecError(
                f"{source}: marker {name} holds a tensor of shape {list(shape)}; hspmd cuts and "
                f"reshards {what} tensors only"
            )
        markers.append((name, shape[len(rows) :]))
    return markers


def _batch_fields(
    gm: torch.fx.GraphModule, items: Items | None, num_layers: int, stream: tuple[int, ...],
    source: str,
) -> dict[str, Any]:  # fmt: skip
    """A dataset model's fields in the graph's order, each with the layer whose stage
    reads it: 0 if block 0's input depends on it, else the last (after the blocks)."""
    if items is None:
        return {}
    structure, fields = items
    by_name = {f.name: f for f in fields}
    before = _before_first_block(gm)
    last = _ancestors_of(gm, f"layers.{num_layers - 1}.input")
    out = []
    for node in (n for n in gm.graph.nodes if n.op == "placeholder"):
        f = by_name[str(node.target)]
        if node in before:
            late = [
                u
                for u in node.users
                if u not in before and u.target not in (aten_sym_size, getattr)
            ]
            if late:
                raise ModelSpecError(
                    f"{source}: the field {f.name} is read before the first block and after it "
                    f"(at {source_line(late[0]) or late[0].name}): a pipeline passes a field to "
                    "the first stage or to the last, not to both; return it from the blocks' "
                    "stream or read it once"
                )
            layer = 0
        elif num_layers > 1 and node in last:
            raise ModelSpecError(
                f"{source}: the field {f.name} is read inside the blocks: a pipeline passes a "
                "field to the first stage (before the blocks) or to the last (after them)"
            )
        else:
            layer = num_layers - 1
        out.append(BatchField(f.name, f.shape, f.dtype, layer))
    return {"batch": tuple(out), "structure": structure, "stream": stream}


_CROSS_ENTROPY = torch.ops.aten.cross_entropy_loss.default


def _ignore_index(gm: torch.fx.GraphModule) -> int:
    """The ``ignore_index`` of the graph's cross-entropy (``F.cross_entropy``'s -100 where
    it has none, or several that differ)."""
    found = {
        int(n.args[4] if len(n.args) > 4 else n.kwargs.get("ignore_index", -100))
        for n in gm.graph.nodes
        if n.target is _CROSS_ENTROPY
    }
    return found.pop() if len(found) == 1 else -100


def _hf_config(module: nn.Module, source: str, kwargs: Mapping[str, Any]) -> str:
    """A Hugging Face model's config as canonical JSON: ``hf:DIR``'s config.json with the
    ``--config`` overrides, or the config of a factory's model; "" for other modules."""
    directory = hf_directory(source)
    if directory is not None:
        data = hf_config(directory, kwargs)
    else:
        to_dict = getattr(getattr(module, "config", None), "to_dict", None)
        if convention_of(module) != "hf" or not callable(to_dict):
            return ""
        data = to_dict()
    return json.dumps(data, sort_keys=True, default=str)


_LENGTH_FIELDS = ("max_seq_len", "max_position_embeddings", "n_positions", "block_size")


def _max_len(module: nn.Module) -> int:
    """The longest sequence the module takes: its ``max_seq_len`` attribute, or its
    config's (Hugging Face's ``max_position_embeddings``/``n_positions``, nanoGPT's
    ``block_size``); no limit if it states none."""
    for owner in (module, getattr(module, "config", None)):
        for name in _LENGTH_FIELDS:
            value = getattr(owner, name, None)
            if isinstance(value, int) and value > 0:
                return value
    return NO_LIMIT


def _marker_layers(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Each marker's layer by where it runs: that of the last block input before it (0
    before the first): a tied head's ``tp_in`` is on the last stage, not the embedding's."""
    out, current = {}, 0
    for node in gm.graph.nodes:
        if not is_reshard_node(node):
            continue
        name = str(node.args[1])
        if name.startswith("layers.") and name.endswith(".input"):
            current = int(name.split(".")[1])
        out[name] = current
    return out


def _placements(gm: torch.fx.GraphModule) -> dict[str, Placement]:
    """The placements hspmd gave the markers it inserted (``hspmd.models.heads``)."""
    return {
        str(n.args[1]): n.meta[PLACEMENT]
        for n in gm.graph.nodes
        if is_reshard_node(n) and PLACEMENT in n.meta
    }


def _marker_spec(
    name: str, trailing: tuple[int, ...], layers: Mapping[str, int],
    placements: Mapping[str, Placement], *, post: bool = False,
) -> MarkerSpec:  # fmt: skip
    """A block input is the stream (``residual``); so is the reduced output of a row layer
    or a vocab-parallel embedding (``*.tp_out``): under sequence parallelism the all-reduce
    there becomes a reduce-scatter of the sequence, and the column layers' inputs
    (``*.tp_in``, ``dup``) all-gather it (Megatron's sequence parallelism). An attention's
    heads markers carry their own (``hspmd.models.heads``)."""
    if name.startswith("layers.") and name.endswith(".input"):
        return MarkerSpec(name, int(name.split(".")[1]), "residual", trailing)
    placement: Placement = "residual" if name.endswith(".tp_out") else "dup"
    return MarkerSpec(name, layers[name], placements.get(name, placement), trailing, post)


def _post(names: list[str], blocks: str, num_layers: int) -> set[str]:
    """The markers after the last block (a vocab-parallel head's ``tp_in``), of ``names``
    in graph order: after the last block input and in no block (``{blocks}.{i}.*``).
    Under context parallelism their tensors are whole on the sequence (the Llama's
    ``head_in``): the loss runs on whole rows."""
    last = f"layers.{num_layers - 1}.input"
    after = names[names.index(last) + 1 :] if last in names else []
    return {n for n in after if not n.startswith((f"{blocks}.", "layers."))}


def _vocab_size(module: nn.Module, gm: torch.fx.GraphModule) -> int:
    size = getattr(module, "vocab_size", None)
    if size is None:
        size = getattr(getattr(module, "config", None), "vocab_size", None)
    if isinstance(size, int):
        return size
    tokens = next(n for n in gm.graph.nodes if n.op == "placeholder")
    for user in tokens.users:
        if user.target is _EMBEDDING:
            weight = user.args[0]
            assert isinstance(weight, torch.fx.Node)
            return int(gm.get_parameter(str(weight.target)).shape[0])
    return 256


@captured_cache(maxsize=16)  # a launcher sends its workers these (hspmd.graph.portable)
def _capture(
    source: str,
    kwargs: tuple[tuple[str, Any], ...],
    rules: tuple[tuple[str, str], ...],
    items: Items | None = None,
    packed: bool = False,
    dtype: str = "fp32",
) -> tuple[torch.fx.GraphModule, bool]:
    """The graph of the module cast to the compute ``dtype`` on the meta device (no values:
    initial weights stay the factory's fp32 ones, ``hspmd.models.initial``). A forward
    that reads a tensor's dtype (Hugging Face's RMSNorm casts back to its input's) is
    recorded as the run executes it: captured in fp32 and cast afterwards, the recorded
    ``.to(float32)`` would stay and mix dtypes."""
    with on_meta():
        module = build_module(source, dict(kwargs)).to(CAPTURE_DTYPES[dtype])
    kinds = {n: kind_by_rules(n, rules) for n, _ in module.named_parameters()}
    return capture_model(module, kinds, source, items, packed=packed)


def _in_dtype(items: Items | None, dtype: str) -> Items | None:
    """``items`` with their floating fields in the compute ``dtype``: the graph takes them
    as a run feeds them (``hspmd.train.loop``), and so does ``ModuleModel.batch``."""
    if items is None or dtype == "fp32":
        return items
    name = str(CAPTURE_DTYPES[dtype]).removeprefix("torch.")
    structure, fields = items
    return structure, tuple(
        replace(f, dtype=name) if getattr(torch, f.dtype).is_floating_point else f for f in fields
    )


def model_graph(model: ModuleModel) -> torch.fx.GraphModule:
    """The captured graph of ``model`` on the meta device, with its markers (shared: read
    only, docs/decisions.md "Shared caches"); with ``model.packed`` it takes ``segments``."""
    items = _items_key((model.structure, model.batch)) if model.batch else None
    return _capture(model.source, model.kwargs, model.tp_rules, items, model.packed, model.dtype)[0]
