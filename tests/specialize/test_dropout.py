"""Dropout in executables, without processes: every stage and micro-batch of a DP + PP
strategy draws the reference's masks (the chained stages give the plain module's loss
under ``positional_dropout``), a recomputed layer draws them again, attention dropout on a
TP rank's heads takes its block of the weights, and what cannot be keyed is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hspmd.deduce import DeductionError
from hspmd.models.build import plain_model, step_loss
from hspmd.models.module import load_model
from hspmd.plan.strategy import StrategyOptions, parse_strategy
from hspmd.randomness import dropout_key, positional_dropout
from hspmd.specialize.dropout import CounterAttention, CounterDropout
from hspmd.specialize.executable import ExecutableError, build_executable

DATA = Path(__file__).parents[1] / "models" / "data"
NANOGPT = f"{DATA / 'nanogpt_style.py'}:make_untied"
SEQ = 16


def _batch(rows: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, vocab, (rows, SEQ), generator=g), torch.randint(
        0, vocab, (rows, SEQ), generator=g
    )


def _pipeline_loss(model, strategy: str, p: int, rows: range, step: int, tokens, targets):  # type: ignore[no-untyped-def]
    """The loss of pipeline ``p`` on ``rows``: its stages' executables chained in-process."""
    parsed = parse_strategy(strategy)
    options = StrategyOptions()
    x: torch.Tensor = tokens[rows.start : rows.stop]
    key = dropout_key(step, rows)
    for stage in parsed.pipelines[p].stages:
        exe = build_executable(model, parsed, options, stage.ranks[0], seq_len=SEQ, seed=0)
        x = exe(x, targets[rows.start : rows.stop], None, key)
    return x


def test_every_stage_and_micro_batch_draws_the_reference_masks() -> None:
    model = load_model(NANOGPT, {"dropout": 0.1})
    tokens, targets = _batch(4, model.vocab_size)
    plain = plain_model(model, seed=0)
    with positional_dropout(seed=0, step=2, rows=range(4)):
        whole = float(step_loss(model, plain, tokens, targets).detach())
    without = float(step_loss(model, plain.eval(), tokens, targets).detach())
    assert abs(whole - without) > 1e-3  # the masks matter at the tolerance below
    # pipeline 0: micro-batches of one row, three stages; pipeline 1: rows 2-3, one stage
    strategy = "2x1: R0:L0 R1:L1 R2:L2; 1x2: R3:L0-2"
    parts = [_pipeline_loss(model, strategy, 0, range(m, m + 1), 2, tokens, targets)
             for m in range(2)]  # fmt: skip
    parts.append(_pipeline_loss(model, strategy, 1, range(2, 4), 2, tokens, targets) * 2)
    assert float(sum(parts).detach()) / 4 == pytest.approx(whole, rel=1e-6)
    shifted = _pipeline_loss(model, strategy, 1, range(1, 3), 2, tokens, targets)  # wrong rows
    assert float(shifted.detach()) != pytest.approx(float(parts[2].detach() / 2), rel=1e-4)


def test_a_recomputed_layer_draws_the_same_masks_again() -> None:
    model = load_model(NANOGPT, {"dropout": 0.1})
    tokens, targets = _batch(2, model.vocab_size)
    grads = []
    for text in ("1x2: R0:L0-2", "1x2: R0:L0-2:RC3"):
        exe = build_executable(model, parse_strategy(text), StrategyOptions(), 0, seq_len=SEQ,
                               seed=0)  # fmt: skip
        exe(tokens, targets, None, dropout_key(1, range(2))).backward()
        grads.append({name: p.grad for name, p in exe.params.items()})
    assert any("CheckpointedLayer" in type(m).__name__ for m in exe.graph_module.modules())
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-6, atol=1e-8, msg=name)


def test_dropout_nodes_become_counter_modules_numbered_over_the_whole_graph() -> None:
    model = load_model(NANOGPT, {"dropout": 0.1})
    exe = build_executable(model, parse_strategy("1x2: R0:L0 R1:L1-2"), StrategyOptions(), 1,
                           seq_len=SEQ, seed=0)  # fmt: skip
    ops = {name: m for name, m in exe.graph_module.named_modules() if name.startswith("dropout")}
    # layer 0 holds ops 1-3 (attention, resid, mlp): stage 1 starts at op 4
    assert sorted(m.op for m in ops.values()) == list(range(4, 10))
    assert sum(isinstance(m, CounterAttention) for m in ops.values()) == 2
    assert all(isinstance(m, CounterAttention | CounterDropout) for m in ops.values())
    with pytest.raises(ExecutableError, match="key=hspmd.randomness.dropout_key"):
        exe(torch.zeros(2, SEQ, 32), torch.zeros(2, SEQ, dtype=torch.long))


def test_attention_dropout_on_a_tp_rank_takes_its_heads_of_the_weights() -> None:
    pytest.importorskip("transformers")
    model = load_model(f"{DATA / 'hf_models.py'}:llama", {"attention_dropout": 0.1})
    exe = build_executable(model, parse_strategy("1x2: R0-1:L0-3"), StrategyOptions(), 1,
                           seq_len=SEQ, seed=0)  # fmt: skip
    attention = next(m for m in exe.graph_module.modules() if isinstance(m, CounterAttention))
    # 4 heads over TP 2: rank 1 holds heads 2-3 of the (2, 4, 16, 16) weights
    assert attention.block == ((2, 4, SEQ, SEQ), (0, 2, 0, 0), (2, 2, SEQ, SEQ))


class _SequenceFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.blocks = nn.Embedding(16, 8), nn.ModuleList([nn.Linear(8, 8)])
        self.head = nn.Linear(8, 16)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](self.wte(tokens))
        x = F.dropout(x.transpose(0, 1), 0.1).transpose(0, 1)  # (T, B, H): batch second
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


class _Noisy(_SequenceFirst):
    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](self.wte(tokens))
        x = x + torch.rand_like(x)  # each rank would draw its own
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def test_dropout_of_a_tensor_whose_first_dim_is_not_the_batch_is_refused() -> None:
    model = load_model("tests.specialize.test_dropout:_SequenceFirst")
    with pytest.raises(ExecutableError, match=r"test_dropout.py:\d+ .*first dim is not the batch"):
        build_executable(model, parse_strategy("1x2: R0:L0"), StrategyOptions(), 0, seq_len=SEQ,
                         seed=0)  # fmt: skip


def test_other_random_ops_are_refused_by_deduction() -> None:
    model = load_model("tests.specialize.test_dropout:_Noisy")
    with pytest.raises(DeductionError, match="rand_like.* draws from torch's random generator"):
        build_executable(model, parse_strategy("1x2: R0:L0"), StrategyOptions(), 0, seq_len=SEQ,
                         seed=0)  # fmt: skip
