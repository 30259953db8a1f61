"""Exact communication of one TP-2 stage (2 layers, one micro-batch: F, B, stage grad sync)
under the four combinations of sequence parallel and per-layer recompute, on 2 gloo
processes in one launch.

Per step, L layers, Megatron TP (no SP): all-reduces only, forward ``embed`` + two per
layer, backward two per layer + ``head_in`` (4L + 2), and the vocab-parallel loss's three
all-reduces of one float per token (max, sum of exponentials, target logit) where the
gathered path (``gather_logits=True``, also run) all-gathers the ``(B, T, V)`` logits.
Sequence parallel swaps every marker's all-reduce for an all-gather or a reduce-scatter
(each moving half the bytes) and adds one all-reduce: the norm weights' partial gradients
(stage grad sync); in backward each gathered matmul input is gathered again rather than
kept (``hspmd.runtime.regather``). Recompute per layer reruns each layer's forward in backward, so the
forward collectives of a layer are issued once more per layer; non-reentrant checkpointing
stops the rerun after the layer's last saved tensor, so a layer's final marker (mlp_out),
which saves nothing, is not reissued.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hspmd.models.llama import get_config
from hspmd.plan.strategy import StrategyOptions, parse_strategy
from hspmd.runtime import World, count_comm, launch
from hspmd.runtime.executable import bind_executable, sync_grads
from hspmd.specialize.executable import build_executable, executable_groups

pytestmark = pytest.mark.multiproc

CONFIG = get_config("llama-tiny", num_layers=2)
STRATEGY = "1x2: R0-1:L0-1"
CASES = {
    "TP": StrategyOptions(),
    "TP gathered logits": StrategyOptions(),
    "TP + recompute": StrategyOptions(recompute=True),
    "TP + SP": StrategyOptions(sequence_parallel=True),
    "TP + SP + recompute": StrategyOptions(sequence_parallel=True, recompute=True),
}


def counted(world: World) -> dict[str, Any]:
    torch.set_num_threads(1)
    strategy = parse_strategy(STRATEGY)
    world.prepare_groups(executable_groups(strategy))
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=g)
    targets = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=g)
    out = {}
    for name, options in CASES.items():
        gather = name == "TP gathered logits"
        exe = build_executable(
            CONFIG, strategy, options, world.rank, seq_len=16, seed=0, gather_logits=gather
        )
        bind_executable(exe, world)
        with count_comm(world) as forward:
            loss = exe.forward(tokens, targets)
        with count_comm(world) as backward:
            loss.backward()
            sync_grads(exe, world)
        # numpy: tensors would travel as shared-memory fds
        grads = {n: p.grad.numpy().copy() for n, p in exe.params.items() if p.grad is not None}
        out[name] = (forward.counts(), backward.counts(), float(loss.detach()), grads)
        out[name + " events"] = [(e.op, e.group, e.nbytes) for e in forward.events]
        out[name + " not kept"] = exe.around.saved if exe.around is not None else 0
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return launch(counted, 2, timeout_s=120)


def test_sequence_parallel_gathers_and_scatters_instead_of_all_reduces(
    results: list[dict[str, Any]],
) -> None:
    L = CONFIG.num_layers
    for per_rank in results:
        forward, backward, *_ = per_rank["TP"]
        assert forward == {"all_reduce": 2 * L + 1 + 3}
        assert backward == {"all_reduce": 2 * L + 1}
        forward, backward, *_ = per_rank["TP + SP"]
        # embed, attn_out, mlp_out reduce-scatter; attn_in, mlp_in, head_in gather; the loss
        assert forward == {"reduce_scatter": 2 * L + 1, "all_gather": 2 * L + 1, "all_reduce": 3}
        # the conjugates (the loss's backward is local), each gathered input gathered again
        # for its matmuls' weight gradients (q, k and v share one: hspmd.runtime.regather),
        # then one all-reduce of the norm grads
        assert backward == {
            "reduce_scatter": 2 * L + 1,
            "all_gather": 2 * (2 * L + 1),
            "all_reduce": 1,
        }


def test_sequence_parallel_keeps_shards_of_the_gathered_matmul_inputs(
    results: list[dict[str, Any]],
) -> None:
    rows = 2 * 16 * CONFIG.hidden_size * 4  # one gathered input: (B, T, H) fp32
    for per_rank in results:
        assert per_rank["TP not kept"] == 0  # nothing is gathered
        # per layer: attn_in for q, k and v, mlp_in for gate and up; head_in for the head
        assert per_rank["TP + SP not kept"] == (5 * CONFIG.num_layers + 1) * rows
        assert per_rank["TP + SP + recompute not kept"] == rows  # the layers keep nothing


def test_last_stage_reduces_three_floats_per_token_instead_of_gathering_logits(
    results: list[dict[str, Any]],
) -> None:
    tokens, vocab = 2 * 16, CONFIG.vocab_size
    for per_rank in results:
        # the head's output stays vocab-split: the last three forward collectives are the
        # loss's all-reduces of one fp32 per token over the TP group
        assert per_rank["TP events"][-3:] == [("all_reduce", (0, 1), tokens * 4)] * 3
        assert all(op != "all_gather" for op, *_ in per_rank["TP events"])
        forward, backward, *_ = per_rank["TP gathered logits"]
        assert forward == {"all_reduce": 2 * CONFIG.num_layers + 1, "all_gather": 1}
        assert backward == per_rank["TP"][1]
        gather = per_rank["TP gathered logits events"][-1]
        assert gather == ("all_gather", (0, 1), tokens * vocab // 2 * 4)


def test_recompute_reissues_each_layers_forward_collectives_in_backward(
    results: list[dict[str, Any]],
) -> None:
    L = CONFIG.num_layers
    for per_rank in results:
        plain_f, plain_b, *_ = per_rank["TP"]
        forward, backward, *_ = per_rank["TP + recompute"]
        assert forward == plain_f  # the forward itself is unchanged
        # per layer: attn_out's all-reduce again (mlp_out's is past the last saved tensor)
        assert backward == {"all_reduce": plain_b["all_reduce"] + L}
        sp_f, sp_b, *_ = per_rank["TP + SP"]
        forward, backward, *_ = per_rank["TP + SP + recompute"]
        assert forward == sp_f
        # per layer: attn_in and mlp_in gathers, attn_out's reduce-scatter again; a
        # recomputed layer keeps nothing, so only head_in is gathered again as without
        assert backward == {
            "reduce_scatter": sp_b["reduce_scatter"] + L,
            "all_gather": sp_b["all_gather"],
            "all_reduce": 1,
        }


def test_every_variant_gives_the_same_loss_and_gradients(results: list[dict[str, Any]]) -> None:
    for per_rank in results:
        _, _, loss, grads = per_rank["TP"]
        for name in CASES:
            _, _, other_loss, other_grads = per_rank[name]
            assert abs(other_loss - loss) <= 1e-6 * abs(loss), name
            for param, grad in grads.items():
                torch.testing.assert_close(
                    torch.from_numpy(other_grads[param]),
                    torch.from_numpy(grad),
                    rtol=1e-4,
                    atol=1e-6,
                )
