"""Errors of the replay package.

``TraceFormatError`` is what every loader raises on malformed input: it names the file, the
1-based line and the reason, so a bad trace stops with a message that points at the fix.
"""

from __future__ import annotations

import os


class TraceFormatError(ValueError):
    """A trace file line that cannot be replayed."""

    def __init__(self, path: str | os.PathLike[str], line: int, reason: str) -> None:
        self.path = str(path)
        self.line = line
        self.reason = reason
        super().__init__(f"{self.path}:{line}: {reason}")


class ReplayError(RuntimeError):
    """A replay that cannot run as configured (budget too small for a request, stuck loop...)."""
