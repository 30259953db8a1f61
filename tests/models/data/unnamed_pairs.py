"""A block whose projections no common name covers: Megatron's pairs come from the graph
(``hspmd.models.tp_structure``). ``fused``: one ``qkv`` projection cut on its features
(as nanoGPT's ``c_attn.split``), so attention stays whole, and its output layer is named
``o_proj`` as Phi-3's: a row by name that the graph demotes."""

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int, heads: int, fused: bool) -> None:
        super().__init__()
        self.heads, self.fused = heads, fused
        self.norm = nn.LayerNorm(width)
        if fused:
            self.qkv = nn.Linear(width, 3 * width)
        else:
            self.query, self.key, self.value = (nn.Linear(width, width) for _ in range(3))
        self.o_proj = nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        h = self.norm(x)
        if self.fused:
            q, k, v = self.qkv(h).split(c, dim=2)
        else:
            q, k, v = self.query(h), self.key(h), self.value(h)
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, width: int, fused: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, width)
        self.layers = nn.ModuleList(Block(width, 4, fused) for _ in range(2))
        self.head = nn.Linear(width, 64)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def make(width: int = 16, fused: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return Net(width, fused)
