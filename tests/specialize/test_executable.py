"""Executable graphs without processes: TP 1 stages equal the plain model; TP 2 graphs are
localized (view sizes, parameter slices, vocab-parallel embedding, comm kinds); boundary
plans match the deduced boundary markers."""

from __future__ import annotations

import pytest
import torch

from hspmd.models.llama import Llama, get_config
from hspmd.plan.strategy import StrategyOptions, parse_strategy
from hspmd.specialize.boundary import boundary_plans
from hspmd.specialize.executable import (
    ExecutableError,
    build_executable,
    deduce_pipeline,
    executable_groups,
)
from hspmd.specialize.recompute import CheckpointedLayer

CONFIG = get_config("llama-tiny", num_layers=2)
SEQ = 16
OPTIONS = StrategyOptions()


def batch(rows: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CONFIG.vocab_size, (rows, SEQ), generator=g)
    return tokens, torch.randint(0, CONFIG.vocab_size, (rows, SEQ), generator=g)


def reference() -> tuple[float, dict[str, torch.Tensor]]:
    model = Llama(CONFIG, seed=0)
    tokens, targets = batch()
    loss = model(tokens, targets)
    loss.backward()
    return float(loss.detach()), {
        n: p.grad for n, p in model.named_parameters() if p.grad is not None
    }


def build(strategy: str, rank: int) -> object:
    return build_executable(CONFIG, parse_strategy(strategy), OPTIONS, rank, seq_len=SEQ, seed=0)


def assert_grads(params: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for name, p in params.items():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, want[name], rtol=1e-5, atol=1e-7, msg=name)


def test_single_stage_tp1_equals_the_plain_model() -> None:
    want_loss, want_grads = reference()
    exe = build("1x2: R0:L0-1", 0)
    tokens, targets = batch()
    loss = exe.forward(tokens, targets)
    loss.backward()
    assert abs(float(loss.detach()) - want_loss) <= 1e-6 * abs(want_loss)
    assert set(exe.params) == set(want_grads)
    assert_grads(exe.params, want_grads)
    assert exe.comm == ()


def test_two_tp1_stages_chained_equal_the_plain_model() -> None:
    want_loss, want_grads = reference()
    first, second = build("1x2: R0:L0 R1:L1", 0), build("1x2: R0:L0 R1:L1", 1)
    assert "def forward(self, activation, targets, segments = None, key = None)" in (
        second.graph_module.code
    )
    tokens, targets = batch()
    out = first.forward(tokens, targets)
    received = out.detach().requires_grad_(True)
    loss = second.forward(received, targets)
    loss.backward()
    out.backward(received.grad)
    assert abs(float(loss.detach()) - want_loss) <= 1e-6 * abs(want_loss)
    assert set(first.params) | set(second.params) == set(want_grads)
    assert not set(first.params) & set(second.params)
    assert_grads(first.params | second.params, want_grads)


def test_tp2_graph_is_localized() -> None:
    exe = build("1x2: R0-1:L0-1", 1)
    code = exe.graph_module.code
    assert "view.default(linear, [sym_size_int_2, sym_size_int_3, 2, 16])" in code  # 4 heads -> 2
    assert "vocab_parallel_embedding(tokens, embed_weight, 128)" in code
    shapes = {n: tuple(p.shape) for n, p in exe.params.items()}
    assert shapes["layers.0.attn.wq.weight"] == (32, 64)
    assert shapes["layers.0.attn.wo.weight"] == (64, 32)
    assert shapes["head.weight"] == (128, 64)
    assert shapes["norm.weight"] == (64,)
    full = Llama(CONFIG, seed=0).state_dict()["layers.1.mlp.w_down.weight"]
    torch.testing.assert_close(exe.params["layers.1.mlp.w_down.weight"].detach(), full[:, 64:])
    kinds = dict(line.split(": ", 1) for line in exe.comm)
    assert kinds["embed"] == "forward all-reduce, backward identity"
    assert kinds["layers.1.attn_in"] == "forward identity, backward all-reduce"
    assert kinds["layers.0.mlp_out"] == "forward all-reduce, backward identity"
    assert "logits" not in kinds  # {2:2} -> {2:2}: the loss is vocab-parallel
    assert kinds["loss"] == (
        "vocab-parallel cross-entropy over [0, 1] (classes from 128 of 256): forward 3 all-reduce"
    )
    gathered = build_executable(
        CONFIG,
        parse_strategy("1x2: R0-1:L0-1"),
        OPTIONS,
        1,
        seq_len=SEQ,
        seed=0,
        gather_logits=True,
    )
    kinds = dict(line.split(": ", 1) for line in gathered.comm)
    assert kinds["logits"] == "forward all-gather, backward local" and "loss" not in kinds
    assert kinds["head_in"] == "forward identity, backward all-reduce"
    with pytest.raises(ExecutableError, match="bind_executable"):
        exe.forward(*batch(1))
    assert executable_groups(parse_strategy("1x2: R0-1:L0-1; 2x1: R2:L0-1")) == [(0, 1)]


