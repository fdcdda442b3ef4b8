"""The cache's side of the L3 port (:class:`kvstrata.impl.l3.port.TreePort`): the only way the L3
tier reaches the tree. Each call delegates to the piece that owns the data; residency still moves
only in :mod:`.tiers` and states only in :mod:`.states`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from kvstrata.impl.cache.clock import StepClock
from kvstrata.impl.cache.index import TreeIndex
from kvstrata.impl.cache.locks import LockBook
from kvstrata.impl.cache.node import Node, Pages, StateInfo
from kvstrata.impl.cache.states import StateBook
from kvstrata.impl.cache.tiers import Tiers
from kvstrata.impl.fingerprint import FINGERPRINT_BYTES
from kvstrata.impl.hashing import digests_tail, resolve
from kvstrata.impl.kernels import sha256_chain
from kvstrata.model.keys import Namespace
from kvstrata.model.lifecycles import HOST_CLAIMED, HOST_VALID

__all__ = ["CachePort"]

_HOST_CLAIMED_T = tuple(HOST_CLAIMED)
_HOST_VALID_T = tuple(HOST_VALID)
_DIGEST = 32


class CachePort:
    """See the module docstring."""

    def __init__(
        self, clock: StepClock, index: TreeIndex, locks: LockBook, states: StateBook, tiers: Tiers
    ) -> None:
        self._clock = clock
        self._index = index
        self._locks = locks
        self._states = states
        self._tiers = tiers
        self.page_size = index.page_size

    @property
    def has_states(self) -> bool:
        return self._states.enabled

    @property
    def host_capacity(self) -> int:
        host = self._tiers.host
        return 0 if host is None else host.num_pages

    def new_op(self) -> int:
        return self._clock.new_op()

    def lock(self, node: Node, delta: int) -> None:
        self._locks.lock(node, delta)

    def continuation(
        self, query: npt.NDArray[np.uint32], namespace: Namespace
    ) -> tuple[Node, int] | None:
        """Where a prefetch of ``query`` would attach: the node its local match ends at (the node
        it ends inside is split) and the pages matched; ``None`` unless that node is a root or
        host-claimed (I3: L3 pages join after host-backed nodes only)."""
        root, path, matched, _ = self._index.walk_split(query, namespace)
        anchor = path[-1] if path else root
        if not (anchor.is_root or anchor.state in _HOST_CLAIMED_T):
            return None
        return anchor, matched

    def chain_after(
        self, anchor: Node, query: npt.NDArray[np.uint32], matched: int, namespace: Namespace
    ) -> Callable[[], bytes]:
        """A function (run by the store worker) hashing the chain of the whole pages of ``query``
        after its first ``matched``, seeded from ``anchor``'s last page (or the namespace)."""
        size = self.page_size
        rest = query[matched * size : len(query) // size * size].tobytes()
        seed = digests_tail(anchor.digests) if anchor.digests else namespace.seed()
        page_bytes = 4 * size
        return lambda: sha256_chain(resolve(seed), rest, page_bytes)

    def reserve_host(self, pages: int, *, state: bool) -> tuple[Pages, int | None] | None:
        """The model's rule: pages first, then room for one L2 state slot (the anchor locked by the
        caller); nothing is allocated unless both fit."""
        tiers = self._tiers
        host = tiers.host
        assert host is not None
        if pages > host.free_count:
            tiers.evict_host(pages - host.free_count)
        if pages > host.free_count or (state and not self._states.make_room(host=True)):
            return None
        reserved = np.asarray(host.alloc(pages), dtype=np.int64)
        return reserved, self._states.alloc(host=True) if state else None

    def free_host(self, pages: Pages) -> None:
        if len(pages):
            host = self._tiers.host
            assert host is not None
            host.free(pages)

    def free_host_state(self, slot: int) -> None:
        self._states.free(slot, host=True)

    def host_state(self, node: Node) -> StateInfo:
        info = self._states.info[node]
        assert info.host is not None and node.last_hash is not None
        return info

    def commit_pages(
        self,
        tokens: npt.NDArray[np.uint32],
        namespace: Namespace,
        prefix_pages: int,
        host: Pages,
        digests: bytes,
    ) -> tuple[int, Node | None]:
        """The model's ``_commit_pages``: pages the tree already has give their slot back; the rest
        become one host-only leaf if its parent's L2 copy is readable or it is a root (I3), else
        are given back. Nothing arrived: the tree is not touched (no split where the prefix ends)."""
        arrived = len(host)
        if not arrived:
            return 0, None
        root, path, matched, fps = self._index.walk_split(tokens, namespace)
        last = path[-1] if path else root
        have = max(0, min(arrived, matched - prefix_pages))
        spare = [host[:have]]
        added = 0
        end: Node | None = last if arrived and have == arrived and not last.is_root else None
        if have < arrived and (last.is_root or last.state in _HOST_VALID_T):
            start = prefix_pages + have
            end = self._tiers.commit_host_pages(
                last,
                fps[start * FINGERPRINT_BYTES :],
                digests[have * _DIGEST : arrived * _DIGEST],
                host[have:arrived].copy(),
            )
            added = arrived - have
        else:
            spare.append(host[have:arrived])
        self.free_host(np.concatenate(spare))
        return added, end

    def host_nodes(self) -> list[Node]:
        return [
            node
            for node in self._index.nodes()
            if node.state in HOST_VALID
            and node.host is not None
            and len(node.hashes) == node.num_pages * _DIGEST
        ]

    def commit_state(self, end: Node | None, slot: int) -> None:
        self._states.commit_prefetched(end, slot)
