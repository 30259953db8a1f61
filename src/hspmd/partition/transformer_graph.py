"""Generated transformer training steps: seeded, layer by layer, built with numpy.

One decoder layer, forward (``x``: the layer input; ``H`` heads in parallel)::

    x ─> ln1 ─┬─> q ─┐
              ├─> k ─┼─> score_h ─> softmax_h ─> context_h ─┐   (h = 0 .. H-1)
              └─> v ─┴──────────────────────────────────────┴─> out ─> add1 ─> ln2
    x ─────────────────────────────────────────────────────────────────^
    add1 ─> ln2 ─> ff1 ─> act ─> ff2 ─> add2 (the next layer's x)
    add1 ───────────────────────────────^

An embedding starts the stack, a head and a loss end it. Backward mirrors forward as
a training graph records it: per forward op ``f`` one gradient op for its inputs
(reading the gradients of ``f``'s consumers, ``f``'s inputs, and ``f`` itself where
the derivative needs it: norms, softmax, activation), and per weighted op one weight
gradient. Every weight is three residual nodes (value, Adam's two moments, all of the
weight's size) and three update ops colocated with it (both moments, then the value,
which waits for the gradient op that reads the weight: write after read).

Costs from a roofline (``5 us + max(FLOPs / 15.7 TFLOP/s, bytes / 900 GB/s)``, a V100's
datasheet figures), times jittered by a seeded log-normal factor (sigma 0.15). With
the defaults a layer is 174 ops; ``num_layers_for(100_000)`` is 575.

>>> g = transformer_graph(2, seed=0)
>>> g.num_nodes, int((g.residual_bytes > 0).sum())  # 2 layers of 174 + 22
(370, 54)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hspmd.errors import PartitionError
from hspmd.partition.graph import OpGraph

_FLOPS_PER_US = 15.7e6
_BYTES_PER_US = 0.9e6
_LAUNCH_US = 5.0
_FLOAT = 4


@dataclass(frozen=True, kw_only=True, slots=True)
class TransformerShape:
    """Sizes of the generated model (defaults: a 1024-wide, 16-head layer on 4 x 512 tokens)."""

    dim: int = 1024
    heads: int = 16
    seq: int = 512
    batch: int = 4
    vocab: int = 32000

    def __post_init__(self) -> None:
        if min(self.dim, self.heads, self.seq, self.batch, self.vocab) < 1 or self.dim % self.heads:
            raise PartitionError(f"{self} needs positive sizes and dim divisible by heads")

    @property
    def ops_per_layer(self) -> int:
        forward = 11 + 3 * self.heads
        return forward + (forward + 8) + 8 * 6  # forward, gradients, 8 weights x 6 nodes


def num_layers_for(num_nodes: int, shape: TransformerShape | None = None) -> int:
    """The layer count whose graph has about ``num_nodes`` ops (at least 1)."""
    per = (shape or TransformerShape()).ops_per_layer
    return max(1, round((num_nodes - _END_OPS) / per))


_END_OPS = 22  # 2 inputs, embed, head, loss, 5 gradients, 2 weights x 6


# a forward op: (node, inputs, weight node or -1, flops, needs own output in backward)
_Forward = tuple[int, list[int], int, float, bool]


class _Builder:
    """Appends nodes (name, time, bytes, residual, colocate) and edges, and keeps the
    forward ops in order for the backward pass."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.time: list[float] = []
        self.out: list[int] = []
        self.residual: list[int] = []
        self.coloc: list[int] = []
        self.src: list[int] = []
        self.dst: list[int] = []
        self.fwd: list[_Forward] = []

    def node(
        self, name: str, time_us: float, out: int, *, residual: int = 0, coloc: int = -1
    ) -> int:
        self.names.append(name)
        self.time.append(time_us)
        self.out.append(out)
        self.residual.append(residual)
        self.coloc.append(coloc)
        return len(self.names) - 1

    def edge(self, a: int, b: int) -> None:
        self.src.append(a)
        self.dst.append(b)

    def weight(self, label: str, num_bytes: int) -> int:
        return self.node(f"{label}.weight", 0.0, num_bytes, residual=num_bytes)

    def op(
        self,
        label: str,
        inputs: list[int],
        out: int,
        flops: float,
        *,
        w: int = -1,
        keep: bool = False,
    ) -> int:
        """A forward op reading ``inputs`` (and weight ``w``), timed by the roofline."""
        moved = out + sum(self.out[i] for i in inputs) + (self.out[w] if w >= 0 else 0)
        v = self.node(label, _roofline(flops, moved), out)
        for i in inputs:
            self.edge(i, v)
        if w >= 0:
            self.edge(w, v)
        self.fwd.append((v, inputs, w, flops, keep))
        return v


def _roofline(flops: float, num_bytes: float) -> float:
    return _LAUNCH_US + max(flops / _FLOPS_PER_US, num_bytes / _BYTES_PER_US)


