"""An emulated cluster as data: namespaces, a bridge, addresses, shaping, and its commands.

A ``NetSpec`` names ``num_nodes`` "nodes" (network namespaces) joined by a bridge that lives
in a hub namespace of its own, so the host's network is never touched::

    hspmd-nc-hub   bridge br0 -- p0 -- p1 -- ...        (no address)
    hspmd-nc-n0    lo, nc0 10.213.0.1/24   (veth nc0 <-> p0 of the hub)
    hspmd-nc-n1    lo, nc0 10.213.0.2/24   (veth nc0 <-> p1 of the hub)

Ranks of one node talk over the node's loopback (its own address routes through ``lo``);
ranks of different nodes cross two shaped veth ends: each direction of a node's link is an
htb class at ``inter_gbps`` (egress of ``nc0`` in the node, egress of ``pK`` in the hub),
with a netem delay of ``latency_ms`` / 2 on each end when a latency is asked for.

With ``nic_per_rank``, every node has one veth per rank instead (``nc0``, ``nc1``, ...; NIC
``k`` of node ``i`` is ``10.213.k.(i+1)``, one subnet per local rank index), each shaped
alone, as a GPU server has one InfiniBand NIC per GPU. Local rank ``k`` binds gloo to
``nck``; traffic to an address in subnet ``k`` leaves and enters through the NICs ``k``.
ARP answers only on the NIC owning an address (``arp_ignore=1``, ``arp_announce=2``) and
reverse-path filtering is off, since a connection may leave by one NIC and return by
another.

The plan is pure data, so it is tested without root::

    >>> spec = NetSpec(num_nodes=2, ranks_per_node=2, inter_gbps=0.4)
    >>> spec.namespaces
    ('hspmd-nc-hub', 'hspmd-nc-n0', 'hspmd-nc-n1')
    >>> spec.address(1)
    '10.213.0.2'
    >>> print(render(up_commands(spec)[0]))
    ip netns add hspmd-nc-hub
"""

from __future__ import annotations

from dataclasses import dataclass

from hspmd.errors import HspmdError

PREFIX = "hspmd-nc-"
HUB = f"{PREFIX}hub"
BRIDGE = "br0"
NODE_IFNAME = "nc0"  # the veth end inside every node namespace
SUBNET_PREFIX = "10.213"  # private: only the namespaces made here hold addresses in it
SUBNET = f"{SUBNET_PREFIX}.0"  # NIC 0 of every node, where node 0 hosts the rendezvous
MAX_NODES = 200

Command = tuple[str, ...]


class NetClusterError(HspmdError, ValueError):
    """A network spec that cannot be built, or a command that failed while building it."""


@dataclass(frozen=True, slots=True)
class NetSpec:
    """``num_nodes`` namespaces of ``ranks_per_node`` ranks, links shaped to ``inter_gbps``
    Gbit/s per direction and ``latency_ms`` round trip."""

    num_nodes: int
    ranks_per_node: int
    inter_gbps: float
    latency_ms: float = 0.0
    nic_per_rank: bool = False

    def __post_init__(self) -> None:
        if not 2 <= self.num_nodes <= MAX_NODES:
            raise NetClusterError(
                f"--nodes {self.num_nodes}: give 2 to {MAX_NODES} nodes (2-4 fit this machine)"
            )
        if self.ranks_per_node < 1:
            raise NetClusterError(f"--ranks-per-node {self.ranks_per_node}: give at least 1")
        if not 0 < self.inter_gbps <= 100:
            raise NetClusterError(
                f"--inter-gbps {self.inter_gbps:g}: give a rate in (0, 100] Gbit/s, e.g. 0.4"
            )
        if not 0 <= self.latency_ms <= 1000:
            raise NetClusterError(f"--latency-ms {self.latency_ms:g}: give 0 to 1000 ms")

    @property
    def num_ranks(self) -> int:
        return self.num_nodes * self.ranks_per_node

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(node_namespace(i) for i in range(self.num_nodes))

    @property
    def namespaces(self) -> tuple[str, ...]:
        return (HUB, *self.nodes)

    @property
    def nics(self) -> tuple[str, ...]:
        """The veth names inside every node: ``("nc0",)``, or one per rank."""
        count = self.ranks_per_node if self.nic_per_rank else 1
        return tuple(f"nc{k}" for k in range(count))

    def address(self, node: int, nic: int = 0) -> str:
        """The IPv4 address of NIC ``nic`` of node ``node`` (``10.213.0.1``: node 0, NIC 0)."""
        return f"{SUBNET_PREFIX}.{nic}.{node + 1}"

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node


