"""The paged radix tree of the model: structure only (SPEC §3).

A node holds a run of whole pages: their token ids and their page hashes. Children are keyed by the
token ids of their first page, so two children of a node never start with the same page. Each namespace
has its own root; namespaces never mix. Matching inside a node *splits* it: the existing node keeps the
suffix (and its identity, its children and every handle pointing at it), a new node takes the prefix.

Locks are path locks: ``pins`` counts the locks taken on the node itself (by the scheduler or by an
in-flight operation) and ``lock_ref`` counts the locks on the node or any descendant. A split copies
``lock_ref`` to the new prefix node, so the counts stay exact.

Residency (which tier holds the bytes of a page) is *not* stored here: the cache keeps it per page hash,
so a split can never change what a pending operation covers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import attrs

from kvstrata.model.errors import InvariantViolation, MisuseError
from kvstrata.model.keys import Namespace, PageHash, chain_page_hashes

__all__ = ["Node", "RadixTree", "Walk"]


@attrs.define(eq=False)
class Node:
    node_id: int
    parent_id: int | None
    namespace: Namespace
    tokens: tuple[int, ...]
    pages: tuple[PageHash, ...]
    children: dict[tuple[int, ...], int] = attrs.field(factory=dict)
    pins: int = 0
    lock_ref: int = 0
    last_access: int = 0
    hits: int = 0

    @property
    def is_root(self) -> bool:
        return self.parent_id is None

    @property
    def last_page(self) -> PageHash | None:
        return self.pages[-1] if self.pages else None


@attrs.frozen
class Walk:
    """The nodes a token sequence runs through, root excluded, and how many pages matched."""

    root: Node
    path: tuple[Node, ...]
    matched_pages: int

    @property
    def last(self) -> Node:
        return self.path[-1] if self.path else self.root


@attrs.define
class RadixTree:
    page_size: int
    nodes: dict[int, Node] = attrs.field(factory=dict)
    roots: dict[Namespace, int] = attrs.field(factory=dict)
    _next_id: int = 0

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def root(self, namespace: Namespace) -> Node:
        """The root of ``namespace`` (created on first use; it holds no pages)."""
        node_id = self.roots.get(namespace)
        if node_id is None:
            node_id = self._new_id()
            self.nodes[node_id] = Node(node_id, None, namespace, (), ())
            self.roots[namespace] = node_id
        return self.nodes[node_id]

    def _peek_root(self, namespace: Namespace) -> Node:
        """The root of ``namespace`` if it exists, else a detached empty root (id 0) that is not
        added to the tree: a read-only walk never changes the tree."""
        node_id = self.roots.get(namespace)
        return self.nodes[node_id] if node_id is not None else Node(0, None, namespace, (), ())

    def node(self, node_id: int) -> Node:
        try:
            return self.nodes[node_id]
        except KeyError:
            raise MisuseError(f"no node {node_id} in the tree") from None

    def parent(self, node: Node) -> Node | None:
        return None if node.parent_id is None else self.nodes[node.parent_id]

    def page_tokens(self, tokens: Sequence[int], index: int) -> tuple[int, ...]:
        size = self.page_size
        return tuple(tokens[index * size : (index + 1) * size])

    def walk(self, tokens: Sequence[int], namespace: Namespace, *, split: bool) -> Walk:
        """Follow ``tokens`` (whole pages only) from the root. With ``split`` a match that ends inside a
        node splits it so that the walk ends exactly on a node boundary; without it the partly matched
        node is left out of the path (and its matched pages are not counted)."""
        root = self.root(namespace) if split else self._peek_root(namespace)
        total = len(tokens) // self.page_size
        node = root
        path: list[Node] = []
        matched = 0
        while matched < total:
            child_id = node.children.get(self.page_tokens(tokens, matched))
            if child_id is None:
                break
            child = self.nodes[child_id]
            common = 0
            child_pages = len(child.pages)
            while (
                common < child_pages
                and matched + common < total
                and self.page_tokens(child.tokens, common)
                == self.page_tokens(tokens, matched + common)
            ):
                common += 1
            if common < child_pages:
                if not split:
                    break
                child = self.split(child, common)
            path.append(child)
            matched += common
            node = child
            if common < child_pages:
                break
        return Walk(root, tuple(path), matched)

    def split(self, node: Node, pages: int) -> Node:
        """Split ``node`` after ``pages`` pages; returns the new prefix node (``node`` keeps the
        suffix, its id, its children and its pins)."""
        if not 0 < pages < len(node.pages):
            raise InvariantViolation("tree", f"split of node {node.node_id} at {pages}")
        parent = self.nodes[node.parent_id] if node.parent_id is not None else None
        assert parent is not None
        cut = pages * self.page_size
        prefix = Node(
            node_id=self._new_id(),
            parent_id=parent.node_id,
            namespace=node.namespace,
            tokens=node.tokens[:cut],
            pages=node.pages[:pages],
            lock_ref=node.lock_ref,
            last_access=node.last_access,
            hits=node.hits,
        )
        self.nodes[prefix.node_id] = prefix
        parent.children[self.page_tokens(prefix.tokens, 0)] = prefix.node_id
        node.tokens = node.tokens[cut:]
        node.pages = node.pages[pages:]
        node.parent_id = prefix.node_id
        prefix.children[self.page_tokens(node.tokens, 0)] = node.node_id
        return prefix

    def add_leaf(
        self, parent: Node, tokens: tuple[int, ...], pages: tuple[PageHash, ...], now: int
    ) -> Node:
        key = self.page_tokens(tokens, 0)
        if not pages or key in parent.children:
            raise InvariantViolation("tree", f"bad leaf under node {parent.node_id}")
        leaf = Node(
            node_id=self._new_id(),
            parent_id=parent.node_id,
            namespace=parent.namespace,
            tokens=tokens,
            pages=pages,
            last_access=now,
            lock_ref=0,
        )
        self.nodes[leaf.node_id] = leaf
        parent.children[key] = leaf.node_id
        return leaf

    def remove_leaf(self, node: Node) -> None:
        if node.children or node.is_root or node.lock_ref:
            raise InvariantViolation("tree", f"node {node.node_id} is not a removable leaf")
        parent = self.nodes[node.parent_id] if node.parent_id is not None else None
        assert parent is not None
        del parent.children[self.page_tokens(node.tokens, 0)]
        del self.nodes[node.node_id]

    def ancestors(self, node: Node) -> Iterator[Node]:
        """``node`` and every ancestor up to, not including, the root."""
        current: Node | None = node
        while current is not None and not current.is_root:
            yield current
            current = self.parent(current)

    def add_lock(self, node: Node, delta: int) -> list[Node]:
        """Take (+1) or release (-1) one path lock on ``node``; returns the nodes whose ``lock_ref``
        crossed zero (so that the cache can move them between evictable and protected)."""
        crossed: list[Node] = []
        node.pins += delta
        for current in self.ancestors(node):
            before = current.lock_ref
            current.lock_ref += delta
            if (before == 0) != (current.lock_ref == 0):
                crossed.append(current)
        return crossed

    def prefix_tokens(self, node: Node) -> tuple[int, ...]:
        """Every token from the root to the end of ``node``."""
        parts = [current.tokens for current in self.ancestors(node)]
        return tuple(token for part in reversed(parts) for token in part)

    def expected_pages(self, node: Node) -> tuple[PageHash, ...]:
        """The page hashes ``node`` must hold, recomputed from scratch (I8)."""
        parent = self.parent(node)
        previous = parent.last_page if parent is not None else None
        return chain_page_hashes(node.tokens, self.page_size, node.namespace, previous)

    def non_root_nodes(self) -> Iterator[Node]:
        return (node for node in self.nodes.values() if not node.is_root)
