"""The defined graph: capture an nn.Module with torch.fx, propagate global shapes."""

from hspmd.graph.capture import CaptureError, InliningTracer, capture
from hspmd.graph.shapes import ShapeError, ShapeInfo, TensorSpec, propagate_shapes

__all__ = [
    "CaptureError",
    "InliningTracer",
    "ShapeError",
    "ShapeInfo",
    "TensorSpec",
    "capture",
    "propagate_shapes",
]
