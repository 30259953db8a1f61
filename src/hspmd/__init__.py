"""hspmd: hierarchical, heterogeneous SPMD training on PyTorch.

The package is layered as DESIGN.md's "Architecture" lists it; each layer depends only on
those above it (specialize builds plans and graphs as data, runtime executes them):

    annotation -> graph -> deduce -> comm -> specialize -> runtime -> switch
    -> elastic -> planner -> sim -> partition (ParDNN) -> models -> cli
"""

__version__ = "0.1.0"

__all__ = ["__version__", "reshard"]


def __getattr__(name: str) -> object:
    # Lazy, so that importing a pure module (hspmd.annotation, ...) does not import torch.
    if name == "reshard":
        from hspmd.markers import reshard

        return reshard
    raise AttributeError(f"module 'hspmd' has no attribute {name!r}")
