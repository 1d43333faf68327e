"""The block tree: one radix tree of 64-token blocks, exact identity, path counters (spec §5.1-5.2).

Children are found by lookup hash and confirmed by an exact compare of the block's tokens and extra
key; nodes whose hashes collide chain through ``hash_next`` under one dict entry, so a forced
constant hash degrades to a linear probe, never to a false hit.

The tree keeps two path counters exact as nodes come and go:
``forks_below`` (nodes with two or more children in the subtree; the Boundary rule of §9.3 asks
"is the tree below a single chain?") and, through :meth:`add_along_path`, the snapshot counts
``live_snapshots_below`` and ``retained_below`` that :class:`~.prefix_index.PrefixIndex` maintains.
"""

from __future__ import annotations

from collections.abc import Iterator

from .keys import ROOT_HASH
from .node import BlockNode


class BlockTree:
    def __init__(self) -> None:
        self._next_id = 1
        self.root = BlockNode(
            id=0, parent=None, depth=-1, lookup_hash=ROOT_HASH, extra=0, tokens=b""
        )
        self.n_nodes = 0

    # ---------------------------------------------------------------- lookup
    @staticmethod
    def find_child(parent: BlockNode, h: int, tokens: bytes, extra: int) -> BlockNode | None:
        only = parent.only_child
        if only is not None:  # equal tokens and extra under one parent imply equal hashes
            return only if only.tokens == tokens and only.extra == extra else None
        children = parent.children
        if not children:
            return None
        c = children.get(h)
        while c is not None:
            if c.tokens == tokens and c.extra == extra:
                return c
            c = c.hash_next
        return None

    # ---------------------------------------------------------------- structure
    def add_child(self, parent: BlockNode, h: int, tokens: bytes, extra: int) -> BlockNode:
        node = BlockNode(self._next_id, parent, parent.depth + 1, h, extra, tokens)
        self._next_id += 1
        self.n_nodes += 1
        n = parent.n_children
        parent.n_children = n + 1
        if n == 0:  # the common case: extending a chain
            parent.only_child = node
            return node
        children = parent.children
        if children is None:  # the second child: the chain forks here
            only = parent.only_child
            assert only is not None
            parent.only_child = None
            children = parent.children = {only.lookup_hash: only}
            self._add_forks(parent, 1)
        node.hash_next = children.get(h)
        children[h] = node
        return node

    def remove_leaf(self, node: BlockNode) -> None:
        """Unlink a childless node. Counters along its path must already be zero for it."""
        assert node.n_children == 0 and not node.is_root, node
        parent = node.parent
        assert parent is not None
        node.parent = None
        self.n_nodes -= 1
        parent.n_children -= 1
        if parent.only_child is not None:
            assert parent.only_child is node
            parent.only_child = None
            return
        children = parent.children
        assert children is not None
        head = children[node.lookup_hash]
        if head is node:
            if node.hash_next is None:
                del children[node.lookup_hash]
            else:
                children[node.lookup_hash] = node.hash_next
        else:
            while head.hash_next is not node:
                nxt = head.hash_next
                assert nxt is not None  # node is on this hash chain
                head = nxt
            head.hash_next = node.hash_next
        node.hash_next = None
        if parent.n_children == 1:  # back to a chain: the last child leaves the dict
            (last,) = children.values()
            assert last.hash_next is None
            parent.children = None
            parent.only_child = last
            self._add_forks(parent, -1)

    def _add_forks(self, node: BlockNode | None, delta: int) -> None:
        while node is not None:
            node.forks_below += delta
            node = node.parent

    # ---------------------------------------------------------------- paths
    @staticmethod
    def path(node: BlockNode) -> list[BlockNode]:
        """Nodes from block 0 to ``node`` (root excluded)."""
        out: list[BlockNode] = []
        while node.parent is not None:
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    @staticmethod
    def is_single_chain(node: BlockNode) -> bool:
        """No node in ``node``'s subtree (itself included) has two or more children."""
        return node.forks_below == 0

    def subtree_postorder(self, node: BlockNode) -> Iterator[BlockNode]:
        """Every node below ``node`` (``node`` last), children before parents."""
        stack: list[tuple[BlockNode, bool]] = [(node, False)]
        while stack:
            n, expanded = stack.pop()
            if expanded:
                yield n
                continue
            stack.append((n, True))
            for c in n.iter_children():
                stack.append((c, False))