def test_sequence_parallel_graph_gathers_and_scatters() -> None:
    """SP: embed/attn_out/mlp_out reduce-scatter, the *_in markers all-gather, the norm
    weights' partial gradients get one all-reduce per stage; a later stage reads the
    sequence length (RoPE) as a constant, not from its T/tp-long activation."""
    sp = StrategyOptions(sequence_parallel=True)
    strategy = parse_strategy("1x2: R0-1:L0 R2-3:L1")
    first = build_executable(CONFIG, strategy, sp, 0, seq_len=SEQ, seed=0)
    kinds = dict(line.split(": ", 1) for line in first.comm)
    assert kinds["embed"] == "forward reduce-scatter, backward all-gather"
    assert kinds["layers.0.attn_in"] == "forward all-gather, backward reduce-scatter"
    assert kinds["layers.0.attn_out"] == "forward reduce-scatter, backward all-gather"
    assert kinds["layers.0.mlp_in"] == "forward all-gather, backward reduce-scatter"
    assert kinds["layers.0.mlp_out"] == "forward reduce-scatter, backward all-gather"
    assert [(i.names, i.plan.kinds) for i in first.grad_sync] == [
        (("layers.0.attn_norm.weight", "layers.0.mlp_norm.weight"), ("all-reduce",))
    ]
    last = build_executable(CONFIG, strategy, sp, 3, seq_len=SEQ, seed=0)
    code = last.graph_module.code  # T for the RoPE tables, from the length of the call
    assert "stage_shape(activation, (2, 16), 8)" in code  # tokens (B, T) from (B, T/tp, H)
    assert "getitem_1 = stage_shape_1[1]" in code and "(rope_cos, 0, 0, getitem_1)" in code
    assert last.length_multiple == 2
    assert "all-reduce" in str(last) and "norm.weight" in last.grad_sync[0].names
    plans = boundary_plans(strategy, CONFIG, 3, (2, SEQ, 64), options=sp)
    assert plans.incoming is not None
    assert str(plans.incoming.forward.dst) == "[2,3]{1:2}"  # sequence shards move
    assert plans.incoming.forward.kinds == ("send-recv",)


def test_recompute_splits_the_stage_per_layer_and_equals_the_plain_model() -> None:
    want_loss, want_grads = reference()
    exe = build_executable(
        CONFIG, parse_strategy("1x2: R0:L0-1"), StrategyOptions(recompute=True), 0,
        seq_len=SEQ, seed=0,
    )  # fmt: skip
    wrapped = [m.layer for m in exe.graph_module.children() if isinstance(m, CheckpointedLayer)]
    assert wrapped == [0, 1]
    loss = exe.forward(*batch())
    loss.backward()
    assert abs(float(loss.detach()) - want_loss) <= 1e-6 * abs(want_loss)
    assert_grads(exe.params, want_grads)


def test_recompute_layers_checkpoints_the_first_layers_only() -> None:
    want_loss, want_grads = reference()
    options = StrategyOptions(recompute=True, recompute_layers=1)
    exe = build_executable(CONFIG, parse_strategy("1x2: R0:L0-1"), options, 0, seq_len=SEQ, seed=0)
    wrapped = [m.layer for m in exe.graph_module.children() if isinstance(m, CheckpointedLayer)]
    assert wrapped == [0]  # layer 1 keeps its activations
    loss = exe.forward(*batch())
    loss.backward()
    assert abs(float(loss.detach()) - want_loss) <= 1e-6 * abs(want_loss)
    assert_grads(exe.params, want_grads)


