"""`hspmd export`: a checkpoint of any strategy as one Hugging Face folder.

    hspmd train --model hf:llama-1b --strategy "..." --steps 100 --save ckpt
    hspmd export ckpt --format hf --out llama-1b-tuned
    python -c "import transformers; transformers.AutoModelForCausalLM.from_pretrained('llama-1b-tuned')"

CKPT is a checkpoint folder (``--save``'s, whose newest complete step is taken, or one
``step-N`` folder). Its shards are checked by their headers first (missing, truncated or
corrupt: one line). ``--format hf`` writes ``model.safetensors`` (every parameter whole,
tied weights once) and ``config.json`` (the config the run recorded), and copies the
tokenizer files of the ``hf:DIR`` the run started from if that folder is still there;
``--format safetensors`` writes the weights alone (any model). The weights are written in
the config's dtype unless ``--dtype`` says otherwise; one tensor at a time is held in
memory. See docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import json
import time

from hspmd.checkpoint.export import DTYPES, export_checkpoint
from hspmd.cli.flags import HelpFormatter

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="write a checkpoint (any strategy) as a Hugging Face folder or one safetensors file",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("checkpoint", metavar="CKPT", help="a --save folder or a step-N folder")
    parser.add_argument("--format", choices=("hf", "safetensors"), default="hf",
                        help="hf: config.json + model.safetensors (transformers loads it); "
                        "safetensors: the weights alone")  # fmt: skip
    parser.add_argument("--out", required=True, metavar="DIR", help="the folder to write")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                        help="the weights' dtype (default: the config's, else float32)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print what was written as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    result = export_checkpoint(args.checkpoint, args.out, format=args.format, dtype=args.dtype)
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps({
            "out": str(result.folder), "step": result.step, "tensors": result.tensors,
            "bytes": result.bytes, "dtype": result.dtype, "copied": list(result.copied),
            "seconds": round(seconds, 3),
        }))  # fmt: skip
        return 0
    config = " + config.json" if args.format == "hf" else ""
    copied = f"; copied {', '.join(result.copied)}" if result.copied else ""
    print(
        f"wrote {result.folder}/model.safetensors{config}: step {result.step}, "
        f"{result.tensors} tensors, {result.bytes / 2**20:.1f} MiB {result.dtype}, "
        f"{seconds:.1f} s{copied}"
    )
    return 0
