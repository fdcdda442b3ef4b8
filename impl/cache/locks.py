"""Path locks, the evictable / protected L1 page counts and the lazy LRU heap of L1 leaves.

Owned here and nowhere else: every node's ``lock_ref`` / ``pins``, the counts ``evictable_pages`` and
``protected_pages`` (L1 pages of unlocked and locked nodes: their sum is every L1-valid page of the
tree), ``device_nodes`` (nodes holding L1 pages) and the heap.

* A lock on a node is a path lock: ``lock_ref`` of the node and every ancestor (root excluded) grows
  by one; ``pins`` counts the locks taken on the node itself (the scheduler's and the copy ops').
  Where a node's ``lock_ref`` leaves or reaches zero its L1 pages move between the two counts.
* The heap holds ``(last_access, id, node)`` entries. An entry is pushed only where a node may be an
  unlocked L1 leaf; entries go stale (touched since, locked, evicted, a child added) and are skipped
  when popped. :meth:`LockBook.pop_leaf` returns only current, unlocked L1 leaves, oldest first.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable

from kvstrata.impl.cache.clock import StepClock
from kvstrata.impl.cache.node import Node
from kvstrata.impl.fingerprint import FINGERPRINT_BYTES
from kvstrata.model.lifecycles import DEVICE_CLAIMED, DEVICE_VALID

__all__ = ["LockBook", "is_device_leaf"]

# tuples: membership tests identity first, no Python-level Enum.__hash__ call
_DEVICE_VALID_T = tuple(DEVICE_VALID)
_DEVICE_CLAIMED_T = tuple(DEVICE_CLAIMED)
_REBUILD_AT = 1024  # heap entries below which stale entries are never worth a rebuild


def is_device_leaf(node: Node) -> bool:
    """An unlocked node valid on L1 with no child that holds (or is getting) L1 pages."""
    return (
        not node.lock_ref
        and node.state in _DEVICE_VALID_T
        and not any(child.state in _DEVICE_CLAIMED_T for child in node.children.values())
    )


class LockBook:
    """See the module docstring. ``count_hits``: bump ``Node.hits`` on every touch (only
    ``write_through_selective`` reads them)."""

    __slots__ = (
        "_clock",
        "count_hits",
        "device_nodes",
        "evictable_pages",
        "leaves",
        "protected_pages",
    )

    def __init__(self, clock: StepClock, *, count_hits: bool) -> None:
        self._clock = clock
        self.count_hits = count_hits
        self.evictable_pages = 0
        self.protected_pages = 0
        self.device_nodes = 0
        self.leaves: list[tuple[int, int, Node]] = []

    def lock(self, node: Node, delta: int) -> None:
        """Add ``delta`` to the path lock of ``node``: its ``lock_ref`` and every ancestor's. L1 pages
        move between evictable and protected where a count leaves or reaches zero; a node whose count
        reaches zero gets a heap entry unless the node below it on the path holds L1 pages (then it is
        no L1 leaf, and whatever makes it one pushes it)."""
        node.pins += delta
        leaves = self.leaves
        moved = 0  # L1 pages that become protected (negative: evictable)
        below: Node | None = None
        current = node
        parent = current.parent
        while parent is not None:
            before = current.lock_ref
            after = current.lock_ref = before + delta
            if (before == 0) != (after == 0) and current.state in _DEVICE_VALID_T:
                pages = len(current.fps) // FINGERPRINT_BYTES
                moved += pages if after else -pages
            if after == 0 and (
                (below.state not in _DEVICE_CLAIMED_T)
                if below is not None
                else not any(c.state in _DEVICE_CLAIMED_T for c in current.children.values())
            ):  # an unlocked node with no L1 child below it: an L1 leaf candidate
                heapq.heappush(leaves, (current.last_access, current.id, current))
            below = current
            current = parent
            parent = current.parent
        self.protected_pages += moved
        self.evictable_pages -= moved

    @staticmethod
    def raw_lock(node: Node, delta: int) -> None:
        """A lock that only keeps eviction away for the length of one call (no accounting)."""
        node.pins += delta
        current = node
        while current.parent is not None:
            current.lock_ref += delta
            current = current.parent

    def count_device(self, node: Node, sign: int) -> None:
        """``node``'s pages became valid on L1 (``sign`` +1) or stopped being (-1)."""
        self.device_nodes += sign
        if node.lock_ref:
            self.protected_pages += sign * node.num_pages
        else:
            self.evictable_pages += sign * node.num_pages

    def touch(self, path: list[Node], child_added: bool = False) -> None:
        """Mark ``path`` (root side first) as used now: LRU time of every node, and its hit count
        when counted. The heap gets a current entry for each node that may be an L1 leaf: the
        deepest, and any whose successor on the path holds no L1 pages. A node with an L1 child is
        no leaf; the eviction, ack or unlock that makes it one pushes it then, with its
        ``last_access`` of that time. ``child_added``: the caller adds an L1 leaf below the deepest
        node next (no leaf then)."""
        clock = self._clock.now
        leaves = self.leaves
        push = heapq.heappush
        claimed_below = child_added
        if self.count_hits:
            for node in path:
                node.hits += 1
        for node in reversed(path):
            node.last_access = clock
            if not claimed_below:
                push(leaves, (clock, node.id, node))
            claimed_below = node.state in _DEVICE_CLAIMED_T

    def push(self, node: Node) -> None:
        """``node`` may have become an unlocked L1 leaf: give the heap a current entry for it."""
        heapq.heappush(self.leaves, (node.last_access, node.id, node))

    def refresh(self, nodes: list[Node]) -> None:
        """A copy finished: its nodes (and the parent of the first) may have become L1 leaf
        candidates; give the heap a current entry for each (stale ones are skipped on pop)."""
        push = heapq.heappush
        for node in (*nodes, nodes[0].parent):
            if node is not None and not node.is_root:
                push(self.leaves, (node.last_access, node.id, node))

    def compact(self, nodes: Callable[[], Iterable[Node]]) -> None:
        """Rebuild the heap from the tree (``nodes``) when it is mostly stale entries, so that every
        pop stays short."""
        heap = self.leaves
        if len(heap) > _REBUILD_AT and len(heap) > 8 * max(self.device_nodes, 1):
            heap[:] = [(n.last_access, n.id, n) for n in nodes() if is_device_leaf(n)]
            heapq.heapify(heap)

    def pop_leaf(self) -> Node | None:
        """The least recently used current, unlocked L1 leaf (its entry removed), or ``None``."""
        heap = self.leaves
        pop = heapq.heappop
        while heap:
            access, _, node = pop(heap)
            if (
                access != node.last_access
                or node.lock_ref
                or node.state not in _DEVICE_VALID_T
                or (node.children and not is_device_leaf(node))
            ):
                continue  # stale: touched since, evicted, or not an unlocked L1 leaf now
            return node
        return None

    def reset(self) -> None:
        self.evictable_pages = self.protected_pages = self.device_nodes = 0
        self.leaves.clear()
