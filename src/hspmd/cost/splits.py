"""What TP and CP split in a captured graph: deduced as one stage at a probe degree.

``hspmd.cost.captured`` measures a model's ops at their whole sizes; which of them each
rank runs on a shard, and which collectives a stage adds, come from deducing the graph as
one stage of the smallest degree the model allows, the way the trainer deduces it:

- ``tp_splits``: TP ``probe`` (without or with sequence parallelism). An op is split when
  one of its tensors, input or output, is split or partial; the collectives are the
  markers' resolved plans (all-reduce, or reduce-scatter and all-gather under sequence
  parallelism) and the vocab-parallel loss's three all-reduces of one fp32 per token;
- ``cp_splits``: TP 1 x CP ``probe`` (Ulysses, docs/models.md "Context parallelism"). An
  op is split when a tensor of it is split (the sequence, or the heads after the
  all-to-all: either way a rank does ``1/cp`` of it); the collectives are the CP stage's
  own: the four all-to-alls of each attention, the gather of the sequence before a
  vocab-parallel head (and of the embedding's gradient), and what the fallback gathers
  where an op cannot run on a sequence split (GPT-2's ``Conv1D``). None where the model
  has no attention-head markers or its deduction refuses CP: the planner then offers none.

Every node belongs to a part (``node_parts``): ``PRE`` (before block 0), a block index, or
``POST`` (after the last block, the loss included).

>>> from hspmd.models.module import load_model
>>> model = load_model("hspmd.models.examples:gpt2", {"num_layers": 2})
>>> found = cp_splits(model, cp_probe(model), 16)
>>> cp_probe(model), sorted({c.kind for _, _, c in found.comm})
(2, ['all-gather', 'all-to-all'])
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import torch.fx
import torch.nn.functional as F

from hspmd.annotation import DUP, Annotation
from hspmd.comm.resolve import resolve
from hspmd.errors import HspmdError
from hspmd.markers import is_reshard_node
from hspmd.models.build import model_graph
from hspmd.models.spec import HEADS, Amount, CommItem, ModelSpec, ModelSpecError
from hspmd.plan.strategy import Strategy, StrategyOptions, parse_strategy

__all__ = ["POST", "PRE", "Splits", "cp_probe", "cp_splits", "node_parts", "tp_splits"]

LOSSES = (F.cross_entropy, torch.ops.aten.cross_entropy_loss.default)
COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all")
PRE, POST = -1, -2  # parts that are not blocks


@dataclass(frozen=True, slots=True)
class Splits:
    """What one probe deduction found: the nodes that run split (``ops``), the nodes whose
    output is split (``outputs``: what autograd keeps of them is a shard), the collectives
    by part with the node each runs at (``comm``), and whether the loss is vocab-parallel."""

    ops: frozenset[str] = frozenset()
    outputs: frozenset[str] = frozenset()
    comm: tuple[tuple[int, str, CommItem], ...] = ()
    vocab: bool = False


def node_parts(model: ModelSpec) -> dict[str, int]:
    """Every node's part of ``model``'s graph: a block index, PRE or POST (module docstring):
    by the ``{blocks}.{i}`` in its module stack, else the part its inputs are in."""
    gm = model_graph(model)
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
def tp_splits(model: ModelSpec, probe: int, seq_len: int, sp: bool) -> Splits:
    """``Splits`` of ``model`` deduced as one stage of TP ``probe`` (module docstring);
    ModelSpecError where the deduction fails (under sequence parallelism: as without)."""
    if probe == 1:
        return Splits()
    strategy = parse_strategy(f"1x1: R0-{probe - 1}:L0-{model.num_layers - 1}")
    try:
        found = _deduced(model, strategy, sp=sp, seq_len=seq_len)
    except HspmdError as error:
        if sp:  # no sequence parallelism for this model: it splits as without
            plain = tp_splits(model, probe, seq_len, False)
            comm = tuple(
                (p, n, dataclasses.replace(c, sequence_parallel=True)) for p, n, c in plain.comm
            )
            return Splits(plain.ops, plain.outputs, comm, plain.vocab)
        raise ModelSpecError(
            f"{model.name}: hspmd cannot cost it, deducing it at TP {probe} failed: {error}"
        ) from error
    return found


def cp_probe(model: ModelSpec) -> int:
    """The smallest CP degree above 1 that divides the heads of every attention-head marker
    (TP 1); 1 where the model has none."""
    counts = [m.trailing[0] for m in model.markers() if m.placement in HEADS]
    g = 0
    for count in counts:
        g = math.gcd(g, count)
    return next((c for c in range(2, g + 1) if g % c == 0), 1)


@functools.lru_cache(maxsize=16)
def cp_splits(model: ModelSpec, probe: int, seq_len: int) -> Splits | None:
    """``Splits`` of ``model`` deduced as one stage of TP 1 x CP ``probe`` (module
    docstring); None where the model takes no CP (``probe`` 1, or deduction refuses it)."""
    if probe == 1 or seq_len < probe or seq_len % probe:
        return None
    last = model.num_layers - 1
    # two sequences: a sequence split survives an op that merges (B, T) into one dim only
    # where B is 1 (GPT-2's Conv1D), which a training micro-batch seldom is
    strategy = parse_strategy(f"1x2: R0-{probe - 1}:L0-{last}:C{probe}")
    try:
        return _deduced(model, strategy, sp=False, seq_len=seq_len)
    except HspmdError:
        return None


def _deduced(model: ModelSpec, strategy: Strategy, *, sp: bool, seq_len: int) -> Splits:
    """The ``Splits`` of one deduction of ``model`` as the single pipeline of ``strategy``."""
    from hspmd.specialize.cut import deduce_pipeline

    pipeline = strategy.pipelines[0]
    ag = deduce_pipeline(model, pipeline, StrategyOptions(sequence_parallel=sp), seq_len=seq_len)
    ops, outputs = set(), set()
    for node in ag.module.graph.nodes:
        if _is_split(ag.annotations.get(node.name)):
            outputs.add(node.name)
        if node.op in ("call_function", "call_method", "call_module"):
            names = [node.name, *(n.name for n in node.all_input_nodes)]
            if any(_is_split(ag.annotations.get(n)) for n in names):
                ops.add(node.name)
    parts = _with_inserted(ag.module, node_parts(model))
    tokens = seq_len * pipeline.micro_batch_size  # the deduction's micro-batch
    comm: list[tuple[int, str, CommItem]] = []
    for site in ag.reshards:
        if _is_gather(site.src, site.dst):  # backward gathers it again: a shard is kept
            outputs.add(site.node_name)
        plans = [(False, site.src, site.dst)]
        if site.grad_out is not None and site.grad_in is not None:
            plans.append((True, site.grad_out, site.grad_in))
        # the first block's input is where the pre part's whole rows meet the stage's
        # layout (a CP stage's slice, its backward the embedding gradient's gather): the
        # first stage's, as the pre part
        part = PRE if site.name == "layers.0.input" else parts.get(site.node_name, POST)
        for backward, src, dst in plans:
            comm += _collectives(part, site.node_name, backward, sp, src, dst, site.shape, tokens)
    for align in ag.alignments:
        comm += _collectives(parts.get(align.source, POST), align.source, True, sp,
                             align.grad_from, align.grad_to, align.shape, tokens)  # fmt: skip
    vocab = False
    for node in ag.module.graph.nodes:
        if node.op == "call_function" and node.target in LOSSES:
            logits = node.args[0]
            if isinstance(logits, torch.fx.Node) and _is_split(ag.annotations.get(logits.name)):
                vocab = True
                item = CommItem("all-reduce", False, sp, 3.0, Amount(1.0), fp32=True)
                comm.append((POST, node.name, item))
    return Splits(frozenset(ops), frozenset(outputs), tuple(comm), vocab)


def _collectives(
    part: int, node: str, backward: bool, sp: bool, src: Annotation, dst: Annotation,
    shape: tuple[int, ...], tokens: int,
) -> list[tuple[int, str, CommItem]]:  # fmt: skip
    per_token = math.prod(shape) / tokens
    return [
        (part, node, CommItem(kind, backward, sp, 1.0, Amount(per_token)))
        for kind in resolve(src, dst, shape).kinds
        if kind in COLLECTIVES
    ]


def _with_inserted(gm: torch.fx.GraphModule, parts: dict[str, int]) -> dict[str, int]:
    """``parts`` with the nodes deduction inserted (the fallback's gathers, alignments):
    each in the part its inputs are in."""
    out = dict(parts)
    for node in gm.graph.nodes:
        if node.name not in out:
            known = {out[n.name] for n in node.all_input_nodes if n.name in out}
            out[node.name] = (POST if POST in known else max(known)) if known else POST
    return out
