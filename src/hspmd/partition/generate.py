"""Synthetic training-step graphs: seeded, layered, built with numpy in well under a second.

A generated graph imitates what a framework records for one training step::

    params ─┐                                   ┌─> update (colocated with its param)
    input ─> fwd layer 0 ─> ... ─> fwd layer L-1 ─> loss ─> bwd layer L-1 ─> ... ─> bwd 0
              (1..w ops, fan-out / fan-in, skips)           (edges reversed, + saved inputs)

* forward: ``L`` layers of 1..``max_width`` ops (widths heavy-tailed); every op has a
  parent in the layer before, every op a child in the layer after, and some ops a
  skip parent two to four layers back;
* backward: one gradient op per forward op with the forward edges reversed, plus the
  edge forward op -> its gradient op (the activation saved for backward);
* parameters: residual nodes feeding a share of the forward ops and their gradient ops;
  each has an update op, colocated with it, that reads the gradient;
* times, output sizes and parameter sizes are log-normal (heavy tails), times
  loosely follow sizes; backward ops take 1.5-2.5x their forward op; an output of
  median size (1 MiB) takes about as long to send as its op takes to run.

Example::

    >>> g = layered_graph(1000, seed=0)
    >>> len(g.names), int((g.residual_bytes > 0).sum()) > 0
    (1000, True)
"""

from __future__ import annotations

import numpy as np

from hspmd.errors import PartitionError
from hspmd.partition.graph import OpGraph

_MIN_NODES = 16


def layered_graph(
    num_nodes: int,
    *,
    seed: int = 0,
    max_width: int = 6,
    skip_prob: float = 0.15,
    param_prob: float = 0.3,
    name: str | None = None,
) -> OpGraph:
    """A training-step-like DAG of exactly ``num_nodes`` nodes (see the module docstring)."""
    if num_nodes < _MIN_NODES:
        raise PartitionError(f"{num_nodes=} is too small; ask for at least {_MIN_NODES} nodes")
    if not 0.0 <= param_prob <= 1.0 or not 0.0 <= skip_prob <= 1.0:
        raise PartitionError(f"{param_prob=} and {skip_prob=} must lie in [0, 1]")
    rng = np.random.default_rng(seed)
    # Budget: num_nodes = 2F (fwd + bwd) + 1 (loss) + 2P (params + updates) + r, r in {0, 1}.
    num_fwd = max(4, int((num_nodes - 1) / (2.0 + 2.0 * param_prob)))
    num_params = (num_nodes - 1 - 2 * num_fwd) // 2
    extra = num_nodes - 1 - 2 * num_fwd - 2 * num_params
    layer_of = _layers(num_fwd, max_width=max_width, rng=rng)
    fwd_src, fwd_dst = _forward_edges(layer_of, skip_prob=skip_prob, rng=rng)
    return _assemble(
        num_fwd=num_fwd,
        num_params=num_params,
        extra=extra,
        fwd_src=fwd_src,
        fwd_dst=fwd_dst,
        layer_of=layer_of,
        rng=rng,
        name=name or f"layered_{num_nodes}_s{seed}",
    )


def _layers(num_fwd: int, *, max_width: int, rng: np.random.Generator) -> np.ndarray:
    """Layer index of each forward op, widths geometric (mostly chains, sometimes wide)."""
    widths = np.minimum(rng.geometric(0.45, size=num_fwd), max_width)
    ends = np.cumsum(widths)
    num_layers = int(np.searchsorted(ends, num_fwd)) + 1
    widths = widths[:num_layers].copy()
    widths[-1] -= int(ends[num_layers - 1]) - num_fwd
    return np.repeat(np.arange(num_layers), widths)


