"""The cost model: seconds per operator on each GPU kind and each link class.

Every time the planner and the simulator use is ``overhead + slope * units`` of one operator
family (``hspmd.cost.profile``): matmul and attention per FLOP, norm, element-wise and
optimizer per byte on a device; all-reduce, all-gather, reduce-scatter, all-to-all and
send/recv per ring bus byte on a link. Where each line comes from, per GPU kind:

1. ``"profile"`` in the cluster file: the fits ``hspmd profile`` measured (compute families
   and, for link classes of the same name, the collectives);
2. else ``"achieved_tflops"``: matmul and attention at that rate, norms, element-wise ops
   and the optimizer bound by ``"hbm_GBps"`` (``DEFAULT_HBM_GBPS`` when absent);
3. else the documented assumption: ``DEFAULT_EFFICIENCY`` (half) of ``bf16_tflops``.

A link class without a profile runs at its file bandwidth with, per call, the overhead the
cluster's profiled link measured for that collective (the software's fixed cost), else
``LINK_OVERHEAD_S``.
``slowdown`` in a kind multiplies its compute times (not its links). ``source`` on each
line says which rule made it, and ``CostModel.describe()`` prints them all.

Core sharing is a property of the profiled host, not of the strategy: a kind whose profile
was measured on a CPU (``kind == "cpu"``) with ``core_sharing`` factors runs its ranks as
processes sharing the cores of their node. ``CostModel.pools()`` gives one
``hspmd.sim.Pool`` per such node and ``share_of(rank)`` its name; the simulator slows each
compute task by the factor of how many ranks of the node compute at once. GPU kinds
(``achieved_tflops``, assumed figures, or a CUDA profile) have none: their ranks never
slow each other down.

>>> from hspmd.cost.cluster import load_cluster
>>> model = CostModel.of(load_cluster("hetu-h800-h20"))
>>> round(model.device("H800").seconds("matmul", 1e15), 3)  # 1 PFLOP at 495 TFLOPS
2.02
>>> round(model.collective("all-reduce", 1e9, (0, 1)) * 1e3, 2)  # 1 GB, 2 H800s, 200 GB/s
2.24
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from hspmd.comm.topology import LOCAL, LinkClass, Topology
from hspmd.cost.cluster import Cluster, GpuKind
from hspmd.cost.link import transfer_time
from hspmd.cost.profile import (
    COLLECTIVE_OPS,
    COMPUTE_OPS,
    Fit,
    LinkFit,
    Profile,
    ProfileError,
    bus_bytes,
    load_profile,
)
from hspmd.errors import HspmdError
from hspmd.sim.engine import Pool

__all__ = [
    "DEFAULT_EFFICIENCY",
    "DEFAULT_HBM_GBPS",
    "LINK_OVERHEAD_S",
    "CostError",
    "CostModel",
    "DeviceCost",
    "LinkCost",
]

Dtype = Literal["bf16", "fp32"]

DEFAULT_EFFICIENCY = 0.5  # achieved / peak dense bf16 matmul throughput, when nothing is given
DEFAULT_HBM_GBPS = 2000.0  # memory bandwidth when a kind gives none (GB/s)
KERNEL_OVERHEAD_S = 5e-6  # per compute launch, when nothing is measured
LINK_OVERHEAD_S = 20e-6  # per collective or send/recv call, when nothing is measured
# Adam moves about 8 bytes of state per byte of fp32 parameter (read p, g, m, v; write p, m, v).
OPTIMIZER_BYTES_PER_PARAM_BYTE = 8.0


class CostError(HspmdError, ValueError):
    """A cost model that cannot be built from the cluster file, or an unknown operator."""


@dataclass(frozen=True, slots=True)
class DeviceCost:
    """Compute lines of one GPU kind: ``fits[family].seconds(units) * slowdown``."""

    kind: str
    memory_bytes: float
    fits: Mapping[str, Fit]
    slowdown: float = 1.0
    source: str = ""
    core_sharing: tuple[float, ...] = ()  # CPU hosts: slowdown per k ranks computing at once
    cpu: bool = False  # profiled on CPU processes: compute and communication share the cores

    def seconds(self, op: str, units: float) -> float:
        if op not in self.fits:
            raise CostError(f"no cost line for {op!r} on {self.kind}: known {', '.join(self.fits)}")
        if units <= 0:
            return 0.0
        return self.fits[op].seconds(units) * self.slowdown


@dataclass(frozen=True, slots=True)
class LinkCost:
    """Collective lines of one link class, per ring bus byte (``profile.bus_bytes``)."""

    name: str
    fits: Mapping[str, Fit]
    source: str = ""
    by_size: Mapping[str, LinkFit] = field(default_factory=dict)  # measured group sizes
    # measured rings (a profile): one flow leaving a node had the link; else a file's
    # bandwidth, which the cluster format counts per rank
    per_flow: bool = False

    def scaled(self, factor: float) -> LinkCost:
        """This link with its bandwidth times ``factor`` (per-call costs unchanged)."""
        if factor == 1.0:
            return self
        fits = {op: _scaled(f, factor) for op, f in self.fits.items()}
        by_size = {
            op: LinkFit(_scaled(f.fit, factor), f.group_size,
                        tuple((n, _scaled(g, factor)) for n, g in f.groups))
            for op, f in self.by_size.items()
        }  # fmt: skip
        source = f"{self.source}, x{factor:g} bandwidth"
        return LinkCost(self.name, fits, source, by_size, self.per_flow)

    def seconds(self, op: str, nbytes: float, group_size: int) -> float:
        """``op`` on ``nbytes`` over ``group_size`` ranks: the fit measured over the nearest
        group size where the profile has several, else the one line."""
        if group_size <= 1 or nbytes <= 0:
            return 0.0
        fit = self.line(op, group_size)
        moved = bus_bytes(op, nbytes, group_size)
        return transfer_time(moved, per_byte=fit.per_unit_s, latency=fit.overhead_s)

    def line(self, op: str, group_size: int) -> Fit:
        """The fit ``seconds`` uses for ``op`` over ``group_size`` ranks (per bus byte)."""
        if op not in self.fits:
            raise CostError(f"no cost line for {op!r} on link {self.name}")
        return self.by_size[op].for_size(group_size) if op in self.by_size else self.fits[op]


@dataclass(frozen=True)
class CostModel:
    """Device lines per GPU kind, link lines per link class, and the cluster's layout."""

    cluster: Cluster
    dtype: Dtype
    devices: Mapping[str, DeviceCost]
    links: Mapping[str, LinkCost]
    _kinds: tuple[str, ...] = field(default=(), repr=False)
    _topology: Topology = field(default_factory=Topology, repr=False)
    _nodes: tuple[int, ...] = field(default=(), repr=False)  # node index per rank

    @staticmethod
    def of(cluster: Cluster, *, dtype: Dtype = "bf16") -> CostModel:
        """The cost model of ``cluster`` (profiles read from the paths its kinds name)."""
        profiles = {k.name: _read_profile(k) for k in cluster.kinds if k.profile}
        devices = {k.name: _device(k, profiles.get(k.name)) for k in cluster.kinds}
        link_classes = {k.intra_link.name: k.intra_link for k in cluster.kinds}
        link_classes[cluster.inter_link.name] = cluster.inter_link
        measured: dict[str, tuple[str, Mapping[str, LinkFit]]] = {}
        for name, profile in profiles.items():
            for link, fits in profile.links.items():
                measured[link] = (name, fits)
        calls = next(iter(measured.values()), None)  # per-call costs of the profiled software
        links = {n: _link(c, measured.get(n), calls) for n, c in link_classes.items()}
        kinds = tuple(cluster.kind_of(r).name for r in range(cluster.num_ranks))
        topology = cluster.topology()
        nodes = tuple(topology.node_of(r) for r in range(cluster.num_ranks))
        return CostModel(cluster, dtype, devices, links, kinds, topology, nodes)

    @property
    def num_ranks(self) -> int:
        return len(self._kinds)

    @property
    def element_bytes(self) -> int:
        """Bytes of one activation or weight element in the compute dtype."""
        return 2 if self.dtype == "bf16" else 4

    def kind_of(self, rank: int) -> str:
        return self._kinds[rank]

    def device(self, kind: str) -> DeviceCost:
        return self.devices[kind]

    def device_of(self, rank: int) -> DeviceCost:
        return self.devices[self._kinds[rank]]

    def node_of(self, rank: int) -> int:
        return self._nodes[rank]

    def link_between(self, a: int, b: int) -> LinkCost:
        if a == b:
            return _FREE
        if self._nodes[a] != self._nodes[b]:  # one of the node's rank-many flows at once
            node = self._nodes[a]
            return self._inter({node: len(self._topology.nodes[node].ranks)})
        return self.links[self.cluster.kind(self._kinds[a]).intra_link.name]

    def group_link(self, ranks: Sequence[int], concurrent: int = 1) -> LinkCost:
        """The slowest link a ring over ``ranks`` crosses (the inter-node one if it spans
        nodes), while ``concurrent`` such rings run side by side (the TP shards of one
        gradient sync). On a shared inter link (``Cluster.shared_nic``) a node's link is
        split among the ring flows leaving it: one flow may use the whole node's, more
        split it; with a NIC per GPU each flow has its GPU's (the file's figure). A link
        measured across nodes (``hspmd profile --nnodes``) is already one flow's."""
        if len(ranks) <= 1:
            return _FREE
        nodes = [self.node_of(r) for r in ranks]
        if len(set(nodes)) == 1:
            return self.link_between(ranks[0], ranks[1])
        leaving: dict[int, int] = {}
        for a, b in zip(nodes, [*nodes[1:], nodes[0]], strict=True):
            if a != b:
                leaving[a] = leaving.get(a, 0) + concurrent
        return self._inter(leaving)

    def _inter(self, leaving: Mapping[int, int]) -> LinkCost:
        """The inter link for a flow while ``leaving[n]`` flows leave each node ``n``: on a
        shared NIC the busiest node's link split among its flows (a file's figure is a
        rank's, a measured line one flow's); else each flow's own NIC."""
        link = self.links[self.cluster.inter_link.name]
        if not self.cluster.shared_nic:
            return link
        whole = {n: 1 if link.per_flow else len(self._topology.nodes[n].ranks) for n in leaving}
        return link.scaled(min(whole[n] / f for n, f in leaving.items()))

    def collective(
        self, op: str, nbytes: float, ranks: Sequence[int], concurrent: int = 1
    ) -> float:
        """Seconds for ``op`` of a ``nbytes`` tensor over ``ranks`` (``concurrent`` such
        rings at once: ``group_link``)."""
        return self.group_link(ranks, concurrent).seconds(op, nbytes, len(ranks))

    def send(self, nbytes: float, src: int, dst: int) -> float:
        return self.link_between(src, dst).seconds("send-recv", nbytes, 2)

    def share_of(self, rank: int) -> str:
        """The processor pool of ``rank``'s compute (``"cores:node3"``), or ``""`` when its
        kind does not share cores (module docstring)."""
        if not self.device_of(rank).core_sharing:
            return ""
        if self.cluster.one_host:  # emulated nodes: one machine's cores for all
            return "cores:host"
        return f"cores:node{self._nodes[rank]}"

    def pools(self) -> dict[str, Pool]:
        """The simulator's pools: one per node whose ranks share CPU cores (one for the
        whole cluster when its nodes are emulated on one machine, ``Cluster.one_host``)."""
        out: dict[str, Pool] = {}
        for rank in range(self.num_ranks):
            name = self.share_of(rank)
            if name and name not in out:
                out[name] = Pool(self.device_of(rank).core_sharing)
        return out

    def describe(self) -> str:
        """One line per device kind and link class: where its figures come from."""
        lines = [f"{d.kind}: {d.source}" for d in self.devices.values()]
        lines += [f"{link.name}: {link.source}" for link in self.links.values()]
        return "\n".join(lines)


