"""hspmd.fused_ops: the Llama norm's and SwiGLU's values and gradients, keeping less."""

from __future__ import annotations

import pytest
import torch

from hspmd.fused_ops import rms_norm, swiglu


def _plain(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


def test_gradients_are_the_derivative() -> None:
    x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, (6,), b, 1e-5), (x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_the_autograd_composition(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, 7, 16, generator=g).to(dtype)
    w0 = torch.randn(16, generator=g).to(dtype)
    up = torch.randn(2, 7, 16, generator=g).to(dtype)
    outs = []
    for fn in (lambda x, w: rms_norm(x, (16,), w, 1e-5), lambda x, w: _plain(x, w, 1e-5)):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = fn(x, w)
        y.backward(up)
        outs.append((y.detach(), x.grad, w.grad))
    (y1, gx1, gw1), (y2, gx2, gw2) = outs
    # the same ops in the same order, forward and backward: the same bits
    assert torch.equal(y1, y2) and torch.equal(gx1, gx2) and torch.equal(gw1, gw2)


def test_keeps_the_input_and_one_reciprocal_per_row() -> None:
    x = torch.randn(3, 4, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(32, dtype=torch.bfloat16, requires_grad=True)
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() != w.untyped_storage().data_ptr():
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        rms_norm(x, (32,), w, 1e-5)
    assert sorted(kept.values()) == [3 * 4 * 4, 3 * 4 * 32 * 2]  # fp32 rstd, bf16 input


def test_refuses_a_shape_other_than_the_last_dimension() -> None:
    with pytest.raises(ValueError, match="last dimension"):
        rms_norm(torch.randn(2, 3), (2, 3), torch.ones(3), 1e-5)


def test_swiglu_gradients_are_the_derivative() -> None:
    gate = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    up = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu, (gate, up))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_equals_the_autograd_composition_and_keeps_two_tensors(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    gate0, up0, grad = (torch.randn(2, 9, 24, generator=g).to(dtype) for _ in range(3))
    outs = []
    for fn in (swiglu, lambda a, b: torch.nn.functional.silu(a) * b):
        gate, up = gate0.clone().requires_grad_(), up0.clone().requires_grad_()
        kept: dict[int, int] = {}

        def pack(t: torch.Tensor, kept: dict[int, int] = kept) -> torch.Tensor:
            kept[t.untyped_storage().data_ptr()] = t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = fn(gate, up)
        y.backward(grad)
        outs.append((y.detach(), gate.grad, up.grad, len(kept)))
    (y1, gg1, gu1, k1), (y2, gg2, gu2, k2) = outs
    assert (k1, k2) == (2, 3)
    # the same kernels in the same order, silu recomputed: the same bits
    assert torch.equal(y1, y2) and torch.equal(gg1, gg2) and torch.equal(gu1, gu2)