def node_namespace(node: int) -> str:
    return f"{PREFIX}n{node}"


def render(command: Command) -> str:
    """A command as one shell line (arguments here never need quoting)."""
    return " ".join(command)


def _shape(namespace: str, device: str, spec: NetSpec) -> list[Command]:
    """htb at the link rate on ``device``'s egress, then netem for half the round trip."""
    rate = f"{spec.inter_gbps * 1000:g}mbit"
    tc = ("ip", "netns", "exec", namespace, "tc")
    out: list[Command] = [
        (*tc, "qdisc", "add", "dev", device, "root", "handle", "1:", "htb", "default", "10"),
        (*tc, "class", "add", "dev", device, "parent", "1:", "classid", "1:10", "htb",
         "rate", rate, "ceil", rate),
    ]  # fmt: skip
    if spec.latency_ms > 0:
        out.append(
            (*tc, "qdisc", "add", "dev", device, "parent", "1:10", "handle", "10:", "netem",
             "delay", f"{spec.latency_ms / 2:g}ms", "limit", "100000")
        )  # fmt: skip
    return out


def up_commands(spec: NetSpec) -> tuple[Command, ...]:
    """Every ``ip`` / ``tc`` command that builds ``spec``, in order.

    >>> for c in up_commands(NetSpec(2, 1, 0.5))[:6]: print(render(c))
    ip netns add hspmd-nc-hub
    ip -n hspmd-nc-hub link add br0 type bridge
    ip -n hspmd-nc-hub link set br0 up
    ip -n hspmd-nc-hub link set lo up
    ip netns add hspmd-nc-n0
    ip -n hspmd-nc-n0 link set lo up
    """
    out: list[Command] = [
        ("ip", "netns", "add", HUB),
        ("ip", "-n", HUB, "link", "add", BRIDGE, "type", "bridge"),
        ("ip", "-n", HUB, "link", "set", BRIDGE, "up"),
        ("ip", "-n", HUB, "link", "set", "lo", "up"),
    ]
    for i, ns in enumerate(spec.nodes):
        out += [("ip", "netns", "add", ns), ("ip", "-n", ns, "link", "set", "lo", "up")]
        if spec.nic_per_rank:
            sysctl = ("ip", "netns", "exec", ns, "sysctl", "-qw")
            out += [(*sysctl, f"net.ipv4.conf.{scope}.{key}")
                    for scope in ("all", "default")
                    for key in ("arp_ignore=1", "arp_announce=2", "rp_filter=0")]  # fmt: skip
        for k, nic in enumerate(spec.nics):
            port = f"p{i}" if not spec.nic_per_rank else f"p{i}k{k}"
            out += [
                # both ends are made inside namespaces: the host's namespace never holds them
                ("ip", "link", "add", "name", nic, "netns", ns, "type", "veth",
                 "peer", "name", port, "netns", HUB),
                ("ip", "-n", HUB, "link", "set", port, "master", BRIDGE),
                ("ip", "-n", HUB, "link", "set", port, "up"),
                ("ip", "-n", ns, "addr", "add", f"{spec.address(i, k)}/24", "dev", nic),
                ("ip", "-n", ns, "link", "set", nic, "up"),
            ]  # fmt: skip
            out += _shape(ns, nic, spec)
            out += _shape(HUB, port, spec)
    return tuple(out)


def down_commands(existing: tuple[str, ...]) -> tuple[Command, ...]:
    """Delete every namespace of ``existing`` that carries this package's prefix, nodes first
    (deleting a namespace deletes the veth ends and the bridge inside it).

    >>> [render(c) for c in down_commands(("other", "hspmd-nc-hub", "hspmd-nc-n0"))]
    ['ip netns del hspmd-nc-n0', 'ip netns del hspmd-nc-hub']
    """
    ours = [ns for ns in existing if ns.startswith(PREFIX)]
    ours.sort(key=lambda ns: ns == HUB)
    return tuple(("ip", "netns", "del", ns) for ns in ours)


def parse_netns_list(text: str) -> tuple[str, ...]:
    """Names from ``ip netns list`` output (lines like ``hspmd-nc-n0 (id: 3)``).

    >>> parse_netns_list("hspmd-nc-n1 (id: 1)\\nhspmd-nc-n0\\n")
    ('hspmd-nc-n1', 'hspmd-nc-n0')
    """
    return tuple(line.split()[0] for line in text.splitlines() if line.strip())
