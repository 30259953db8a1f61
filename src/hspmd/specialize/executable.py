"""Per-rank executable graphs: the rank's stage of the model, specialized (paper 6.2).

``build_executable(config, strategy, options, rank, seq_len=, seed=)`` returns an
``Executable``: an fx GraphModule of the rank's ops only, on local tensors, plus the
rank's parameter slices. Steps:

1. ``hspmd.specialize.cut``: deduce the plan of the rank's pipeline and cut the stage out: from the tokens (stage 0) or the ``layers.{first}.input``
   marker's output (a new placeholder, the activation the previous stage sends) to the
   loss (last stage) or the residual stream entering ``layers.{last+1}.input``.
   Constants (RoPE tables, sizes) the stage needs stay; the sizes read from
   ``tokens.shape`` read the activation's shape instead (``stage_shape``: same B and T);
2. markers inside the stage become ``ReshardModule`` calls holding the resolved forward
   plan ``resolve(src, dst)`` and backward plan ``resolve(grad_out, grad_in)``; markers
   whose plans both do nothing vanish. Align nodes (deduction's, where consumers give a
   tensor's gradient different annotations) become ``ReshardModule`` calls with an
   identity forward and the backward ``resolve(grad_from, grad_to)``. Pipeline
   boundaries stay with the trainer (``hspmd.specialize.boundary``);
3. localize: parameters are the rank's slices of the plan-free global init (DESIGN 5),
   view/reshape constants become local sizes, the embedding becomes vocab-parallel, and a
   cross-entropy on vocab-split logits becomes a ``VocabParallelLoss`` call
   (``hspmd.specialize.loss``; its runner is bound by the runtime like a marker's).

The sequence length is symbolic (DESIGN decision 14): deduction and resolution run once at
``seq_len``, the maximum; the graph reads B and T from its inputs, so one executable runs
every length up to it that is a multiple of ``Executable.length_multiple`` (1, or the TP
degree under sequence parallelism, or the CP degree), its plans sized per call
(``hspmd.comm.sizing``).

The result is data: the ``ReshardModule`` calls hold their plans and no process group.
``hspmd.runtime.executable.bind_executable(exe, world)`` gives each one the runtime's
autograd reshard on ``world`` (and moves the graph to the world's device)::

    reshard_embed = self.reshard_embed(vocab_parallel_embedding)  # embed: all-reduce

>>> from hspmd.models.llama import get_config
>>> from hspmd.plan.strategy import StrategyOptions, parse_strategy
>>> exe = build_executable(get_config("llama-tiny", num_layers=2),
...     parse_strategy("2x1: R0:L0 R1:L1"), StrategyOptions(), 1, seq_len=8, seed=0)
>>> next(line for line in exe.graph_module.code.splitlines() if "def " in line)
'def forward(self, activation, targets, segments = None, key = None):'
>>> sorted(exe.params)[:1]
['head.weight']
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from hspmd.annotation import Piece
from hspmd.comm.plan import CommPlan
from hspmd.comm.resolve import resolve
from hspmd.comm.sizing import length_multiple
from hspmd.deduce import AnnotatedGraph
from hspmd.gcpause import paused_gc
from hspmd.markers import is_align_node, is_reshard_node
from hspmd.models.build import constant, initial_piece
from hspmd.models.spec import ModelSpec
from hspmd.plan.strategy import Strategy, StrategyOptions
from hspmd.randomness import draws_mask, mask_ops
from hspmd.specialize.align import align_plans
from hspmd.specialize.cut import ExecutableError, cut, deduce_pipeline, locate
from hspmd.specialize.dropout import counter_call
from hspmd.specialize.grad_sync import StageGradSync, stage_grad_sync
from hspmd.specialize.localize import local_view_sizes, vocab_parallel_embedding
from hspmd.specialize.loss import CROSS_ENTROPY, VocabParallelLoss, vocab_shard
from hspmd.specialize.recompute import checkpoint_layers, layer_of

__all__ = [
    "Executable",
    "ExecutableError",
    "ReshardModule",
    "VocabParallelLoss",
    "build_executable",
    "deduce_pipeline",
    "executable_groups",
    "locate",
    "reshard_plans",
    "stage_shape",
]

Runner = Callable[[torch.Tensor, CommPlan, CommPlan], torch.Tensor]

aten = torch.ops.aten
_SIZED = frozenset(
    {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}
)  # ATen ops whose second argument lists the output's sizes
_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}  # cross_entropy_loss's enum

SEQ_DIM = 1
"""The sequence dim of tokens (B, T) and activations (B, T, H): the symbolic length."""


def stage_shape(x: torch.Tensor, shape: tuple[int, ...], x_length: int) -> torch.Size:
    """``shape`` (a tensor's local shape at the maximum length) at the length of this call:
    its sequence dim scaled by ``x.shape[1] / x_length`` (the stage input's length now and
    at the maximum).

    >>> stage_shape(torch.zeros(2, 3, 8), (2, 12), 6)      # SP input: 3 of 6 positions
    torch.Size([2, 6])
    """
    out = list(shape)
    if x_length:  # 0: no sequence dim (a dataset's fields)
        out[SEQ_DIM] = shape[SEQ_DIM] * x.shape[SEQ_DIM] // x_length
    return torch.Size(out)


class ReshardModule(nn.Module):
    """A marker in an executable graph: its forward and backward plans, as data.

    ``runner(x, forward_plan, backward_plan)`` executes them; the runtime sets it
    (``hspmd.runtime.executable.bind_executable``), specialization leaves it None.
    """

    def __init__(
        self, name: str, forward: CommPlan, backward: CommPlan, *, runner: Runner | None = None
    ):
        super().__init__()
        self.name, self.forward_plan, self.backward_plan = name, forward, backward
        self.runner = runner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.runner is None:
            raise ExecutableError(
                f"marker {self.name!r} communicates ({self.extra_repr()}): bind the "
                "executable to a world first: "
                "hspmd.runtime.executable.bind_executable(exe, world)"
            )
        return self.runner(x, self.forward_plan, self.backward_plan)

    def extra_repr(self) -> str:
        fwd, bwd = self.forward_plan.kinds, self.backward_plan.kinds
        return f"{self.name}: forward {'+'.join(fwd)}, backward {'+'.join(bwd)}"


@dataclass(eq=False)
class Executable:
    """One rank's stage program (``hspmd.train.loop.StageProgram``).

    ``forward(x, targets, segments=None, key=None)``: ``x`` is the micro-batch's tokens on
    stage 0, else the activation received from the previous stage (a dataset's model: its
    first field, ``targets`` the others, a tuple where there are several); ``segments`` the
    document ids of packed rows (``hspmd.attention``); ``key`` the step and the
    micro-batch's rows of the global batch, from which dropout draws its masks
    (``hspmd.randomness.dropout_key``; needed only where the stage drops); returns the
    mean token loss of the micro-batch on the last stage, else the residual stream to send on. Any sequence length up to the
    ``seq_len`` it was built for runs (a multiple of ``length_multiple``): the graph reads
    lengths from its inputs, and the runtime sizes each plan per call
    (``hspmd.comm.sizing``).
    """

    graph_module: torch.fx.GraphModule
    params: dict[str, torch.Tensor]  # parameter name -> local slice (a leaf Parameter)
    pieces: dict[str, Piece]  # parameter name -> the global region it holds
    rank: int
    pipeline: int
    stage: int
    layers: tuple[int, int]
    comm: tuple[str, ...]  # one line per kept marker: name, forward and backward kinds
    grad_sync: tuple[StageGradSync, ...] = ()  # deduced partial grads inside the stage
    seq_len: int = 0  # the maximum sequence length (plans are resolved at it)
    around: AbstractContextManager[object] | None = None  # entered around each forward (runtime)

    @property
    def length_multiple(self) -> int:
        """Sequence lengths this executable runs are multiples of this (``comm.sizing``)."""
        out = 1
        for plan in reshard_plans(self.graph_module):
            out = math.lcm(out, length_multiple(plan, SEQ_DIM))
        return out

    def forward(
        self,
        x: torch.Tensor,
        targets: torch.Tensor | tuple[torch.Tensor, ...],
        segments: torch.Tensor | None = None,
        key: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rest = targets if isinstance(targets, tuple) else (targets,)
        with self.around or nullcontext():
            out = self.graph_module(x, *rest, segments, key)
        assert isinstance(out, torch.Tensor)
        return out

    __call__ = forward

    def __str__(self) -> str:
        first, last = self.layers
        head = f"rank {self.rank}: pipeline {self.pipeline} stage {self.stage} L{first}-{last}"
        sync = [f"grad sync {item}" for item in self.grad_sync]
        return "\n".join([head, *(f"  {line}" for line in (*self.comm, *sync))])


def _check_supported(config: ModelSpec, options: StrategyOptions) -> None:
    unsupported = ["zero1"] if options.zero1 else []
    if options.dtype != "fp32":
        unsupported.append(f"dtype={options.dtype}")
    if unsupported:
        raise ExecutableError(
            f"executable graphs do not support {', '.join(unsupported)} yet: "
            "train in fp32 without them"
        )


def executable_groups(strategy: Strategy) -> list[tuple[int, ...]]:
    """Process groups executables use (every stage's ranks, and on a context-parallel
    stage its TP and CP groups): prepare them on EVERY rank of the world, idle ones
    included, before building: ``world.prepare_groups(...)``."""
    groups = set()
    for _, _, s in strategy.stages():
        for group in (s.ranks, *s.tp_groups, *s.cp_groups):
            if len(group) > 1:
                groups.add(tuple(sorted(group)))
    return sorted(groups)


# -- building the executable graph ------------------------------------------------------------


@dataclass(slots=True)
class _Builder:
    """Copies the kept nodes into a new graph, specializing each for ``rank``."""

    ag: AnnotatedGraph
    config: ModelSpec
    rank: int
    seed: int
    graph: torch.fx.Graph = dataclasses.field(default_factory=torch.fx.Graph)
    root: dict[str, Any] = dataclasses.field(default_factory=dict)
    env: dict[torch.fx.Node, Any] = dataclasses.field(default_factory=dict)
    pieces: dict[str, Piece] = dataclasses.field(default_factory=dict)
    comm: list[str] = dataclasses.field(default_factory=list)
    key: torch.fx.Node | None = None  # the executable's dropout key input
    mask_ops: dict[torch.fx.Node, int] = dataclasses.field(default_factory=dict)

    def local_shape(self, node: torch.fx.Node) -> tuple[int, ...]:
        ann, shape = self.ag.annotations.get(node.name), self.ag.shape(node.name)
        if ann is None:
            return shape
        if self.rank not in ann:
            raise ExecutableError(
                f"node {node.name} ({node.format_node()}) is annotated {ann}, without rank "
                f"{self.rank}, yet the rank's stage computes it: check the plan's markers"
            )
        return ann.piece(self.rank, shape).shape

    def copy(self, node: torch.fx.Node) -> None:
        before = len(self.graph.nodes)
        self._copy(node)
        new = self.env[node]
        if isinstance(new, torch.fx.Node) and len(self.graph.nodes) > before:
            new.meta["layer"] = layer_of(node, blocks=self.config.blocks)  # recompute per layer

    def swapped(self, node: torch.fx.Node, x: torch.fx.Node, x_length: int) -> None:
        """An earlier stage's tensor read for its shape or dtype: the stage input stands in
        for it, and its shape is ``stage_shape`` of the input: the local shape at the
        maximum length with the sequence length of the call (under sequence parallelism
        the received residual holds T / tp positions of the T the RoPE tables need)."""
        self.env[node] = x
        for user in node.users:
            if user.target is getattr and user.args[1] == "shape":
                shape = self._elsewhere_shape(node)
                self.env[user] = self.graph.call_function(stage_shape, (x, shape, x_length))
            elif user.target is aten.sym_size.int:  # a captured graph's size read
                shape = self._elsewhere_shape(node)
                sizes = self.graph.call_function(stage_shape, (x, shape, x_length))
                self.env[user] = self.graph.call_function(operator.getitem, (sizes, user.args[1]))

    def _elsewhere_shape(self, node: torch.fx.Node) -> tuple[int, ...]:
        """The local shape of a tensor an earlier stage holds (the same on its ranks)."""
        ann, shape = self.ag.annotations.get(node.name), self.ag.shape(node.name)
        if ann is None:
            return shape
        sizes = {ann.piece(r, shape).shape for r in ann.ranks}
        if len(sizes) != 1:
            raise ExecutableError(
                f"node {node.name} is annotated {ann}: its shape differs between ranks, so "
                "a later stage cannot read it; make it duplicate inside its stage"
            )
        return sizes.pop()

    def _copy(self, node: torch.fx.Node) -> None:
        if node in self.env:
            return  # a shape read of a swapped tensor: already a constant
        if node.op == "get_attr":
            self.attr(node)
        elif is_reshard_node(node):
            self.marker(node)
        elif is_align_node(node):
            self.align(node)
        elif draws_mask(node):
            self.dropout(node)
        elif node.op == "call_method" and node.target in ("view", "reshape"):
            self.view(node)
        elif node.target in _SIZED:
            self.sized(node)
        elif node.target is F.embedding:
            self.embedding(node)
        elif node.target is aten.embedding.default:
            self.embedding(node, weight_first=True)
        elif node.target in CROSS_ENTROPY:
            self.cross_entropy(node)
        else:
            self.env[node] = self.graph.node_copy(node, self.env.__getitem__)

    def attr(self, node: torch.fx.Node) -> None:
        target = str(node.target)
        name = self.ag.params.get(node.name)
        if name is None:  # a buffer: the Llama's RoPE tables, say
            self.root[target] = constant(self.config, target, seed=self.seed)
        elif target not in self.root:  # a tied weight's second node reads the same one
            piece = self.ag.annotations[node.name].piece(self.rank, self.ag.shape(node.name))  # type: ignore[union-attr]
            local = initial_piece(self.config, name, seed=self.seed, region=piece.region)
            self.root[target] = nn.Parameter(local)
            self.pieces[name] = piece
        self.env[node] = self.graph.get_attr(target)

    def marker(self, node: torch.fx.Node) -> None:
        name = str(node.args[1])
        site = self.ag.reshard(name)
        forward = resolve(site.src, site.dst, site.shape)
        assert site.grad_out is not None and site.grad_in is not None, name
        backward = resolve(site.grad_out, site.grad_in, site.shape)
        source = self.env[node.args[0]]  # type: ignore[index]
        if not forward.steps and not backward.steps:
            self.env[node] = source
            return
        module = ReshardModule(name, forward, backward)
        target = "reshard_" + name.replace(".", "_")
        self.root[target] = module
        self.comm.append(module.extra_repr())
        self.env[node] = self.graph.call_module(target, (source,))

    def align(self, node: torch.fx.Node) -> None:
        """An align node: identity forward, its gradient resharded (hspmd.specialize.align)."""
        site, source = self.ag.alignment(node.name), self.env[node.args[0]]  # type: ignore[index]
        forward, backward = align_plans(site) if site is not None else (None, None)
        if forward is None or backward is None or not backward.steps:
            self.env[node] = source
            return
        module = ReshardModule(str(node.args[1]), forward, backward)
        self.root["align_" + node.name] = module
        self.comm.append(module.extra_repr())
        self.env[node] = self.graph.call_module("align_" + node.name, (source,))

    def dropout(self, node: torch.fx.Node) -> None:
        """Dropout, or attention with dropout: drawn by position on the rank's block
        (``hspmd.specialize.dropout``)."""
        assert self.key is not None
        ann, shape = self.ag.annotations.get(node.name), self.ag.shape(node.name)
        op = self.mask_ops[node]
        module, args = counter_call(
            node, self.ag.module.graph, shape_of=self.ag.shape, seed=self.seed, op=op,
            piece=None if ann is None else ann.piece(self.rank, shape),
        )  # fmt: skip
        self.root[f"dropout_{op}"] = module
        mapped = torch.fx.node.map_arg(args, self.env.__getitem__)
        self.env[node] = self.graph.call_module(f"dropout_{op}", (*mapped, self.key))

    def view(self, node: torch.fx.Node) -> None:
        source, *sizes = node.args
        packed = len(sizes) == 1 and isinstance(sizes[0], list | tuple)
        flat = list(sizes[0]) if packed else sizes  # type: ignore[arg-type]
        local = self._local_sizes(node, flat)
        new_sizes = (tuple(local),) if packed else tuple(local)
        args = (self.env[source], *new_sizes)  # type: ignore[index]
        self.env[node] = self.graph.call_method(str(node.target), args, {})

    def _local_sizes(self, node: torch.fx.Node, sizes: list[Any]) -> list[Any]:
        """A view's sizes written for the global shape, made local to this rank."""
        full, here = self.ag.shape(node.name), self.local_shape(node)
        mapped = torch.fx.node.map_arg(
            list(local_view_sizes(sizes, full, here)), self.env.__getitem__
        )
        local: list[Any] = list(mapped)
        for dim, size in enumerate(sizes):
            if isinstance(size, torch.fx.Node) and full[dim] != here[dim] and self._whole(size):
                # a size read from a tensor that is whole on this rank: the global size
                local[dim] = self.graph.call_function(
                    operator.floordiv, (self.env[size], full[dim] // here[dim])
                )
        return local

    def sized(self, node: torch.fx.Node) -> None:
        """An ATen view/reshape/expand: ``view``'s localization of its size list."""
        source, sizes, *rest = node.args
        assert isinstance(sizes, list | tuple)
        local = self._local_sizes(node, list(sizes))
        args = (self.env[source], local, *rest)  # type: ignore[index]
        self.env[node] = self.graph.call_function(node.target, args, dict(node.kwargs))  # type: ignore[arg-type]

    def _whole(self, size: torch.fx.Node) -> bool:
        """True if ``size`` reads a dim of a tensor that is whole on this rank (``x.size()[i]``,
        ``x.size(i)``, ``x.shape[i]``): its runtime value is then the global size."""
        source: Any = None
        dim: Any = None
        if size.target is operator.getitem and isinstance(size.args[1], int):
            parent = size.args[0]
            if isinstance(parent, torch.fx.Node) and (
                (parent.op == "call_method" and parent.target == "size" and len(parent.args) == 1)
                or (parent.target is getattr and parent.args[1] == "shape")
            ):
                source, dim = parent.args[0], size.args[1]
        elif (
            size.op == "call_method"
            and size.target == "size"
            and len(size.args) == 2
            or size.target is aten.sym_size.int
        ):
            source, dim = size.args[0], size.args[1]
        if not isinstance(source, torch.fx.Node) or not isinstance(dim, int):
            return False
        shape, ann = self.ag.shape(source.name), self.ag.annotations.get(source.name)
        if ann is not None and self.rank not in ann:  # an earlier stage's: its shape there
            return self._elsewhere_shape(source)[dim] == shape[dim]
        return self.local_shape(source)[dim] == shape[dim]

    def embedding(self, node: torch.fx.Node, *, weight_first: bool = False) -> None:
        tokens, weight = node.args[0], node.args[1]
        if weight_first:  # aten.embedding(weight, ids)
            tokens, weight = weight, tokens
        assert isinstance(weight, torch.fx.Node) and isinstance(tokens, torch.fx.Node)
        piece = self.pieces[self.ag.params[weight.name]]
        if piece.shape == self.ag.shape(weight.name):
            self.env[node] = self.graph.node_copy(node, self.env.__getitem__)
            return
        start = piece.region[0][0]
        args = (self.env[tokens], self.env[weight], start)
        self.env[node] = self.graph.call_function(vocab_parallel_embedding, args)

    def cross_entropy(self, node: torch.fx.Node) -> None:
        """Logits split on the class dim: the vocab-parallel loss (hspmd.specialize.loss)."""
        logits = node.args[0]
        assert isinstance(logits, torch.fx.Node)
        ann = self.ag.annotations.get(logits.name)
        shard = None
        if ann is not None and self.ag.shape(logits.name)[1:2]:
            ignore_index, reduction = _loss_options(node)
            shard = vocab_shard(
                ann,
                self.ag.shape(logits.name),
                self.rank,
                ignore_index=ignore_index,
                reduction=reduction,
            )
        if shard is None:
            self.env[node] = self.graph.node_copy(node, self.env.__getitem__)
            return
        module = VocabParallelLoss(shard)
        self.root["vocab_parallel_loss"] = module
        self.comm.append(f"loss: {shard}")
        args = torch.fx.node.map_arg(node.args[:2], self.env.__getitem__)
        self.env[node] = self.graph.call_module("vocab_parallel_loss", args)


def _loss_options(node: torch.fx.Node) -> tuple[int, str]:
    """``(ignore_index, reduction)`` of ``F.cross_entropy`` or ``aten.cross_entropy_loss``."""
    if node.target is aten.cross_entropy_loss.default:
        defaults = (None, None, None, 1, -100)  # (x, t, weight, reduction, ignore_index)
        args = (*node.args, *defaults[len(node.args) :])
        reduction = node.kwargs.get("reduction", args[3])
        ignore_index = node.kwargs.get("ignore_index", args[4])
        return int(ignore_index), _REDUCTIONS[int(reduction)]  # type: ignore[arg-type]
    kwargs = node.kwargs
    return int(kwargs.get("ignore_index", -100)), str(kwargs.get("reduction", "mean"))  # type: ignore[arg-type]


@paused_gc()  # millions of objects that live on: hspmd.gcpause
def build_executable(
    config: ModelSpec,
    strategy: Strategy,
    options: StrategyOptions,
    rank: int,
    *,
    seq_len: int,
    seed: int,
    gather_logits: bool = False,
) -> Executable:
    """The executable graph of ``rank`` (see the module docstring), on the CPU.

    Markers that communicate (TP > 1) run once the runtime binds it to a world:
    ``hspmd.runtime.executable.bind_executable(exe, world)``. The loss is the vocab-parallel
    cross-entropy where the last stage's TP degree is above 1; ``gather_logits=True``
    all-gathers the logits and runs ``F.cross_entropy`` on every TP rank instead (the
    earlier path, kept for comparison).
    """
    _check_supported(config, options)
    p, s = locate(strategy, rank)
    pipeline = strategy.pipelines[p]
    stage = pipeline.stages[s]
    ag = deduce_pipeline(config, pipeline, options, seq_len=seq_len, gather_logits=gather_logits)
    stage_cut = cut(ag, stage, config.num_layers)
    b = _Builder(ag, config, rank, seed, mask_ops=mask_ops(ag.module.graph))
    x, inputs = _placeholders(b, first_stage=stage_cut.start is None)
    # the local length of the stage input at seq_len (the sizes of swapped tensors scale
    # by it; 0: a dataset's fields, whose sizes are static)
    x_length = seq_len if stage_cut.start is None else b.local_shape(stage_cut.start)[SEQ_DIM]
    x_length = 0 if getattr(config, "batch", ()) else x_length
    for node in ag.module.graph.nodes:
        if node.op == "placeholder" and node.target in inputs:
            b.env[node] = inputs[str(node.target)]
        elif node is stage_cut.start or (node.op == "placeholder" and stage_cut.start is None):
            b.env[node] = x  # the tokens on stage 0, else the received activation
        elif node in stage_cut.swap:
            b.swapped(node, x, x_length)
        elif node in stage_cut.keep:
            b.copy(node)
    b.graph.output(b.env[stage_cut.end])
    gm = torch.fx.GraphModule(b.root, b.graph, class_name=f"Rank{rank}Stage")
    named = dict(gm.named_parameters())
    params: dict[str, torch.Tensor] = {name: named[name] for name in b.pieces}
    recomputed = stage.recomputed(options)
    if recomputed:  # the stage's first layers (:RC<k>, --recompute-layers), or all of them
        gm = checkpoint_layers(gm, upto=stage.first_layer + recomputed - 1)
        assert all(params[n] is p for n, p in _params_by_target(gm, params)), "split copied"
    return Executable(
        graph_module=gm,
        params=params,
        pieces=b.pieces,
        rank=rank,
        pipeline=p,
        stage=s,
        layers=(stage.first_layer, stage.last_layer),
        comm=tuple(b.comm),
        grad_sync=_grad_sync(ag, b.pieces, rank),
        seq_len=seq_len,
    )


def _placeholders(b: _Builder, *, first_stage: bool) -> tuple[torch.fx.Node, dict[str, Any]]:
    """The executable's inputs: the stage input (the graph's first input on stage 0, else
    the activation received), the graph's other inputs by name (targets; a dataset's other
    fields), ``segments`` and ``key`` (None by default)."""
    first, *rest = [n for n in b.ag.module.graph.nodes if n.op == "placeholder"]
    x = b.graph.placeholder(str(first.target) if first_stage else "activation")
    names = [str(n.target) for n in rest if n.target != "segments"]
    inputs: dict[str, Any] = {name: b.graph.placeholder(name) for name in names}
    inputs["segments"] = b.graph.placeholder("segments", default_value=None)
    b.key = b.graph.placeholder("key", default_value=None)
    return x, inputs


def _params_by_target(
    gm: torch.fx.GraphModule, params: dict[str, torch.Tensor]
) -> Iterable[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every parameter the (split) graph holds, by object."""
    by_id = {id(p): n for n, p in params.items()}
    for p in gm.parameters():
        yield by_id.get(id(p), "?"), p


def _grad_sync(
    ag: AnnotatedGraph, pieces: dict[str, Piece], rank: int
) -> tuple[StageGradSync, ...]:
    nodes = {}  # a tied weight has a node per stage: the one on this rank's
    for node, name in ag.params.items():
        ann = ag.annotations[node]
        if ann is not None and rank in ann:
            nodes[name] = node
    table = {}
    for name in pieces:
        ann = ag.annotations[nodes[name]]
        assert ann is not None
        grad = ag.grads.get(nodes[name], ag.param_grads.get(name))
        assert grad is not None, name
        table[name] = (grad, ann, ag.shape(nodes[name]))
    return stage_grad_sync(table)


def reshard_plans(gm: torch.fx.GraphModule) -> Iterable[CommPlan]:
    """The forward and backward plans of every ``ReshardModule`` in ``gm``."""
    for module in gm.modules():
        if isinstance(module, ReshardModule):
            yield from (module.forward_plan, module.backward_plan)
