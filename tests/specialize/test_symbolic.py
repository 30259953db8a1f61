"""Symbolic sequence length: one executable, built at the maximum length, runs shorter
(packed) micro-batches without rebuilding, equal to the plain model at each length."""

from __future__ import annotations

import torch

from hspmd.attention import causal_attention, masked_attention
from hspmd.models.llama import Llama, get_config
from hspmd.plan.strategy import StrategyOptions, parse_strategy
from hspmd.specialize.executable import build_executable

CONFIG = get_config("llama-tiny", num_layers=2)
MAX = 32


def packed(length: int, rows: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(length)
    tokens = torch.randint(0, CONFIG.vocab_size, (rows, length), generator=g)
    targets = torch.randint(0, CONFIG.vocab_size, (rows, length), generator=g)
    segments = torch.zeros(rows, length, dtype=torch.long)
    segments[:, length // 3 :] = 1  # two documents per row, then padding
    segments[:, length - 2 :] = 2
    targets[:, length - 2 :] = -100
    return tokens, targets, segments


def test_two_stages_run_every_length_equal_to_the_plain_model() -> None:
    strategy = parse_strategy("1x2: R0:L0 R1:L1")
    first, second = (
        build_executable(CONFIG, strategy, StrategyOptions(), r, seq_len=MAX, seed=0)
        for r in (0, 1)
    )
    model = Llama(CONFIG, seed=0)
    for length in (8, 20, MAX):
        tokens, targets, segments = packed(length)
        model.zero_grad()
        want = model(tokens, targets, segments)
        want.backward()
        for p in [*first.params.values(), *second.params.values()]:
            p.grad = None
        out = first.forward(tokens, targets, segments)
        assert out.shape == (2, length, CONFIG.hidden_size)
        received = out.detach().requires_grad_(True)
        loss = second.forward(received, targets, segments)
        loss.backward()
        out.backward(received.grad)
        torch.testing.assert_close(loss, want, rtol=1e-6, atol=0.0)
        grads = dict(model.named_parameters())
        for name, p in (first.params | second.params).items():
            torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-7, msg=name)


def test_packed_documents_do_not_see_each_other() -> None:
    model = Llama(CONFIG, seed=0)
    tokens, _, segments = packed(12, rows=1)
    alone = model.logits(tokens[:, 4:8])  # the second document by itself
    together = model.logits(tokens, segments)[:, 4:8]
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-5)


def test_per_document_attention_equals_the_masked_one() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 4, 10, 8, generator=g) for _ in range(3))
    segments = torch.tensor([[0] * 10, [0, 0, 0, 1, 1, 1, 1, 2, 2, 2], [0] * 9 + [1]])
    torch.testing.assert_close(
        causal_attention(q, k, v, segments), masked_attention(q, k, v, segments)
    )


def test_recomputed_executable_runs_shorter_packed_rows() -> None:
    strategy = parse_strategy("1x2: R0:L0-1")
    exe = build_executable(
        CONFIG, strategy, StrategyOptions(recompute=True), 0, seq_len=MAX, seed=0
    )
    model = Llama(CONFIG, seed=0)
    tokens, targets, segments = packed(12)
    want = model(tokens, targets, segments)
    want.backward()
    loss = exe.forward(tokens, targets, segments)
    loss.backward()
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0.0)
    grads = dict(model.named_parameters())
    for name, p in exe.params.items():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-7, msg=name)
