"""The one error of the data package."""

from __future__ import annotations

from hspmd.errors import HspmdError

__all__ = ["DataError"]


class DataError(HspmdError, ValueError):
    """A data file or tokenizer that is missing, empty, unreadable, malformed, too short for
    the request, or does not fit the model (ids past its vocabulary)."""
