"""Lookup (spec §6.1): the matched block path and the snapshots a prompt may resume from.

Walk from the root over blocks ``b < floor((n - 1) / 64)`` (at least one prompt token is always
prefilled, so there is no full-hit path), selecting children by lookup hash and confirming by exact
compare. Then collect, deepest first, the snapshots anchored on that path whose tail tokens equal
the prompt's and whose frontier F satisfies F <= n - 1 and lies outside every Vision span.

O(k + snapshots on the path); no mutation of the tree. ``PrefixIndex.touch`` applies the recency
of a hit. Matched blocks are not hashed: a child whose tokens and extra key equal the prompt's
block, under a parent matched the same way, carries exactly the chained lookup hash the prompt
would compute for that block, so the walk copies it into the key (``key.hashes``) and hashes only
where a parent has several children to choose from (and past the match, when a commit needs it).
"""

from __future__ import annotations

from typing import NamedTuple

from .keys import BLOCK_BYTES, BLOCK_TOKENS, PromptKey
from .node import BlockNode, FastResidency
from .snapshot import Snapshot
from .tree import BlockTree


class Match(NamedTuple):
    n: int  # tokens the match considered
    path: list[BlockNode]  # matched full blocks, block 0 first
    device_blocks: int  # leading path blocks whose device copy is resident (not filling)
    settled_blocks: int  # leading path blocks with no device copy still filling
    best: Snapshot | None  # s*: the deepest valid snapshot (§6.2)
    best_device: Snapshot | None  # s_dev: the deepest one fully resident on the device
    branch_point: int | None  # 64k when the walk left the tree where it continues differently

    @property
    def kv_tokens(self) -> int:
        return BLOCK_TOKENS * len(self.path)


def match_prompt(tree: BlockTree, key: PromptKey, limit: int | None = None) -> Match:
    n = key.n if limit is None else min(key.n, limit)
    kmax = (n - 1) // BLOCK_TOKENS if n > 0 else 0
    node = tree.root
    path: list[BlockNode] = []
    device_blocks = settled = -1
    branch: int | None = None
    resident, filling = FastResidency.RESIDENT, FastResidency.FILLING
    data, bb = key.data, BLOCK_BYTES
    hashes = key.hashes
    known = len(hashes)  # hashes[:known] are the prompt's; known >= b at block b
    extra = key.extra if key.has_extras else None
    add = path.append
    end = 0  # byte offset of block b's end
    for b in range(kmax):
        # A chain (one child): it matches or nothing does, whatever the hash would select.
        child = node.only_child
        if child is None:
            children = node.children
            if not children:
                break
            if b < known:
                child = children.get(hashes[b])
            else:
                child = children.get(key.ensure_hashes(b + 1)[b])
                known = b + 1
        end += bb
        tokens = data[end - bb : end]
        x = extra(b) if extra is not None else 0
        while child is not None and (child.tokens != tokens or child.extra != x):
            child = child.hash_next
        if child is None:
            if b:
                branch = BLOCK_TOKENS * b
            break
        if b == known:
            hashes.append(child.lookup_hash)  # the prompt's own hash of block b (see above)
            known += 1
        state = child.device_state
        if state is not resident:
            if device_blocks < 0:
                device_blocks = b
            # A restore still landing hides what lies beyond; a write-through in flight does not
            # (the device copy it reads is intact and pinned by its lane).
            if settled < 0 and state is filling:
                settled = b
        add(child)
        node = child
    k = len(path)
    if device_blocks < 0:
        device_blocks = k
    if settled < 0:
        settled = k

    best: Snapshot | None = None
    best_device: Snapshot | None = None
    for j in range(min(k, settled), -1, -1):
        anchor = path[j - 1] if j else tree.root
        if not anchor.snapshots:
            continue
        found: Snapshot | None = None
        found_dev: Snapshot | None = None
        for s in anchor.snapshots:
            f = s.frontier
            if f > n - 1:
                continue
            if s.tail and key.tokens(BLOCK_TOKENS * j, f) != s.tail:
                continue
            if s.tail_device_state is filling or s.device_state is filling:
                continue
            if key.vision_spans and key.in_vision_span(f) is not None:
                continue
            if found is None or f > found.frontier:
                found = s
            if (
                j <= device_blocks
                and s.device_state is resident
                and (not s.tail or s.tail_device_state is resident)
                and (found_dev is None or f > found_dev.frontier)
            ):
                found_dev = s
        if best is None:
            best = found
        if found_dev is not None:
            best_device = found_dev
            break
    return Match(n, path, device_blocks, settled, best, best_device, branch)
