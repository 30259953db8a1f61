"""What one stage of a model costs per micro-batch: the model's own cost function, priced.

The planner and the simulator never read a model's fields: each model carries its cost
function (``ModelSpec.cost``, ``hspmd.models.cost_function.CostFunction``): the Llama
presets their formulas (``hspmd.models.llama_cost``), any other model the figures measured
on its captured graph (``hspmd.cost.captured.costed``: FLOPs and elements per cost line,
split by the TP degree where deduction found them split, backward twice the forward, the
TP collectives the deduced plans name; docs/planner.md, "Any model"). This module hands
that function the stage's prices from the cluster's cost lines (``hspmd.cost.lines``): its
slowest rank's compute lines, the link of its TP groups and of its context-parallel groups.

No torch here.
"""

from __future__ import annotations

from hspmd.cost.lines import CostModel
from hspmd.errors import HspmdError
from hspmd.models.cost_function import CostFunction, StageShape, StageWork
from hspmd.models.spec import ModelSpec

__all__ = [
    "NoCostError",
    "StageWork",
    "cost_of",
    "embed_params",
    "head_params",
    "layer_params",
    "stage_params",
    "stage_work",
    "trains_context_parallel",
    "trains_sequence_parallel",
]


class NoCostError(HspmdError, ValueError):
    """A model whose cost has not been measured yet."""


def cost_of(model: ModelSpec) -> CostFunction:
    """The model's own cost function (one line naming the fix where it has none)."""
    found = model.cost
    if found is None:
        raise NoCostError(
            f"{model.name} has no cost figures: measure them with "
            "hspmd.cost.captured.costed(model) first (hspmd simulate and hspmd plan do)"
        )
    return found


def trains_sequence_parallel(model: ModelSpec) -> bool:
    """Whether the planner may choose sequence parallelism for ``model`` (a captured model's
    run refuses it: the markers hspmd inserts keep the stream whole)."""
    return cost_of(model).sequence_parallel


def trains_context_parallel(model: ModelSpec) -> bool:
    """Whether the planner may choose context parallelism for ``model``: its cost function
    prices it (a captured model's figures do where its graph deduces as a CP stage:
    ``hspmd.cost.splits``)."""
    cost = model.cost
    return cost is not None and cost.context_parallel


def embed_params(model: ModelSpec) -> int:
    """Parameters of the pre part (all TP shards together)."""
    return cost_of(model).part_params()[0]


def layer_params(model: ModelSpec) -> int:
    """Parameters of one block (all TP shards together)."""
    return cost_of(model).part_params()[1]


def head_params(model: ModelSpec) -> int:
    """Parameters of the post part (all TP shards together)."""
    return cost_of(model).part_params()[2]


def stage_params(model: ModelSpec, num_layers: int, tp: int, *, first: bool, last: bool) -> int:
    """Parameters one rank of a stage of TP degree ``tp`` holds."""
    return cost_of(model).stage_params(num_layers, tp, first=first, last=last)


def stage_work(
    cost: CostModel, model: ModelSpec, ranks: tuple[int, ...], num_layers: int, *,
    micro_batch_size: int, seq_len: int, first: bool, last: bool, recompute: bool = False,
    sequence_parallel: bool = False, cp: int = 1, recompute_layers: int = 0,
) -> StageWork:  # fmt: skip
    """The work of one micro-batch on the stage of ``ranks`` holding ``num_layers`` layers.

    The stage runs at the pace of its slowest rank (its TP collectives wait for it). With
    ``cp > 1`` the ranks are TP x CP (context parallelism, Ulysses-style: consecutive ranks
    form a CP group, every ``cp``-th rank a TP group). ``recompute_layers``: with
    ``recompute``, only that many of the layers rerun their forward (0: all of them).
    """
    tp = len(ranks) // cp
    device = max((cost.device_of(r) for r in ranks), key=lambda d: d.seconds("matmul", 1e12))
    link = cost.group_link(ranks[::cp], cp)  # the first of cp TP groups (all ranks at cp 1)
    cp_link = cost.group_link(ranks[:cp], tp)  # the first of tp CP groups
    shape = StageShape(
        num_layers=num_layers, b=micro_batch_size, s=seq_len, tp=tp, cp=cp,
        sequence_parallel=sequence_parallel and tp > 1, first=first, last=last,
        recomputed=_recomputed_share(num_layers, recompute, recompute_layers),
        element_bytes=cost.element_bytes,
    )  # fmt: skip
    return cost_of(model).stage_work(shape, device=device, link=link, cp_link=cp_link)


def _recomputed_share(num_layers: int, recompute: bool, recompute_layers: int) -> float:
    """The share of a stage's layers whose forward reruns in backward."""
    if not recompute or not num_layers:
        return 0.0
    return min(recompute_layers, num_layers) / num_layers if recompute_layers else 1.0