_FREE = LinkCost(LOCAL, {op: Fit(0.0, 0.0, 1.0) for op in COLLECTIVE_OPS}, "same rank")


def _read_profile(kind: GpuKind) -> Profile:
    assert kind.profile is not None
    try:
        return load_profile(kind.profile)
    except ProfileError as error:
        raise CostError(f"GPU kind {kind.name}: {error}") from None


def _device(kind: GpuKind, profile: Profile | None) -> DeviceCost:
    memory = kind.memory_mb * 1e6
    if profile is not None:
        missing = [op for op in COMPUTE_OPS if op not in profile.compute]
        if missing:
            raise CostError(
                f"GPU kind {kind.name}: profile {kind.profile} has no {', '.join(missing)}: "
                "run `hspmd profile` again (it measures every family)"
            )
        fits = {op: profile.compute[op] for op in COMPUTE_OPS}
        source = f"profile {kind.profile} ({profile.device}, {profile.dtype})"
        sharing = profile.core_sharing if profile.kind == "cpu" else ()
        if sharing:
            shown = ", ".join(f"{f:.2f}" for f in sharing)
            source += f", {profile.threads}-thread ranks sharing cores: x{shown} for k = 1.."
        cpu = profile.kind == "cpu"
        return DeviceCost(kind.name, memory, fits, kind.slowdown, source, sharing, cpu)
    if kind.achieved_tflops is not None:
        tflops, source = kind.achieved_tflops, f"achieved_tflops {kind.achieved_tflops:g}"
    else:
        tflops = DEFAULT_EFFICIENCY * kind.bf16_tflops
        source = f"assumed {DEFAULT_EFFICIENCY:g} x bf16 peak = {tflops:g} TFLOPS"
    hbm = (kind.hbm_GBps or DEFAULT_HBM_GBPS) * 1e9
    source += f", HBM {hbm / 1e9:g} GB/s" + ("" if kind.hbm_GBps else " (assumed)")
    per_flop = Fit(1.0 / (tflops * 1e12), KERNEL_OVERHEAD_S, 1.0)
    per_byte = Fit(1.0 / hbm, KERNEL_OVERHEAD_S, 1.0)
    fits = {
        "matmul": per_flop,
        "attention": per_flop,
        "norm": per_byte,
        "elementwise": per_byte,
        "optimizer": Fit(OPTIMIZER_BYTES_PER_PARAM_BYTE / hbm, KERNEL_OVERHEAD_S, 1.0),
    }
    if kind.slowdown != 1.0:
        source += f", slowdown x{kind.slowdown:g}"
    return DeviceCost(kind.name, memory, fits, kind.slowdown, source)


