"""Every tested model family as its authors wrote it (issue 35), side by side in one run.

The families are the tests' factories (tests/models/data): Hugging Face Llama, Mistral,
Qwen2 and GPT-2 built from configs (random init), and nanoGPT as written; here with 4
layers, hidden 256, 4 heads (2 key/value heads where the family has GQA), vocabulary 512,
one micro-batch of 4 x 256 tokens, fp32, one torch thread. Per family:

    capture s   ``load_model``: the factory on the meta device, torch.export of the training
                step, hspmd's markers, the markers' shapes; median [min, max] of 3 rounds
                that visit the families in turn, after a warm-up capture that pays
                torch.export's first-call imports (reported apart)
    ATen ops    ATen op nodes of the captured graph (hspmd's markers are not counted)
    fallbacks   ops computed whole on gathered inputs under one TP-2 stage
                (``1x4: R0-1:L0-3``, ``AnnotatedGraph.fallbacks``) and the bytes they
                gather per micro-batch; ``split`` counts the parameters TP-2 splits
    step        one rank, forward + backward + optimizer step: hspmd's executable for
                ``1x4: R0:L0-3`` (``build_executable`` for rank 0: its markers do not
                communicate, so no process is needed) with hspmd's Adam, over the module in
                plain eager PyTorch with ``torch.optim.AdamW(foreach=False)`` at weight decay
                0 (the same numbers); rounds alternate which side runs first, the ratio of
                each round is hspmd's median step over eager's, in wall time and in the
                process's CPU time (``time.process_time``: less moved by the other processes
                of a shared machine); median [min, max] of the rounds
    loss diff   max |hspmd loss - eager loss| over the steps (same weights, same batches)

Then the cost check of benchmarks/model_cost.py on the HF Llama: for llama-small, -32b
and -70b (2 layers), an HF ``LlamaConfig`` of the same sizes, and the FLOPs per token at the
preset's longest sequence (at most 4096) that ``model_cost(load_model(hf llama))`` measures,
over the Llama formulas' (``hspmd.cost.stage``): a block's matmuls, its attention,
the head's matmul; the hspmd preset measured the same way beside it.

``--profile`` adds, per family, the ATen ops whose self CPU time per step differs most
between the two sides (torch's profiler: the calls per step are exact, the times move with
the machine's load), the captured graph's slices, and the attention of the HF families
alone (SDPA forward + backward) as the exported graph runs it over as HF runs it eagerly.

    PYTHONPATH=src .venv/bin/python benchmarks/models.py            # about 5 minutes
    PYTHONPATH=src .venv/bin/python benchmarks/models.py --profile  # about 8 minutes
    PYTHONPATH=src .venv/bin/python benchmarks/models.py --quick    # tiny sizes (the test)

What the executable runs beyond eager comes from the captured graph, not from hspmd's
runtime (one rank: no marker is left, the graph is straight-line code):

- HF under torch.export, left to itself, builds a boolean (B, 1, T, T) causal mask and calls
  SDPA with it and without ``is_causal`` (``find_packed_sequence_indices`` cannot read the
  ``position_ids`` while tracing, ``_ignore_causal_mask_sdpa`` refuses to skip the mask while
  exporting); with a mask, GQA runs by ``repeat_kv``, the fused kernel computes the blocks
  above the diagonal too, and ``model_cost`` counted that attention whole (2x the formulas'
  causal FLOPs, now 1.0000). hspmd captures HF models under ``hspmd.models.hf.training_masks``, which
  makes both decisions as eager makes them for a training step: SDPA with ``is_causal`` and
  ``enable_gqa``, as eager runs it (2026-12-06, load 17, two runs at once, main at 1001abe
  and with training_masks: ATen ops 304-311 -> 247 for the GQA families, 212 -> 179 for GPT-2, loss
  difference to eager 1e-6 -> 0, CPU-time ratio medians Llama 1.014 -> 0.997, Mistral 1.036
  -> 0.999, Qwen2 1.002 -> 0.992, GPT-2 1.043 -> 1.022; ``--profile``'s attention line times
  the masked path against eager);
- export records ``x[:, :, None]`` (``repeat_kv``) and ``hidden_states[:, slice(0, None)]``
  (``slice_logits_to_keep``) as ``aten.slice`` over whole dims, and hspmd's capture turns
  ``split`` (nanoGPT's and GPT-2's fused qkv) into slices: each slice's backward writes
  zeros of its input and copies the gradient in, where eager skips whole slices and
  ``split``'s backward is one ``cat``;
- a row-parallel layer's bias is added after its marker (``addmm`` becomes ``mm`` +
  ``add``), as TP needs (nanoGPT's ``mlp.c_proj``).

Prints the tables, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import hspmd.models.module as module_api
from hspmd.cost.captured import model_cost
from hspmd.models.calling import convention_of
from hspmd.models.config import get_config
from hspmd.models.initial import plain_module
from hspmd.models.module import load_model, model_graph
from hspmd.models.spec import ModuleModel
from hspmd.plan.strategy import StrategyOptions, parse_strategy
from hspmd.specialize.cut import deduce_pipeline
from hspmd.specialize.executable import build_executable
from hspmd.train.config import AdamConfig
from hspmd.train.optim import Adam

DATA = Path(__file__).resolve().parents[1] / "tests" / "models" / "data"
HF, NANOGPT = f"{DATA / 'hf_models.py'}", f"{DATA / 'nanogpt_style.py'}"


@dataclass(frozen=True, slots=True)
class Sizes:
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    batch: int


FULL = Sizes(layers=4, hidden=256, heads=4, vocab=512, seq=256, batch=4)
QUICK = Sizes(layers=2, hidden=32, heads=4, vocab=64, seq=16, batch=2)


def families(s: Sizes) -> dict[str, tuple[str, dict[str, Any]]]:
    """Family -> (``--model`` source, factory keywords) at sizes ``s``."""
    hf = dict(
        num_hidden_layers=s.layers, hidden_size=s.hidden, num_attention_heads=s.heads,
        num_key_value_heads=s.heads // 2, intermediate_size=3 * s.hidden, vocab_size=s.vocab,
        max_position_embeddings=s.seq,
    )  # fmt: skip
    gpt = dict(n_layer=s.layers, n_embd=s.hidden, n_head=s.heads, vocab_size=s.vocab)
    return {
        "hf-llama": (f"{HF}:llama", hf),
        "hf-mistral": (f"{HF}:mistral", hf),
        "hf-qwen2": (f"{HF}:qwen2", hf),
        "hf-gpt2": (f"{HF}:gpt2", {**gpt, "n_positions": s.seq}),
        "nanogpt": (f"{NANOGPT}:make", {**gpt, "block_size": s.seq}),
    }


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


# -- capture and deduction ----------------------------------------------------------------------


def capture_times(cases: dict[str, tuple[str, dict[str, Any]]], rounds: int) -> dict[str, Any]:
    """``load_model`` of every family, ``rounds`` times in turn, caches cleared before each."""
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, (source, kwargs) in cases.items():
            module_api._load.cache_clear()  # the capture itself, not the cache
            module_api._capture.cache_clear()
            start = time.perf_counter()
            load_model(source, kwargs)
            seconds[name].append(time.perf_counter() - start)
    return {name: spread(values) for name, values in seconds.items()}


def graph_figures(model: ModuleModel, s: Sizes) -> dict[str, Any]:
    """ATen ops of the captured graph; fallbacks and their bytes under one TP-2 stage."""
    gm = model_graph(model)
    aten = [n for n in gm.graph.nodes if isinstance(n.target, torch._ops.OpOverload)]
    strategy = parse_strategy(f"1x{s.batch}: R0-1:L0-{model.num_layers - 1}")
    ag = deduce_pipeline(model, strategy.pipelines[0], StrategyOptions(), seq_len=s.seq)
    return {
        "aten_ops": len(aten),
        "aten_kinds": len({str(n.target) for n in aten}),
        "tp2_split_params": sum(1 for p in model.params if p.kind != "replicate"),
        "fallbacks": [str(f) for f in ag.fallbacks],
        "fallback_bytes": sum(ag.fallback_bytes(f) for f in ag.fallbacks),
    }


# -- one-rank step: hspmd's executable against plain eager PyTorch -------------------------------


def eager_loss(module: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss as the model's authors compute it: HF's ``.loss`` (targets already shifted,
    given as ``shift_labels``), nanoGPT's ``(logits, loss)``."""
    if convention_of(module) == "hf":
        out = module(input_ids=tokens, labels=targets, shift_labels=targets, use_cache=False)
        return out.loss
    return module(tokens, targets)[1]


