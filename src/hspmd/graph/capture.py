"""Capture the defined graph: an nn.Module's forward as a torch.fx GraphModule.

Every submodule is traced through (no leaf modules), so ``nn.Linear`` becomes
``F.linear(x, weight)`` with the weight a ``get_attr`` node named by its parameter's
qualified name; deduction rules then only see functions, methods and parameters::

    >>> import torch
    >>> gm = capture(torch.nn.Sequential(torch.nn.Linear(4, 2)))
    >>> [n.op for n in gm.graph.nodes]
    ['placeholder', 'get_attr', 'get_attr', 'call_function', 'output']

Reshard markers (``hspmd.markers.reshard``) record themselves as ``call_function`` nodes.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
import torch.fx
from torch import nn

from hspmd.errors import HspmdError

__all__ = ["CaptureError", "InliningTracer", "capture", "source_line"]


class CaptureError(HspmdError, ValueError):
    """A module whose forward torch.fx cannot trace."""


class InliningTracer(torch.fx.Tracer):
    """A tracer that inlines every submodule (``torch.nn`` ones included).

    A parameter's name is looked up in a table built once per trace: fx's own lookup scans
    ``named_parameters()`` at every parameter access, quadratic in the parameter count
    (llama-70b's 80 layers: 10 s of a 15 s capture).
    """

    _param_names: dict[int, str]

    def __init__(self, *, user_lines: bool = False) -> None:
        super().__init__()
        self._user_lines = user_lines

    def create_node(self, *args: Any, **kwargs: Any) -> torch.fx.Node:
        """With ``user_lines``, each node keeps the Python stack that made it (for
        ``source_line``). fx's own ``record_stack_traces`` symbolizes through torch's
        profiler, whose first use imports torch._dynamo and torch._inductor (8-10 s)."""
        node = super().create_node(*args, **kwargs)
        if self._user_lines and not node.stack_trace:
            node.stack_trace = "".join(traceback.format_stack(limit=24)[:-1])
        return node

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return False

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> torch.fx.Graph:
        self._param_names = {}
        if isinstance(root, nn.Module):
            for name, param in root.named_parameters():  # first name of a shared parameter
                self._param_names.setdefault(id(param), name)
        return super().trace(root, concrete_args)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        name = self._param_names.get(id(attr_val))
        if name is None or not isinstance(attr_val, nn.Parameter):
            return super().getattr(attr, attr_val, parameter_proxy_cache)
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
        return parameter_proxy_cache[name]


def capture(module: nn.Module) -> torch.fx.GraphModule:
    """Trace ``module.forward`` into a GraphModule whose parameters are ``get_attr`` nodes.

    Works on modules built on the meta device (shapes only), e.g. the llama-32b preset.
    """
    try:
        graph = InliningTracer().trace(module)
    except Exception as error:  # fx raises many kinds (TraceError, TypeError, ...)
        raise CaptureError(
            f"torch.fx cannot trace {type(module).__name__}.forward: {error}. "
            "Keep data-dependent control flow out of forward (branch on shapes or config only)"
        ) from error
    return _graph_module(module, graph, class_name=type(module).__name__)


def _graph_module(
    root: nn.Module, graph: torch.fx.Graph, *, class_name: str
) -> torch.fx.GraphModule:
    """A GraphModule whose Python code is generated when first called or read, not now:
    a captured graph is read (deduction, cuts), rarely run, and generating and compiling
    the code of llama-70b's 6,000 nodes costs about 0.3 s (torch's ``_LazyGraphModule``,
    what torch.compile uses; a plain GraphModule where this torch has none)."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # pragma: no cover - torch before 2.3
        return torch.fx.GraphModule(root, graph, class_name=class_name)
    return _LazyGraphModule(root, graph, class_name=class_name)


def source_line(node: torch.fx.Node) -> str | None:
    """``file:line`` of the user's code that made ``node`` (the innermost frame of its
    recorded stack outside torch), or None when the capture recorded no stack."""
    stack = node.meta.get("stack_trace") or getattr(node, "stack_trace", None)
    if not stack:
        return None
    found = None
    for line in str(stack).splitlines():
        line = line.strip()
        if line.startswith('File "') and "/torch/" not in line:
            path, _, rest = line[6:].partition('", line ')
            found = f"{path}:{rest.split(',')[0]}"
    return found
