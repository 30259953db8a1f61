"""`hspmd ...`: a thin command-line layer over the library.

Each subcommand lives in its own module of this package and exposes
``register(subparsers) -> None``; the parser it adds sets ``func`` to a function
``(args) -> int`` that returns the exit status. User errors (``HspmdError``)
print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from typing import Any, NoReturn

from hspmd.errors import HspmdError

# Subcommand modules, in the order `hspmd --help` lists them.
COMMANDS = (
    "reshard",
    "partition",
    "partition_capture",
    "tokenize",
    "train",
    "export",
    "demo",
    "explain",
    "switch_cost",
    "profile",
    "simulate",
    "plan",
    "netcluster",
    "timeline",
)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (the subcommands' parsers are of this class too).
    A value in exponent notation such as ``--lr -1e-3`` is a value, not an unknown option
    (argparse before Python 3.13 took it for a flag: "--lr: expected one argument")."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hspmd",
        description="Hierarchical, heterogeneous SPMD training and op-graph partitioning.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"hspmd.cli.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except HspmdError as error:
        print(f"hspmd {args.command}: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # a file the command reads or writes, named by the OS
        where = f" {error.filename!r}" if error.filename else ""
        print(f"hspmd {args.command}: error:{where} {error.strerror or error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
