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
the vocab-parallel loss's three all-reduces of one fp32 per token. Which ops and
collectives context parallelism splits and adds comes from deducing it as a TP 1 x CP
stage, where the model has attention-head markers (``hspmd.cost.splits``). Each node
belongs to the pre part, a block (``{blocks}.{i}`` in its module stack, or its inputs'
part), or the post part; the block figure is the mean over the blocks (the planner
assumes the blocks alike). Parameters per part come from the protocol (``param_layer``,
``param_kind``).

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

from hspmd.cost.splits import POST, PRE, Splits, cp_probe, cp_splits, node_parts, tp_splits
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

__all__ = ["costed", "model_cost", "planning_model", "tp_probe"]

aten = torch.ops.aten
NORMS = (F.layer_norm, F.group_norm, F.batch_norm, F.instance_norm) + (
    (F.rms_norm,) if hasattr(F, "rms_norm") else ()
) + (
    aten.layer_norm.default, aten.rms_norm.default, aten.group_norm.default,
    aten.batch_norm.default, aten.instance_norm.default,
)  # fmt: skip
CAUSAL = ("hspmd.attention", "causal_attention")  # hspmd's own, by name (the layering)
RMS_NORM = ("hspmd.fused_ops", "rms_norm")


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
    tp = {sp: tp_splits(model, probe, lengths[0], sp) for sp in (False, True)}
    cp_degree = cp_probe(model)
    cp = cp_splits(model, cp_degree, lengths[-1] - lengths[-1] % cp_degree)
    sums = _sums(model, lengths, tp, cp)
    comm = _comm(tp, cp)
    out: dict[int, PartCost] = {}
    for part in (PRE, 0, POST):
        share = 1 / model.num_layers if part == 0 else 1.0  # the mean block
        items = [
            WorkItem(
                line,
                a,
                b,
                values[0][0] * share,
                _fit([u for _, u in values], lengths, share),
                split_cp=c,
            )  # fmt: skip
            for (g, line, a, b, c), values in sorted(sums.items())
            if g == part
        ]
        mine = [
            dataclasses.replace(c, calls=c.calls * share, elements=_scaled(c.elements, share))
            for p, c in comm
            if _group(p) == part
        ]
        out[part] = PartCost(
            work=tuple(w for w in items if w.line != "saved"),
            comm=_merged_comm(mine),
            saved=tuple(w for w in items if w.line == "saved"),
            params_split=_params(model, part)[0],
            params_dup=_params(model, part)[1],
        )
    return ModelCost(
        pre=out[PRE], layer=out[0], post=out[POST], vocab_split=tp[False].vocab, probe=probe,
        lengths=lengths, hidden_size=model.hidden_size, cp_probe=cp_degree if cp else 1,
    )  # fmt: skip


Sums = dict[tuple[int, str, bool, bool, bool], list[list[float]]]
"""(part, line, split under TP, under TP with SP, under CP) -> per length [calls, units]."""


def _sums(
    model: ModelSpec, lengths: tuple[int, ...], tp: dict[bool, Splits], cp: Splits | None
) -> Sums:
    """Every measured op's calls and units, and the elements autograd keeps (``saved``, by
    whether their producer's output is a shard), by part and by what splits them."""
    gm = model_graph(model)
    group = {name: _group(part) for name, part in node_parts(model).items()}
    on_cp = cp.ops if cp else frozenset()
    sums: Sums = defaultdict(lambda: [[0.0, 0.0] for _ in lengths])
    for i, s in enumerate(lengths):
        ops, kept = _measure(gm, model, s)
        for node, line, calls, units in ops:
            key = (group[node], line, node in tp[False].ops, node in tp[True].ops, node in on_cp)
            sums[key][i][0] += calls
            sums[key][i][1] += units
        for consumer, producer, elements in kept:
            # a kept tensor is a shard where its producer's output is split (the planner's
            # memory model divides a CP stage's activations by its own rule)
            shard = (producer in tp[False].outputs, producer in tp[True].outputs)
            sums[(group[consumer], "saved", *shard, False)][i][1] += elements
    return sums


def _comm(tp: dict[bool, Splits], cp: Splits | None) -> list[tuple[int, CommItem]]:
    """The TP collectives (on ``1/cp`` of their tensor where CP splits it) and the CP
    stage's own (on ``1/tp`` of theirs where TP splits it), by part."""
    on_cp = cp.outputs if cp else frozenset()
    out = [
        (part, dataclasses.replace(c, split_cp=node in on_cp))
        for sp in (False, True)
        for part, node, c in tp[sp].comm
    ]
    for part, node, c in cp.comm if cp else ():
        out.append((part, dataclasses.replace(c, cp=True, split_tp=node in tp[False].outputs)))
    return out


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
    merged: dict[tuple[str, bool, bool, bool, bool, bool, bool], CommItem] = {}
    for c in items:
        key = (c.kind, c.backward, c.sequence_parallel, c.fp32, c.cp, c.split_cp, c.split_tp)
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
