"""Who sends what to whom in a switch: bytes per (sender, receiver) pair, per scheme.

``switch_pairs`` plans the BSR tables of a switch once (``hspmd.switch.cost.plan_tables``)
and runs several schemes over them; each ``PairTraffic`` lists the pairs with their link
class and bytes (summed over a relay's rounds), the per-rank totals, and the scheme's
estimated time (``hspmd.cost.traffic``'s model). Local copies are not traffic.

    >>> from hspmd.cost.cluster import load_cluster
    >>> naive, fused = switch_pairs(model="llama-tiny", source="1x1: R0-1:L0-3",
    ...     target="1x1: R8:L0-3", cluster=load_cluster("h20x32"), algos=("naive", "fused"),
    ...     states="bf16")
    >>> [(src, dst, link) for src, dst, link, _ in fused.pairs]
    [(0, 8, 'ib'), (1, 8, 'ib')]
    >>> naive.received()[8] == fused.received()[8]
    True
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from hspmd.comm.plan import Transfer, volume
from hspmd.comm.topology import Topology
from hspmd.cost.cluster import Cluster
from hspmd.cost.traffic import estimate
from hspmd.switch.cost import ALGOS, SwitchError, plan_tables, scheme_stages

__all__ = ["PairTraffic", "pair_bytes", "switch_pairs"]


@dataclass(frozen=True, slots=True)
class PairTraffic:
    """One scheme's traffic: ``(src, dst, link class, bytes)`` sorted by pair, and its time."""

    algo: str
    pairs: tuple[tuple[int, int, str, float], ...]
    time: float

    def sent(self) -> dict[int, float]:
        """Bytes each rank sends."""
        out: dict[int, float] = defaultdict(float)
        for src, _, _, size in self.pairs:
            out[src] += size
        return dict(out)

    def received(self) -> dict[int, float]:
        """Bytes each rank receives."""
        out: dict[int, float] = defaultdict(float)
        for _, dst, _, size in self.pairs:
            out[dst] += size
        return dict(out)

    def total(self) -> float:
        return sum(size for *_, size in self.pairs)


def pair_bytes(
    stages: Sequence[Sequence[Transfer]], *, topology: Topology, itemsizes: dict[int, int]
) -> tuple[tuple[int, int, str, float], ...]:
    """Bytes per (src, dst) pair over all ``stages``, with the pair's link class."""
    sizes: dict[tuple[int, int], float] = defaultdict(float)
    for stage in stages:
        for t in stage:
            if t.src != t.dst:
                sizes[t.src, t.dst] += volume(t.region) * itemsizes.get(t.tensor, 1)
    return tuple(
        (src, dst, topology.link(src, dst).name, size) for (src, dst), size in sorted(sizes.items())
    )


def switch_pairs(
    *,
    model: str,
    source: str,
    target: str,
    cluster: Cluster,
    algos: Sequence[str] = ("naive", "fused", "relay"),
    states: str = "fp32-adam",
    failed: Collection[int] = (),
    zero1: bool = False,
    model_kwargs: tuple[tuple[str, object], ...] = (),
) -> tuple[PairTraffic, ...]:
    """The traffic of each of ``algos`` for the switch ``source -> target`` (tables planned once)."""
    unknown = [a for a in algos if a not in ALGOS]
    if unknown:
        raise SwitchError(f"unknown switch algorithm {unknown[0]!r}: use one of {', '.join(ALGOS)}")
    _, _, tables = plan_tables(
        model=model, source=source, target=target, cluster=cluster, states=states,
        failed=failed, zero1=zero1, model_kwargs=model_kwargs,
    )  # fmt: skip
    topology = cluster.topology()
    itemsizes = {t.tensor: t.itemsize for t in tables}
    out = []
    for algo in algos:
        stages = scheme_stages(tables, algo, topology=topology, failed=failed)
        pairs = pair_bytes(stages, topology=topology, itemsizes=itemsizes)
        out.append(
            PairTraffic(algo, pairs, estimate(stages, topology=topology, itemsizes=itemsizes).time)
        )
    return tuple(out)