Step = Callable[[], float]


def steps(model: ModuleModel, s: Sizes) -> tuple[Step, Step]:
    """(hspmd's step, eager's step) on the same weights and batch; each returns its loss."""
    strategy = parse_strategy(f"1x{s.batch}: R0:L0-{model.num_layers - 1}")
    exe = build_executable(model, strategy, StrategyOptions(), 0, seq_len=s.seq, seed=0)
    ours = Adam(list(exe.params.values()), AdamConfig(lr=1e-4))
    module = plain_module(model, 0).train()
    theirs = torch.optim.AdamW(module.parameters(), lr=1e-4, weight_decay=0.0, foreach=False)
    g = torch.Generator().manual_seed(0)
    tokens, targets = torch.randint(0, model.vocab_size, (2, s.batch, s.seq), generator=g)

    def hspmd_step() -> float:
        ours.zero_grad()
        loss = exe(tokens, targets)
        loss.backward()
        ours.step()
        return float(loss.detach())

    def eager_step() -> float:
        theirs.zero_grad(set_to_none=True)
        loss = eager_loss(module, tokens, targets)
        loss.backward()
        theirs.step()
        return float(loss.detach())

    return hspmd_step, eager_step


Times = tuple[list[float], list[float]]  # wall seconds, CPU seconds of the process


