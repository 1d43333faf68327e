"""The sequences the cache saw finish most recently: what ``GET /slots`` shows as slots.

The cache records each released sequence here; the boundary API (``boundaries.py``) reads it.
"""

from __future__ import annotations

from ..index import PromptKey


class Recent:
    """The keys of the sequences released most recently (prompt and output), newest last.
    Bounded in entries and in tokens (a key holds 4 B a token); a retry or the next turn of the
    same request id replaces its entry."""

    def __init__(self, entries: int = 64, tokens: int = 1 << 22) -> None:
        self.entries = entries
        self.tokens = tokens
        self._keys: dict[str, PromptKey] = {}  # insertion order: oldest first
        self._held = 0

    def add(self, rid: str, key: PromptKey) -> None:
        old = self._keys.pop(rid, None)
        if old is not None:
            self._held -= old.n
        self._keys[rid] = key
        self._held += key.n
        while len(self._keys) > self.entries or (self._held > self.tokens and len(self._keys) > 1):
            first = next(iter(self._keys))
            self._held -= self._keys.pop(first).n

    def newest(self, limit: int) -> list[tuple[str, PromptKey]]:
        items = list(self._keys.items())
        return items[::-1][: max(0, limit)]

    def get(self, rid: str) -> PromptKey | None:
        return self._keys.get(rid)
