"""Errors raised by the converter. Every message names the file, tensor or directory at fault."""

from __future__ import annotations


class ConvertError(ValueError):
    """A checkpoint that cannot be converted, exported or loaded as asked (bad input, not a bug)."""


def listing(names, limit: int = 20) -> str:
    """`a, b, c (and 12 more)` for error messages."""
    names = sorted(names)
    head = ", ".join(names[:limit])
    return head + (f" (and {len(names) - limit} more)" if len(names) > limit else "")
