"""Models as their authors wrote them (issue 35): Hugging Face causal LMs and a nanoGPT-style
file, captured below Python and trained under DP, PP, TP and heterogeneous strategies,
equal to the plain module on one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hspmd.models.build import plain_model, step_loss
from hspmd.models.module import load_model
from hspmd.plan.strategy import StrategyOptions, parse_strategy
from hspmd.specialize.executable import build_executable
from hspmd.train.api import train_config
from hspmd.train.compare import compare
from hspmd.train.config import TrainConfig, TrainError
from hspmd.train.reference import TrainResult, run_reference
from hspmd.train.trainer import train_many

pytest.importorskip("transformers")

DATA = Path(__file__).parent / "data"
HF, NANOGPT = f"{DATA / 'hf_models.py'}", f"{DATA / 'nanogpt_style.py'}"


def test_a_hugging_face_model_is_read_from_itself() -> None:
    model = load_model(f"{HF}:llama")
    assert model.convention == "hf" and model.blocks == "model.layers"
    assert (model.num_layers, model.hidden_size, model.vocab_size) == (4, 32, 256)
    assert model.max_seq_len == 64  # its config's max_position_embeddings
    kinds = {name: model.param_kind(name) for name in model.parameter_shapes()}
    assert kinds["model.layers.0.self_attn.k_proj.weight"] == "column"  # GQA: 2 kv heads
    assert kinds["model.layers.3.mlp.down_proj.weight"] == "row"
    assert kinds["model.embed_tokens.weight"] == kinds["lm_head.weight"] == "vocab"
    assert kinds["model.norm.weight"] == "replicate"
    assert model.param_layer("lm_head.weight") == 3 and model.param_layer("model.norm.weight") == 3


def test_gpt2s_conv1d_projections_stay_replicate() -> None:
    model = load_model(f"{HF}:gpt2")
    assert model.param_kind("transformer.h.0.mlp.c_fc.weight") == "replicate"  # addmm, (in, out)
    assert model.param_kind("transformer.wte.weight") == "vocab" and model.tie_embeddings


def test_nanogpt_as_written_is_read_from_itself() -> None:
    model = load_model(f"{NANOGPT}:make")
    assert model.convention == "positional" and model.blocks == "transformer.h"
    assert model.max_seq_len == 32 and model.tie_embeddings  # config.block_size
    assert model.param_kind("transformer.h.0.mlp.c_fc.weight") == "column"
    assert model.param_kind("transformer.h.0.attn.c_attn.weight") == "replicate"  # fused qkv


# Every multi-process case of this file trains in one launch (``train_many``): the workers
# start, import and capture each model once for all of them. (model, strategy, global batch,
# sequence parallel, model kwargs); configs are made in the fixture: a TrainConfig reads its
# model, which collection must not.
CASES = {
    "llama": (f"{HF}:llama", "2x1: R0-1:L0-2 R2:L3; 1x2: R3:L0-3", 4, False, {}),
    "qwen2": (f"{HF}:qwen2", "1x2: R0:L0-1 R1-2:L2-3", 2, False, {}),
    "gpt2": (f"{HF}:gpt2", "2x1: R0:L0-3; 1x2: R1:L0-3", 4, False, {}),
    "nanogpt": (f"{NANOGPT}:make", "2x1: R0-1:L0-2; 1x2: R2:L0-2", 4, False, {}),
    "nanogpt tied": (f"{NANOGPT}:make", "2x1: R0-1:L0-1 R2:L2; 1x2: R3:L0-2", 4, False, {}),
    "gpt2 tied": (f"{HF}:gpt2", "2x1: R0:L0 R1:L1-3", 2, False, {}),
    "llama sp": (f"{HF}:llama", "1x2: R0-1:L0-1 R2-3:L2-3", 2, True, {}),
    "nanogpt sp": (f"{NANOGPT}:make", "1x2: R0-1:L0-2", 2, True, {}),
    # context parallelism (a stage's :C2): a stage without CP then a CP-2 stage, beside a
    # one-rank pipeline (GQA: 4 heads, 2 KV heads, each split over CP)
    "llama cp": (f"{HF}:llama", "1x2: R0:L0-1 R1-2:L2-3:C2; 2x1: R3:L0-3", 4, False, {}),
    # TP 2 x CP 2 on nanoGPT: its fused c_attn is replicate, so the heads split over CP
    # only (``cp_heads``); the key third of c_attn's bias gets fp32 noise as its gradient
    # (noise-only elements: docs/cli.md, "Equal to the reference: the rule")
    "nanogpt tp cp": (f"{NANOGPT}:make", "1x2: R0-3:L0-2:C2", 2, False, {}),
}
Runs = dict[str, tuple[TrainConfig, TrainResult]]


@pytest.fixture(scope="module")
def runs() -> Runs:
    configs = [
        train_config(model=model, strategy=strategy, global_batch=batch, seq_len=16, steps=2,
                     sequence_parallel=sp, model_kwargs=tuple(kwargs.items()))
        for model, strategy, batch, sp, kwargs in CASES.values()
    ]  # fmt: skip
    return dict(zip(CASES, zip(configs, train_many(configs), strict=True), strict=True))


def _equal(runs: Runs, name: str) -> None:
    config, result = runs[name]
    got, want = result.losses, run_reference(config).losses
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5, (got, want)


@pytest.mark.multiproc
def test_hf_llama_trains_under_tp_and_uneven_pp_beside_a_one_rank_pipeline(
    runs: Runs,
) -> None:
    _equal(runs, "llama")


@pytest.mark.multiproc
def test_hf_qwen2_trains_with_a_vocab_parallel_last_stage(runs: Runs) -> None:
    _equal(runs, "qwen2")


@pytest.mark.multiproc
def test_hf_gpt2_tied_trains_under_dp(runs: Runs) -> None:
    _equal(runs, "gpt2")


@pytest.mark.multiproc
def test_nanogpt_as_written_trains_under_tp_and_dp(runs: Runs) -> None:
    _equal(runs, "nanogpt")


@pytest.mark.multiproc
def test_hf_llama_trains_sequence_parallel_across_a_stage_boundary(runs: Runs) -> None:
    """The stream split on the sequence inside TP stages: the o_proj/down_proj outputs
    reduce-scattered, the q_proj/gate_proj inputs all-gathered, the norms' gradients
    summed over TP, a T/2-long activation sent between the stages."""
    _equal(runs, "llama sp")


@pytest.mark.multiproc
def test_nanogpt_trains_sequence_parallel(runs: Runs) -> None:
    """Its fused attention is replicate: deduction gathers the sequence where an op needs
    it whole (the positional embedding's add, attention), the rest runs on T/2 positions."""
    _equal(runs, "nanogpt sp")


@pytest.mark.multiproc
def test_tied_weights_across_stages_sum_their_gradient_between_them(
    runs: Runs,
) -> None:
    """nanoGPT's and GPT-2's head is the token embedding: a copy on the first and the last
    stage, different TP degrees there, gradients summed between them and the pipelines."""
    _equal(runs, "nanogpt tied")
    _equal(runs, "gpt2 tied")


def test_a_tied_weight_lives_on_both_of_its_stages() -> None:
    from hspmd.plan.params import parameter_annotations
    from hspmd.plan.strategy import parse_strategy

    model = load_model(f"{NANOGPT}:make")
    assert model.tied == (("transformer.wte.weight", 2),)
    specs = parameter_annotations(parse_strategy("2x1: R0-1:L0-1 R2:L2; 1x2: R3:L0-2"), model)
    assert str(specs["transformer.wte.weight"].annotation) == "hD: [0,1]{0:2} [2]{} [3]{}"
    for zero in (1, 3):  # the line names the stage given (it said --zero1 for --zero 3)
        with pytest.raises(
            TrainError, match=f"--zero {zero} does not shard yet: drop --zero {zero}"
        ):
            train_config(model=f"{NANOGPT}:make", strategy="2x1: R0:L0 R1:L1-2", global_batch=2,
                        seq_len=16, zero=zero).model_config()  # fmt: skip


def _equal_params(runs: Runs, name: str) -> None:
    """Losses within 1e-5 and every parameter within its tolerance (docs/cli.md)."""
    config, result = runs[name]
    reference = run_reference(config)
    got, want = result.losses, reference.losses
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5, (got, want)
    comparison = compare(result, reference, config=config)
    assert comparison.ok, f"{name}: {comparison}"


@pytest.mark.multiproc
def test_hf_llama_trains_context_parallel_in_one_pipeline_of_two(runs: Runs) -> None:
    """A stage without CP, then a CP-2 stage (q, k, v and the output traded between the
    sequence and the heads split by all-to-alls; RoPE after them, on global positions; the
    sizes it reads from the tokens are the global ones), beside a one-rank pipeline."""
    _equal_params(runs, "llama cp")


@pytest.mark.multiproc
def test_nanogpt_trains_tp_times_cp(runs: Runs) -> None:
    """nanoGPT as written on TP 2 x CP 2: the MLP split by TP, the replicate attention's
    heads by CP, learned positions added before the split."""
    _equal_params(runs, "nanogpt tp cp")


def _sites(source: str, strategy: str, **kwargs: object) -> dict[str, object]:
    from hspmd.plan.strategy import StrategyOptions, parse_strategy
    from hspmd.specialize.sites import deduced_sites

    model = load_model(source, dict(kwargs))
    found = deduced_sites(parse_strategy(strategy), model, StrategyOptions(), seq_len=16)
    assert not found.fallbacks, found.fallbacks  # every op has its rule: nothing gathered
    return {site.name: site for site in found.sites}


def test_captured_attention_gets_head_markers_that_only_cp_resolves() -> None:
    """Each captured SDPA gets q/k/v markers (at their entry, before RoPE) and a ctx marker
    (its output): all-to-alls on a CP stage, nothing without CP."""
    attn = "model.layers.1.self_attn"
    cp = _sites(f"{HF}:llama", "1x2: R0-1:L0-3:C2")
    for role in ("q", "k", "v", "ctx"):
        site = cp[f"{attn}.{role}"]
        assert site.forward_plan().kinds == site.backward_plan().kinds == ("all-to-all",), role
    assert str(cp[f"{attn}.k"].dst) == "[0,1]{2:2}"  # (B, T, 2 KV heads, hd): one head each
    tp = _sites(f"{HF}:llama", "1x2: R0-1:L0-3")  # TP 2: the heads are split already
    nano = _sites(f"{NANOGPT}:make", "1x2: R0-1:L0-2")  # TP 2 leaves c_attn whole
    for sites, path in ((tp, attn), (nano, "transformer.h.0.attn")):
        for role in ("q", "k", "v", "ctx"):
            site = sites[f"{path}.{role}"]
            assert not site.forward_plan().steps and not site.backward_plan().steps, site


def test_q_and_k_are_marked_before_rotary_embeddings() -> None:
    """The q marker stands on the head view's transpose (its entry), so RoPE (q * cos +
    rotate_half(q) * sin) runs after the all-to-all, on whole rows; nanoGPT's replicate
    c_attn gives heads TP leaves whole (``cp_heads``)."""
    import torch

    from hspmd.markers import is_reshard_node
    from hspmd.models.module import model_graph

    aten = torch.ops.aten
    gm = model_graph(load_model(f"{HF}:llama"))
    marker = next(n for n in gm.graph.nodes if is_reshard_node(n) and n.args[1].endswith(".q"))
    there = marker.args[0]  # transpose(1, 2) of the entry: (B, T, heads, hd)
    assert there.target is aten.transpose.int and there.args[0].target is aten.transpose.int
    assert there.args[0].args[0].target is aten.view.default  # the entry: the head view's
    attention = next(
        n for n in gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default
    )
    assert attention.args[0].target is aten.add.Tensor  # RoPE's sum, after the marker
    placements = {str(m.placement) for m in load_model(f"{NANOGPT}:make").markers()
                  if m.name.startswith("transformer.h.0.attn.")}  # fmt: skip
    assert placements == {"cp_heads", "dup"}


def test_context_parallelism_refuses_heads_it_cannot_split_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The all-to-all splits the KV heads (2) over TP x CP: CP 4 does not divide them."""
    from hspmd.cli import main

    code = main(["train", "--model", f"{HF}:llama", "--strategy", "1x1: R0-3:L0-3:C4",
                 "--seq-len", "16", "--steps", "1"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "the 2 heads of marker model.layers.0.self_attn.k over CP = 4 ranks" in err, err
    assert "use CP dividing 2" in err, err


@pytest.mark.parametrize("source", [f"{HF}:llama", f"{HF}:gpt2"])  # both failed before
def test_bf16_runs_the_graph_captured_in_bf16_from_fp32_initial_weights(source: str) -> None:
    """A factory builds in fp32; ``--dtype bf16`` captures the module cast to bf16, so a
    cast back to the input's dtype (HF's RMSNorm, rotary tables) is recorded as bf16, and
    the executable cast to bf16 runs. Its initial weights are still the fp32 ones."""
    models = {dtype: load_model(source, dtype=dtype) for dtype in ("fp32", "bf16")}
    strategy, seq = parse_strategy(f"1x1: R0:L0-{models['fp32'].num_layers - 1}"), 8
    exes = {
        dtype: build_executable(model, strategy, StrategyOptions(), 0, seq_len=seq, seed=0)
        for dtype, model in models.items()
    }
    for name, value in exes["fp32"].params.items():
        assert torch.equal(exes["bf16"].params[name], value), name
    exe = exes["bf16"]
    exe.graph_module.to(torch.bfloat16)  # as a bf16 run casts its compute copy
    tokens = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(0))
    loss = exe.forward(tokens, tokens.roll(-1, 1))
    loss.backward()
    want = exes["fp32"].forward(tokens, tokens.roll(-1, 1))
    assert abs(loss.item() - want.item()) < 0.05 * want.item(), (loss, want)
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in exe.params.values())


def test_a_mixture_of_experts_captures_its_routing_and_its_routers_gradient() -> None:
    """HF Mixtral on one rank: loss and every gradient equal to its eager step. Before: the
    router's ``topk`` outputs read as constants (its weight had no gradient), and the
    capture on meta took ``grouped_mm``'s GPU branch (``histc`` on ints, refused on CPU)."""
    model = load_model(f"{HF}:mixtral")
    strategy = parse_strategy("1x1: R0:L0-0")
    exe = build_executable(model, strategy, StrategyOptions(), 0, seq_len=8, seed=0)
    tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    loss = exe.forward(tokens, tokens.roll(-1, 1))
    loss.backward()
    plain = plain_model(model, seed=0)
    want = step_loss(model, plain, tokens, tokens.roll(-1, 1))
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=0)
    for name, param in plain.named_parameters():
        torch.testing.assert_close(exe.params[name].grad, param.grad, rtol=1e-4, atol=1e-6)
    assert exe.params["model.layers.0.mlp.gate.weight"].grad.abs().sum() > 0


