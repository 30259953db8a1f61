"""What a switch between two strategies costs, without running it.

Every parameter's BSR table (``hspmd.comm.bsr``) goes from its annotation under the old
strategy to its annotation under the new one; a scheme picks the senders; the traffic model
(``hspmd.cost.traffic``) gives each rank's send volume per link class and the time of the
slowest rank. What moves (``states``):

    states      tensors moved per parameter              bytes per element  mode
    fp32-adam   fp32 master, Adam exp_avg, exp_avg_sq    12                 unstable devices
    bf16        the bf16 compute weight                  2                  mixed-length data

The three fp32 tensors of a parameter share one annotation, so they move as one tensor of
12 bytes per element. Algorithms (``ALGOS``):

    naive       local copy, else the lowest-rank owner sends; one BSR per tensor
    per-tensor  the paper's heuristic (fastest link, then least loaded), one BSR per tensor
    fused       one heuristic scheme over all tensors: load balanced over the whole switch
    relay       fused, then single-owner inter-node transfers spread over every NIC of both
                nodes (beyond the paper; ``hspmd.comm.relay``: the rounds of the relay plan)

Ranks in ``failed`` own nothing (their pieces are lost) and relay nothing.

    >>> from hspmd.cost.cluster import load_cluster
    >>> cost = switch_cost(model="llama-tiny", source="1x1: R0-1:L0-3", target="1x1: R8:L0-3",
    ...                    cluster=load_cluster("h20x32"), algo="fused", states="bf16")
    >>> cost.slowest_rank, sorted(cost.estimate.sent[0])
    (8, ['ib'])
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hspmd.comm.bsr import BsrEntry, BsrTable, schedule
from hspmd.comm.plan import Transfer
from hspmd.comm.relay import plan_relay
from hspmd.comm.slices import holders_table
from hspmd.comm.topology import Topology
from hspmd.cost.bsr_volume import fused_estimate
from hspmd.cost.cluster import Cluster
from hspmd.cost.traffic import Estimate, estimate
from hspmd.errors import HspmdError
from hspmd.gcpause import paused_gc
from hspmd.models import get_model
from hspmd.plan.params import ParamSpec, parameter_annotations, state_annotations
from hspmd.plan.strategy import Strategy, parse_strategy

__all__ = ["ALGOS", "STATES", "SwitchCost", "SwitchError", "estimate_scheme", "plan_tables", "switch_cost", "switch_tables"]  # fmt: skip

ALGOS = ("naive", "per-tensor", "fused", "relay")
STATES = {"fp32-adam": 12, "bf16": 2}


class SwitchError(HspmdError, ValueError):
    """A switch that cannot be planned: an unknown algorithm, or a slice nobody still owns."""


def switch_tables(
    before: Mapping[str, ParamSpec],
    after: Mapping[str, ParamSpec],
    *,
    itemsize: int,
    failed: Collection[int] = (),
) -> list[BsrTable]:
    """One BSR table per tensor of ``after`` (tensor index = position), failed ranks owning
    nothing. SwitchError names a slice that only failed ranks held.

    Tensors of one shape whose annotations are equal before and after have equal entries,
    built once (``_entries``): the layers of one stage under both strategies (at 65,536
    ranks, a table's pieces are 65,536 regions)."""
    tables = []
    built: dict[tuple[Any, ...], tuple[BsrEntry, ...]] = {}
    for index, (name, spec) in enumerate(after.items()):
        if name not in before or before[name].shape != spec.shape:
            raise SwitchError(f"tensor {name} {list(spec.shape)} is not in the old strategy")
        key = (before[name].annotation, spec.annotation, spec.shape)
        entries = built.get(key)
        if entries is None:
            entries = built[key] = _entries(name, before[name], spec, failed)
        tables.append(BsrTable(entries, tensor=index, itemsize=itemsize))
    return tables


def _entries(
    name: str, before: ParamSpec, spec: ParamSpec, failed: Collection[int]
) -> tuple[BsrEntry, ...]:
    """The BSR entries of tensor ``name`` from ``before`` to ``spec``, failed ranks owning
    nothing (SwitchError: a slice only they held)."""
    src = {r: p.region for r, p in before.annotation.pieces(spec.shape).items() if r not in failed}
    dst = {r: p.region for r, p in spec.annotation.pieces(spec.shape).items()}
    rows = holders_table(src, dst, spec.shape)
    for region, owners, _ in rows:
        if not owners:
            raise SwitchError(
                f"{name} slice {region} was held only by failed ranks "
                f"{sorted(set(before.annotation.ranks) & set(failed))}: "
                "it cannot be moved (restore it from a checkpoint)"
            )
    return tuple(BsrEntry(*row) for row in rows)


def scheme_stages(
    tables: Sequence[BsrTable], algo: str, *, topology: Topology, failed: Collection[int] = ()
) -> list[list[Transfer]]:
    """The transfers of ``algo`` in stages (one stage, or three for ``relay``)."""
    if algo not in ALGOS:
        raise SwitchError(f"unknown switch algorithm {algo!r}: use one of {', '.join(ALGOS)}")
    if algo == "naive":
        return [list(schedule(tables, topology=topology, method="naive", fused=False))]
    if algo == "per-tensor":
        return [list(schedule(tables, topology=topology, fused=False))]
    fused = schedule(tables, topology=topology)
    if algo == "fused":
        return [list(fused)]
    return plan_relay(tables, fused, topology=topology, exclude=failed).stages()


def estimate_scheme(
    tables: Sequence[BsrTable], algo: str, *, topology: Topology, failed: Collection[int] = ()
) -> Estimate:
    """Volumes and time of ``algo`` over ``tables`` on ``topology``."""
    return _estimate(tables, algo, topology=topology, failed=failed)[0]


def _estimate(
    tables: Sequence[BsrTable], algo: str, *, topology: Topology, failed: Collection[int] = ()
) -> tuple[Estimate, int]:
    """Volumes and time of ``algo`` over ``tables``, and its message count. ``fused`` is
    priced from bytes per (sender, receiver) (``hspmd.cost.bsr_volume``: no transfer per
    slice, the same figures); the others from their transfers."""
    if algo == "fused":
        return fused_estimate(tables, topology=topology)
    stages = scheme_stages(tables, algo, topology=topology, failed=failed)
    itemsizes = {t.tensor: t.itemsize for t in tables}
    est = estimate(stages, topology=topology, itemsizes=itemsizes)
    return est, _count_messages(stages, fused=algo == "relay")


def _count_messages(stages: Sequence[Sequence[Transfer]], *, fused: bool) -> int:
    """Fused schemes send one message per (sender, receiver) pair and stage; unfused ones one
    per pair and tensor."""
    if fused:  # len(messages(stage)) without building the messages
        return sum(len({(t.src, t.dst) for t in stage if t.src != t.dst}) for stage in stages)
    return len({(t.src, t.dst, t.tensor) for stage in stages for t in stage if t.src != t.dst})


@dataclass(frozen=True, slots=True)
class SwitchCost:
    """The estimate of one switch, with what it was computed from."""

    model: str
    source: str
    target: str
    cluster: str
    algo: str
    states: str
    num_tensors: int
    num_messages: int
    estimate: Estimate = field(compare=False)

    @property
    def slowest_rank(self) -> int:
        """The rank busiest over the whole switch (-1 when nothing moves)."""
        times = self.estimate.rank_time
        return max(sorted(times), key=lambda r: times[r]) if times else -1

    def to_json(self) -> dict[str, Any]:
        est = self.estimate
        return {
            "model": self.model,
            "from": self.source,
            "to": self.target,
            "cluster": self.cluster,
            "algo": self.algo,
            "states": self.states,
            "tensors": self.num_tensors,
            "messages": self.num_messages,
            "sent_bytes": {str(r): per for r, per in est.sent.items()},
            "received_bytes": {str(r): per for r, per in est.received.items()},
            "rank_seconds": {str(r): t for r, t in sorted(est.rank_time.items())},
            "total_bytes": est.total(),
            "slowest_rank": self.slowest_rank,
            "seconds": est.time,
        }


@paused_gc()  # millions of objects that live on: hspmd.gcpause
def switch_cost(
    *,
    model: str,
    source: str,
    target: str,
    cluster: Cluster,
    algo: str,
    states: str = "fp32-adam",
    failed: Collection[int] = (),
    zero1: bool = False,
    model_kwargs: tuple[tuple[str, object], ...] = (),
) -> SwitchCost:
    """Plan the switch ``source -> target`` of ``model`` on ``cluster`` and estimate it."""
    if algo not in ALGOS:
        raise SwitchError(f"unknown switch algorithm {algo!r}: use one of {', '.join(ALGOS)}")
    old, new, tables = plan_tables(
        model=model, source=source, target=target, cluster=cluster, states=states,
        failed=failed, zero1=zero1, model_kwargs=model_kwargs,
    )  # fmt: skip
    est, count = _estimate(tables, algo, topology=cluster.topology(), failed=failed)
    return SwitchCost(
        model=model,
        source=str(old),
        target=str(new),
        cluster=cluster.name,
        algo=algo,
        states=states,
        num_tensors=len(tables),
        num_messages=count,
        estimate=est,
    )


def plan_tables(
    *,
    model: str,
    source: str,
    target: str,
    cluster: Cluster,
    states: str = "fp32-adam",
    failed: Collection[int] = (),
    zero1: bool = False,
    model_kwargs: tuple[tuple[str, object], ...] = (),
) -> tuple[Strategy, Strategy, list[BsrTable]]:
    """The parsed strategies and every moved tensor's BSR table, checked against ``cluster``."""
    if states not in STATES:
        raise SwitchError(f"unknown states {states!r}: use one of {', '.join(STATES)}")
    config = get_model(model, **dict(model_kwargs))
    old, new = parse_strategy(source), parse_strategy(target)
    cluster.check_ranks(old.ranks, what="the old strategy")
    cluster.check_ranks(new.ranks, what="the new strategy")
    cluster.check_ranks(failed, what="--failed")
    dead = sorted(set(failed) & set(new.ranks))
    if dead:
        raise SwitchError(f"failed rank {dead[0]} is in the new strategy: leave it out of it")
    if states == "bf16":
        before, after = parameter_annotations(old, config), parameter_annotations(new, config)
    else:
        before = state_annotations(old, config, zero1=zero1)
        after = state_annotations(new, config, zero1=zero1)
    tables = switch_tables(before, after, itemsize=STATES[states], failed=failed)
    return old, new, tables
