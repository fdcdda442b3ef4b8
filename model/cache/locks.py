"""Path locks and the evictable/protected accounting of the cache model, and the eviction order.

Invariants upheld here alone:

* ``evictable_pages`` / ``protected_pages`` count exactly the device-valid pages of unlocked / locked
  nodes (accounting): every lock that makes a node's ``lock_ref`` cross zero moves its device-valid
  pages between the two counts (:meth:`Locks.lock`), and every page that starts or stops being
  device-valid is counted where its node's lock puts it (:meth:`Locks.count_device`);
* a locked node is never a victim: eviction takes unlocked leaves only, least recently used first
  (ties broken by node id), and an L2 leaf only when no backup pins its pages or its end state;
* a *shield* (:meth:`Locks.shield`) protects a node from the eviction it triggers itself without
  counting as a lock (it is released before the step ends).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import attrs

from kvstrata.model.cache.index import Node, RadixTree
from kvstrata.model.cache.node import PageTable
from kvstrata.model.cache.states import States
from kvstrata.model.lifecycles import DEVICE_CLAIMED, DEVICE_VALID, Residency

__all__ = ["Locks"]


@attrs.define
class Locks:
    tree: RadixTree = attrs.field(repr=False)
    pages: PageTable = attrs.field(repr=False)
    states: States = attrs.field(repr=False)
    evictable_pages: int = attrs.field(init=False, default=0)
    protected_pages: int = attrs.field(init=False, default=0)

    def lock(self, node: Node, delta: int) -> None:
        """Take (+1) or release (-1) one path lock on ``node``."""
        for crossed in self.tree.add_lock(node, delta):
            device = len(crossed.pages) if self.pages.residency_of(crossed) in DEVICE_VALID else 0
            if crossed.lock_ref:  # became protected
                self.evictable_pages -= device
                self.protected_pages += device
            else:
                self.evictable_pages += device
                self.protected_pages -= device

    def count_device(self, node: Node, sign: int) -> None:
        """``node``'s pages start (+1) or stop (-1) being device-valid."""
        if node.lock_ref:
            self.protected_pages += sign * len(node.pages)
        else:
            self.evictable_pages += sign * len(node.pages)

    @contextmanager
    def shield(self, node: Node) -> Iterator[None]:
        """Keep ``node`` (and its path) out of the eviction run inside the ``with`` block."""
        self.tree.add_lock(node, +1)
        try:
            yield
        finally:
            self.tree.add_lock(node, -1)

    def device_victims(self) -> list[Node]:
        """Unlocked device-valid nodes with no device-claimed child, LRU first."""
        out = []
        for node in self.tree.non_root_nodes():
            if node.lock_ref or self.pages.residency_of(node) not in DEVICE_VALID:
                continue
            children = (self.tree.nodes[c] for c in node.children.values())
            if any(self.pages.residency_of(child) in DEVICE_CLAIMED for child in children):
                continue
            out.append(node)
        return sorted(out, key=lambda n: (n.last_access, n.node_id))

    def host_victims(self) -> list[Node]:
        """Unlocked host-only leaves whose pages and end state no backup pins, LRU first."""
        records = self.pages.records
        out = [
            node
            for node in self.tree.non_root_nodes()
            if not node.children
            and not node.lock_ref
            and self.pages.residency_of(node) is Residency.HOST
            and all(records[page].host_pins == 0 for page in node.pages)
            and not self.states.pinned(node)
        ]
        return sorted(out, key=lambda n: (n.last_access, n.node_id))