def timed(step: Step, count: int, times: Times, losses: list[float]) -> None:
    for _ in range(count):
        wall, cpu = time.perf_counter(), time.process_time()
        losses.append(step())
        times[0].append(time.perf_counter() - wall)
        times[1].append(time.process_time() - cpu)


def step_ratio(ours: Step, theirs: Step, *, rounds: int, per_round: int) -> dict[str, Any]:
    """Alternate the two sides (first one, then the other); per round, hspmd's median step
    time over eager's, in wall time and in the process's CPU time (less moved by other
    processes on a shared machine). One warm-up step each first."""
    losses: dict[str, list[float]] = {"hspmd": [], "eager": []}
    timed(ours, 1, ([], []), losses["hspmd"])
    timed(theirs, 1, ([], []), losses["eager"])
    ratios: Times = ([], [])
    all_ours: Times = ([], [])
    all_theirs: Times = ([], [])
    for r in range(rounds):
        mine: Times = ([], [])
        other: Times = ([], [])
        order = [(ours, mine, "hspmd"), (theirs, other, "eager")]
        for step, out, side in order if r % 2 == 0 else order[::-1]:
            timed(step, per_round, out, losses[side])
        for kind in (0, 1):
            ratios[kind].append(statistics.median(mine[kind]) / statistics.median(other[kind]))
            all_ours[kind].extend(mine[kind])
            all_theirs[kind].extend(other[kind])
    diff = max(abs(a - b) for a, b in zip(losses["hspmd"], losses["eager"], strict=True))
    return {
        "ratio": spread(ratios[0]),
        "cpu_ratio": spread(ratios[1]),
        "hspmd_ms": statistics.median(all_ours[0]) * 1e3,
        "eager_ms": statistics.median(all_theirs[0]) * 1e3,
        "loss_diff": diff,
    }