def _scaled(fit: Fit, factor: float) -> Fit:
    return replace(fit, per_unit_s=fit.per_unit_s / factor)


def _link(
    cls: LinkClass,
    measured: tuple[str, Mapping[str, LinkFit]] | None,
    calls: tuple[str, Mapping[str, LinkFit]] | None = None,
) -> LinkCost:
    """The link's measured fits; else its file bandwidth, with the per-call overheads of
    another link the same hosts profiled (``calls``: a collective's fixed cost is the
    software's, gloo's or nccl's, whatever link then carries its bytes), or
    ``LINK_OVERHEAD_S``."""
    if measured is not None and all(op in measured[1] for op in COLLECTIVE_OPS):
        fits = {op: f.fit for op, f in measured[1].items()}
        sizes = sorted({g for f in measured[1].values() for g in (f.group_size, *dict(f.groups))})
        source = f"profile of {measured[0]}, groups of {', '.join(map(str, sizes))}"
        return LinkCost(cls.name, fits, source, dict(measured[1]), per_flow=True)
    slope = 1.0 / cls.bandwidth
    if calls is not None and all(op in calls[1] for op in COLLECTIVE_OPS):
        by_size = {
            op: LinkFit(
                Fit(slope, f.fit.overhead_s, 1.0),
                f.group_size,
                tuple((n, Fit(slope, g.overhead_s, 1.0)) for n, g in f.groups),
            )
            for op, f in calls[1].items()
        }
        fits = {op: f.fit for op, f in by_size.items()}
        source = f"{cls.bandwidth / 1e9:g} GB/s + per-call overheads of {calls[0]}'s profile"
        return LinkCost(cls.name, fits, source, by_size)
    fits = {op: Fit(slope, LINK_OVERHEAD_S, 1.0) for op in COLLECTIVE_OPS}
    return LinkCost(cls.name, fits, f"{cls.bandwidth / 1e9:g} GB/s + {LINK_OVERHEAD_S * 1e6:g} us")
