"""The one cost model: what the planner, the simulator, switching and ParDNN price with.

A model's own cost (its formulas, or figures measured on its captured graph) is the
model's: ``hspmd.models.cost_function``; ``stage`` prices it with a cluster's lines.

============  ================================================================== =====
module        holds                                                              torch
============  ================================================================== =====
cluster       the cluster format (``hspmd.cluster/1``): nodes, GPU kinds, links  no
profile       measured profiles (``hspmd.profile/1``): fitted lines, bus bytes   no
lines         the cost lines of a cluster: seconds per operator and per link     no
link          the link model: one transfer's time, for every user                no
traffic       a BSR scheme's bytes per link class and its time                   no
comm_plans    a resolved CommPlan's time as the runtime issues it (Post's plans) no
stage         one stage's seconds per micro-batch, from the model's own cost     no
measure       ``hspmd profile``: times kernels and collectives on this machine   yes
captured      a model's cost measured on its captured graph (FLOPs, bytes)       yes
============  ================================================================== =====
"""
