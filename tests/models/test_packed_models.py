"""Packed documents (--tokens-per-step) for models as their authors wrote them (issue 35,
item 5): each causal SDPA of the captured step runs per document, Hugging Face models get
restarting ``position_ids``, and every family trains equal to the reference."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from hspmd.models.calling import call_step, eager_step
from hspmd.models.initial import plain_module
from hspmd.models.module import load_model, model_graph
from hspmd.models.spec import ModelSpecError
from hspmd.plan.strategy import StrategyOptions, parse_strategy
from hspmd.specialize.executable import build_executable
from hspmd.train.api import train_config
from hspmd.train.compare import compare
from hspmd.train.config import AdamConfig
from hspmd.train.reference import run_reference
from hspmd.train.trainer import train_many

pytest.importorskip("transformers")

DATA = Path(__file__).parent / "data"
HF, NANOGPT = f"{DATA / 'hf_models.py'}", f"{DATA / 'nanogpt_style.py'}"
SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _packed_row(model_docs: list[torch.Tensor], rows: list[list[int]], length: int, ignore: int):
    """tokens, targets, segments (rows x length) with ``rows``' documents back to back."""
    tokens = torch.zeros(len(rows), length, dtype=torch.long)
    targets = torch.full((len(rows), length), ignore)
    segments = torch.zeros(len(rows), length, dtype=torch.long)
    for r, ids in enumerate(rows):
        at = 0
        for i, d in enumerate(ids):
            n = len(model_docs[d]) - 1
            tokens[r, at : at + n], targets[r, at : at + n] = model_docs[d][:-1], model_docs[d][1:]
            segments[r, at : at + n] = i
            at += n
        segments[r, at:] = len(ids)  # padding: a document of its own
    return tokens, targets, segments


def test_a_packed_row_costs_the_sum_of_its_documents_alone() -> None:
    """GPT-2 (learned absolute positions): no document sees another, and each starts at
    position 0, so the packed loss is the token-weighted mean of the documents' own losses."""
    model = load_model(f"{HF}:gpt2", packed=True)
    strategy = parse_strategy("1x2: R0:L0-3")
    exe = build_executable(model, strategy, StrategyOptions(), 0, seq_len=16, seed=0)
    module = plain_module(model, 0)
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, model.vocab_size, (n + 1,), generator=g) for n in (5, 7, 3, 9, 4)]
    tokens, targets, segments = _packed_row(docs, [[0, 1, 2], [3, 4]], 16, model.ignore_index)
    with torch.no_grad():
        alone = [call_step(module, d[None, :-1], d[None, 1:], "hf") * (len(d) - 1) for d in docs]
        want = float(sum(alone)) / sum(len(d) - 1 for d in docs)
        got = float(exe(tokens, targets, segments))
        eager = float(eager_step(module, tokens, targets, "hf", segments))  # HF's own mask
        crossing = float(exe(tokens, targets, torch.zeros_like(segments)))  # one document a row
    assert abs(got - want) < 1e-5 and abs(eager - want) < 1e-5, (got, eager, want)
    assert abs(crossing - want) > 1e-3


def test_captured_hf_attention_is_causal_sdpa_without_a_mask() -> None:
    """No (B, 1, T, T) mask: SDPA's is_causal, GQA inside SDPA (benchmarks/models.py)."""
    attention = [n for n in model_graph(load_model(f"{HF}:llama")).graph.nodes if n.target is SDPA]
    assert len(attention) == 4
    for node in attention:
        assert node.args[3:6] == (None, 0.0, True) and node.kwargs["enable_gqa"], node.format_node()


def test_a_sliding_window_shorter_than_the_model_keeps_its_mask_and_refuses_packing() -> None:
    """Without a mask the capture would hold for lengths up to 8 only (LengthRangeError):
    it is taken again with HF's masks, and packed documents are refused there."""
    window = {"sliding_window": 8}  # max_position_embeddings 64: the window binds at some lengths
    with pytest.raises(ModelSpecError, match="takes a mask, which hspmd cannot keep to one doc"):
        load_model(f"{HF}:mistral", window, packed=True)


