"""The one error type of the converter: bad input, said in one line that names the file, field,
flag or tensor (the CLI prints it and exits with status 2)."""

from __future__ import annotations


class ConvertError(ValueError):
    """A checkpoint, config or argument the converter refuses (message: one line)."""


__all__ = ["ConvertError"]
