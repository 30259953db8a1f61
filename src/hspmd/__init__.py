"""hspmd: hierarchical, heterogeneous SPMD training on PyTorch.

The package is layered as DESIGN.md's "Architecture" lists it: annotation (values), graph
and deduce (the defined graph and its annotations), comm (resolution), specialize (per-rank
plans and graphs, as data), runtime (executes them), checkpoint, switch, train, then
planner and sim (choosing a plan), partition (ParDNN), viz and cli. Which package may
import which is one table in docs/decisions.md ("The package layering"), enforced by
tests/test_layering.py.
"""

__version__ = "0.1.0"

__all__ = ["__version__", "fit", "reshard"]


def __getattr__(name: str) -> object:
    # Lazy, so that importing a pure module (hspmd.annotation, ...) does not import torch.
    if name == "reshard":
        from hspmd.markers import reshard

        return reshard
    if name == "fit":  # hspmd.train is the package; fit is its one-call API
        from hspmd.train.api import fit

        return fit
    raise AttributeError(f"module 'hspmd' has no attribute {name!r}")
