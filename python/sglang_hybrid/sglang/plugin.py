"""SGLang plugin entry point (group ``sglang.srt.plugins``): registers the ``hybrid`` backend.

SGLang calls :func:`register` in every process that loads plugins (the launcher, each scheduler,
the detokenizer, the DP controller); processes are spawned, so it must be idempotent.
"""

from __future__ import annotations


def register() -> None:
    """Nothing is registered yet: the backend lands with its own issue."""