def _forward_edges(
    layer_of: np.ndarray, *, skip_prob: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Forward edges: a parent in the previous layer, a child in the next, and skips."""
    num_layers = int(layer_of[-1]) + 1
    width = np.bincount(layer_of, minlength=num_layers)
    start = np.concatenate(([0], np.cumsum(width)[:-1]))
    nodes = np.arange(len(layer_of))
    has_prev = layer_of > 0
    child = nodes[has_prev]
    prev_layer = layer_of[child] - 1
    parent = start[prev_layer] + (rng.random(len(child)) * width[prev_layer]).astype(np.int64)
    has_next = layer_of < num_layers - 1
    src2 = nodes[has_next]
    next_layer = layer_of[src2] + 1
    dst2 = start[next_layer] + (rng.random(len(src2)) * width[next_layer]).astype(np.int64)
    skip = nodes[(layer_of >= 2) & (rng.random(len(nodes)) < skip_prob)]
    back = np.minimum(rng.integers(2, 5, size=len(skip)), layer_of[skip])
    skip_layer = layer_of[skip] - back
    skip_src = start[skip_layer] + (rng.random(len(skip)) * width[skip_layer]).astype(np.int64)
    src = np.concatenate((parent, src2, skip_src))
    dst = np.concatenate((child, dst2, skip))
    key = np.unique(src * len(nodes) + dst)
    return key // len(nodes), key % len(nodes)


def _assemble(
    *,
    num_fwd: int,
    num_params: int,
    extra: int,
    fwd_src: np.ndarray,
    fwd_dst: np.ndarray,
    layer_of: np.ndarray,
    rng: np.random.Generator,
    name: str,
) -> OpGraph:
    """Lay out params | forward | loss | backward | updates | (step) and wire them."""
    p0, f0 = 0, num_params
    loss = f0 + num_fwd
    b0 = loss + 1  # grad of forward op i is b0 + (num_fwd - 1 - i): a reversed forward
    u0 = b0 + num_fwd
    total = u0 + num_params + extra
    fwd = np.arange(num_fwd)
    grad = b0 + (num_fwd - 1 - fwd)
    last = fwd[layer_of == layer_of[-1]]
    owner = np.sort(rng.choice(num_fwd, size=num_params, replace=num_params > num_fwd))
    params = p0 + np.arange(num_params)
    updates = u0 + np.arange(num_params)
    src = [f0 + fwd_src, grad[fwd_dst], f0 + fwd, f0 + last, np.full(len(last), loss)]
    dst = [f0 + fwd_dst, grad[fwd_src], grad, np.full(len(last), loss), grad[last]]
    src += [params, params, grad[owner], params]
    dst += [f0 + owner, grad[owner], updates, updates]
    if extra:
        src.append(updates)
        dst.append(np.full(num_params, total - 1))
    edges = np.stack((np.concatenate(src), np.concatenate(dst)), axis=1).astype(np.int64)
    out_bytes, time_us, residual = _costs(num_fwd, num_params, total, rng=rng)
    colocate = np.full(total, -1, dtype=np.int64)
    colocate[updates] = params
    names = _names(num_fwd=num_fwd, num_params=num_params, extra=extra)
    return OpGraph.build(
        name,
        names,
        time_us=time_us,
        out_bytes=out_bytes,
        residual_bytes=residual,
        edges=edges,
        colocate=colocate,
    )


def _costs(
    num_fwd: int, num_params: int, total: int, *, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Heavy-tailed sizes (median 1 MiB, mean ~2.4 MB) and times (median ~18 us).

    The size scale is that of the shared Inception slice (2.2 MB per output on average),
    so cutting an edge costs about as much as running an op, as in real graphs.
    """
    out_bytes = np.zeros(total, dtype=np.int64)
    time_us = np.zeros(total, dtype=np.float64)
    residual = np.zeros(total, dtype=np.int64)
    f0, b0 = num_params, num_params + num_fwd + 1
    act = rng.lognormal(np.log(1024 * 1024), 1.3, size=num_fwd)
    fwd_time = 5.0 + act / 80_000.0 * rng.lognormal(0.0, 0.8, size=num_fwd)
    out_bytes[f0 : f0 + num_fwd] = act.astype(np.int64)
    time_us[f0 : f0 + num_fwd] = fwd_time
    bwd = slice(b0, b0 + num_fwd)
    out_bytes[bwd] = out_bytes[f0 : f0 + num_fwd][::-1]
    time_us[bwd] = (fwd_time * rng.uniform(1.5, 2.5, size=num_fwd))[::-1]
    weights = rng.lognormal(np.log(1024 * 1024), 1.5, size=num_params).astype(np.int64) + 4
    residual[:num_params] = weights
    out_bytes[:num_params] = weights
    time_us[:num_params] = 1.0
    u0 = b0 + num_fwd
    time_us[u0 : u0 + num_params] = 2.0 + weights / 100_000.0
    time_us[f0 + num_fwd] = 10.0  # loss
    time_us[u0 + num_params :] = 1.0
    return out_bytes, np.round(time_us, 3), residual


def _names(*, num_fwd: int, num_params: int, extra: int) -> tuple[str, ...]:
    parts = [f"param{i}" for i in range(num_params)]
    parts += [f"fwd{i}" for i in range(num_fwd)]
    parts.append("loss")
    parts += [f"grad{i}" for i in range(num_fwd - 1, -1, -1)]
    parts += [f"update{i}" for i in range(num_params)]
    parts += ["step"] * extra
    return tuple(parts)