@pytest.mark.parametrize(
    "text, options, want",
    [
        ("1x2: R0:L0-1:RC1", StrategyOptions(), [0]),  # the stage's own count wins
        ("1x2: R0:L0-1:RC0", StrategyOptions(recompute=True), []),
        ("1x2: R0:L0-1:RC2", StrategyOptions(recompute=True, recompute_layers=1), [0, 1]),
        ("1x2: R0:L0-1", StrategyOptions(recompute=True, recompute_layers=1), [0]),
    ],
)
def test_a_stage_recomputes_its_own_count_of_layers(
    text: str, options: StrategyOptions, want: list[int]
) -> None:
    exe = build_executable(CONFIG, parse_strategy(text), options, 0, seq_len=SEQ, seed=0)
    wrapped = [m.layer for m in exe.graph_module.children() if isinstance(m, CheckpointedLayer)]
    assert wrapped == want


def test_unsupported_options_and_ranks_are_refused() -> None:
    with pytest.raises(ExecutableError, match="zero1"):
        build_executable(
            CONFIG, parse_strategy("1x2: R0-1:L0-1"), StrategyOptions(zero=1),
            0, seq_len=SEQ, seed=0,
        )  # fmt: skip
    with pytest.raises(ExecutableError, match="rank 5"):
        build("1x2: R0-1:L0-1", 5)


@pytest.mark.parametrize(
    ("strategy", "rank", "incoming", "outgoing"),
    [
        ("4x1: R0-1:L0 R2-3:L1", 3, ("send-recv", "send-recv"), None),
        ("4x1: R0-1:L0 R2-3:L1", 0, None, ("send-recv", "send-recv")),
        ("4x1: R0-1:L0 R2:L1", 2, ("bsr", "bsr"), None),
        ("4x1: R0:L0 R1-2:L1", 0, None, ("bsr", "bsr")),
    ],
)
def test_boundary_plans_match_the_deduced_markers(
    strategy: str, rank: int, incoming: object, outgoing: object
) -> None:
    parsed = parse_strategy(strategy)
    plans = boundary_plans(parsed, CONFIG, rank, (1, SEQ, CONFIG.hidden_size))
    for boundary, kinds in ((plans.incoming, incoming), (plans.outgoing, outgoing)):
        if kinds is None:
            assert boundary is None
            continue
        assert boundary is not None
        assert (boundary.forward.kinds[0], boundary.backward.kinds[0]) == kinds
        site = deduce_pipeline(CONFIG, parsed.pipelines[0], OPTIONS, seq_len=SEQ).reshard(
            boundary.name
        )
        assert (boundary.forward.src, boundary.forward.dst) == (site.src, site.dst)
        assert (boundary.backward.src, boundary.backward.dst) == (site.grad_out, site.grad_in)


def saved_activation_numel(exe: object) -> int:
    """Elements of the non-parameter tensors autograd keeps for backward after a forward
    (the checkpointed layers save through their own hooks: nothing but their inputs)."""
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        exe.forward(*batch())  # type: ignore[attr-defined]
    params = {id(p) for p in exe.params.values()}  # type: ignore[attr-defined]
    return sum(t.numel() for t in saved if id(t) not in params)


def test_recompute_keeps_far_fewer_activations() -> None:
    plain = saved_activation_numel(build("1x2: R0:L0-1", 0))
    recomputed = saved_activation_numel(
        build_executable(
            CONFIG,
            parse_strategy("1x2: R0:L0-1"),
            StrategyOptions(recompute=True),
            0,
            seq_len=SEQ,
            seed=0,
        )  # fmt: skip
    )
    # measured 190,945 vs 42,081 elements (2 layers): what is left is the embedding, the
    # head and loss, and each layer's input
    assert recomputed < plain / 4, (plain, recomputed)
