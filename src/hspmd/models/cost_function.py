"""What a model costs: the protocol the planner reads, and the figures of a captured graph.

The planner, the simulator and the memory model never read a model's fields to cost it:
they ask the model's own cost function (``ModelSpec.cost``, a ``CostFunction``) for a
stage's seconds per micro-batch, its parameters and the activations a layer keeps. Two
implement it:

- ``ModelCost``: figures measured on the model's captured graph, per part (pre, one
  block, post), as plain data (``hspmd.cost.captured`` measures them on the meta device);
  any ``nn.Module`` (``ModuleModel.cost``);
- ``hspmd.models.llama_cost.LlamaCost``: the Llama presets' formulas, so that llama-70b
  is costed without a graph.

Prices come in through two small protocols, so that no model imports the cost package:
``ComputeLines.seconds(line, units)`` (one GPU kind's cost lines: ``matmul`` and
``attention`` per FLOP, ``norm``, ``elementwise`` per byte) and
``LinkLines.seconds(op, nbytes, group_size)`` (one link class's collectives), which
``hspmd.cost.lines.DeviceCost`` and ``LinkCost`` are.

No torch here.

>>> Amount(10.0, 0.5).at(2, 4)
96.0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

__all__ = [
    "Amount",
    "CommItem",
    "ComputeLines",
    "CostFunction",
    "LinkLines",
    "ModelCost",
    "PartCost",
    "StageShape",
    "StageWork",
    "WorkItem",
]


class ComputeLines(Protocol):
    """Seconds of ``units`` of one compute line on one device (``DeviceCost``)."""

    def seconds(self, op: str, units: float) -> float: ...


class LinkLines(Protocol):
    """Seconds of collective ``op`` on a ``nbytes`` tensor over ``group_size`` ranks
    (``LinkCost``)."""

    def seconds(self, op: str, nbytes: float, group_size: int) -> float: ...


class StageShape(NamedTuple):
    """One stage's micro-batch as its cost function sees it: ``num_layers`` blocks, ``b``
    sequences of ``s`` tokens, TP degree ``tp`` and context-parallel degree ``cp`` (the
    stage has ``tp * cp`` ranks), ``sequence_parallel`` (only where ``tp > 1``), whether
    it holds the pre and the post part, the share of its layers whose forward reruns in
    backward (``recomputed``), and the bytes of one element in the compute dtype.

    A named tuple rather than a frozen dataclass: the planner builds one per stage it
    prices, and a tuple is built ten times faster."""

    num_layers: int
    b: int
    s: int
    tp: int
    cp: int = 1
    sequence_parallel: bool = False
    first: bool = False
    last: bool = False
    recomputed: float = 0.0
    element_bytes: int = 2


@dataclass(frozen=True, slots=True)
class StageWork:
    """Seconds of one micro-batch on one stage: ``forward_s`` and ``backward_s`` (both with
    their TP collectives, ``tp_comm_s`` of them, ``forward_comm_s`` in the forward), and the
    activation bytes it sends on."""

    forward_s: float
    backward_s: float
    tp_comm_s: float
    activation_bytes: float
    forward_comm_s: float = 0.0

    @property
    def backward_comm_s(self) -> float:
        return self.tp_comm_s - self.forward_comm_s


class CostFunction(Protocol):
    """A model's own cost (module docstring). ``sequence_parallel``: whether the planner may
    choose sequence parallelism for it; ``context_parallel``: whether ``stage_work`` prices
    a CP degree (the planner offers CP only then); ``vocab_split``: whether its loss reads
    logits split over the vocabulary (the memory of the last stage's logits)."""

    @property
    def sequence_parallel(self) -> bool: ...
    @property
    def context_parallel(self) -> bool: ...
    @property
    def vocab_split(self) -> bool: ...

    def part_params(self) -> tuple[int, int, int]:
        """Parameters of the pre part, of one block and of the post part (all TP shards)."""
        ...

    def stage_params(self, num_layers: int, tp: int, *, first: bool, last: bool) -> int:
        """Parameters one rank of a stage of TP degree ``tp`` holds."""
        ...

    def saved_bytes(self, b: int, s: int, tp: int, *, elt: int, sequence_parallel: bool) -> float:
        """Bytes one block keeps for its backward per micro-batch on one rank."""
        ...

    def stage_work(
        self, shape: StageShape, *, device: ComputeLines, link: LinkLines, cp_link: LinkLines
    ) -> StageWork:
        """Seconds of one micro-batch on the stage: ``device`` its slowest rank's lines,
        ``link`` its TP groups', ``cp_link`` its context-parallel groups'."""
        ...


# -- what a model costs, as measured on its captured graph (hspmd.cost.captured derives it)


@dataclass(frozen=True, slots=True)
class Amount:
    """A figure of one micro-batch of ``b`` sequences of ``s`` tokens:
    ``b * s * (per_token + per_square * s)`` (attention scales with ``s`` squared).

    >>> Amount(10.0, 0.5).at(2, 4)
    96.0
    """

    per_token: float = 0.0
    per_square: float = 0.0

    def at(self, b: int, s: int) -> float:
        return b * s * (self.per_token + self.per_square * s)


@dataclass(frozen=True, slots=True)
class WorkItem:
    """Ops of one cost line (``matmul``, ``attention``: FLOPs; ``norm``, ``elementwise``:
    elements written; ``saved``: elements autograd keeps for the backward) in one part of
    the model: ``calls`` ops in all, ``split`` if they run on tensors split (or partial)
    under TP, so each rank does ``1/t``; ``split_sp`` the same under sequence parallelism;
    ``split_cp`` under context parallelism (the sequence, or the heads after the
    all-to-all: ``1/c`` each)."""

    line: str
    split: bool
    split_sp: bool
    calls: float
    units: Amount
    split_cp: bool = False


@dataclass(frozen=True, slots=True)
class CommItem:
    """TP collectives of one part: ``calls`` of ``kind`` moving ``elements`` in all (the
    whole tensor, as ``LinkCost.seconds`` takes it), in the backward or the forward, with
    or without sequence parallelism; ``fp32`` where they move fp32 whatever the dtype.

    With ``cp`` they are a context-parallel stage's own, over its CP groups (``elements``:
    the global tensor; an all-to-all moves a rank's ``1/c`` piece, a gather the whole),
    on ``1/t`` of it where TP splits it too (``split_tp``); a TP collective on a tensor
    CP splits (``split_cp``) moves ``1/c`` of it there."""

    kind: str
    backward: bool
    sequence_parallel: bool
    calls: float
    elements: Amount
    fp32: bool = False
    cp: bool = False
    split_cp: bool = False
    split_tp: bool = False

    def seconds(
        self, link: LinkLines, cp_link: LinkLines, *, b: int, s: int, tp: int, cp: int, elt: int
    ) -> float:
        """Seconds of one call on a stage of TP ``tp`` x CP ``cp`` (``link``: its TP
        groups', ``cp_link`` its CP groups')."""
        nbytes = self.elements.at(b, s) * (4 if self.fp32 else elt) / self.calls
        if not self.cp:
            return link.seconds(self.kind, nbytes / (cp if self.split_cp else 1), tp)
        nbytes /= (tp if self.split_tp else 1) * (cp if self.kind == "all-to-all" else 1)
        return cp_link.seconds(self.kind, nbytes, cp)


@dataclass(frozen=True, slots=True)
class PartCost:
    """One part of a model: the pre part (before block 0), one block (the mean of the
    blocks), or the post part (after the last block, the loss included)."""

    work: tuple[WorkItem, ...] = ()
    comm: tuple[CommItem, ...] = ()
    saved: tuple[WorkItem, ...] = ()
    params_split: float = 0.0  # parameters TP splits (column, row, vocab)
    params_dup: float = 0.0  # parameters every TP rank holds whole

    def seconds(
        self, device: ComputeLines, links: tuple[LinkLines, LinkLines], *, b: int, s: int,
        tp: int, elt: int, sp: bool, cp: int = 1,
    ) -> tuple[float, float, float, float, float]:  # fmt: skip
        """(forward compute, backward compute, forward comm, backward comm, the forward's
        all-gathers under sequence parallelism: backward runs them again where the layer
        keeps its activations): each cost line's calls share its units evenly (the lines are
        affine, so this is the sum of the calls), split lines divided by ``tp`` (and by
        ``cp``), the backward twice the forward. ``links``: the TP groups' and the CP
        groups' (``CommItem.seconds``)."""
        fwd = bwd = fwd_comm = bwd_comm = gathers = 0.0
        for w in self.work:
            if w.calls <= 0:
                continue
            units = w.units.at(b, s) / (tp if (w.split_sp if sp else w.split) else 1)
            units /= cp if w.split_cp else 1
            if w.line in ("norm", "elementwise"):
                units *= elt  # elements -> bytes
            fwd += w.calls * device.seconds(w.line, units / w.calls)
            bwd += w.calls * device.seconds(w.line, 2 * units / w.calls)
        for c in self.comm:
            if c.sequence_parallel != sp or c.calls <= 0 or (c.cp and cp == 1):
                continue
            seconds = c.calls * c.seconds(*links, b=b, s=s, tp=tp, cp=cp, elt=elt)
            if c.backward:
                bwd_comm += seconds
            else:
                fwd_comm += seconds
                gathers += seconds if sp and c.kind == "all-gather" else 0.0
        return fwd, bwd, fwd_comm, bwd_comm, gathers


@dataclass(frozen=True, slots=True)
class ModelCost:
    """What a model costs per micro-batch, part by part (docs/planner.md, "Any model"):
    measured from its graph on the meta device at ``lengths``, split by deducing it at
    TP ``probe`` (1: nothing splits) and at CP ``cp_probe`` (1: the model takes no CP, and
    the planner offers none). ``vocab_split``: the loss reads vocab-split logits;
    ``hidden_size``: the width of the stream between blocks (what a stage sends on).

    A captured model's runs keep the stream whole (``TrainConfig`` refuses sequence
    parallelism for them), so the planner does not choose it."""

    pre: PartCost
    layer: PartCost
    post: PartCost
    vocab_split: bool
    probe: int
    lengths: tuple[int, ...]
    hidden_size: int
    cp_probe: int = 1

    @property
    def sequence_parallel(self) -> bool:
        return False

    @property
    def context_parallel(self) -> bool:
        return self.cp_probe > 1

    def part_params(self) -> tuple[int, int, int]:
        parts = (self.pre, self.layer, self.post)
        return tuple(round(p.params_split + p.params_dup) for p in parts)  # type: ignore[return-value]

    def stage_params(self, num_layers: int, tp: int, *, first: bool, last: bool) -> int:
        """Split parameters divided over the TP ranks, the others whole."""
        parts = [(self.layer, num_layers), (self.pre, int(first)), (self.post, int(last))]
        split = sum(p.params_split * k for p, k in parts)
        whole = sum(p.params_dup * k for p, k in parts)
        return -(-round(split) // tp) + round(whole)

    def saved_bytes(self, b: int, s: int, tp: int, *, elt: int, sequence_parallel: bool) -> float:
        sp = sequence_parallel and tp > 1
        return elt * sum(
            w.units.at(b, s) / (tp if (w.split_sp if sp else w.split) else 1)
            for w in self.layer.saved
        )

    def stage_work(
        self, shape: StageShape, *, device: ComputeLines, link: LinkLines, cp_link: LinkLines
    ) -> StageWork:
        """Per part from the measured figures (``PartCost.seconds``); the layers' forward
        again in backward for the recomputed share."""
        b, s, cp, redo, elt = shape.b, shape.s, shape.cp, shape.recomputed, shape.element_bytes

        def priced(part: PartCost) -> tuple[float, float, float, float, float]:
            return part.seconds(device, (link, cp_link), b=b, s=s, tp=shape.tp, elt=elt,
                                sp=shape.sequence_parallel, cp=cp)  # fmt: skip

        lf, lb, lfc, lbc, lg = priced(self.layer)
        fwd, bwd = shape.num_layers * lf, shape.num_layers * lb
        fwd_comm, bwd_comm = shape.num_layers * lfc, shape.num_layers * (lbc + (1 - redo) * lg)
        bwd += redo * fwd
        bwd_comm += redo * fwd_comm
        for part, here in ((self.pre, shape.first), (self.post, shape.last)):
            if here:
                pf, pb, pfc, pbc, pg = priced(part)
                fwd, bwd, fwd_comm = fwd + pf, bwd + pb, fwd_comm + pfc
                bwd_comm += pbc + pg
        comm = fwd_comm + bwd_comm
        sent = b * s * self.hidden_size * elt / cp  # the stream is split on the sequence
        return StageWork(fwd + fwd_comm, bwd + bwd_comm, comm, sent, fwd_comm)