def transformer_graph(
    num_layers: int,
    *,
    seed: int = 0,
    shape: TransformerShape | None = None,
    name: str | None = None,
) -> OpGraph:
    """One training step of a ``num_layers`` decoder stack (see the module docstring)."""
    if num_layers < 1:
        raise PartitionError(f"{num_layers=} must be >= 1")
    s = shape or TransformerShape()
    b = _Builder()
    tokens = s.batch * s.seq
    act = tokens * s.dim * _FLOAT
    ids = b.node("input:ids", 0.0, tokens * 8)
    w_emb = b.weight("embed", s.vocab * s.dim * _FLOAT)
    x = b.op("embed", [ids], act, float(tokens * s.dim), w=w_emb)
    for layer in range(num_layers):
        x = _layer(b, s, x, prefix=f"layer{layer}.")
    w_head = b.weight("head", s.vocab * s.dim * _FLOAT)
    logits = tokens * s.vocab * _FLOAT
    head = b.op("head", [x], logits, 2.0 * tokens * s.dim * s.vocab, w=w_head)
    target = b.node("input:target", 0.0, tokens * 8)
    loss = b.op("loss", [head, target], _FLOAT, 4.0 * tokens * s.vocab, keep=True)
    _backward(b, b.fwd, loss)
    rng = np.random.default_rng(seed)
    times = np.asarray(b.time) * rng.lognormal(0.0, 0.15, size=len(b.time))
    edges = np.stack((np.asarray(b.src), np.asarray(b.dst)), axis=1)
    return OpGraph.build(
        name or f"transformer_{num_layers}L_s{seed}",
        b.names,
        time_us=np.round(times, 3),
        out_bytes=b.out,
        residual_bytes=b.residual,
        edges=edges,
        colocate=b.coloc,
    )


def _layer(b: _Builder, s: TransformerShape, x: int, *, prefix: str) -> int:
    """One decoder layer's weights and forward ops on input ``x``; returns its output."""
    p = prefix
    tokens = s.batch * s.seq
    act = tokens * s.dim * _FLOAT
    sq = s.dim * s.dim * _FLOAT
    ws = {
        n: b.weight(p + n, sz)
        for n, sz in (
            ("ln1", 2 * s.dim * _FLOAT),
            ("q", sq),
            ("k", sq),
            ("v", sq),
            ("out", sq),
            ("ln2", 2 * s.dim * _FLOAT),
            ("ff1", 4 * sq),
            ("ff2", 4 * sq),
        )
    }
    mm = 2.0 * tokens * s.dim * s.dim
    ln1 = b.op(p + "ln1", [x], act, 8.0 * tokens * s.dim, w=ws["ln1"], keep=True)
    q, k, v = (b.op(p + n, [ln1], act, mm, w=ws[n]) for n in ("q", "k", "v"))
    contexts = [_head(b, s, (q, k, v), prefix=p, h=h) for h in range(s.heads)]
    out = b.op(p + "out", contexts, act, mm, w=ws["out"])
    add1 = b.op(p + "add1", [x, out], act, float(tokens * s.dim))
    ln2 = b.op(p + "ln2", [add1], act, 8.0 * tokens * s.dim, w=ws["ln2"], keep=True)
    ff1 = b.op(p + "ff1", [ln2], 4 * act, 4 * mm, w=ws["ff1"])
    gelu = b.op(p + "act", [ff1], 4 * act, 8.0 * 4 * tokens * s.dim, keep=True)
    ff2 = b.op(p + "ff2", [gelu], act, 4 * mm, w=ws["ff2"])
    return b.op(p + "add2", [add1, ff2], act, float(tokens * s.dim))


def _head(
    b: _Builder, s: TransformerShape, qkv: tuple[int, int, int], *, prefix: str, h: int
) -> int:
    """Attention head ``h`` of a layer: score, softmax, context; returns the context."""
    q, k, v = qkv
    head_dim = s.dim // s.heads
    scores = s.batch * s.seq * s.seq * _FLOAT
    act = s.batch * s.seq * s.dim * _FLOAT
    flops = 2.0 * s.batch * s.seq * s.seq * head_dim
    score = b.op(f"{prefix}score{h}", [q, k], scores, flops)
    soft = b.op(f"{prefix}softmax{h}", [score], scores, 5.0 * scores / _FLOAT, keep=True)
    return b.op(f"{prefix}context{h}", [soft, v], act // s.heads, flops)


def _backward(b: _Builder, fwd: list[_Forward], loss: int) -> None:
    """Gradient ops in reverse forward order, weight gradients, Adam updates."""
    consumers: dict[int, list[int]] = {}
    for v, inputs, _, _, _ in fwd:
        for i in inputs:
            consumers.setdefault(i, []).append(v)
    grad: dict[int, int] = {}  # forward op -> its input-gradient op
    for v, inputs, w, flops, keep in reversed(fwd):
        upstream = [grad[c] for c in consumers.get(v, []) if c in grad]
        saved = [i for i in inputs if b.residual[i] == 0 and not b.names[i].startswith("input:")]
        in_bytes = sum(b.out[i] for i in saved) or b.out[v]
        g = b.node(f"grad:{b.names[v]}", _roofline(flops, in_bytes + b.out[v]), in_bytes)
        for u in upstream + saved + ([v] if keep or v == loss else []):
            b.edge(u, g)
        if w >= 0:
            b.edge(w, g)  # the weight is read to propagate the gradient
        grad[v] = g
        if w >= 0:
            gw = b.node(f"grad:{b.names[w]}", _roofline(flops, b.out[w] + in_bytes), b.out[w])
            for u in upstream + saved:
                b.edge(u, gw)
            _adam(b, w, gw, reader=g)


def _adam(b: _Builder, w: int, gw: int, *, reader: int) -> None:
    """Two moment nodes and three update ops, all colocated with weight ``w``."""
    size = b.out[w]
    label = b.names[w].removesuffix(".weight")
    step = _roofline(4.0 * size / _FLOAT, 3.0 * size)
    moments = []
    for m in ("exp_avg", "exp_avg_sq"):
        state = b.node(f"{label}.{m}", 0.0, size, residual=size, coloc=w)
        upd = b.node(f"update:{label}.{m}", step, 0, coloc=w)
        b.edge(state, upd)
        b.edge(gw, upd)
        moments.append(upd)
    final = b.node(f"update:{label}.weight", step, 0, coloc=w)
    for u in (*moments, w, reader):
        b.edge(u, final)
