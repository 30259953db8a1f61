"""Run communication plans on real processes with torch.distributed.

``launch`` starts local workers (gloo on CPU), ``World`` is one rank's handle with its
cached subgroups, ``run_plan`` executes a ``CommPlan`` on this rank, ``reshard`` is the
autograd-aware version, and ``count_comm`` records the communication a block issued.
See docs/runtime.md.
"""

from hspmd.runtime.counting import CommEvent, CommLog, count_comm
from hspmd.runtime.execute import ExecuteError, run_plan
from hspmd.runtime.launch import LaunchError, launch, run_from_env
from hspmd.runtime.world import World, WorldError, plan_groups

__all__ = [
    "CommEvent",
    "CommLog",
    "ExecuteError",
    "LaunchError",
    "World",
    "WorldError",
    "count_comm",
    "launch",
    "plan_groups",
    "run_from_env",
    "run_plan",
]
