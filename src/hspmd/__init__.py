"""hspmd: hierarchical, heterogeneous SPMD training on PyTorch.

The package is layered; each module depends only on those above it:

    annotation -> graph -> deduce -> comm -> specialize -> runtime -> switch
    -> elastic -> planner -> sim;  partition (ParDNN) stands apart;  models;  cli
"""

__version__ = "0.1.0"
