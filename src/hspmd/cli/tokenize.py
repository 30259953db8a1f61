"""`hspmd tokenize`: tokenize text once into a token file that `hspmd train --data` reads.

    hspmd tokenize corpus.jsonl --tokenizer tokenizer.json --out corpus.bin
    hspmd train --data corpus.bin --config '{"vocab_size": 50304}' --strategy "..."

INPUT is read as ``train --data`` reads text (a JSONL record is one document, any other
file one document, a directory its files sorted); each document is encoded by the tokenizer
(a ``tokenizer.json``, or a local Hugging Face tokenizer folder: offline) and ends with the
end-of-document id (the tokenizer's end-of-sequence token, or ``--eod-id``). ``--out
NAME.bin`` writes a Megatron pair (NAME.bin + NAME.idx: documents kept by the index),
``--format flat`` nanoGPT's flat ids, ``NAME.npy`` a NumPy array (both split at
``--eod-id`` when training). A rich progress bar on a terminal; ``--json`` prints what was
written as one object. See docs/data.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from hspmd.cli.flags import HelpFormatter
from hspmd.cli.paths import check_out_folder
from hspmd.data.errors import DataError
from hspmd.data.prepare import FORMATS, Written, output_format, write_tokens
from hspmd.data.tokenizer import load_tokenizer

__all__ = ["byte_progress", "register", "summary"]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tokenize",
        help="tokenize text or JSONL once into a token file (Megatron .bin/.idx, flat .bin, .npy)",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("input", metavar="INPUT", help="text or JSONL file, or a directory")
    parser.add_argument("--tokenizer", required=True, metavar="PATH",
                        help="tokenizer.json or a local Hugging Face tokenizer folder")  # fmt: skip
    parser.add_argument("--out", required=True, metavar="NAME.bin|NAME.npy",
                        help="the token file to write")  # fmt: skip
    parser.add_argument("--format", choices=FORMATS, default=None,
                        help="megatron (NAME.bin + NAME.idx), flat (NAME.bin) or npy "
                        "(default: by --out's suffix, .bin megatron)")  # fmt: skip
    parser.add_argument("--eod-id", type=int, default=None, metavar="ID",
                        help="the id that ends each document (default: the tokenizer's "
                        "end-of-sequence token)")  # fmt: skip
    parser.add_argument("--max-bytes", type=int, default=None, metavar="N",
                        help="read at most about N bytes of text (default: all)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print what was written as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


@contextmanager
def byte_progress(title: str, *, quiet: bool = False) -> Iterator[Callable[[int, int], None]]:
    """An ``on_progress(done, total)`` callback: a rich bar of bytes read on a terminal
    (stderr), nothing otherwise."""
    if quiet or not sys.stderr.isatty():
        yield lambda done, total: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(),
               TransferSpeedColumn(), TimeRemainingColumn())  # fmt: skip
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(title, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def summary(written: Written) -> str:
    """What ``written`` holds, and how to train on it, in two lines."""
    files = f"{written.path} + .idx" if written.format == "megatron" else written.path
    rate = written.tokens / max(written.seconds, 1e-9)
    eod = "" if written.format == "megatron" else f" --eod-id {written.eod_id}"
    return (
        f"wrote {files} ({written.format}): {written.documents:,} documents, "
        f"{written.tokens:,} tokens ({written.dtype}), vocabulary {written.vocab_size:,}, "
        f"end-of-document id {written.eod_id}; {written.seconds:.1f} s, {rate:,.0f} tokens/s\n"
        f"train on it: hspmd train --data {written.path}{eod} "
        f"""--config '{{"vocab_size": {written.vocab_size}}}' ... (a preset's size; """
        f"--model hf:DIR or your own needs a vocabulary of at least {written.vocab_size:,})"
    )


def run(args: argparse.Namespace) -> int:
    check_out_folder(args.out, "--out")
    output_format(args.out, args.format)  # before the tokenizer loads
    if args.max_bytes is not None and args.max_bytes < 1:
        raise DataError(f"--max-bytes {args.max_bytes}: give a positive size (or leave it out)")
    tokenizer = load_tokenizer(args.tokenizer)
    with byte_progress("tokenizing", quiet=args.quiet or args.json) as on_progress:
        written = write_tokens(
            args.input, tokenizer, args.out, format=args.format, eod_id=args.eod_id,
            max_bytes=args.max_bytes, on_progress=on_progress,
        )  # fmt: skip
    print(json.dumps(written.to_json()) if args.json else summary(written))
    return 0
