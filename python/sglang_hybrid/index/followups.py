"""Follow-up offsets: where later prompts leave an earlier prompt's path, learned (issue #15).

Traffic without template hints (token ids from ``/generate`` clients, routers, harnesses) gives
the tap planner no opener to tap at. Its follow-ups still diverge at a recurring distance before
the end of the prompt they continue: a chat template that renders the last turn differently from
history (an empty think block, a generation prompt) moves the divergence a fixed few tokens back;
a client that edits or regenerates the last message, a harness that rewrites the tail, or a
block-hashed trace with a private last block move it further. The prompt-tail tap
(floor64(n - 1)) serves none of these, and the ladder's first rung lies thousands of tokens back.

``FollowUpOffsets`` learns that distance from what the cache sees. Every prompt marks the nodes
of its last ``WINDOW_TOKENS`` with its end (``BlockNode.prompt_end``, at release). When a later
match leaves the tree at a block boundary d on such a node (the branch point), ``e - d`` is one
observation: a follow-up diverged that many tokens before an earlier prompt's end e. A prefill of
n tokens resuming at ``base`` then taps at n - q, the q that maximises the expected saving
``P(offset <= q) * (n - q - base)`` over the observed offsets: near the largest offset when
the prompt is long past its base, nearer the tail when it is not. A follow-up that leaves this
prompt ``offset`` tokens before its end diverges at n - offset, so the tap at n - q serves
exactly the offsets up to q (it once sat at n - 1 - q: one token short, which the grid floor
turned into a whole block whenever n - q was on the grid).

The histogram ages by observation count, never by time (every TP rank learns the same from the
same stream), and offsets past the window are ignored: the ladder serves those. O(1) to observe,
O(WINDOW_TOKENS / 64) to choose. No tensor work.
"""

from __future__ import annotations

from .keys import BLOCK_TOKENS

WINDOW_TOKENS = 4096  # the ladder's smallest first rung (spec §14.2: G >= 4096)
BINS = WINDOW_TOKENS // BLOCK_TOKENS
MIN_OBSERVATIONS = 8  # before this many, no follow-up tap: one stray branch teaches nothing
HALF_LIFE = 1024  # observations after which old ones weigh half: traffic changes


class FollowUpOffsets:
    """A decaying histogram of follow-up divergence offsets, in 64-token bins."""

    __slots__ = ("counts", "observations", "weight")

    def __init__(self) -> None:
        # counts[i]: weight of offsets in (64 i, 64 (i + 1)]. Only ``observe`` changes it.
        self.counts = [0.0] * BINS
        self.observations = 0  # over the histogram's life
        self.weight = 0.0  # sum(counts)

    def observe(self, offset: int) -> None:
        """A later prompt diverged ``offset`` tokens before an earlier prompt's end."""
        if not 0 < offset <= WINDOW_TOKENS:
            return
        self.observations += 1
        if self.observations % HALF_LIFE == 0:
            self.counts = [c * 0.5 for c in self.counts]
            self.weight *= 0.5
        self.counts[(offset - 1) // BLOCK_TOKENS] += 1.0
        self.weight += 1.0

    def offset(self, span: int) -> int | None:
        """The q to tap at n - q for a prefill that computes ``span`` = n - base tokens,
        or None (too few observations, or no offset leaves a block above the base)."""
        if self.observations < MIN_OBSERVATIONS or self.weight <= 0.0:
            return None
        best, best_q, cum = 0.0, None, 0.0
        for i, c in enumerate(self.counts):
            cum += c
            q = BLOCK_TOKENS * (i + 1)
            saved = span - q
            if saved < BLOCK_TOKENS:
                break
            if c and cum * saved > best:
                best, best_q = cum * saved, q
        return best_q
