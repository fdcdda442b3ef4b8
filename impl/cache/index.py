"""The tree's shape: one root per namespace, nodes found by page fingerprints, splits, leaves added and
removed, page-hash chains, and the match memo (SPEC §3).

Owned here: the roots, the fingerprinter, the page hasher and the memo. Nothing here changes a page's
residency (that is :mod:`kvstrata.impl.cache.tiers`) or a lock count (:mod:`.locks`).

* A node holds no token ids: its pages' 16-byte keyed NH fingerprints (``fps``; the first one is its
  key among its parent's children) and, with page hashes on, their SHA-256 chain digests (pending
  while the hashing thread works; a split splits the view, never the job).
* A split keeps the node object on the suffix (its id, children, pins, pending ops, node end and end
  state) and puts a new node in front with the first pages; every pending copy op covering the node
  gets the prefix in its node list, so an ack reaches every page it covered (I4), and the L3 backup
  ops are told (``on_split``) so their page references and pins follow.
* ``clock.version`` changes with every change of shape: a memo (what ``match_prefix`` found, reused
  by the ``insert`` of the same request) is valid only while it is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from kvstrata.impl.cache.clock import StepClock
from kvstrata.impl.cache.locks import LockBook
from kvstrata.impl.cache.node import Node, Pages
from kvstrata.impl.errors import MisuseError
from kvstrata.impl.fingerprint import FINGERPRINT_BYTES, Fingerprinter, common_pages
from kvstrata.impl.hashing import Digests, PageHasher, split_digests
from kvstrata.model.keys import DEFAULT_NAMESPACE, Namespace, PageHash
from kvstrata.model.lifecycles import DEVICE_VALID, HOST_VALID, Residency

__all__ = ["MatchMemo", "TreeIndex", "as_tokens", "frozen"]

_MAX_TOKEN = 2**32 - 1
_DEVICE_VALID_T = tuple(DEVICE_VALID)
_HOST_VALID_T = tuple(HOST_VALID)
_UINT32 = np.dtype("<u4")


def frozen(array: npt.NDArray[Any]) -> bool:
    """Whether nobody can write to ``array``'s memory: it and every array it views are read-only,
    down to an immutable ``bytes`` or a read-only array that owns its data. (A read-only view of a
    writable array is not frozen: its base can still change.)"""
    current: object = array
    while isinstance(current, np.ndarray):
        if current.flags.writeable:
            return False
        base = current.base
        if base is None:
            return True
        current = base
    return type(current) is bytes


def as_tokens(tokens: object) -> npt.NDArray[np.uint32]:
    """``tokens`` as a 1-D uint32 array; :class:`MisuseError` for anything else."""
    if (
        type(tokens) is np.ndarray
        and tokens.dtype == _UINT32
        and tokens.ndim == 1
        and tokens.flags.c_contiguous
    ):
        return tokens  # the common case, checked by type alone
    if isinstance(tokens, str | bytes):
        raise MisuseError(f"tokens must be a 1-D sequence of ints, got {type(tokens).__name__}")
    try:
        array = np.asarray(tokens)
    except (TypeError, ValueError) as exc:
        raise MisuseError(f"tokens must be a 1-D sequence of ints: {exc}") from exc
    if array.ndim != 1:
        raise MisuseError(f"tokens must be 1-D, got shape {array.shape}")
    if array.size == 0:
        return np.zeros(0, dtype=np.uint32)
    if array.dtype.kind not in "iu":
        raise MisuseError(f"token ids must be integers, got dtype {array.dtype}")
    if array.dtype.itemsize <= 4 and array.dtype.kind == "u":
        return np.ascontiguousarray(array, dtype="<u4")  # in range by type: no scan
    if int(array.min()) < 0 or int(array.max()) > _MAX_TOKEN:
        raise MisuseError(f"token ids must be in [0, {_MAX_TOKEN}]")
    return np.ascontiguousarray(array, dtype="<u4")


@attrs.define(slots=True, eq=False)
class MatchMemo:
    """What ``match_prefix`` found, for the ``insert`` of the same request: valid while the clock's
    ``version`` is unchanged (no node added, removed, split or moved between residencies)."""

    fps: bytes
    namespace: Namespace
    path: list[Node]  # ends on a node boundary (the match split the node it ended inside)
    pages: int
    devices: Pages | None  # the path's L1 pages if every node of it holds valid L1 pages
    version: int
    tokens: npt.NDArray[np.uint32] | None  # the matched tokens, if frozen (see frozen)


class TreeIndex:
    """See the module docstring."""

    def __init__(
        self,
        clock: StepClock,
        locks: LockBook,
        fingerprint: Fingerprinter,
        hasher: PageHasher,
        *,
        page_size: int,
        hashing: bool,
    ) -> None:
        self._clock = clock
        self._locks = locks
        self.fingerprint = fingerprint
        self.hasher = hasher
        self.page_size = page_size
        self.hashing = hashing
        self.roots: dict[Namespace, Node] = {}
        self.memo: MatchMemo | None = None
        self.on_split: Callable[[Node, Node], None] | None = None  # L3 backups follow splits

    @staticmethod
    def namespace_of(extra_key: str | Namespace | None) -> Namespace:
        if extra_key is None:
            return DEFAULT_NAMESPACE
        if isinstance(extra_key, Namespace):
            return extra_key
        if not isinstance(extra_key, str):
            raise MisuseError(f"extra_key must be a str or None, got {type(extra_key).__name__}")
        return Namespace(extra_key=extra_key)

    def root(self, namespace: Namespace, create: bool) -> Node:
        root = self.roots.get(namespace)
        if root is None:
            if not create:
                return Node(0, None, namespace, fps=b"", hashes=b"", state=None)
            root = Node(self._clock.new_id(), None, namespace, fps=b"", hashes=b"", state=None)
            self.roots[namespace] = root
        return root

    def descend(self, fps: bytes, namespace: Namespace) -> tuple[list[Node], int, Node | None, int]:
        """Follow the page fingerprints ``fps`` down from the namespace's root, changing nothing.
        Returns the fully matched path (root excluded), its pages, and the node the match ends inside
        with its matching leading pages (``None, 0`` when the match ends on a node boundary)."""
        path: list[Node] = []
        node = self.roots.get(namespace)
        if node is None:
            return path, 0, None, 0
        step = FINGERPRINT_BYTES
        start, end = 0, len(fps)
        while start < end:
            child = node.children.get(fps[start : start + step])
            if child is None:
                break
            stored = child.fps
            if not fps.startswith(stored, start):
                return path, start // step, child, common_pages(stored, fps, start)
            path.append(child)
            start += len(stored)
            node = child
        return path, start // step, None, 0

    def split(self, node: Node, pages: int) -> Node:
        """``node`` keeps the suffix (and its id, children, pins, pending ops); a new node takes the
        first ``pages`` pages and joins every pending op that covers ``node``."""
        parent = node.parent
        assert parent is not None and 0 < pages < node.num_pages
        self._clock.version += 1
        cut = pages * FINGERPRINT_BYTES
        prefix = Node(
            self._clock.new_id(),
            parent,
            node.namespace,
            fps=node.fps[:cut],
            hashes=b"",
            state=node.state,
        )
        prefix.digests, node.digests = split_digests(node.digests, pages)
        prefix.lock_ref = node.lock_ref
        prefix.last_access = node.last_access
        prefix.hits = node.hits
        if node.device is not None:
            prefix.device, node.device = node.device[:pages], node.device[pages:]
            self._locks.device_nodes += 1
        if node.host is not None:
            prefix.host, node.host = node.host[:pages], node.host[pages:]
        for op in (node.write_op, node.load_op):
            if op is not None:
                op.nodes.insert(op.nodes.index(node), prefix)
        prefix.write_op, prefix.load_op = node.write_op, node.load_op
        if node.backup_pins and self.on_split is not None:  # sets the prefix's pins
            self.on_split(node, prefix)
        parent.children[prefix.fps[:FINGERPRINT_BYTES]] = prefix
        node.fps = node.fps[cut:]
        node.parent = prefix
        prefix.children[node.fps[:FINGERPRINT_BYTES]] = node
        return prefix

    def add_leaf(self, parent: Node, fps: bytes, hashes: Digests) -> Node:
        """A new ``NEW`` leaf under ``parent`` (its residency is advanced by the caller, in tiers)."""
        self._clock.version += 1
        leaf = Node(
            self._clock.new_id(),
            parent,
            parent.namespace,
            fps=fps,
            hashes=hashes,
            state=Residency.NEW,
        )
        leaf.last_access = self._clock.now
        parent.children[fps[:FINGERPRINT_BYTES]] = leaf
        return leaf

    def remove_leaf(self, node: Node) -> None:
        """Detach a leaf whose residency already went to ``GONE``."""
        assert node.parent is not None and not node.children and not node.lock_ref
        assert node.state is Residency.GONE
        self._clock.version += 1
        del node.parent.children[node.fps[:FINGERPRINT_BYTES]]
        node.parent = None

    def chain(
        self,
        query: npt.NDArray[np.uint32],
        first: int,
        parent: Node,
        namespace: Namespace,
        is_frozen: bool,
    ) -> Digests:
        """The SHA-256 digests of the whole pages of ``query`` from page ``first`` on, chained from
        ``parent``'s last page (or the namespace seed), as the hasher returns them (pending while a
        worker hashes); empty when page hashes are off. ``is_frozen``: nobody writes to ``query``
        again (:func:`frozen`), so a worker may read it in place."""
        if not self.hashing:
            return b""
        pages = len(query) // self.page_size
        new = query[first * self.page_size : pages * self.page_size]
        digests = parent.digests
        seed: Digests  # bytes: the seed itself; a pending view: seeded from its last page
        if not digests:
            seed = namespace.seed()
        elif type(digests) is bytes:
            seed = digests[-32:]
        else:
            seed = digests
        return self.hasher.submit(seed, new, pages - first, frozen=is_frozen)

    def nodes(self) -> Iterator[Node]:
        """Every non-root node, parents before children."""
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            if not node.is_root:
                yield node
            stack.extend(node.children.values())

    @staticmethod
    def ancestors(node: Node) -> Iterator[Node]:
        current: Node | None = node
        while current is not None and not current.is_root:
            yield current
            current = current.parent

    def walk_split(
        self, query: npt.NDArray[np.uint32], namespace: Namespace
    ) -> tuple[Node, list[Node], int, bytes]:
        """Follow ``query`` from its namespace's root (created if needed), splitting the node the
        match ends inside: the root, the matched path, its pages and the query's fingerprints."""
        fps = self.fingerprint(query)
        root = self.root(namespace, create=True)
        path, matched, partial, common = self.descend(fps, namespace)
        if partial is not None:
            path.append(self.split(partial, common))
            matched += common
        return root, path, matched, fps

    def cached_path(
        self,
        tokens: Sequence[int] | npt.NDArray[np.integer],
        extra_key: str | Namespace | None,
    ) -> list[Node]:
        """The nodes fully covered by ``tokens`` (no split, no LRU touch)."""
        query = as_tokens(tokens)
        path, _, _, _ = self.descend(self.fingerprint(query), self.namespace_of(extra_key))
        return path

    def residency(
        self, tokens: Sequence[int] | npt.NDArray[np.integer], extra_key: str | Namespace | None
    ) -> tuple[Residency, ...]:
        """Residency of each full page of ``tokens`` in the tree (no split, no LRU touch)."""
        out: list[Residency] = []
        for node in self.cached_path(tokens, extra_key):
            assert node.state is not None
            out.extend([node.state] * node.num_pages)
        return tuple(out)

    def page_hashes(
        self, tokens: Sequence[int] | npt.NDArray[np.integer], extra_key: str | Namespace | None
    ) -> tuple[PageHash, ...]:
        """The page hashes held for the cached pages of ``tokens``; :class:`MisuseError` when
        page hashes are off."""
        if not self.hashing:
            raise MisuseError(
                "page hashes are off for this cache (RadixCacheConfig.page_hashes=False)"
            )
        path = self.cached_path(tokens, extra_key)
        return tuple(node.page_hash(i) for node in path for i in range(node.num_pages))

    def cached_pages(self) -> dict[str, int]:
        """Pages per tier held by the tree."""
        device = host = 0
        for node in self.nodes():
            device += node.num_pages if node.state in _DEVICE_VALID_T else 0
            host += node.num_pages if node.state in _HOST_VALID_T else 0
        return {"device": device, "host": host}

    def reset(self) -> None:
        self.roots.clear()
        self.memo = None
        self.fingerprint.forget()