def test_a_model_without_sdpa_is_refused_packed_documents_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "manual.py"
    path.write_text(MANUAL_ATTENTION)
    assert load_model(f"{path}:make").convention == "positional"  # trains unpacked
    with pytest.raises(ModelSpecError) as error:
        load_model(f"{path}:make", packed=True)
    assert "no F.scaled_dot_product_attention to run per document" in str(error.value)
    assert "\n" not in str(error.value)


MANUAL_ATTENTION = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / 4.0
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril()
        return x + self.out(scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.blocks, self.head = nn.Embedding(64, 16), nn.ModuleList([Block()]), nn.Linear(16, 64)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def make():
    return Net()
"""


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Short documents (2 to 13 bytes), several to a row of 32."""
    rng = random.Random(1)
    text = Path(random.__file__).read_text()
    lines = []
    for _ in range(200):
        n = rng.randrange(2, 14)
        start = rng.randrange(len(text) - n)
        lines.append(json.dumps({"text": text[start : start + n]}))
    path = tmp_path_factory.mktemp("data") / "docs.jsonl"
    path.write_text("\n".join(lines))
    return path


# per family: a pipeline of two stages (PP) beside a one-stage pipeline (DP between them):
# absolute positions and a tied head (GPT-2), nanoGPT as written (positions not restarted,
# its loss ignores -1); Llama (RoPE on restarting positions, GQA) on a CP-2 stage beside a
# one-rank pipeline: its documents' rows split on the sequence, attention on whole rows of
# half the heads. Mistral and Qwen2 capture as Llama does: their packed step is checked on
# one rank below (the launch costs a capture per rank).
FAMILIES = {
    f"{HF}:gpt2": "2x1: R0:L0-1 R1:L2-3; 1x2: R2:L0-3",
    f"{NANOGPT}:make": "2x1: R0:L0 R1:L1-2; 1x2: R2:L0-2",
    f"{HF}:llama": "2x1: R0-1:L0-3:C2; 1x2: R2:L0-3",
}


@pytest.mark.multiproc
def test_families_train_packed_documents_equal_to_the_reference(short_documents: Path) -> None:
    configs = [
        train_config(model=model, strategy=strategy, global_batch=4, seq_len=32, step_tokens=100,
                     steps=2, adam=AdamConfig(lr=1e-3), data=str(short_documents))
        for model, strategy in FAMILIES.items()
    ]  # fmt: skip
    results = train_many(configs, timeout_s=900, threads=1)
    for model, config, result in zip(FAMILIES, configs, results, strict=True):
        reference = run_reference(config)
        comparison = compare(result, reference, config=config)
        assert comparison.ok, f"{model}: {comparison}"
        assert any(sum(r.sequences or ()) > 4 for r in result.records), model  # 4 rows a step


# Llama, Mistral and Qwen2 (the GQA families) on one rank: the multi-rank test above keeps to
# GPT-2 (Hugging Face, tied) and nanoGPT (its own positions) for the suite's time
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_a_packed_step_on_one_rank_equals_the_eager_forward(family: str) -> None:
    """The captured packed step (per-document causal SDPA, restarting positions) against
    the model run eagerly with ``position_ids``, which HF packs with its own block mask:
    loss and gradients."""
    model = load_model(f"{HF}:{family}", packed=True)
    exe = build_executable(model, parse_strategy("1x2: R0:L0-3"), StrategyOptions(), 0,
                           seq_len=16, seed=0)  # fmt: skip
    module = plain_module(model, 0)
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, model.vocab_size, (n + 1,), generator=g) for n in (6, 2, 8, 5, 3)]
    tokens, targets, segments = _packed_row(docs, [[0, 1, 2], [3, 4]], 16, model.ignore_index)
    got, want = exe(tokens, targets, segments), eager_step(module, tokens, targets, "hf", segments)
    got.backward()
    want.backward()
    assert abs(float(got.detach()) - float(want.detach())) < 1e-5, (got, want)
    for name, param in module.named_parameters():
        assert param.grad is not None and torch.allclose(
            exe.params[name].grad, param.grad, rtol=1e-4, atol=1e-6
        ), name
