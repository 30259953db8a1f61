"""Activation recompute per layer: the stage graph cut into one submodule per layer.

Every node of an executable graph carries the layer it came from (``node.meta["layer"]``,
from the defined graph's ``nn_module_stack``: ``layers.{i}`` or None for the embedding,
the final norm, the head and the loss). ``checkpoint_layers`` splits the graph there
(``torch.fx.passes.split_module``) and runs each layer's submodule under
``torch.utils.checkpoint`` (non-reentrant): only the layer's inputs (the residual stream,
the RoPE tables, sizes) are kept in forward, and its forward, collectives included, runs
again in backward right before the layer's own backward::

    stage L0-1, TP 2         forward                  backward
    submod_0  (embed)        embed AR                 (autograd)
    submod_1  (layers.0)     attn_out AR, mlp_out AR  attn_out AR, mlp_out AR (rerun), then
                                                      mlp_in AR, attn_in AR (grads)
    submod_2  (layers.1)     ...

The rerun reissues the same collectives on every rank of the TP group in the same order:
the ranks of a stage run the same graph, so they recompute the same layer at the same
point of their backward (and stop early at the same op). Parameters stay the objects the
unsplit graph held (the trainer's optimizer and gradient sync see the same tensors).

>>> import torch
>>> seq = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
>>> g = torch.fx.symbolic_trace(seq)
>>> for node in g.graph.nodes:  # the first two modules are "layer 0"
...     node.meta["layer"] = 0 if node.target in ("0", "1") else None
>>> split = checkpoint_layers(g)
>>> [(name, type(m).__name__) for name, m in split.named_children()][:2]
[('submod_0', 'CheckpointedLayer'), ('submod_1', 'GraphModule')]
>>> torch.testing.assert_close(split(torch.ones(3, 2)), seq(torch.ones(3, 2)))
"""

from __future__ import annotations

import re

import torch
import torch.fx
from torch import nn
from torch.fx.passes.split_module import split_module
from torch.utils.checkpoint import checkpoint

__all__ = ["CheckpointedLayer", "checkpoint_layers", "layer_of"]


def layer_of(node: torch.fx.Node, *, blocks: str = "layers") -> int | None:
    """The transformer layer a defined-graph node belongs to (None: outside the layers):
    the index under the model's blocks (``layers``; a user model's ``transformer.h``).

    >>> node = torch.fx.Graph().placeholder("x")
    >>> node.meta["nn_module_stack"] = {p: (p, None) for p in ("transformer.h.2", "transformer.h.2.mlp")}
    >>> layer_of(node, blocks="transformer.h"), layer_of(node)
    (2, None)
    """
    pattern = re.compile(re.escape(blocks) + r"\.(\d+)")
    stack = node.meta.get("nn_module_stack") or {}
    for path in stack:
        match = pattern.fullmatch(str(path))
        if match:
            return int(match.group(1))
    return None


class CheckpointedLayer(nn.Module):
    """One layer's submodule, run under non-reentrant activation checkpointing."""

    def __init__(self, inner: nn.Module, layer: int) -> None:
        super().__init__()
        self.inner, self.layer = inner, layer

    def forward(self, *args: object) -> object:
        return checkpoint(self.inner, *args, use_reentrant=False)

    def extra_repr(self) -> str:
        return f"layer {self.layer}: recomputed in backward"


def checkpoint_layers(gm: torch.fx.GraphModule, *, upto: int | None = None) -> torch.fx.GraphModule:
    """``gm`` split into consecutive partitions, each layer's one checkpointed (with
    ``upto``: only the layers up to that one, ``--recompute-layers``).

    Partitions are numbered in graph order: a new one starts where the layer tag changes,
    so the embedding (before the layers) and the head (after them) get their own
    unwrapped ones.
    """
    parts: dict[torch.fx.Node, int] = {}
    layers: dict[int, int] = {}  # partition -> layer
    current: object = object()
    index = -1
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        tag = node.meta.get("layer")
        if tag != current:
            index, current = index + 1, tag
            if tag is not None and (upto is None or int(tag) <= upto):
                layers[index] = int(tag)
        parts[node] = index
    split = split_module(gm, gm, parts.__getitem__, keep_original_order=True)
    for index, layer in layers.items():
        name = f"submod_{index}"
        split.add_submodule(name, CheckpointedLayer(getattr(split, name), layer))
    split.recompile()
    return split
