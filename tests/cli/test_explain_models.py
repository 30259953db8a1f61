"""`hspmd explain` for any model: a file the test writes, the examples, a plan file (issue 12)."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

import pytest

from hspmd.cli import explain
from hspmd.cli import main as hspmd_main
from hspmd.errors import HspmdError
from hspmd.models.config import get_config
from hspmd.plan.strategy import StrategyOptions, parse_strategy
from hspmd.specialize.explain import explain as explain_strategy

MODEL = textwrap.dedent(
    """
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self, h):
            super().__init__()
            self.norm = nn.LayerNorm(h)
            self.up = nn.Linear(h, 4 * h)
            self.down = nn.Linear(4 * h, h)

        def forward(self, x):
            return x + self.down(F.relu(self.up(self.norm(x))))

    class Tiny(nn.Module):
        tp_rules = {"layers.*.up.*": "column", "layers.*.down.weight": "row"}
        max_seq_len = 16

        def __init__(self, num_layers, hidden=16, vocab=32):
            super().__init__()
            self.embed = nn.Embedding(vocab, hidden)
            self.layers = nn.ModuleList(Block(hidden) for _ in range(num_layers))
            self.head = nn.Linear(hidden, vocab)

        def forward(self, tokens, targets):
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x)
            return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())

    def make(num_layers=2):
        return Tiny(num_layers)
    """
)
STRATEGY = "2x1: R0-1:L0-1 R2:L2-3; 1x2: R3:L0-3"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hspmd")
    explain.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except HspmdError as error:
        print(f"hspmd explain: error: {error}", file=sys.stderr)
        return 2


@pytest.fixture
def model_file(tmp_path: Path) -> str:
    path = tmp_path / "tiny_model.py"
    path.write_text(MODEL)
    return f"{path}:make"


def test_inline_model(model_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["explain", "--model", model_file, "--config", '{"num_layers": 4}']
    assert main([*argv, "--strategy", STRATEGY, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["pipelines"] == [[[0, 1], [2]], [[3]]]
    by_rank = {r["rank"]: r for r in data["ranks"]}
    # the column/row pair of each block: one all-reduce forward, one backward, per layer
    assert by_rank[0]["forward_comm"] == {"all-reduce": 2, "bsr": 1}
    assert by_rank[0]["backward_comm"] == {"all-reduce": 2, "bsr": 1}
    assert by_rank[3]["forward_comm"] == {} and by_rank[3]["layers"] == [0, 3]
    # a TP rank holds half of each split weight: up (64, 16) + bias, down (16, 64)
    assert by_rank[0]["param_elements"] < by_rank[3]["param_elements"]
    assert data["gradient_sync"] == {"all-reduce": 14, "split-all-reduce": 13}
    assert main([*argv, "--strategy", "1x1: R0-2:L0-3"]) == 2  # 64 rows over 3 ranks
    assert "divide" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("model", "strategy"),
    [
        ("hspmd.models.examples:gpt2", "2x1: R0-1:L0-1; 1x2: R2:L0-1"),
        ("hspmd.models.examples:convnet", "2x1: R0:L0 R1:L1"),
    ],
)
def test_examples(model: str, strategy: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["explain", "--model", model, "--config", '{"num_layers": 2}', "--strategy", strategy]
    assert main([*argv, "--seq-len", "8"]) == 0
    out = capsys.readouterr().out
    assert "pipelines (constructed from the forward communication; match the strategy)" in out
    assert "(explained in" in out


def test_plan_file(model_file: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hspmd.cli import train

    parser = argparse.ArgumentParser(prog="hspmd")
    train.register(parser.add_subparsers(dest="command", required=True))
    plan = tmp_path / "plan.json"
    argv = ["--model", model_file, "--config", '{"num_layers": 4}', "--seq-len", "8"]
    args = parser.parse_args(["train", *argv, "--strategy", STRATEGY, "--save-plan", str(plan)])
    assert args.func(args) == 0
    capsys.readouterr()
    base = ["explain", "--model", model_file, "--config", '{"num_layers": 4}', "--json"]
    assert main([*base, "--plan", str(plan)]) == 0
    from_plan = json.loads(capsys.readouterr().out)
    assert main([*base, "--strategy", STRATEGY, "--seq-len", "8"]) == 0
    assert json.loads(capsys.readouterr().out) == from_plan
    assert main([*base, "--plan", str(plan), "--strategy", STRATEGY]) == 2
    assert "--plan carries the strategy" in capsys.readouterr().err


def test_no_max_seq_len_needs_seq_len(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "free.py"
    path.write_text(MODEL.replace("    max_seq_len = 16\n", ""))
    assert main(["explain", "--model", f"{path}:make", "--strategy", "1x1: R0:L0-1"]) == 2
    assert "give --seq-len" in capsys.readouterr().err


def test_a_sequence_past_the_model_is_refused(tmp_path: Path, capsys) -> None:
    # explain, simulate and plan costed a length the model cannot run (train refuses it)
    path = tmp_path / "m.py"
    path.write_text(MODEL)
    model = ["--model", f"{path}:make", "--seq-len", "32"]
    for argv in (
        ["explain", *model, "--strategy", "1x1: R0:L0-1"],
        ["simulate", *model, "--strategy", "1x1: R0:L0-1", "--cluster", "h200x8"],
        ["plan", *model, "--cluster", "h200x8", "--global-batch", "8"],
    ):
        assert hspmd_main(argv) == 2
        err = capsys.readouterr().err
        assert "--seq-len 32 exceeds" in err and "give --seq-len 16 or less" in err, argv


@pytest.mark.parametrize("sp", [False, True])
def test_deduced_sites_equal_llama_formulas(sp: bool) -> None:
    # The generic path (deduce each pipeline's graph) against the Llama's formulas: every
    # rank's communication, traffic and held parameters agree.
    config, strategy = get_config("llama-tiny"), parse_strategy(STRATEGY)
    options = StrategyOptions(sequence_parallel=sp)
    want = explain_strategy(config, strategy, options, seq_len=8)
    got = explain_strategy(config, strategy, options, seq_len=8, by_deduction=True)
    assert got.post_kinds == want.post_kinds and got.layer_sync == want.layer_sync
    fields = ("forward_comm", "backward_comm", "post_comm", "forward_traffic",
              "backward_traffic", "post_traffic", "num_params", "param_elements")  # fmt: skip
    for a, b in zip(got.ranks, want.ranks, strict=True):
        assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields], a.rank


HEAD_ONLY = MODEL.replace(
    """tp_rules = {"layers.*.up.*": "column", "layers.*.down.weight": "row"}""",
    """tp_rules = {"head.*": "vocab"}""",
)
TIED = HEAD_ONLY.replace(
    """tp_rules = {"head.*": "vocab"}""", """tp_rules = {"embed.weight": "vocab"}"""
).replace(
    "self.head = nn.Linear(hidden, vocab)",
    "self.head = nn.Linear(hidden, vocab, bias=False)\n        self.head.weight = self.embed.weight",
)


@pytest.mark.parametrize(
    ("source", "strategy"),
    [
        (HEAD_ONLY, "1x2: R0-1:L0-1"),
        (HEAD_ONLY, "1x2: R0:L0 R1-2:L1; 2x1: R3-4:L0-1"),
        (TIED, "1x2: R0:L0 R1-2:L1"),  # the tied head alone splits on the second stage
    ],
)
def test_vocab_parallel_loss_joins_its_stage(source: str, strategy: str, tmp_path: Path) -> None:
    # A stage whose only TP split is the head communicates in its forward pass only inside
    # the vocab-parallel loss. explain saw no collective there and found each rank a
    # pipeline of its own ("the pipelines found ... differ") where train ran the strategy.
    # Now explain lists the loss's three all-reduces over the groups the executable's loss
    # uses.
    from hspmd.models.module import load_model
    from hspmd.plan.strategy import check_strategy
    from hspmd.specialize.executable import build_executable
    from hspmd.specialize.explain import Traffic

    path = tmp_path / "head_only.py"
    path.write_text(source)
    model, parsed = load_model(f"{path}:make"), parse_strategy(strategy)
    check_strategy(parsed, model, seq_len=8)  # a tied head's stage splits it (tp_sizes)
    found = explain_strategy(model, parsed, StrategyOptions(), seq_len=8)
    assert found.pipelines.to_json() == [
        [list(stage.ranks) for stage in p.stages] for p in parsed.pipelines
    ]
    for summary in found.ranks:
        exe = build_executable(model, parsed, StrategyOptions(), summary.rank, seq_len=8, seed=0)
        loss = getattr(exe.graph_module, "vocab_parallel_loss", None)
        tokens = 8 * parsed.pipelines[summary.pipeline].micro_batch_size  # one fp32 each
        peers = "in [" + ",".join(map(str, loss.shard.group)) + "]" if loss else ""
        want = [Traffic("all-reduce", peers, 3, 3 * 4 * tokens)] if loss else []
        assert [t for t in summary.forward_traffic if t.kind == "all-reduce"] == want
