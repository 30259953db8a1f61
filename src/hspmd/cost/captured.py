"""What any model costs per micro-batch, measured from its graph on the meta device.

``model_cost(model)`` runs the model's defined graph (``hspmd.models.build.model_graph``)
on the meta device at two sequence lengths and records, for every fx node, the aten ops it
dispatches:

- ``matmul``: FLOPs of ops ``torch.utils.flop_counter`` knows (mm, addmm, bmm,
  convolutions); ``attention``: ``F.scaled_dot_product_attention`` (and hspmd's causal
  attention) by formula, ``4 * B * heads * Tq * Tk * head_dim``, halved when causal, as a
  fused kernel runs it (its decomposition on the meta device is not counted);
- ``norm``: ``F.layer_norm``, ``F.rms_norm``, ``F.group_norm``, ``F.batch_norm`` (one call,
  its output's elements); ``elementwise``: every other op that writes a new tensor (views
  are free), its outputs' elements;
- ``saved``: the tensors autograd keeps for the backward (``saved_tensors_hooks``), by
  storage, parameters and buffers excluded; an attention keeps q, k, v, its output and
  one float per query and head (a fused kernel's log-sum-exp); what reads a marker that
  gathers a split tensor (sequence parallelism) keeps the shard, as the runtime does
  (``hspmd.runtime.regather``).

Each figure is fitted as ``b * s * (per_token + per_square * s)`` from the two lengths
(``hspmd.models.spec.Amount``). Which ops TP splits comes from deducing the graph as one
stage of TP ``probe`` (the smallest degree above 1 that the model's ``tp_sizes`` allow),
without and with sequence parallelism: an op is split when one of its tensors, input or
output, is split or partial there. The TP collectives are the deduced plans of the
markers (all-reduce, or reduce-scatter and all-gather under sequence parallelism), plus
the vocab-parallel loss's three all-reduces of one fp32 per token. Each node belongs to
the pre part, a block (``{blocks}.{i}`` in its module stack, or its inputs' part), or the
post part; the block figure is the mean over the blocks (the planner assumes the blocks
alike). Parameters per part come from the protocol (``param_layer``, ``param_kind``).

``costed(model)`` returns a ``ModuleModel`` with these figures attached (``cost``), which
the planner and the simulator read. A Llama preset keeps its formulas
(``hspmd.models.llama_cost``); ``model_cost`` on one is the check of this path
(tests/cost/test_captured.py).

>>> from hspmd.models.module import load_model
>>> cost = model_cost(load_model("hspmd.models.examples:gpt2", {"num_layers": 2}))
>>> cost.probe, cost.vocab_split, sorted(w.line for w in cost.layer.work if w.split)
(2, True, ['attention', 'elementwise', 'matmul'])
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from hspmd.annotation import DUP, Annotation
from hspmd.errors import HspmdError
from hspmd.graph.export import GraphInput
from hspmd.markers import is_reshard_node
from hspmd.models.build import model_graph, params_before_first_block
from hspmd.models.spec import (
    Amount,
    CommItem,
    ModelCost,
    ModelSpec,
    ModelSpecError,
    ModuleModel,
    PartCost,
    WorkItem,
)
from hspmd.plan.strategy import StrategyOptions, parse_strategy

__all__ = ["costed", "model_cost", "planning_model", "tp_probe"]

aten = torch.ops.aten
NORMS = (F.layer_norm, F.group_norm, F.batch_norm, F.instance_norm) + (
    (F.rms_norm,) if hasattr(F, "rms_norm") else ()
) + (
    aten.layer_norm.default, aten.rms_norm.default, aten.group_norm.default,
    aten.batch_norm.default, aten.instance_norm.default,
)  # fmt: skip
LOSSES = (F.cross_entropy, aten.cross_entropy_loss.default)
CAUSAL = ("hspmd.attention", "causal_attention")  # hspmd's own, by name (the layering)
RMS_NORM = ("hspmd.fused_ops", "rms_norm")
COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all")
PRE, POST = -1, -2  # parts that are not blocks


def costed(model: ModuleModel) -> ModuleModel:
    """``model`` with its cost figures (``model_cost``) attached, for the planner."""
    if model.cost is not None:
        return model
    if model.batch:
        raise ModelSpecError(
            f"{model.name} trains on a dataset's items (--dataset): hspmd's cost model prices "
            "models of token sequences (costs per token and length), so it cannot plan or "
            "simulate this one yet; `hspmd explain --dataset` shows its plan"
        )
    return dataclasses.replace(model, cost=model_cost(model))


def planning_model(model: ModelSpec) -> ModelSpec:
    """The model as the planner and the simulator take it: with its own cost function
    (``ModelSpec.cost``: a Llama preset's formulas), else with the figures measured on its
    captured graph (``costed``)."""
    if model.cost is not None:
        return model
    if not isinstance(model, ModuleModel):
        raise ModelSpecError(f"{model.name} has no cost function and no graph to measure one")
    return costed(model)


def tp_probe(model: ModelSpec) -> int:
    """The smallest TP degree above 1 that divides every size ``tp_sizes`` names; 1 where
    none does (or the model splits nothing)."""
    sizes = list(model.tp_sizes(0, model.num_layers - 1).values())
    if not sizes:
        return 1
    g = 0
    for size in sizes:
        g = math.gcd(g, size)
    return next((t for t in range(2, g + 1) if g % t == 0), 1)


@functools.lru_cache(maxsize=8)
def model_cost(model: ModelSpec) -> ModelCost:
    """The cost figures of ``model`` (module docstring); ModelSpecError naming what could
    not be measured and the fix."""
    probe = tp_probe(model)
    lengths = _lengths(model, probe)
    gm = model_graph(model)
    group = {name: _group(part) for name, part in _parts(gm, model).items()}
    split = {sp: _split_nodes(model, probe, lengths[0], sp) for sp in (False, True)}
    runs = len(lengths)
    # (group, line, split, split under SP) -> per length [calls, units]; "saved" for memory
    sums: dict[tuple[int, str, bool, bool], list[list[float]]] = defaultdict(
        lambda: [[0.0, 0.0] for _ in range(runs)]
    )
    for i, s in enumerate(lengths):
        ops, kept = _measure(gm, model, s)
        for node, line, calls, units in ops:
            key = (group[node], line, node in split[False][0], node in split[True][0])
            sums[key][i][0] += calls
            sums[key][i][1] += units
        for consumer, producer, elements in kept:
            # a kept tensor is a shard where its producer's output is split
            key = (group[consumer], "saved", producer in split[False][3], producer in split[True][3])  # fmt: skip
            sums[key][i][1] += elements
    out: dict[int, PartCost] = {}
    for part in (PRE, 0, POST):
        share = 1 / model.num_layers if part == 0 else 1.0  # the mean block
        items = [
            WorkItem(line, a, b, values[0][0] * share, _fit([u for _, u in values], lengths, share))
            for (g, line, a, b), values in sorted(sums.items())
            if g == part
        ]
        comm = [
            dataclasses.replace(c, calls=c.calls * share, elements=_scaled(c.elements, share))
            for sp in (False, True)
            for p, c in split[sp][1]
            if _group(p) == part
        ]
        out[part] = PartCost(
            work=tuple(w for w in items if w.line != "saved"),
            comm=_merged_comm(comm),
            saved=tuple(w for w in items if w.line == "saved"),
            params_split=_params(model, part)[0],
            params_dup=_params(model, part)[1],
        )
    return ModelCost(
        pre=out[PRE], layer=out[0], post=out[POST], vocab_split=split[False][2], probe=probe,
        lengths=lengths, hidden_size=model.hidden_size,
    )  # fmt: skip


def _group(part: int) -> int:
    """PRE, POST, or 0 for every block (the planner takes the mean block)."""
    return part if part < 0 else 0


def _lengths(model: ModelSpec, probe: int) -> tuple[int, ...]:
    """Two lengths that are multiples of ``probe`` (sequence parallelism splits them) within
    the model's limit; one where only one fits."""
    top = model.max_seq_len - model.max_seq_len % probe
    if top < probe:
        raise ModelSpecError(
            f"{model.name}: max_seq_len={model.max_seq_len} is below its TP degree {probe}: "
            "hspmd cannot measure its cost; raise max_seq_len"
        )
    s2 = min(8 * probe, top)
    s1 = (s2 // 2) - (s2 // 2) % probe
    return (s1, s2) if s1 >= probe else (s2,)


def _fit(units: list[float], lengths: tuple[int, ...], share: float) -> Amount:
    """``Amount`` through the units measured at ``lengths`` (batch 1), times ``share``."""
    per = [u / s for u, s in zip(units, lengths, strict=True)]
    if len(lengths) == 1:
        return Amount(per[0] * share)
    square = (per[1] - per[0]) / (lengths[1] - lengths[0])
    if square < 1e-9 * max(abs(per[0]), 1.0):  # linear (float noise, or a shrinking term)
        return Amount(per[1] * share)
    return Amount((per[0] - square * lengths[0]) * share, square * share)


def _scaled(amount: Amount, share: float) -> Amount:
    return Amount(amount.per_token * share, amount.per_square * share)


def _merged_comm(items: Iterable[CommItem]) -> tuple[CommItem, ...]:
    merged: dict[tuple[str, bool, bool, bool], CommItem] = {}
    for c in items:
        key = (c.kind, c.backward, c.sequence_parallel, c.fp32)
        if key in merged:
            m = merged[key]
            c = dataclasses.replace(
                c, calls=m.calls + c.calls,
                elements=Amount(m.elements.per_token + c.elements.per_token,
                                m.elements.per_square + c.elements.per_square),
            )  # fmt: skip
        merged[key] = c
    return tuple(merged[k] for k in sorted(merged))


def _params(model: ModelSpec, part: int) -> tuple[float, float]:
    """(split, whole) parameter counts of the pre part, one block (mean) or the post part.

    The protocol says only which layer's stage holds a parameter, so a pre- or post-part
    parameter is told from a block's by its name: a block's are ``{blocks}.{i}.*``."""
    blocks = getattr(model, "blocks", "layers")  # a ModuleModel names its own
    split = whole = 0.0
    for name, shape in model.parameter_shapes().items():
        layer = model.param_layer(name)
        in_block = name.startswith(f"{blocks}.{layer}.")
        mine = in_block if part == 0 else (not in_block and (layer == 0) == (part == PRE))
        if not in_block and model.num_layers == 1 and part != 0:  # layer 0 is also the last
            mine = _is_pre_param(model, name) == (part == PRE)
        if not mine:
            continue
        numel = float(math.prod(shape))
        if model.param_kind(name) == "replicate":
            whole += numel
        else:
            split += numel
    share = 1 / model.num_layers if part == 0 else 1.0
    return split * share, whole * share


def _is_pre_param(model: ModelSpec, name: str) -> bool:
    """For a one-block model (layer 0 is also the last): does ``name`` feed the block?"""
    return str(name) in params_before_first_block(model_graph(model))


# -- parts ---------------------------------------------------------------------------------------


def _parts(gm: torch.fx.GraphModule, model: ModelSpec) -> dict[str, int]:
    """Every node's part: a block index, PRE or POST (module docstring)."""
    blocks = getattr(model, "blocks", "layers")  # a ModuleModel names its own
    last = model.num_layers - 1
    out: dict[str, int] = {}
    current = PRE
    for node in gm.graph.nodes:
        if is_reshard_node(node) and str(node.args[1]).startswith("layers."):
            name = str(node.args[1])
            if name.endswith(".input") and name.split(".")[1].isdigit():
                current = int(name.split(".")[1])
                out[node.name] = current
                continue
        stack = node.meta.get("nn_module_stack") or {}
        block = None
        for path in stack:
            head, _, index = str(path).rpartition(".")
            if head == blocks and index.isdigit():
                block = int(index)
                break
        if block is not None:
            out[node.name] = block
        elif stack:  # a module outside the blocks
            out[node.name] = PRE if current == PRE else (POST if current == last else current)
        else:  # code of the top module, or a node hspmd inserted: its inputs' part
            known = {out[n.name] for n in node.all_input_nodes if n.name in out}
            if node.op == "get_attr" or not known:
                out[node.name] = PRE if current == PRE else POST if current == last else current
            else:  # the post part reads the blocks, the blocks the pre part
                out[node.name] = POST if POST in known else max(known)
    return out


# -- split: deduced at TP ``probe`` -----------------------------------------------------------------


def _is_split(annotation: Annotation | None) -> bool:
    if annotation is None:
        return False
    return any(deg > 1 and dim != DUP for ds in annotation.states for dim, deg in ds.entries)


def _is_gather(src: Annotation, dst: Annotation) -> bool:
    """A marker that gathers a tensor split over a real dimension into a duplicated one
    (under sequence parallelism; ``hspmd.runtime.regather`` keeps the shard for backward)."""
    real = any(deg > 1 and dim >= 0 for ds in src.states for dim, deg in ds.entries)
    return real and not _is_split(dst)


@functools.lru_cache(maxsize=16)
def _split_nodes(
    model: ModelSpec, probe: int, seq_len: int, sp: bool
) -> tuple[frozenset[str], tuple[tuple[int, CommItem], ...], bool, frozenset[str]]:
    """(nodes that run split, the TP collectives by part, whether the loss is vocab-parallel,
    nodes whose output is split: what autograd keeps of them is a shard) from deducing the
    graph as one stage of TP ``probe``."""
    if probe == 1:
        return frozenset(), (), False, frozenset()
    from hspmd.specialize.cut import deduce_pipeline

    last = model.num_layers - 1
    strategy = parse_strategy(f"1x1: R0-{probe - 1}:L0-{last}")
    options = StrategyOptions(sequence_parallel=sp)
    try:
        ag = deduce_pipeline(model, strategy.pipelines[0], options, seq_len=seq_len)
    except HspmdError as error:
        if sp:  # no sequence parallelism for this model: it splits as without
            plain, plain_comm, plain_vocab, plain_out = _split_nodes(model, probe, seq_len, False)
            as_sp = tuple(
                (p, dataclasses.replace(c, sequence_parallel=True)) for p, c in plain_comm
            )
            return plain, as_sp, plain_vocab, plain_out
        raise ModelSpecError(
            f"{model.name}: hspmd cannot cost it, deducing it at TP {probe} failed: {error}"
        ) from error
    gm = ag.module
    found, outputs = set(), set()
    for node in gm.graph.nodes:
        if _is_split(ag.annotations.get(node.name)):
            outputs.add(node.name)
        if node.op == "call_function" or node.op == "call_method" or node.op == "call_module":
            names = [node.name, *(n.name for n in node.all_input_nodes)]
            if any(_is_split(ag.annotations.get(n)) for n in names):
                found.add(node.name)
    parts = _parts(model_graph(model), model)
    tokens = seq_len  # the deduction's micro-batch: 1 sequence of seq_len tokens
    comm: list[tuple[int, CommItem]] = []
    for site in ag.reshards:
        if _is_gather(site.src, site.dst):  # backward gathers it again: a shard is kept
            outputs.add(site.node_name)
        part = parts.get(site.node_name, POST)
        per_token = math.prod(site.shape) / tokens
        plans = [(False, site.src, site.dst)]
        if site.grad_out is not None and site.grad_in is not None:
            plans.append((True, site.grad_out, site.grad_in))
        for backward, src, dst in plans:
            comm += _collectives(part, backward, sp, src, dst, site.shape, per_token)
    for align in ag.alignments:
        part = parts.get(align.source, POST)
        per_token = math.prod(align.shape) / tokens
        comm += _collectives(part, True, sp, align.grad_from, align.grad_to, align.shape, per_token)
    vocab = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in LOSSES:
            logits = node.args[0]
            if isinstance(logits, torch.fx.Node) and _is_split(ag.annotations.get(logits.name)):
                vocab = True
                item = CommItem("all-reduce", False, sp, 3.0, Amount(1.0), fp32=True)
                comm.append((POST, item))
    return frozenset(found), tuple(comm), vocab, frozenset(outputs)


def _collectives(
    part: int, backward: bool, sp: bool, src: Annotation, dst: Annotation,
    shape: tuple[int, ...], per_token: float,
) -> list[tuple[int, CommItem]]:  # fmt: skip
    from hspmd.comm.resolve import resolve

    out = []
    for kind in resolve(src, dst, shape).kinds:
        if kind in COLLECTIVES:
            out.append((part, CommItem(kind, backward, sp, 1.0, Amount(per_token))))
    return out


def _attention_kind(target: Any) -> str | None:
    """ "causal" for hspmd's causal attention, "sdpa" for F.scaled_dot_product_attention."""
    if target in (F.scaled_dot_product_attention, aten.scaled_dot_product_attention.default):
        return "sdpa"
    if _named(target) == CAUSAL:
        return "causal"
    return None


def _named(target: Any) -> tuple[str | None, str | None]:
    return getattr(target, "__module__", None), getattr(target, "__name__", None)


# -- measurement on the meta device --------------------------------------------------------------


class _Counter(TorchDispatchMode):
    """Ops and saved tensors, attributed to the fx node running (``node``)."""

    def __init__(self) -> None:
        super().__init__()
        self.node: str = ""
        self.quiet = False  # inside a node counted by formula (attention, norms)
        self.ops: list[tuple[str, str, float, float]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.quiet:
            return out
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outputs or any(r.alias_info is not None for r in func._schema.returns):
            return out  # views (and in-place ops) write nothing new
        counter = flop_registry.get(func._overloadpacket)
        if counter is not None:
            self.ops.append(
                (self.node, "matmul", 1.0, float(counter(*args, **kwargs, out_val=out)))
            )
        else:
            self.ops.append((self.node, "elementwise", 1.0, float(sum(t.numel() for t in outputs))))
        return out


def _measure(
    gm: torch.fx.GraphModule, model: ModelSpec, seq_len: int
) -> tuple[list[tuple[str, str, float, float]], list[tuple[str, str, float]]]:
    """(ops: node, line, calls, units; saved: consumer node, producer node, elements) of one
    forward at batch 1, ``seq_len`` tokens, on the meta device."""
    counter = _Counter()
    saves = _Saves(counter)
    inputs = _meta_inputs(gm, seq_len)
    try:
        with counter, torch.autograd.graph.saved_tensors_hooks(saves.pack, lambda t: t):
            _CostRun(gm, counter, saves).run(*inputs)
    except HspmdError:
        raise
    except Exception as error:
        raise ModelSpecError(
            f"{model.name}: hspmd cannot cost it, its forward failed on the meta device at "
            f"length {seq_len}: {error!r}; make forward run on meta tensors (no .item(), no "
            "data-dependent shapes)"
        ) from error
    return counter.ops, list(saves.saved.values())


def _meta_inputs(gm: torch.fx.GraphModule, seq_len: int) -> list[torch.Tensor]:
    """One meta tensor per graph input at batch 1 (``GraphInput.sample``), read from the
    placeholders: each symbolic dim (the sequence) at ``seq_len``; tokens, targets and
    packed documents' segments (one document) are int64 zeros."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                trailing = tuple(
                    None if isinstance(d, torch.SymInt) else int(d) for d in val.shape[1:]
                )
                spec = GraphInput(node.name, trailing, str(val.dtype).removeprefix("torch."))
            else:
                spec = GraphInput(node.name, (None,))
            out.append(spec.sample(1, seq_len))
    return out


class _Saves:
    """What autograd saves during the run (by storage): the node that saves it, the
    node that made it, its elements."""

    def __init__(self, counter: _Counter) -> None:
        self.counter = counter
        self.producer: dict[int, str] = {}  # storage -> node that made it
        self.constant: set[int] = set()
        self.saved: dict[int, tuple[str, str, float]] = {}
        self.alive: list[torch.Tensor] = []  # storages stay unique while the run records them

    @staticmethod
    def key(t: torch.Tensor) -> int:
        return int(t.untyped_storage()._cdata)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """The saved-tensors hook: record ``t`` as saved by the running node."""
        self.alive.append(t)
        k = self.key(t)
        if k not in self.constant and not isinstance(t, torch.nn.Parameter):
            numel = float(t.untyped_storage().nbytes() / max(t.element_size(), 1))
            if k not in self.saved or self.saved[k][2] < numel:
                node = self.counter.node
                self.saved[k] = (node, self.producer.get(k, node), numel)
        return t

    def produced(self, n: torch.fx.Node, tensors: list[torch.Tensor]) -> None:
        """Node ``n`` made ``tensors`` (constants are never counted as saved)."""
        self.alive.extend(tensors)
        for t in tensors:
            k = self.key(t)
            if n.op == "get_attr":
                self.constant.add(k)
            elif is_reshard_node(n):
                # an identity here, a new tensor on the ranks (a gather under SP):
                # what reads it afterwards saves the marker's layout, not its input's
                self.producer[k] = n.name
            else:
                self.producer.setdefault(k, n.name)


class _CostRun(torch.fx.Interpreter):
    """Runs the graph node by node, telling the counter and the saves which node runs;
    attention and norms are counted by formula."""

    def __init__(self, gm: torch.fx.GraphModule, counter: _Counter, saves: _Saves) -> None:
        super().__init__(gm)
        self.counter, self.saves = counter, saves

    def run_node(self, n: torch.fx.Node) -> Any:
        counter = self.counter
        counter.node = n.name
        target = n.target
        if n.op == "call_function" and _attention_kind(target) is not None:
            return self._attention(n)
        quiet = n.op == "call_function" and (target in NORMS or _named(target) == RMS_NORM)
        counter.quiet = quiet
        try:
            result = super().run_node(n)
        finally:
            counter.quiet = False
        tensors = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
        if quiet:
            counter.ops.append((n.name, "norm", 1.0, float(sum(t.numel() for t in tensors))))
        self.saves.produced(n, tensors)
        return result

    def _attention(self, n: torch.fx.Node) -> Any:
        counter, saves = self.counter, self.saves
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        q, k, v = args[:3]
        for t in (q, k, v):
            saves.pack(t)
        counter.quiet = True
        with torch.no_grad():  # nothing saved: a fused kernel's saves are counted below
            out = n.target(*args, **kwargs)  # type: ignore[operator]
        counter.quiet = False
        flag = args[5] if len(args) > 5 else kwargs.get("is_causal")  # ATen: positional
        causal = _attention_kind(n.target) == "causal" or bool(flag)
        flops = 4 * q.shape[:-2].numel() * q.shape[-2] * k.shape[-2] * q.shape[-1]
        counter.ops.append((n.name, "attention", 1.0, flops / (2 if causal else 1)))
        # a fused kernel's output is laid out (B, T, heads, D) under its (B, heads, T, D)
        # view, so the usual transpose and reshape to (B, T, H) is a view, not a copy
        if out.dim() == 4:
            out = out.transpose(1, 2).contiguous().transpose(1, 2)
        out = out.detach().requires_grad_(q.requires_grad)
        saves.producer.setdefault(saves.key(out), n.name)
        saves.saved[saves.key(out)] = (n.name, n.name, float(out.numel()))
        lse = float(q.shape[:-1].numel())  # one float per query and head
        saves.saved[-len(saves.saved) - 1] = (n.name, n.name, lse)
        return out
