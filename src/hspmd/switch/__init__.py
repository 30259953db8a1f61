"""Graph switching: cluster files, the cost of a switch between strategies, checkpoints."""

from hspmd.cost.cluster import Cluster, ClusterError, load_cluster
from hspmd.switch.cost import ALGOS, STATES, SwitchCost, SwitchError, switch_cost

__all__ = [
    "ALGOS",
    "STATES",
    "Cluster",
    "ClusterError",
    "SwitchCost",
    "SwitchError",
    "load_cluster",
    "switch_cost",
]