def test_kv_heads_repeated_for_a_masked_attention_are_marked_before_the_repeat() -> None:
    """With a mask (a sliding window shorter than the longest sequence), transformers
    repeats k and v to every head (``repeat_kv``) before SDPA; their markers stand on the
    KV heads' view, before RoPE and the repeat. Before: after the repeat, so k's RoPE ran
    on the sequence split and gathered k under CP (Mistral, Gemma-3)."""
    from hspmd.markers import is_reshard_node
    from hspmd.models.module import model_graph

    gm = model_graph(load_model(f"{HF}:mistral", {"sliding_window": 8}))
    aten = torch.ops.aten
    assert any(n.target is aten.expand.default for n in gm.graph.nodes)  # repeat_kv is there
    shapes = {
        n.args[1].rsplit(".", 1)[1]: tuple(n.args[0].args[0].meta["val"].shape)
        for n in gm.graph.nodes if is_reshard_node(n) and ".self_attn." in n.args[1]
        and n.args[1].startswith("model.layers.0.")
    }  # fmt: skip
    assert shapes["q"][1] == 4 and shapes["k"][1] == shapes["v"][1] == 2, shapes
    marker = next(
        n for n in gm.graph.nodes if is_reshard_node(n) and n.args[1].endswith("0.self_attn.k")
    )
    assert marker.args[0].args[0].args[0].target is aten.view.default  # the entry, before RoPE


def test_packed_documents_rotary_tables_run_after_the_head_markers() -> None:
    """Packed, RoPE's tables come from positions restarting per document (from
    ``segments``, an input every rank holds whole), not from sizes alone; the q and k
    markers still stand before RoPE. Before: after it, and under CP RoPE gathered q and k
    (8 fallbacks per step for HF Starcoder2 under ``:C2``)."""
    from hspmd.markers import is_reshard_node
    from hspmd.models.module import model_graph

    gm = model_graph(load_model(f"{HF}:llama", packed=True))
    for role in ("q", "k"):
        marker = next(n for n in gm.graph.nodes
                      if is_reshard_node(n) and n.args[1] == f"model.layers.0.self_attn.{role}")  # fmt: skip
        assert marker.args[0].args[0].args[0].target is torch.ops.aten.view.default, role
