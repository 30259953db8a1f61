"""How far below the gradient's scale each parameter's reference gradient stays, and which
elements ``hspmd.train.noise_floor`` calls noise-only (docs/cli.md, "Equal to the
reference: the rule").

Runs the reference (``hspmd train --reference``, the same flags) and records, every step,
each parameter's largest ``|g|`` over the step's largest ``|g|`` (of the whole model),
before clipping: the figure the floor ``u x max |g|`` (u = 2^-24 = 6.0e-8) is set against.
Prints, per parameter whose figure ever fell below 1e-4, the smallest and largest of it
over the steps and its noise-only elements; the JSON line has them for every parameter.

``--write-letters random|repeated`` first writes ``--data`` (JSONL): 300 documents of 3 to 16
letters (seed 0), random ones or one letter repeated. docs/cli.md's figures:

    python benchmarks/grad_noise.py --write-letters random --data /tmp/letters.jsonl \\
        --model tests/models/data/hf_models.py:phi --tokens-per-step 96 --seq-len 64 \\
        --strategy "2x1: R0-1:L0-1:C2"
    hspmd train --data /tmp/letters.jsonl ... (the same flags) --compare
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Mapping

import torch

import hspmd.train.reference as reference
from hspmd.cli.train import add_config_arguments, config_from_args
from hspmd.train.noise_floor import UNIT_ROUNDOFF, NoiseFloor

SHOWN = 1e-4  # parameters whose largest |g| fell below this share of the step's are listed


class RecordingFloor(NoiseFloor):
    """The floor of the reference, also keeping each step's per-parameter ratio."""

    steps: list[dict[str, torch.Tensor]] = []  # per step: |g| / the step's max |g|

    def observe(self, grads: Mapping[str, torch.Tensor]) -> None:
        scale = max((float(g.detach().abs().max()) for g in grads.values()), default=0.0)
        if scale:
            ratios = {n: (g.detach().abs() / scale).cpu() for n, g in grads.items()}
            RecordingFloor.steps.append(ratios)
        super().observe(grads)


def _noise_high(name: str, mask: torch.Tensor | None) -> float:
    """The largest |g| / G of ``name``'s noise-only elements over the steps (0: none)."""
    if mask is None:
        return 0.0
    return max(float(s[name][mask].max()) for s in RecordingFloor.steps if name in s)


def write_letters(path: str, kind: str) -> None:
    """300 documents of 3 to 16 letters, random ones or one letter repeated (seed 0)."""
    draw = random.Random(0)
    with open(path, "w") as out:
        for _ in range(300):
            n = draw.randint(3, 16)
            text = "".join(draw.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n))
            out.write(json.dumps({"text": text if kind == "random" else "a" * n}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_arguments(parser, strategy=None)
    parser.add_argument("--write-letters", choices=("random", "repeated"))
    args = parser.parse_args()
    if args.write_letters is not None:
        write_letters(args.data, args.write_letters)
    config = config_from_args(args)
    reference.NoiseFloor = RecordingFloor  # type: ignore[misc]
    result = reference.run_reference(config)
    names = list(result.params)
    steps = RecordingFloor.steps
    low = {n: min(float(s[n].max()) if n in s else 0.0 for s in steps) for n in names}
    high = {n: max(float(s[n].max()) if n in s else 0.0 for s in steps) for n in names}
    noise = {n: int(result.noise_only[n].sum()) if n in result.noise_only else 0 for n in names}
    at = {n: _noise_high(n, result.noise_only.get(n)) for n in names}
    print(f"floor: u = {UNIT_ROUNDOFF:.1e} of the step's largest |g| (G), {len(steps)} steps")
    print(f"{'parameter':<44} {'elements':>8} {'max|g|/G: min':>13} {'max':>8} "
          f"{'noise-only':>10} {'their max |g|/G':>15}")  # fmt: skip
    for n in names:
        if low[n] < SHOWN or noise[n]:
            print(f"{n:<44} {result.params[n].numel():>8} {low[n]:>13.1e} {high[n]:>8.1e} "
                  f"{noise[n]:>10} {at[n]:>15.1e}")  # fmt: skip
    print(json.dumps({"unit_roundoff": UNIT_ROUNDOFF, "steps": len(steps),
                      "largest_over_scale": {n: [low[n], high[n]] for n in names},
                      "noise_only": {n: [noise[n], at[n]] for n in names if noise[n]}}))  # fmt: skip


if __name__ == "__main__":
    main()
