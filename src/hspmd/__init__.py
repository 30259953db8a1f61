"""hspmd: hierarchical, heterogeneous SPMD training on PyTorch.

The public API is ``hspmd.<name>`` for every name of ``__all__`` (``hspmd.api``,
docs/api.md): values (``Strategy``, ``Annotation``, ``TrainConfig``, ...), metadata verbs
(``resolve``, ``explain``, ``simulate``, ``plan_strategy``), ``fit``, and ``launch`` and ``build``
for your own loop. They load on first use, so that importing a pure module
(``hspmd.annotation``, ...) does not import torch.

The package is layered as DESIGN.md's "Architecture" lists it: annotation (values), graph
and deduce (the defined graph and its annotations), comm (resolution), specialize (per-rank
plans and graphs, as data), runtime (executes them), checkpoint, switch, train, then
planner and sim (choosing a plan), partition (ParDNN), viz, api and cli. Which package may
import which is one table in docs/decisions.md ("The package layering"), enforced by
tests/test_layering.py.
"""

__version__ = "0.1.0"

__all__ = [
    "AdamConfig", "Annotation", "Comparison", "ModelIdentity", "RankProgram", "RunOptions",
    "StepRecord", "Strategy", "StrategyOptions", "TrainConfig", "TrainResult", "__version__",
    "assemble", "build", "compare", "explain", "fit", "launch", "model_spec",
    "parse_annotation", "parse_strategy", "plan_strategy", "render", "reshard", "resolve",
    "revise", "simulate", "train_config",
]  # fmt: skip


def __getattr__(name: str) -> object:
    # Lazy: the public names live in hspmd.api, which imports torch.
    if name in __all__:
        import hspmd.api

        return getattr(hspmd.api, name)
    raise AttributeError(f"module 'hspmd' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
