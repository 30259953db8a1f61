"""``AnnotatedGraph``: the defined graph with every annotation deduction found."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.fx

from hspmd.annotation import Annotation
from hspmd.deduce.backward import AlignSite, ReshardSite
from hspmd.deduce.forward import Fallback
from hspmd.deduce.rules import target_text
from hspmd.graph.shapes import TensorSpec

__all__ = ["AnnotatedGraph"]


@dataclass(frozen=True, slots=True)
class AnnotatedGraph:
    """Read-only results of ``deduce``; all mappings are keyed by fx node name.

    ``annotations[n]`` is None for constants (buffers and what is computed from them and
    sizes only: present on every rank that consumes them, duplicate). ``grads`` holds the
    nodes a gradient reaches. ``values`` holds non-tensor nodes (sizes) at global shapes.
    ``params`` maps each parameter ``get_attr`` node to its parameter name, and
    ``param_grads`` each parameter name to its gradient annotation (the source of the
    gradient sync, ``resolve(param_grads[p], param annotation)``). ``inputs`` maps each op
    and marker node to its data inputs (``type_as``'s dtype operand is not one).
    ``alignments`` lists the align nodes of ``module`` (inserted by deduction or by hand).
    """

    module: torch.fx.GraphModule
    specs: Mapping[str, TensorSpec]
    values: Mapping[str, Any]
    annotations: Mapping[str, Annotation | None]
    grads: Mapping[str, Annotation]
    params: Mapping[str, str]
    inputs: Mapping[str, tuple[str, ...]]
    param_grads: Mapping[str, Annotation]
    reshards: tuple[ReshardSite, ...]
    alignments: tuple[AlignSite, ...]
    loss: str
    fallbacks: tuple[Fallback, ...] = ()  # ops computed whole on gathered inputs

    def fallback_bytes(self, fallback: Fallback) -> int:
        """Bytes of the inputs ``fallback`` gathers, at the deduced (micro-batch) shapes."""
        total = 0
        for name in fallback.gathered:
            spec = self.specs[name]
            total += math.prod(spec.shape) * spec.dtype.itemsize
        return total

    def shape(self, node_name: str) -> tuple[int, ...]:
        return self.specs[node_name].shape

    def reshard(self, name: str) -> ReshardSite:
        """The reshard site of marker ``name`` (e.g. ``"layers.0.attn_out"``)."""
        for site in self.reshards:
            if site.name == name:
                return site
        raise KeyError(f"no reshard marker {name!r}")

    def alignment(self, node_name: str) -> AlignSite | None:
        """The site of align node ``node_name`` (None: no gradient passes it)."""
        for site in self.alignments:
            if site.name == node_name:
                return site
        return None

    def lines(self) -> list[str]:
        """One line per tensor node: name, op, shape, annotation, gradient annotation."""
        out = []
        for node in self.module.graph.nodes:
            if node.name not in self.specs:
                continue
            op = node.op if node.op in ("placeholder", "get_attr") else target_text(node.target)
            ann = self.annotations.get(node.name)
            text = "constant" if ann is None else str(ann)
            grad = self.grads.get(node.name)
            tail = "" if grad is None else f"  grad {grad}"
            out.append(f"{node.name} = {op} {self.specs[node.name]}  {text}{tail}")
        return out

    def __str__(self) -> str:
        parts = self.lines()
        parts += [f"reshard {site}" for site in self.reshards]
        parts += [str(site) for site in self.alignments]
        parts += [f"fallback {f}" for f in self.fallbacks]
        return "\n".join(parts)