def profile_diff(ours: Step, theirs: Step, *, count: int, top: int) -> list[dict[str, Any]]:
    """The ATen ops whose self CPU time per step differs most between the sides (torch's
    profiler, ``count`` steps each, alternating; per op the median over the steps, so that
    one preemption does not move it), with the difference in calls per step (exact)."""
    from torch.profiler import ProfilerActivity, profile

    ms: dict[str, dict[str, list[float]]] = {}
    calls: dict[str, dict[str, int]] = {}
    for i, (side, step) in enumerate((("hspmd", ours), ("eager", theirs)) * count):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        for event in prof.key_averages():
            if event.key.startswith("aten::"):
                per_step = ms.setdefault(
                    event.key, {"hspmd": [0.0] * count, "eager": [0.0] * count}
                )
                per_step[side][i // 2] = event.self_cpu_time_total / 1e3
                calls.setdefault(event.key, {"hspmd": 0, "eager": 0})[side] = event.count
    rows: list[dict[str, Any]] = []
    for op, times in ms.items():
        mine, other = statistics.median(times["hspmd"]), statistics.median(times["eager"])
        rows.append({"op": op, "ms": round(mine - other, 2), "hspmd_ms": round(mine, 2),
                     "eager_ms": round(other, 2),
                     "calls": calls[op]["hspmd"] - calls[op]["eager"]})  # fmt: skip
    return sorted(rows, key=lambda r: (-abs(r["ms"]), r["op"]))[:top]


def full_slices(model: ModuleModel) -> tuple[int, int]:
    """(``aten.slice`` nodes, those over a whole dim) in the captured graph: export records
    ``x[:, :, None]`` and ``x[:, slice(0, None)]`` as slices, and each one's backward writes
    zeros of its input and copies the gradient in (``split`` becomes slices too)."""
    nodes = [n for n in model_graph(model).graph.nodes if n.target is torch.ops.aten.slice.Tensor]
    whole = [n for n in nodes if n.args[2:3] in ((), (0,), (None,)) and _to_end(n.args[3:4])]
    return len(nodes), len(whole)


def _to_end(end: tuple[Any, ...]) -> bool:
    return end in ((), (None,)) or (isinstance(end[0], int) and end[0] >= 2**62)


def attention_paths(s: Sizes, *, rounds: int) -> dict[str, float]:
    """SDPA forward + backward at the HF families' shapes here, as HF runs it eagerly
    (``is_causal=True``, ``enable_gqa=True``; hspmd's capture too) and as transformers' own
    masks under torch.export would run it (without ``hspmd.models.hf.training_masks``: a
    boolean causal mask, so no ``is_causal``, and GQA by ``repeat_kv``): masked / eager, per
    round, alternating."""
    import torch.nn.functional as F

    b, heads, kv, t, d = s.batch, s.heads, s.heads // 2, s.seq, s.hidden // s.heads
    q = torch.randn(b, heads, t, d, requires_grad=True)
    k, v = (torch.randn(b, kv, t, d, requires_grad=True) for _ in range(2))

    def eager() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()

    def exported() -> None:
        i = torch.arange(t)
        mask = (i[None, :] <= i[:, None]).expand(b, 1, t, t)
        kk, vv = (
            x[:, :, None].expand(b, kv, heads // kv, t, d).reshape(b, heads, t, d) for x in (k, v)
        )
        F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask).sum().backward()

    ratios = []
    for r in range(rounds + 1):  # round 0: warm-up
        times = {}
        for f in (eager, exported) if r % 2 == 0 else (exported, eager):
            start = time.perf_counter()
            for _ in range(3):
                f()
            times[f] = time.perf_counter() - start
        if r:
            ratios.append(times[exported] / times[eager])
    return spread(ratios)


# -- the model-cost check on the HF Llama --------------------------------------------------------


def hf_llama_kwargs(preset: str) -> dict[str, Any]:
    """The HF ``LlamaConfig`` fields of hspmd's Llama preset ``preset`` at 2 layers."""
    c = get_config(preset, num_layers=2)
    return dict(
        num_hidden_layers=c.num_layers, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, vocab_size=c.vocab_size,
        max_position_embeddings=c.max_seq_len, rope_theta=c.rope_theta, rms_norm_eps=c.norm_eps,
        tie_word_embeddings=c.tie_embeddings,
    )  # fmt: skip


def flops_per_token(cost: Any, s: int) -> dict[str, float]:
    """Matmul and attention FLOPs per token of one block and the head (``post``) at length s."""

    def line(part: Any, name: str) -> float:
        return sum(w.units.at(1, s) for w in part.work if w.line == name) / s

    return {
        "layer_matmul": line(cost.layer, "matmul"),
        "attention": line(cost.layer, "attention"),
        "head_matmul": line(cost.post, "matmul"),
    }


def formula_flops(preset: str, s: int) -> dict[str, float]:
    """The same per token by the Llama formulas (``hspmd.cost.stage._layer``, its head)."""
    c = get_config(preset, num_layers=2)
    H, F, V = c.hidden_size, c.intermediate_size, c.vocab_size
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {
        "layer_matmul": 2 * (H * q + 2 * H * kv + q * H + 3 * H * F),
        "attention": 2 * c.num_heads * s * c.head_dim,  # causal: half of 4 * heads * s * d
        "head_matmul": 2 * H * V,
    }


def cost_check(presets: tuple[str, ...]) -> list[dict[str, Any]]:
    rows = []
    for preset in presets:
        config = get_config(preset, num_layers=2)
        s = min(4096, config.max_seq_len)
        start = time.perf_counter()
        hf = flops_per_token(model_cost(load_model(f"{HF}:llama", hf_llama_kwargs(preset))), s)
        seconds = time.perf_counter() - start
        ours = flops_per_token(model_cost(config), s)
        want = formula_flops(preset, s)
        rows.append({
            "preset": preset, "seq_len": s, "measure_s": round(seconds, 2),
            "hf_over_formula": {k: round(hf[k] / want[k], 4) for k in want},
            "preset_over_formula": {k: round(ours[k] / want[k], 4) for k in want},
            "formula_per_token": want,
        })  # fmt: skip
    return rows


# -- the run -------------------------------------------------------------------------------------


def rounded(value: Any) -> Any:
    """``value`` with every float at 4 significant digits (the JSON line)."""
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


def ranged(v: dict[str, float], fmt: str = ".3f") -> str:
    return f"{v['median']:{fmt}} [{v['min']:{fmt}}, {v['max']:{fmt}}]"


def print_families(rows: dict[str, dict[str, Any]]) -> None:
    print(f"{'family':<11}{'capture s':>22}{'ATen ops':>9}{'split':>6}{'fallbacks':>10}"
          f"{'KiB':>6}{'hspmd ms':>9}{'eager ms':>9}{'step ratio':>22}{'CPU time ratio':>22}"
          f"{'loss diff':>10}")  # fmt: skip
    for name, r in rows.items():
        print(f"{name:<11}{ranged(r['capture_s'], '.2f'):>22}{r['aten_ops']:>9}"
              f"{r['tp2_split_params']:>6}{len(r['fallbacks']):>10}"
              f"{r['fallback_bytes'] / 1024:>6.1f}{r['hspmd_ms']:>9.1f}{r['eager_ms']:>9.1f}"
              f"{ranged(r['ratio']):>22}{ranged(r['cpu_ratio']):>22}{r['loss_diff']:>10.1e}")  # fmt: skip
        for line in r["fallbacks"]:
            print(f"    fallback: {line}")
        if "slices" in r:
            print(
                f"    captured: {r['slices']} aten.slice, {r['whole_slices']} of them over a whole dim"
            )
        for p in r.get("profile", []):
            print(f"    {p['op']:<48} {p['ms']:+8.2f} ms/step ({p['hspmd_ms']:.2f} vs "
                  f"{p['eager_ms']:.2f}), {p['calls']:+.0f} calls/step")  # fmt: skip


def print_costs(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'HF Llama / formula':<20}{'seq':>6}{'block matmul':>13}{'attention':>10}"
          f"{'head':>7}   preset / formula: block, attention, head")  # fmt: skip
    for r in rows:
        hf, ours = r["hf_over_formula"], r["preset_over_formula"]
        print(f"{r['preset']:<20}{r['seq_len']:>6}{hf['layer_matmul']:>13.4f}"
              f"{hf['attention']:>10.4f}{hf['head_matmul']:>7.4f}   {ours['layer_matmul']:.4f}, "
              f"{ours['attention']:.4f}, {ours['head_matmul']:.4f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (the test)")
    parser.add_argument("--rounds", type=int, default=None, help="step rounds (default 10)")
    parser.add_argument("--per-round", type=int, default=2, help="steps per side per round")
    parser.add_argument("--profile", action="store_true", help="per-op differences (profiler)")
    parser.add_argument("--only", nargs="*", default=None, help="these families only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = QUICK if args.quick else FULL
    rounds = args.rounds or (1 if args.quick else 10)
    cases = {k: v for k, v in families(sizes).items() if args.only is None or k in args.only}
    start = time.perf_counter()
    load_model(f"{NANOGPT}:make", {"n_layer": 1})  # torch.export's first-call imports
    warmup_s = time.perf_counter() - start
    captures = capture_times(cases, 1 if args.quick else 3)
    rows: dict[str, dict[str, Any]] = {}
    for name, (source, kwargs) in cases.items():
        model = load_model(source, kwargs)
        ours, theirs = steps(model, sizes)
        rows[name] = {"capture_s": captures[name], **graph_figures(model, sizes)}
        rows[name] |= step_ratio(ours, theirs, rounds=rounds, per_round=args.per_round)
        if args.profile:
            rows[name]["profile"] = profile_diff(ours, theirs, count=5, top=10)
            rows[name]["slices"], rows[name]["whole_slices"] = full_slices(model)
    attention = attention_paths(sizes, rounds=rounds) if args.profile else None
    costs = cost_check(("llama-tiny",) if args.quick else ("llama-small", "llama-32b", "llama-70b"))
    print(f"{sizes}, one torch thread; first capture in the process {warmup_s:.2f} s (apart)")
    print_families(rows)
    if attention is not None:
        print(
            f"HF attention (SDPA forward + backward, GQA) with export's mask / as eager: "
            f"{ranged(attention)}"
        )
    print_costs(costs)
    print(json.dumps({
        "benchmark": "models", "sizes": str(sizes), "warmup_capture_s": round(warmup_s, 2),
        "families": rounded(rows), "cost": costs,
        **({"attention_exported_over_eager": rounded(attention)} if attention else {}),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
