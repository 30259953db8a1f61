"""The ParDNN paper's model families as plain modules, with size presets to capture.

=============  ======================================================================
word_lstm      word-level LSTM language model: embedding, stacked LSTM unrolled over
               the sequence, softmax over the vocabulary (the paper's Word-RNN)
char_cnn       character-aware CNN language model: char embeddings, convolutions of
               several widths, max over time, highway layers, stacked LSTM (Char-CRN)
wrn            wide residual network for 32x32 images (WRN-depth-width)
transformer    encoder-decoder Transformer with explicit attention matmuls (TRN)
=============  ======================================================================

Each preset is ``family-size``; ``large`` follows the paper's Table 3 where it gives the
figures (Word-RNN: 8 layers of 2048, 28 steps; Char-CRN: 8 layers of 2048, embeddings of
15) and is captured on meta tensors, so nothing is allocated.

>>> graph = capture_preset("word_lstm-tiny")
>>> graph.num_nodes > 100, int(graph.residual_bytes.sum()) > 0
(True, True)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hspmd.errors import PartitionError
from hspmd.partition.capture import DEVICES, Device, capture_training_step
from hspmd.partition.graph import OpGraph

# ---- models ------------------------------------------------------------------------


class LSTMStack(nn.Module):
    """Stacked LSTM unrolled step by step (one matmul pair per layer and step)."""

    def __init__(self, input_size: int, hidden: int, num_layers: int) -> None:
        super().__init__()
        sizes = [input_size] + [hidden] * (num_layers - 1)
        self.w_ih = nn.ParameterList(nn.Parameter(torch.randn(4 * hidden, s) * 0.05) for s in sizes)
        self.w_hh = nn.ParameterList(
            nn.Parameter(torch.randn(4 * hidden, hidden) * 0.05) for _ in sizes
        )
        self.bias = nn.ParameterList(nn.Parameter(torch.zeros(4 * hidden)) for _ in sizes)
        self.hidden = hidden

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, input) -> (B, T, hidden)
        batch, steps, _ = x.shape
        for w_ih, w_hh, bias in zip(self.w_ih, self.w_hh, self.bias, strict=True):
            h = x.new_zeros(batch, self.hidden)
            c = x.new_zeros(batch, self.hidden)
            outs = []
            for t in range(steps):
                gates = F.linear(x[:, t], w_ih, bias) + F.linear(h, w_hh)  # (B, 4H)
                i, f, g, o = gates.chunk(4, dim=-1)
                c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h = torch.sigmoid(o) * torch.tanh(c)
                outs.append(h)
            x = torch.stack(outs, dim=1)
        return x


class WordLSTM(nn.Module):
    """Word-level LSTM language model: ids (B, T) -> logits (B, T, vocab)."""

    def __init__(self, *, vocab: int, embed: int, hidden: int, num_layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = LSTMStack(embed, hidden, num_layers)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embed(ids)))


class Highway(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.transform = nn.Linear(size, size)
        self.gate = nn.Linear(size, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.gate(x))
        return gate * F.relu(self.transform(x)) + (1 - gate) * x


class CharCNNLM(nn.Module):
    """Character-aware LM: chars (B, T, W) -> word logits (B, T, vocab)."""

    def __init__(
        self,
        *,
        chars: int,
        char_embed: int,
        widths: tuple[int, ...],
        filters: int,
        highways: int,
        hidden: int,
        num_layers: int,
        vocab: int,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(chars, char_embed)
        self.convs = nn.ModuleList(nn.Conv1d(char_embed, filters * w, w) for w in widths)
        features = filters * sum(widths)
        self.highways = nn.ModuleList(Highway(features) for _ in range(highways))
        self.lstm = LSTMStack(features, hidden, num_layers)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, chars: torch.Tensor) -> torch.Tensor:
        batch, steps, width = chars.shape
        x = self.embed(chars.reshape(batch * steps, width)).transpose(1, 2)  # (BT, E, W)
        pooled = [torch.tanh(conv(x)).amax(dim=-1) for conv in self.convs]
        x = torch.cat(pooled, dim=-1)
        for highway in self.highways:
            x = highway(x)
        return self.head(self.lstm(x.reshape(batch, steps, -1)))


class WideBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.bn1, self.bn2 = nn.BatchNorm2d(cin), nn.BatchNorm2d(cout)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.short = None if cin == cout and stride == 1 else nn.Conv2d(cin, cout, 1, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(x))
        skip = x if self.short is None else self.short(y)
        return skip + self.conv2(F.relu(self.bn2(self.conv1(y))))


class WideResNet(nn.Module):
    """WRN-depth-widen for 32x32 images: images (B, 3, 32, 32) -> logits (B, classes)."""

    def __init__(self, *, depth: int, widen: int, classes: int = 10) -> None:
        super().__init__()
        if (depth - 4) % 6:
            raise PartitionError(f"WRN {depth=} must be 6n + 4")
        blocks = (depth - 4) // 6
        widths = [16, 16 * widen, 32 * widen, 64 * widen]
        self.stem = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        layers: list[nn.Module] = []
        for group in range(3):
            for b in range(blocks):
                cin = widths[group] if b == 0 else widths[group + 1]
                layers.append(WideBlock(cin, widths[group + 1], 2 if b == 0 and group else 1))
        self.blocks = nn.Sequential(*layers)
        self.bn = nn.BatchNorm2d(widths[3])
        self.head = nn.Linear(widths[3], classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.blocks(self.stem(images))))
        return self.head(x.mean(dim=(2, 3)))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.q, self.kv, self.out = (
            nn.Linear(dim, dim),
            nn.Linear(dim, 2 * dim),
            nn.Linear(dim, dim),
        )
        self.heads = heads

    def forward(self, x: torch.Tensor, memory: torch.Tensor, causal: bool) -> torch.Tensor:
        batch, steps, dim = x.shape
        q = self.q(x).view(batch, steps, self.heads, -1).transpose(1, 2)  # (B, h, T, d)
        k, v = self.kv(memory).view(batch, -1, 2, self.heads, dim // self.heads).unbind(2)
        scores = q @ k.permute(0, 2, 3, 1) / (dim // self.heads) ** 0.5  # (B, h, T, S)
        if causal:
            mask = torch.ones(steps, steps, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        mixed = scores.softmax(dim=-1) @ v.transpose(1, 2)  # (B, h, T, d)
        return self.out(mixed.transpose(1, 2).reshape(batch, steps, dim))


class DecoderLayer(nn.Module):
    """Self-attention (causal if decoding), cross-attention if given memory, MLP; pre-norm."""

    def __init__(self, dim: int, heads: int, ff: int, *, cross: bool) -> None:
        super().__init__()
        self.norm1, self.norm3 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.cross = Attention(dim, heads) if cross else None
        self.norm2 = nn.LayerNorm(dim) if cross else None
        self.mlp = nn.Sequential(nn.Linear(dim, ff), nn.ReLU(), nn.Linear(ff, dim))

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, causal=memory is not None)
        if self.cross is not None and self.norm2 is not None and memory is not None:
            x = x + self.cross(self.norm2(x), memory, causal=False)
        return x + self.mlp(self.norm3(x))


class Transformer(nn.Module):
    """Encoder-decoder: (src ids (B, S), tgt ids (B, T)) -> logits (B, T, vocab)."""

    def __init__(self, *, vocab: int, dim: int, heads: int, ff: int, num_layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.encoder = nn.ModuleList(
            DecoderLayer(dim, heads, ff, cross=False) for _ in range(num_layers)
        )
        self.decoder = nn.ModuleList(
            DecoderLayer(dim, heads, ff, cross=True) for _ in range(num_layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        memory = self.embed(src)
        for layer in self.encoder:
            memory = layer(memory)
        x = self.embed(tgt)
        for layer in self.decoder:
            x = layer(x, memory)
        return self.head(self.norm(x))


# ---- presets -----------------------------------------------------------------------


def _lm_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    *inputs, target = batch
    logits = model(*inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


@dataclass(frozen=True, slots=True)
class Preset:
    """A model family at one size, and the batch it trains on (shapes and id ranges)."""

    family: str
    config: dict[str, Any] = field(hash=False)
    batch: tuple[tuple[tuple[int, ...], int], ...]  # (shape, id range; 0 = float data)

    def build(self) -> nn.Module:
        return _FAMILIES[self.family](**self.config)

    def make_batch(self, *, generator: torch.Generator | None = None) -> tuple[torch.Tensor, ...]:
        """Random batch; ids where the range is > 0, floats otherwise (on the current device)."""
        out = []
        for shape, high in self.batch:
            if high:
                out.append(torch.randint(0, high, shape, generator=generator))
            else:
                out.append(torch.randn(shape, generator=generator))
        return tuple(out)


_FAMILIES: dict[str, Callable[..., nn.Module]] = {
    "word_lstm": WordLSTM,
    "char_cnn": CharCNNLM,
    "wrn": WideResNet,
    "transformer": Transformer,
}


def _word(vocab: int, embed: int, hidden: int, layers: int, batch: int, steps: int) -> Preset:
    config = {"vocab": vocab, "embed": embed, "hidden": hidden, "num_layers": layers}
    return Preset("word_lstm", config, (((batch, steps), vocab), ((batch, steps), vocab)))


def _char(hidden: int, layers: int, filters: int, batch: int, steps: int) -> Preset:
    config = {
        "chars": 51,
        "char_embed": 15,
        "widths": (1, 2, 3, 4, 5, 6),
        "filters": filters,
        "highways": 2,
        "hidden": hidden,
        "num_layers": layers,
        "vocab": 10000,
    }
    return Preset("char_cnn", config, (((batch, steps, 21), 51), ((batch, steps), 10000)))


def _wrn(depth: int, widen: int, batch: int) -> Preset:
    return Preset(
        "wrn", {"depth": depth, "widen": widen}, (((batch, 3, 32, 32), 0), ((batch,), 10))
    )


def _trn(dim: int, layers: int, batch: int, steps: int, vocab: int = 8000) -> Preset:
    config = {"vocab": vocab, "dim": dim, "heads": 8, "ff": 4 * dim, "num_layers": layers}
    ids = ((batch, steps), vocab)
    return Preset("transformer", config, (ids, ids, ids))


PRESETS: dict[str, Preset] = {
    "word_lstm-tiny": _word(500, 32, 32, 2, 4, 6),
    "word_lstm-small": _word(10000, 512, 512, 2, 32, 20),
    "word_lstm-large": _word(17000, 2048, 2048, 8, 32, 28),
    "char_cnn-small": _char(512, 2, 25, 32, 20),
    "char_cnn-large": _char(2048, 8, 50, 32, 35),
    "wrn-small": _wrn(16, 4, 32),
    "wrn-large": _wrn(100, 16, 64),
    "transformer-small": _trn(256, 3, 32, 32),
    "transformer-large": _trn(1024, 24, 64, 64),
    "transformer-huge": _trn(2048, 120, 16, 64),
}


def capture_preset(
    name: str, *, device: Device = DEVICES["v100"], optimizer: str = "adam", measure: bool = False
) -> OpGraph:
    """Capture one training step of a preset.

    On meta tensors (nothing is allocated) with roofline times of ``device``; with
    ``measure=True`` on real CPU tensors, each op timed as it runs (small presets only).
    """
    if name not in PRESETS:
        raise PartitionError(f"model preset {name!r} is not known; choose one of {sorted(PRESETS)}")
    preset = PRESETS[name]
    # Seeded for a reproducible capture, without touching the caller's random state.
    with torch.random.fork_rng(devices=[]), torch.device("cpu" if measure else "meta"):
        torch.manual_seed(0)
        model = preset.build()
        batch = preset.make_batch()
    return capture_training_step(
        model,
        batch,
        loss_fn=_lm_loss,
        optimizer=optimizer,
        device=device,
        measure=measure,
        name=name,
    )
