"""Fused compute ops (RMS norm, SwiGLU) that keep less for backward than autograd's
composition of them; the Llama preset uses both.

``rms_norm``: written with autograd's ops, ``weight * (x.float() * rsqrt(mean(x^2) +
eps)).type_as(x)`` keeps the input upcast to fp32 (``4H`` bytes a token, twice a bf16
input) and the normalized output (``eH``). ``rms_norm`` computes the same forward, keeps
the input in its own dtype and the fp32 reciprocal (``eH + 4`` bytes a token), and computes
the backward from them, as the fused norms of Apex and Megatron-LM do; its gradients are
autograd's on the composition, bit for bit (the same ops in the same order; a model's
gradients may still differ in the last bit, where autograd sums the three uses of an
fp32 input, the norm's two and the residual's, in another order). For deduction
(``hspmd.deduce.layers``) it is ``F.rms_norm``: the same arguments, the same rule.

At capture (``hspmd.graph.export``) each is one opaque custom op (``hspmd::rms_norm``,
``hspmd::swiglu``), put back as the function in the captured graph (``hspmd.markers.record_as``),
so executables run these backwards and the dtype casts inside stay those of the run.

``swiglu``: ``silu(gate) * up`` keeps gate, silu(gate) and up (``3F`` elements a token)
written with autograd's ops; ``swiglu`` keeps gate and up and computes silu again in
backward (``2F``), as Megatron-LM's fused bias-SwiGLU does; its gradients are autograd's,
bit for bit (the same kernels), for one more elementwise pass over ``F``. For deduction
(``hspmd.deduce.pointwise``) it is a nonlinear pointwise op of its two inputs.

>>> x = torch.randn(2, 3, 8, requires_grad=True)
>>> w = torch.randn(8, requires_grad=True)
>>> y = rms_norm(x, (8,), w, 1e-5)
>>> plain = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
>>> torch.allclose(y, plain, atol=1e-6)
True
>>> torch.equal(swiglu(x, x), torch.nn.functional.silu(x) * x)
True
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hspmd.markers import is_capturing, record_as

__all__ = ["rms_norm", "swiglu"]


def rms_norm(
    x: torch.Tensor, normalized_shape: tuple[int, ...], weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``weight * x / rms(x)`` over the last dimension, in fp32 (or wider), cast back to ``x``'s dtype
    before the weight (as Hugging Face's Llama does). ``normalized_shape`` must be the last
    dimension's size (it is there for ``F.rms_norm``'s signature)."""
    if tuple(normalized_shape) != (x.shape[-1],):
        raise ValueError(
            f"rms_norm normalizes the last dimension only: got normalized_shape "
            f"{tuple(normalized_shape)} for an input of shape {tuple(x.shape)}"
        )
    if is_capturing():
        return _rms_norm_op(x, list(normalized_shape), weight, eps)
    out = _RMSNorm.apply(x, weight, eps)
    assert isinstance(out, torch.Tensor)
    return out


@torch.library.custom_op("hspmd::rms_norm", mutates_args=())
def _rms_norm_op(
    x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``rms_norm`` as one node of a captured graph (capture only)."""
    return _RMSNorm.apply(x, weight, eps)


@_rms_norm_op.register_fake
def _(
    x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor, eps: float
) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = _wide(x)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).type_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # the ops autograd runs on the composition, in its order: the same bits
        x, weight, rstd = ctx.saved_tensors
        xf = _wide(x)
        normed = (xf * rstd).type_as(x)
        grad_weight = (grad * normed).sum_to_size(weight.shape) if ctx.needs_input_grad[1] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            g = (grad * weight).to(xf.dtype)  # through type_as
            grad_r = (g * xf).sum_to_size(rstd.shape)  # through xf * r
            grad_mean = -0.5 * grad_r * rstd.pow(3)  # through rsqrt
            grad_square = grad_mean.expand(xf.shape) / xf.shape[-1]  # through mean
            grad_x = (g * rstd + grad_square * (2 * xf)).to(x.dtype)  # both paths to x
        return grad_x, grad_weight, None


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32, or wider if it is (fp64 stays fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, keeping only ``gate`` and ``up`` for backward."""
    if is_capturing():
        return _swiglu_op(gate, up)
    out = _SwiGLU.apply(gate, up)
    assert isinstance(out, torch.Tensor)
    return out


@torch.library.custom_op("hspmd::swiglu", mutates_args=())
def _swiglu_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``swiglu`` as one node of a captured graph (capture only)."""
    return _SwiGLU.apply(gate, up)


@_swiglu_op.register_fake
def _(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    shape = torch.broadcast_shapes(gate.shape, up.shape)
    return gate.new_empty(shape, dtype=torch.promote_types(gate.dtype, up.dtype))


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gate, up = ctx.saved_tensors
        # the ops autograd runs on silu(gate) * up, silu recomputed: the same bits, and
        # silu's own fused backward kernel
        grad_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        grad_gate = None
        if ctx.needs_input_grad[0]:
            grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
        return grad_gate, grad_up


record_as(torch.ops.hspmd.rms_norm.default, rms_norm)
record_as(torch.ops.hspmd.swiglu.default, swiglu)
