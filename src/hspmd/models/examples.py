"""Two model families written as a user would: plain PyTorch, nothing imported from hspmd.

What makes them trainable by hspmd is only the documented protocol (docs/models.md):
``forward(tokens, targets)`` returns the mean loss, the blocks sit in ``self.layers``
(an ``nn.ModuleList``), and optionally ``tp_rules`` say how tensor parallelism splits the
weights. Train them with ``hspmd train --model hspmd.models.examples:gpt2`` (or
``:convnet``), ``--config '{"num_layers": 4}'`` for the factory's arguments.

- ``gpt2``: a GPT-2 style decoder: learned positions, LayerNorm with bias, GELU MLP,
  biases everywhere, the head tied to the token embedding (``tie=True``, which needs the
  embedding and the head on one stage: one stage per pipeline) or untied.
- ``convnet``: a non-transformer: a ResNet-style stack of causal 1-D convolutions over the
  sequence (each block: LayerNorm, a gated causal convolution, a residual add), no TP
  rules, so it trains under data and pipeline parallelism.

>>> import torch
>>> tokens = torch.randint(0, 256, (2, 8))
>>> gpt2(num_layers=1)(tokens, tokens).shape, convnet(num_layers=1)(tokens, tokens).shape
(torch.Size([]), torch.Size([]))
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT2", "ConvNet", "convnet", "gpt2"]


class SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.o = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (
            p(x).view(B, T, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class GPT2Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = SelfAttention(hidden, heads)
        self.ln_2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class GPT2(nn.Module):
    # Megatron's split: q, k, v and fc by output features, o and proj by input features
    # (their biases are added once, after the all-reduce), the vocabulary split on the
    # (tied) embedding; LayerNorms and positions replicate.
    tp_rules = {
        "layers.*.attn.[qkv].*": "column",
        "layers.*.fc.*": "column",
        "layers.*.attn.o.weight": "row",
        "layers.*.proj.weight": "row",
        "wte.weight": "vocab",
        "head.weight": "vocab",
    }

    def __init__(
        self, *, vocab_size: int, hidden: int, heads: int, num_layers: int, max_seq_len: int,
        tie: bool,
    ) -> None:  # fmt: skip
        super().__init__()
        self.vocab_size, self.max_seq_len = vocab_size, max_seq_len
        self.wte = nn.Embedding(vocab_size, hidden)
        self.wpe = nn.Embedding(max_seq_len, hidden)
        self.layers = nn.ModuleList(GPT2Block(hidden, heads) for _ in range(num_layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab_size, bias=False)
        if tie:
            self.head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if name.endswith(("o.weight", "proj.weight")):  # GPT-2's scaled residual init
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * num_layers))
            elif p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.layers:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def gpt2(
    *, vocab_size: int = 256, hidden: int = 32, heads: int = 4, num_layers: int = 4,
    max_seq_len: int = 256, tie: bool = True,
) -> GPT2:  # fmt: skip
    """A small GPT-2 (byte vocabulary). ``tie=False`` for more than one stage per pipeline."""
    return GPT2(
        vocab_size=vocab_size, hidden=hidden, heads=heads, num_layers=num_layers,
        max_seq_len=max_seq_len, tie=tie,
    )  # fmt: skip


class ConvBlock(nn.Module):
    """LayerNorm, a gated causal convolution over the sequence, a residual add."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.kernel = kernel
        self.norm = nn.LayerNorm(channels)
        self.conv = nn.Conv1d(channels, 2 * channels, kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, C)
        h = F.pad(self.norm(x).transpose(1, 2), (self.kernel - 1, 0))  # causal: left pad
        y = self.conv(h)  # (B, 2C, T)
        C = x.shape[2]
        return x + (y[:, :C] * torch.sigmoid(y[:, C:])).transpose(1, 2)


class ConvNet(nn.Module):
    def __init__(self, *, vocab_size: int, channels: int, kernel: int, num_layers: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.embed = nn.Embedding(vocab_size, channels)
        self.layers = nn.ModuleList(ConvBlock(channels, kernel) for _ in range(num_layers))
        self.norm = nn.LayerNorm(channels)
        self.head = nn.Linear(channels, vocab_size)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def convnet(
    *, vocab_size: int = 256, channels: int = 32, kernel: int = 4, num_layers: int = 4
) -> ConvNet:
    """A causal convolutional language model (byte vocabulary)."""
    return ConvNet(vocab_size=vocab_size, channels=channels, kernel=kernel, num_layers=num_layers)
