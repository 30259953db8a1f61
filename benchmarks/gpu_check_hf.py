"""Part (g) of the GPU check (benchmarks/gpu_check.py): a captured Hugging Face Llama's
training step through hspmd against the same model in plain eager PyTorch, on one device.

The model is transformers' ``LlamaForCausalLM`` built from a ``LlamaConfig`` (random init,
offline, ``attn_implementation="sdpa"``), in bf16. One rank (nccl on the GPU, gloo in the
dry run) runs, in the same process and on the same device:

    hspmd   ``hspmd.build(hf_llama, "1xB: R0:L0-..", dtype="bf16")``: the module captured by
            torch.export, one executable graph; bf16 compute weights, fp32 masters and
            hspmd's Adam on them (``MixedPost``); ``train_step`` of the program
    eager   the module itself with the same initial weights (``build_reference_model``),
            cast to bf16, called as HF calls it (``labels``/``shift_labels``); fp32 masters
            and ``torch.optim.AdamW(foreach=False)`` on them, the same arithmetic as
            hspmd's Adam; the bf16 weights copied back after each step

The factory builds the module in bf16 (``hf_llama(bf16=True)``), as a bf16 run of a Hugging
Face model builds it: hspmd captures the module in the dtype of its parameters. A module
built in fp32 and trained with ``dtype="bf16"`` fails today at its first matmul ("expected
m1 and m2 to have the same dtype"): its capture keeps HF's RMSNorm cast back to the input's
dtype as a cast to fp32, and the bf16 cast of the executable's parameters does not change it
(``hspmd train --model tests/models/data/hf_models.py:llama --dtype bf16`` shows it).

Both train on the run's first global batch, again at every step, so each side's k-th loss
is comparable. One warm-up step each, then rounds alternating which side goes first (ABAB),
``--steps`` steps a side a round; per round hspmd's median step over eager's, the median
and range over the rounds. A step's time ends at its loss read back to the host, which
waits for every kernel of the step. The aten attention ops each side called in one
profiled step are listed (both should call SDPA's fused kernel).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# the model: on the GPU a TinyLlama-like shape cut to 4 layers; in the dry run a toy
HF_GPU = {
    "num_hidden_layers": 4, "hidden_size": 2048, "intermediate_size": 5632,
    "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000,
    "max_position_embeddings": 2048,
}  # fmt: skip
HF_DRY = {
    "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    "max_position_embeddings": 32,
}  # fmt: skip
ROWS = {"gpu": 4, "dry": 2}  # one micro-batch of this many sequences
ROUNDS = {"gpu": 4, "dry": 2}  # ABAB rounds
STEPS = {"gpu": 5, "dry": 1}  # steps a side a round


def hf_llama(bf16: bool = False, **overrides: Any) -> Any:
    """transformers' Llama from a config (no download): the model hspmd captures; ``bf16``:
    its parameters in bf16, as a bf16 run builds it."""
    import torch
    import transformers

    config = transformers.LlamaConfig(**{**HF_DRY, "attn_implementation": "sdpa", **overrides})
    module = transformers.LlamaForCausalLM(config)
    return module.to(torch.bfloat16) if bf16 else module


def part_hf_llama(data: dict[str, Any], _out: Path, *, dry: bool) -> None:
    import torch
    from gpu_check import DATA

    from hspmd.runtime.launch import launch

    cuda = not dry and torch.cuda.is_available()
    size = "dry" if dry else "gpu"
    shape = HF_DRY if dry else HF_GPU
    rows, seq_len = ROWS[size], shape["max_position_embeddings"]
    options = {
        "model_kwargs": {**shape, "bf16": True}, "global_batch": rows, "seq_len": seq_len,
        "steps": 1, "seed": 0, "lr": 1e-4, "dtype": "bf16", "data": DATA,
        "device": "cuda" if cuda else "cpu",
    }  # fmt: skip
    strategy = f"1x{rows}: R0:L0-{shape['num_hidden_layers'] - 1}"
    data["model"] = {**shape, "attn_implementation": "sdpa", "dtype": "bf16"}
    data["run"] = {"strategy": strategy, "rows": rows, "seq_len": seq_len,
                   "rounds": ROUNDS[size], "steps_per_round": STEPS[size]}  # fmt: skip
    source = f"{Path(__file__).resolve()}:hf_llama"
    begin = time.perf_counter()
    run = {"strategy": strategy, "options": options, "rounds": ROUNDS[size],
           "per_round": STEPS[size]}  # fmt: skip
    (out,) = launch(_rank, 1, args=(source, run), backend="nccl" if cuda else "gloo",
                    timeout_s=600)  # fmt: skip
    data["wall_seconds"] = round(time.perf_counter() - begin, 1)
    data.update(out)
    ratio = out["ratio"]
    data["summary"] = (
        f"HF Llama ({out['parameters'] / 1e6:.1f} M parameters, bf16, {rows} x {seq_len} "
        f"tokens): hspmd {out['hspmd_ms']:.2f} ms a step, eager {out['eager_ms']:.2f} ms: "
        f"hspmd / eager {ratio['median']:.3f} [{ratio['min']:.3f}-{ratio['max']:.3f}] over "
        f"{ROUNDS[size]} rounds; losses {out['max_loss_rel']:.1e} apart (relative)"
    )
    print(data["summary"], flush=True)
    print(f"attention ops: hspmd {out['attention_ops']['hspmd']}, "
          f"eager {out['attention_ops']['eager']}", flush=True)  # fmt: skip
    if out["max_loss_rel"] > 2e-2:
        data["error"] = f"losses {out['max_loss_rel']:.1e} apart (bf16: within 2e-2 passes)"


Step = Callable[[], float]


def _rank(world: Any, source: str, run: dict[str, Any]) -> dict[str, Any]:
    """One rank: both sides built here, then timed in ``run['rounds']`` alternating rounds
    of ``run['per_round']`` steps a side."""
    import torch

    from hspmd.train.program import build

    program = build(source, run["strategy"], world=world, **run["options"])
    batch = next(iter(program.batches()))

    def ours() -> float:
        return program.train_step(batch)

    theirs, parameters = _eager(program.config, world.device, batch)
    sync = torch.cuda.synchronize if world.device.type == "cuda" else (lambda: None)
    losses: dict[str, list[float]] = {"hspmd": [], "eager": []}
    times: dict[str, list[list[float]]] = {"hspmd": [], "eager": []}
    for side, step in (("hspmd", ours), ("eager", theirs)):  # warm-up
        losses[side].append(step())
    for r in range(run["rounds"]):
        order = [("hspmd", ours), ("eager", theirs)]
        for side, step in order if r % 2 == 0 else order[::-1]:
            times[side].append([])
            for _ in range(run["per_round"]):
                sync()
                began = time.perf_counter()
                losses[side].append(step())  # ends at the loss on the host
                times[side][-1].append(time.perf_counter() - began)
    ratios = [statistics.median(a) / statistics.median(b)
              for a, b in zip(times["hspmd"], times["eager"], strict=True)]  # fmt: skip
    pairs = zip(losses["hspmd"], losses["eager"], strict=True)
    return {
        "parameters": parameters,
        "hspmd_ms": statistics.median(t for r in times["hspmd"] for t in r) * 1e3,
        "eager_ms": statistics.median(t for r in times["eager"] for t in r) * 1e3,
        "ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
        "ratios": ratios,
        "losses": losses,
        "max_loss_rel": max(abs(a - b) / abs(b) for a, b in pairs),
        "attention_ops": {"hspmd": _attention_ops(ours), "eager": _attention_ops(theirs)},
    }


def _eager(config: Any, device: Any, batch: Any) -> tuple[Step, int]:
    """The plain module's step (bf16 weights, fp32 masters, AdamW with hspmd's numbers) on
    ``batch``, and its parameter count."""
    import torch

    from hspmd.models.build import step_loss
    from hspmd.train.reference import build_reference_model

    spec = config.model_config()
    module = build_reference_model(config).to(device=device, dtype=torch.bfloat16).train()
    params = list(module.parameters())
    masters = [p.detach().float().clone() for p in params]
    a = config.optimizer
    optimizer = torch.optim.AdamW(masters, lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps,
                                  weight_decay=a.weight_decay, foreach=False)  # fmt: skip
    tokens, targets = (t.to(device) for t in batch[:2])

    def step() -> float:
        for p in params:
            p.grad = None
        loss = step_loss(spec, module, tokens, targets)
        loss.backward()
        with torch.no_grad():
            for master, p in zip(masters, params, strict=True):
                master.grad = p.grad.float()
            optimizer.step()
            for master, p in zip(masters, params, strict=True):
                p.copy_(master)
        return float(loss.detach())

    return step, sum(p.numel() for p in params)


def _attention_ops(step: Step) -> list[str]:
    """The aten attention ops one step calls (torch's profiler, host side)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    keys = {e.key for e in prof.key_averages()}
    wanted = ("scaled_dot_product", "flash", "efficient_attention", "cudnn_attention")
    return sorted(k for k in keys if k.startswith("aten::") and any(w in k for w in wanted))
