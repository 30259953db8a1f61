"""Output paths checked before a command does its work: a typo never costs a finished run."""

from __future__ import annotations

from pathlib import Path

from hspmd.errors import HspmdError

__all__ = ["check_out_folder"]


def check_out_folder(path: str, flag: str) -> None:
    """Refuse ``path`` (given as ``flag``) when the folder it goes in does not exist.

    >>> check_out_folder("/nonexistent/p.json", "--out")
    Traceback (most recent call last):
    hspmd.errors.HspmdError: --out '/nonexistent/p.json': folder '/nonexistent' does not exist: create it first
    """
    folder = Path(path).parent
    if not folder.is_dir():
        raise HspmdError(f"{flag} {path!r}: folder {str(folder)!r} does not exist: create it first")
