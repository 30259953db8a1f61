"""A plain PyTorch Llama: RMSNorm, RoPE, SwiGLU, grouped-query attention.

It knows nothing of parallelism except the identity ``reshard`` markers, placed where a
plan may change the layout of the residual stream or of a sublayer's output::

    x = reshard(embed(tokens), "embed")                     # (B, T, H)
    per layer i:
      x = reshard(x, "layers.{i}.input")                    # pipeline boundary
      h = reshard(attn_norm(x), "layers.{i}.attn_in")
      x = x + reshard(attn(h), "layers.{i}.attn_out")        # attn: markers attn.q, attn.k,
                                                           # attn.v (B,T,heads,hd), attn.ctx
      h = reshard(mlp_norm(x), "layers.{i}.mlp_in")
      x = x + reshard(mlp(h), "layers.{i}.mlp_out")
    x = reshard(norm(x), "head_in")
    logits = reshard(head(x), "logits")                     # (B, T, V)
    loss = cross_entropy(logits, targets)                   # mean over tokens

Parameter names (``model.named_parameters()``; ``head.weight`` is absent when tied)::

    embed.weight                          (V, H)
    layers.{i}.attn_norm.weight           (H,)
    layers.{i}.attn.wq.weight             (nh*hd, H)
    layers.{i}.attn.wk.weight / wv        (nkv*hd, H)
    layers.{i}.attn.wo.weight             (H, nh*hd)
    layers.{i}.mlp_norm.weight            (H,)
    layers.{i}.mlp.w_gate.weight / w_up   (F, H)
    layers.{i}.mlp.w_down.weight          (H, F)
    norm.weight                           (H,)
    head.weight                           (V, H)

``parameter_shapes(config)`` lists them without building the model, and
``init_parameter`` draws any one of them from the seed at its global shape, so initial
weights never depend on a plan (DESIGN decision 5).

The big presets (``llama-32b``, ``llama-70b``) are ``config_only``: build them only on the
meta device (``with torch.device("meta"): Llama(config)``), e.g. to trace their graph.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from hspmd.attention import causal_attention
from hspmd.fused_ops import rms_norm, swiglu
from hspmd.markers import reshard
from hspmd.models.config import (
    PRESETS,
    LlamaConfig,
    ModelConfigError,
    get_config,
    parameter_shapes,
)

# one call node each in the traced graph (packed documents are data: hspmd.attention;
# the norm is F.rms_norm to deduction, swiglu a pointwise op: hspmd.fused_ops)
torch.fx.wrap("causal_attention")
torch.fx.wrap("rms_norm")
torch.fx.wrap("swiglu")

__all__ = [
    "PRESETS",
    "Llama",
    "LlamaConfig",
    "ModelConfigError",
    "get_config",
    "init_parameter",
    "init_weights",
    "parameter_shapes",
]


Segments = torch.Tensor | None  # (B, T) document id per position; None: one per row

# -- building blocks ------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Hugging Face's Llama norm (fp32 inside, cast back before the weight), keeping only
    its input and one fp32 reciprocal per row for backward (``hspmd.fused_ops``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, (self.dim,), self.weight, self.eps)


def rope_tables(config: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``(max_seq_len, head_dim)``, halves repeated as HF does."""
    dim, cpu = config.head_dim, torch.device("cpu")  # on CPU even under a meta device context
    steps = torch.arange(0, dim, 2, dtype=torch.float32, device=cpu)
    inv_freq = 1.0 / (config.rope_theta ** (steps / dim))
    positions = torch.arange(config.max_seq_len, dtype=torch.float32, device=cpu)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` is (B, heads, T, hd); ``cos``/``sin`` (T, hd) broadcast over B and heads."""
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, prefix: str = "attn") -> None:
        super().__init__()
        self.prefix = prefix
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.wq = nn.Linear(config.hidden_size, q_size, bias=False)
        self.wk = nn.Linear(config.hidden_size, kv_size, bias=False)
        self.wv = nn.Linear(config.hidden_size, kv_size, bias=False)
        self.wo = nn.Linear(q_size, config.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments = None
    ) -> torch.Tensor:
        # B and T are read from x, so fx records them as getitem on x.shape and they stay
        # whatever the local tensor holds. The head counts are constants in the traced
        # graph: under tensor parallelism each rank holds num_heads / TP heads, and
        # specialization rewrites these view sizes to the local head counts.
        # The q/k/v and ctx markers are where context parallelism (a sequence split inside
        # the stage) trades the sequence split for a heads split and back (Ulysses
        # all-to-alls); without it they are the TP heads split already and vanish.
        B, T = x.shape[0], x.shape[1]
        p, nh, nkv, hd = self.prefix, self.num_heads, self.num_kv_heads, self.head_dim
        q = reshard(self.wq(x).view(B, T, nh, hd), f"{p}.q").transpose(1, 2)  # (B,nh,T,hd)
        k = reshard(self.wk(x).view(B, T, nkv, hd), f"{p}.k").transpose(1, 2)  # (B,nkv,T,hd)
        v = reshard(self.wv(x).view(B, T, nkv, hd), f"{p}.v").transpose(1, 2)  # (B,nkv,T,hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = causal_attention(
            q, k, v, segments, enable_gqa=nkv != nh
        )  # (B, nh, T, hd); segments (B, T): packed documents attend only to themselves
        y = reshard(y.transpose(1, 2), f"{p}.ctx")  # (B, T, nh, hd)
        return self.wo(y.reshape(B, T, nh * hd))  # (B, T, H), partial under TP


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w_gate = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w_up = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w_down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # silu(gate) * up, keeping gate and up only (hspmd.fused_ops); (B, T, F) -> (B, T, H)
        return self.w_down(swiglu(self.w_gate(x), self.w_up(x)))


class Block(nn.Module):
    def __init__(self, config: LlamaConfig, index: int) -> None:
        super().__init__()
        self.prefix = f"layers.{index}"
        self.attn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attn = Attention(config, f"{self.prefix}.attn")
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments = None
    ) -> torch.Tensor:
        p = self.prefix
        x = reshard(x, f"{p}.input")  # (B, T, H) residual: pipeline boundary, SP layout
        h = reshard(self.attn_norm(x), f"{p}.attn_in")  # TP: duplicate (SP: gather seq)
        x = x + reshard(
            self.attn(h, cos, sin, segments), f"{p}.attn_out"
        )  # TP: partial -> duplicate
        h = reshard(self.mlp_norm(x), f"{p}.mlp_in")
        x = x + reshard(self.mlp(h), f"{p}.mlp_out")
        return x


class Llama(nn.Module):
    """The whole model; ``forward(tokens, targets)`` is the mean token cross-entropy.

    Weights are ``init_weights(model, seed)`` (skipped on the meta device).

    >>> model = Llama(LlamaConfig(num_layers=1))
    >>> tokens = torch.zeros(2, 8, dtype=torch.long)
    >>> model(tokens, tokens).shape
    torch.Size([])
    """

    rope_cos: torch.Tensor  # (max_seq_len, head_dim) buffers, not parameters
    rope_sin: torch.Tensor

    def __init__(self, config: LlamaConfig, *, seed: int = 0) -> None:
        super().__init__()
        on_meta = torch.get_default_device().type == "meta"
        if config.config_only and not on_meta:
            raise ModelConfigError(
                "this preset is config_only (too big to allocate): build it under "
                'torch.device("meta") to trace it, or use parameter_shapes(config)'
            )
        self.config = config
        # _weight skips nn.Embedding's own normal_ init (slow on meta); init_weights follows.
        empty = torch.empty(config.vocab_size, config.hidden_size)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size, _weight=empty)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight
        if on_meta:  # shapes only: the tables' values would be dropped
            cos, sin = (
                torch.empty(config.max_seq_len, config.head_dim, dtype=torch.float32)
                for _ in range(2)
            )
        else:
            cos, sin = (t.to(torch.get_default_device()) for t in rope_tables(config))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if not on_meta:
            init_weights(self, seed)

    def logits(self, tokens: torch.Tensor, segments: Segments = None) -> torch.Tensor:
        """(B, T) int64 -> (B, T, V); ``segments`` (B, T): document ids of packed rows."""
        T = tokens.shape[1]
        # torch.narrow, not [:T]: fx can slice a buffer by a traced size only this way.
        cos, sin = torch.narrow(self.rope_cos, 0, 0, T), torch.narrow(self.rope_sin, 0, 0, T)
        x = reshard(self.embed(tokens), "embed")  # (B, T, H) residual stream
        cos, sin = cos.type_as(x), sin.type_as(x)
        for layer in self.layers:
            x = layer(x, cos, sin, segments)
        x = reshard(self.norm(x), "head_in")  # (B, T, H)
        return reshard(self.head(x), "logits")  # (B, T, V) vocab-parallel head: split dim 2

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor, segments: Segments = None
    ) -> torch.Tensor:
        """Mean cross-entropy over the B*T tokens, computed in fp32; targets -100 (padding
        of packed rows) are left out. ``segments``: see ``hspmd.attention``."""
        logits = self.logits(tokens, segments)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# -- parameters without a model, and plan-independent init ----------------------------------


INIT_STD = 0.02


def init_parameter(name: str, config: LlamaConfig, *, seed: int) -> torch.Tensor:
    """The initial fp32 value of parameter ``name`` at its global shape.

    Each parameter has its own generator, seeded from ``seed`` and the name, so any rank
    can draw any parameter (and slice it) without drawing the others. Norm weights are
    ones; output projections (``wo``, ``w_down``) use std 0.02 / sqrt(2 * num_layers);
    everything else std 0.02.
    """
    shape = parameter_shapes(config).get(name)
    if shape is None:
        raise ModelConfigError(f"no parameter {name!r} in this model: see parameter_shapes()")
    if torch.get_default_device().type == "meta":  # metadata only: nothing to draw
        return torch.empty(shape, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    std = INIT_STD
    if name.endswith(("attn.wo.weight", "mlp.w_down.weight")):
        std /= math.sqrt(2 * config.num_layers)
    generator = torch.Generator().manual_seed(
        (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63
    )
    return torch.randn(shape, generator=generator) * std


@torch.no_grad()
def init_weights(model: Llama, seed: int) -> Llama:
    """Overwrite every parameter with ``init_parameter``; returns ``model``."""
    for name, param in model.named_parameters():
        param.copy_(init_parameter(name, model.config, seed=seed))
    return model
