"""The mixed-length switch: move only the compute weights, in their compute dtype.

In the mixed-length mode (``--switch-mode weights``) the fp32 masters and Adam moments live
under a home layout that no strategy changes (``hspmd.train.home``), so a switch from A to
B moves nothing but the compute weights, from A's parameter annotations to B's, in one
fused BSR (one packed message per pair of ranks, bf16 under ``--dtype bf16``)::

    tensor           from (A)                     to (B)
    param/<name>     A's parameter annotation     B's parameter annotation

A rank sends only the slices it holds under A that some rank of B needs and does not hold
already (local copies are free), so the bytes sent are the compute bytes that change owner.

>>> from hspmd.models.llama import get_config
>>> from hspmd.plan.strategy import parse_strategy
>>> plan = plan_weight_switch(get_config("llama-tiny", num_layers=2),
...     parse_strategy("2x1: R0:L0-0 R1:L1-1"), parse_strategy("2x1: R0-1:L0-1"), itemsize=2)
>>> len(plan.tensors), sorted(plan.messages()), str(plan)
(21, [(0, 1), (1, 0)], 'weight switch: 21 tensors, 2 messages, 107136 bytes')
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from hspmd.comm.bsr import BsrTable, messages, schedule
from hspmd.comm.plan import Transfer
from hspmd.comm.topology import Topology
from hspmd.models.spec import ModelSpec
from hspmd.plan.params import parameter_annotations
from hspmd.plan.strategy import Strategy
from hspmd.runtime.fused import FusedTensor, run_fused_bsr
from hspmd.runtime.world import World

__all__ = ["WeightSwitchPlan", "plan_weight_switch", "run_weight_switch", "transfer_bytes"]


def transfer_bytes(transfers: tuple[Transfer, ...], *, itemsize: int) -> Counter[int]:
    """Bytes each rank sends to other ranks under ``transfers`` (local copies are free)."""
    out: Counter[int] = Counter()
    for t in transfers:
        if t.src != t.dst:
            n = itemsize
            for lo, hi in t.region:
                n *= hi - lo
            out[t.src] += n
    return out


@dataclass(frozen=True, slots=True)
class WeightSwitchPlan:
    """The compute weights a switch moves (``names[i]`` is tensor ``i``) and the transfers."""

    names: tuple[str, ...]
    tensors: tuple[FusedTensor, ...]
    transfers: tuple[Transfer, ...]
    itemsize: int  # bytes per element of the compute dtype

    def messages(self) -> dict[tuple[int, int], int]:
        """Messages per (sender, receiver) pair: one each."""
        return {pair: 1 for pair in messages(self.transfers)}

    def sent_bytes(self) -> Counter[int]:
        return transfer_bytes(self.transfers, itemsize=self.itemsize)

    def __str__(self) -> str:
        total = sum(self.sent_bytes().values())
        return (
            f"weight switch: {len(self.tensors)} tensors, {len(self.messages())} messages, "
            f"{total} bytes"
        )


def plan_weight_switch(
    config: ModelSpec,
    source: Strategy,
    target: Strategy,
    *,
    itemsize: int,
    topology: Topology | None = None,
) -> WeightSwitchPlan:
    """The fused BSR moving every compute weight from ``source`` to ``target`` (metadata)."""
    src = parameter_annotations(source, config)
    dst = parameter_annotations(target, config)
    names = tuple(src)
    tensors = tuple(FusedTensor(src[n].shape, src[n].annotation, dst[n].annotation) for n in names)
    tables = [
        BsrTable.between(t.src, t.dst, t.shape, tensor=i, itemsize=itemsize)
        for i, t in enumerate(tensors)
    ]
    transfers = schedule(tables, topology=topology or Topology.flat(), fused=True)
    return WeightSwitchPlan(names, tensors, transfers, itemsize)


def run_weight_switch(
    plan: WeightSwitchPlan,
    params: Mapping[str, torch.Tensor],
    world: World,
    *,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """This rank's compute weights under the target, by name (empty where it holds none).

    ``params``: this rank's compute weights under the source (empty on an idle rank).
    """
    local = {i: params[n].detach() for i, n in enumerate(plan.names) if n in params}
    out = run_fused_bsr(plan.transfers, plan.tensors, local, world, dtype=dtype)
    return {plan.names[i]: tensor for i, tensor in out.items()}
