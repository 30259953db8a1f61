"""The one cost model: what the planner, the simulator, switching and ParDNN price with.

============  ===============================================================  =========
module        holds                                                            torch
============  ===============================================================  =========
cluster       the cluster format (``hspmd.cluster/1``): nodes, GPU kinds, links  no
profile       measured profiles (``hspmd.profile/1``): fitted lines, bus bytes   no
lines         the cost lines of a cluster: seconds per operator and per link     no
traffic       a BSR scheme's bytes per link class and its time                   no
measure       ``hspmd profile``: times kernels and collectives on this machine   yes
captured      a model's cost measured on its captured graph (FLOPs, bytes)       yes
============  ===============================================================  =========
"""
