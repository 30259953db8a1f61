"""Cluster files: nodes, GPU kinds and link bandwidths, as JSON (format ``hspmd.cluster/1``).

A cluster is a list of node groups (``count`` nodes of ``gpus_per_node`` GPUs of one kind),
ranks numbered node by node in the order listed. Each GPU kind has its memory, its bf16
peak and its intra-node link (NVLink); every GPU has one NIC of the ``inter_link`` class
(InfiniBand). Bandwidths are GB/s (1e9 bytes per second) per GPU in one direction: NVIDIA
quotes NVLink as the total over both directions (H100 and H20 900 GB/s), so its file figure
is half of that.
``assumed`` names the figures that are not measured or published. ``"one_host": true`` says
that every node of the file is emulated on one machine (network namespaces, fake nodes of
local processes): their ranks share that machine's CPU cores (the planner's cost model
puts them in one processor pool). ``"shared": true`` on the inter link says that a node's
GPUs share one link of ``GBps`` x ``gpus_per_node`` instead of having a NIC each (an
emulated node's one veth): one flow leaving the node may use all of it, and the flows
leaving it at once split it::

    {"format": "hspmd.cluster/1", "name": "two-nodes",
     "gpu_kinds": {"H20": {"memory_mb": 97871, "bf16_tflops": 148,
                           "intra_link": {"name": "nvlink", "GBps": 450}}},
     "inter_link": {"name": "ib", "GBps": 50},
     "nodes": [{"kind": "H20", "count": 2, "gpus_per_node": 8}],
     "assumed": {"inter_link.GBps": "one 400 Gb/s NIC per GPU"}}

Two files ship with the package (``load_cluster(name)``): ``hetu-h800-h20`` (the paper's
16 H800 + 32 H20, Table 7) and ``h20x32`` (32 H20, the elastic runs C1-C3).

    >>> cluster = load_cluster("hetu-h800-h20")
    >>> cluster.num_ranks, cluster.kind_of(15).name, cluster.kind_of(16).name
    (48, 'H800', 'H20')
    >>> topo = cluster.topology()
    >>> str(topo.link(0, 1)), str(topo.link(16, 17)), str(topo.link(0, 16))
    ('nvlink(200 GB/s)', 'nvlink(450 GB/s)', 'ib(50 GB/s)')
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from hspmd.comm.topology import LinkClass, Topology
from hspmd.errors import HspmdError

__all__ = ["Cluster", "ClusterError", "GpuKind", "NodeGroup", "load_cluster", "shipped_clusters"]

FORMAT = "hspmd.cluster/1"


class ClusterError(HspmdError, ValueError):
    """A cluster file that cannot be found or read, or a rank the cluster does not have."""


@dataclass(frozen=True, slots=True)
class GpuKind:
    """One GPU model: memory (MB), bf16 dense peak (TFLOPS), its intra-node link.

    Optional, for the planner's cost model (``hspmd.cost.lines``): ``profile``, a measured
    ``hspmd.profile/1`` file (a path, relative to the cluster file); ``achieved_tflops``, the
    sustained dense matmul throughput where no profile exists; ``hbm_GBps``, the memory
    bandwidth that bounds norms, element-wise ops and the optimizer; ``slowdown``, a factor
    on every compute time (``hspmd train --slowdown`` emulates such a device).
    """

    name: str
    memory_mb: float
    bf16_tflops: float
    intra_link: LinkClass
    profile: str | None = None
    achieved_tflops: float | None = None
    hbm_GBps: float | None = None
    slowdown: float = 1.0

    def __str__(self) -> str:
        return f"{self.name}({self.memory_mb:g} MB, {self.bf16_tflops:g} TFLOPS, {self.intra_link})"


@dataclass(frozen=True, slots=True)
class NodeGroup:
    """``count`` nodes of ``gpus_per_node`` GPUs of kind ``kind``."""

    kind: str
    count: int
    gpus_per_node: int

    def __str__(self) -> str:
        return f"{self.count}x{self.gpus_per_node} {self.kind}"


@dataclass(frozen=True, slots=True)
class Cluster:
    """Node groups in rank order, GPU kinds, the inter-node link, and what is assumed."""

    name: str
    kinds: tuple[GpuKind, ...]
    groups: tuple[NodeGroup, ...]
    inter_link: LinkClass
    assumed: tuple[tuple[str, str], ...] = ()
    description: str = ""
    one_host: bool = False  # every node emulated on one machine: its ranks share its cores
    shared_nic: bool = False  # inter_link.shared: a node's GPUs share one link between them

    @property
    def num_ranks(self) -> int:
        return sum(g.count * g.gpus_per_node for g in self.groups)

    def kind(self, name: str) -> GpuKind:
        return next(k for k in self.kinds if k.name == name)

    def kind_of(self, rank: int) -> GpuKind:
        """The GPU kind of ``rank`` (ClusterError when the cluster has no such rank)."""
        self.check_ranks([rank], what="rank")
        first = 0
        for group in self.groups:
            first += group.count * group.gpus_per_node
            if rank < first:
                return self.kind(group.kind)
        raise AssertionError("unreachable: rank checked above")

    def check_ranks(self, ranks: Any, *, what: str) -> None:
        """Raise ClusterError unless every rank of ``ranks`` is in ``0..num_ranks-1``."""
        beyond = [r for r in ranks if not 0 <= r < self.num_ranks]
        if beyond:
            raise ClusterError(
                f"{what} uses rank {min(beyond)}, but cluster {self.name!r} has "
                f"{self.num_ranks} ranks (0-{self.num_ranks - 1}): use a bigger cluster file "
                "or fewer ranks"
            )

    def topology(self) -> Topology:
        """The comm ``Topology``: one node per machine, NVLink inside, NICs between."""
        return Topology.of_kinds(
            [
                (g.kind, g.count, g.gpus_per_node, self.kind(g.kind).intra_link, self.inter_link)
                for g in self.groups
            ]
        )

    def __str__(self) -> str:
        groups = " + ".join(map(str, self.groups))
        return f"{self.name}: {groups} ({self.num_ranks} ranks), inter-node {self.inter_link}"


def shipped_clusters() -> tuple[str, ...]:
    """Names of the cluster files shipped in ``hspmd/clusters``."""
    folder = resources.files("hspmd") / "clusters"
    return tuple(sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json")))


def load_cluster(path_or_name: str | Path) -> Cluster:
    """Read a cluster file by path, or a shipped one by name (``"hetu-h800-h20"``)."""
    path = Path(path_or_name)
    if path.is_file():
        text, origin = path.read_text(), str(path)
    else:
        shipped = resources.files("hspmd") / "clusters" / f"{path_or_name}.json"
        if not shipped.is_file():
            raise ClusterError(
                f"no cluster file {str(path_or_name)!r}: give a path to a JSON file or one "
                f"of the shipped names {', '.join(shipped_clusters())}"
            )
        text, origin = shipped.read_text(), f"{path_or_name} (shipped)"
        if Path(str(shipped)).is_file():  # a package on disk: profiles resolve beside it
            origin = str(shipped)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ClusterError(f"cluster file {origin} is not JSON: {error}") from None
    return cluster_from_json(data, origin=origin)


def cluster_from_json(data: Any, *, origin: str = "<json>") -> Cluster:
    """A ``Cluster`` from the parsed JSON; ClusterError names the bad field."""
    if not isinstance(data, dict):
        raise ClusterError(
            f"cluster file {origin}: expected a JSON object, got {type(data).__name__}"
        )
    if data.get("format") != FORMAT:
        raise ClusterError(
            f"cluster file {origin}: format is {data.get('format')!r}, expected {FORMAT!r}"
        )
    kinds_json = _field(data, "gpu_kinds", dict, origin)
    kinds = tuple(_kind(name, spec, origin) for name, spec in kinds_json.items())
    nodes = _field(data, "nodes", list, origin)
    if not nodes:
        raise ClusterError(f"cluster file {origin}: 'nodes' is empty: list at least one node group")
    groups = tuple(_group(i, n, kinds_json, origin) for i, n in enumerate(nodes))
    assumed = data.get("assumed", {})
    if not isinstance(assumed, dict):
        raise ClusterError(f"cluster file {origin}: 'assumed' must map field names to reasons")
    one_host = data.get("one_host", False)
    if not isinstance(one_host, bool):
        raise ClusterError(
            f"cluster file {origin}: 'one_host' is {one_host!r}: give true (every node emulated "
            "on one machine) or false"
        )
    inter = _field(data, "inter_link", dict, origin)
    shared = inter.get("shared", False)
    if not isinstance(shared, bool):
        raise ClusterError(
            f"cluster file {origin}: inter_link.shared is {shared!r}: give true (a node's GPUs "
            "share one link of GBps x gpus_per_node) or false (a NIC of GBps per GPU)"
        )
    return Cluster(
        name=str(data.get("name", origin)),
        kinds=kinds,
        groups=groups,
        inter_link=_link(inter, "inter_link", origin),
        assumed=tuple((str(k), str(v)) for k, v in assumed.items()),
        description=str(data.get("description", "")),
        one_host=one_host,
        shared_nic=shared,
    )


def _field(data: dict[str, Any], key: str, kind: type, origin: str) -> Any:
    if key not in data:
        raise ClusterError(f"cluster file {origin}: missing field {key!r} (see docs/switching.md)")
    if not isinstance(data[key], kind):
        raise ClusterError(
            f"cluster file {origin}: {key!r} must be a JSON {'object' if kind is dict else 'list'}"
        )
    return data[key]


def _number(spec: dict[str, Any], key: str, where: str, origin: str) -> float:
    value = spec.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ClusterError(
            f"cluster file {origin}: {where}.{key} is {value!r}: give a positive number"
        )
    return float(value)


def _link(spec: dict[str, Any], where: str, origin: str) -> LinkClass:
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise ClusterError(f"cluster file {origin}: {where}.name must name the link, e.g. 'ib'")
    return LinkClass(name, _number(spec, "GBps", where, origin) * 1e9)


def _kind(name: str, spec: Any, origin: str) -> GpuKind:
    where = f"gpu_kinds.{name}"
    if not isinstance(spec, dict) or not isinstance(spec.get("intra_link"), dict):
        raise ClusterError(
            f"cluster file {origin}: {where} needs memory_mb, bf16_tflops and intra_link "
            '{"name": "nvlink", "GBps": 450}'
        )
    profile = spec.get("profile")
    if profile is not None:
        if not isinstance(profile, str) or not profile:
            raise ClusterError(
                f"cluster file {origin}: {where}.profile is {profile!r}: give the path of a "
                "profile JSON written by `hspmd profile`"
            )
        base = Path(origin).parent if Path(origin).is_file() else Path.cwd()
        profile = str(base / profile) if not Path(profile).is_absolute() else profile
    optional = {k: _number(spec, k, where, origin) for k in _OPTIONAL if k in spec}
    if optional.get("slowdown", 1.0) < 1.0:
        raise ClusterError(
            f"cluster file {origin}: {where}.slowdown is {optional['slowdown']:g}: "
            "give a factor >= 1 (1 = full speed)"
        )
    return GpuKind(
        name,
        _number(spec, "memory_mb", where, origin),
        _number(spec, "bf16_tflops", where, origin),
        _link(spec["intra_link"], f"{where}.intra_link", origin),
        profile=profile,
        achieved_tflops=optional.get("achieved_tflops"),
        hbm_GBps=optional.get("hbm_GBps"),
        slowdown=optional.get("slowdown", 1.0),
    )


_OPTIONAL = ("achieved_tflops", "hbm_GBps", "slowdown")


def _group(index: int, spec: Any, kinds: dict[str, Any], origin: str) -> NodeGroup:
    where = f"nodes[{index}]"
    if not isinstance(spec, dict):
        raise ClusterError(f"cluster file {origin}: {where} must be an object")
    kind = spec.get("kind")
    if kind not in kinds:
        raise ClusterError(
            f"cluster file {origin}: {where}.kind is {kind!r}, not one of gpu_kinds "
            f"({', '.join(kinds)})"
        )
    counts = []
    for key in ("count", "gpus_per_node"):
        value = spec.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ClusterError(
                f"cluster file {origin}: {where}.{key} is {value!r}: give a positive integer"
            )
        counts.append(value)
    return NodeGroup(kind, counts[0], counts[1])
