"""Initial values of user modules computed a slice at a time (DESIGN 5 and 16): the
factory's own initialization recorded on meta and replayed for the slice a rank holds;
equal to the same slice of the whole value, and to the reference module's."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from hspmd.models.build import initial_piece, plain_model
from hspmd.models.initial import initial_value, recording
from hspmd.models.module import load_model
from hspmd.models.record import record
from hspmd.models.replay import Replay
from hspmd.models.spec import ModuleModel, ParamInfo

DATA = Path(__file__).parent / "data"
GPT2 = "hspmd.models.examples:gpt2"
NANOGPT, HF = f"{DATA / 'nanogpt_style.py'}:make", f"{DATA / 'hf_models.py'}:llama"


def _regions(shape: tuple[int, ...]) -> list[tuple[tuple[int, int], ...]]:
    """Row and column splits in two, and an odd inner box."""
    if len(shape) == 1:
        half = shape[0] // 2
        return [((0, half),), ((half, shape[0]),), ((1, max(2, shape[0] - 1)),)]
    rows, cols = shape
    return [
        ((0, rows // 2), (0, cols)), ((0, rows), (cols // 2, cols)),
        ((1, max(2, rows - 3)), (2, max(3, cols - 1))),
    ]  # fmt: skip


@pytest.mark.parametrize("source", [GPT2, NANOGPT, HF])
def test_a_slice_is_the_same_slice_of_the_whole_value(source: str) -> None:
    model = load_model(source)
    for name, shape in model.parameter_shapes().items():
        whole = initial_piece(model, name, seed=3, region=None)
        for region in _regions(shape):
            part = initial_piece(model, name, seed=3, region=region)
            assert torch.equal(part, whole[tuple(slice(a, b) for a, b in region)]), name


def test_the_reference_module_starts_from_the_same_values() -> None:
    model = load_model(NANOGPT)
    module = plain_model(model, seed=5)
    assert not any(p.is_meta for p in module.parameters())
    for name, param in module.named_parameters():
        assert torch.equal(param.detach(), initial_piece(model, name, seed=5, region=None)), name
    assert module.lm_head.weight is module.transformer.wte.weight  # tied as the factory ties


def test_values_depend_on_the_seed_only() -> None:
    model = load_model(GPT2, {"num_layers": 2})
    name = "layers.0.attn.q.weight"
    one = initial_piece(model, name, seed=0, region=None)
    assert torch.equal(one, Replay(record(lambda: _build(model)), seed=0).value(name))
    assert not torch.equal(one, initial_piece(model, name, seed=1, region=None))


def _build(model: ModuleModel) -> nn.Module:
    from hspmd.models.module import build_module

    return build_module(model.source, dict(model.kwargs))


def test_the_models_own_initialization_is_kept() -> None:
    nano = load_model(NANOGPT)  # 3 layers: c_proj std 0.02 / sqrt(6), LayerNorm ones/zeros
    c_proj = initial_piece(nano, "transformer.h.0.attn.c_proj.weight", seed=0, region=None)
    assert c_proj.std().item() == pytest.approx(0.02 / math.sqrt(6), rel=0.1)
    assert torch.equal(initial_piece(nano, "transformer.h.0.ln_1.weight", seed=0, region=None),
                       torch.ones(32))  # fmt: skip
    hf = load_model(HF, {"pad_token_id": 3})  # HF's _init_weights: std 0.02, the pad row 0
    embed = initial_piece(hf, "model.embed_tokens.weight", seed=0, region=None)
    assert embed.std().item() == pytest.approx(0.02, rel=0.1)
    assert not embed[3].any() and embed[2].any()
    rows = initial_piece(hf, "model.embed_tokens.weight", seed=0, region=((2, 5), (0, 32)))
    assert torch.equal(rows, embed[2:5])  # a write to a view: replayed whole, then sliced


class _Special(nn.Module):
    """Initializers that skip meta tensors in torch (rejection sampling, QR) and a gate."""

    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Parameter(torch.empty(64, 8))
        nn.init.trunc_normal_(self.t, std=1.0, a=-0.5, b=0.5)
        self.q = nn.Parameter(torch.empty(8, 8))
        nn.init.orthogonal_(self.q)
        self.gate = nn.Parameter(torch.zeros(3))
        self.register_buffer("table", torch.tensor([1.0, 2.0, 3.0]))


def test_initializers_that_skip_meta_tensors_are_replayed_whole() -> None:
    replay = Replay(record(_Special), seed=0)
    t = replay.value("t")
    assert t.abs().max() <= 0.5 and t.std() > 0.1
    q = replay.value("q")
    assert torch.allclose(q @ q.T, torch.eye(8), atol=1e-5)
    assert torch.equal(replay.value("t", ((8, 16), (0, 8))), t[8:16])
    assert torch.equal(replay.value("gate"), torch.zeros(3))
    assert torch.equal(replay.value("table"), torch.tensor([1.0, 2.0, 3.0]))


def test_a_slice_of_a_filled_parameter_is_computed_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    replay = Replay(record(lambda: nn.Embedding(1 << 14, 1 << 10)), seed=0)  # 64 MiB whole
    whole_path: list[str] = []
    monkeypatch.setattr(Replay, "tensor", lambda self, ref: whole_path.append("!"))
    part = replay.value("weight", ((100, 102), (0, 1 << 10)))
    assert part.shape == (2, 1 << 10) and not whole_path


def _module_model(source: str, *params: tuple[str, tuple[int, ...]]) -> ModuleModel:
    return ModuleModel(
        source=source, name=source, num_layers=1, hidden_size=1, vocab_size=1, max_seq_len=8,
        params=tuple(ParamInfo(n, s, "replicate", 0) for n, s in params), marker_specs=(),
    )  # fmt: skip


def test_a_factory_that_reads_values_or_leaves_them_empty_falls_back_to_the_cpu() -> None:
    reads = _module_model(f"{DATA / 'init_models.py'}:reads_values", ("w", (4, 4)))
    assert recording(reads) is None  # .item() cannot run on meta
    torch.manual_seed(11)
    expected = nn.Linear(4, 4).weight.detach() * 2.0  # the factory run on the CPU
    assert torch.equal(initial_value(reads, "w", seed=11), expected)
    empty = _module_model(f"{DATA / 'init_models.py'}:left_empty", ("w", (4,)), ("v", (4,)))
    assert recording(empty) is not None
    torch.manual_seed(2)
    assert torch.equal(initial_value(empty, "v", seed=2, region=((1, 3),)), torch.ones(2))
    assert initial_value(empty, "w", seed=2).shape == (4,)  # whatever the CPU build holds
