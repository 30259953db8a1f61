"""Strategy arguments: a strategy string, or ``@FILE`` for the strategy written in a file.

Every flag that takes a strategy takes ``@FILE`` too (``--strategy``, ``--switch
STEP=@FILE``, ``plan --current``, ``switch-cost --from``/``--to``): the file holds the
strategy string, on one line or several (any spacing; docs/strategy.md). A strategy can
outgrow one command-line argument (Linux allows 128 KiB: 65,536 ranks written out take
more, and the shell refuses to start the command); the repeat form ``COUNT*(PIPELINE)``
keeps most short, a file takes any. A file that cannot be read, is empty or does not parse
is one error naming the path::

    hspmd explain --model llama-70b --strategy @big.txt --rank 0
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hspmd.errors import StrategyError
from hspmd.plan.strategy import parse_strategy

__all__ = ["STRATEGY_HELP", "read_strategy_file", "strategy_argument", "switch_argument"]

STRATEGY_HELP = "a strategy string, or @FILE holding one"


def read_strategy_file(value: str) -> str:
    """``value`` itself, or with a leading ``@`` the strategy in that file (stripped, its
    syntax checked); a StrategyError naming the path and the fix otherwise.

    >>> read_strategy_file("1x1: R0:L0-3")
    '1x1: R0:L0-3'
    >>> read_strategy_file("@/nonexistent.txt")
    Traceback (most recent call last):
    hspmd.errors.StrategyError: no strategy file '/nonexistent.txt': give an existing file after '@', or the strategy itself
    """
    if not value.startswith("@"):
        return value
    path = value[1:]
    if not path:
        raise StrategyError("'@' without a path: write @FILE, the file holding the strategy")
    try:
        text = Path(path).expanduser().read_text()
    except FileNotFoundError:
        raise StrategyError(
            f"no strategy file {path!r}: give an existing file after '@', or the strategy itself"
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else error
        raise StrategyError(
            f"cannot read strategy file {path!r} ({reason}): give a readable text file"
        ) from None
    if not text.strip():
        raise StrategyError(
            f"strategy file {path!r} is empty: write the strategy into it, e.g. '4x1: R0-3:L0-79'"
        )
    try:
        parse_strategy(text)
    except StrategyError as error:
        raise StrategyError(f"strategy file {path!r}: {error}") from None
    return text.strip()


def strategy_argument(value: str) -> str:
    """argparse ``type`` of a flag taking a strategy (``read_strategy_file``)."""
    try:
        return read_strategy_file(value)
    except StrategyError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def switch_argument(value: str) -> str:
    """argparse ``type`` of ``--switch STEP=STRATEGY``: ``STEP=@FILE`` reads the file."""
    step, sep, text = value.partition("=")
    if sep and text.strip().startswith("@"):
        return f"{step}={strategy_argument(text.strip())}"
    return value
