"""The two requests on the scheduler's hot path, ``match_prefix`` and ``insert``: they walk the tree
(:mod:`.index`), touch and lock (:mod:`.locks`), hand pages to the tiers (:mod:`.tiers`) and states
(:mod:`.states`), and share the match memo (a request's ``insert`` reuses its ``match_prefix``'s walk
while the clock's version is unchanged).

Invariants: a match never reports a page that is not valid in the tier it names, and with a
``TRAILING_PAGES`` pool reports only prefixes that end where a state is valid in that tier (I6); an
insert takes every given page (kept by the tree, reviving a host-only node, or given back to the pool:
exactly once each, I5) and adds only pages that are not in the tree. The pieces are bound to locals
once per call: composition costs no attribute hop per node.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvstrata.impl.cache.clock import StepClock
from kvstrata.impl.cache.index import MatchMemo, TreeIndex, frozen
from kvstrata.impl.cache.locks import LockBook
from kvstrata.impl.cache.node import InsertResult, MatchResult, Node, Pages
from kvstrata.impl.cache.pages import EMPTY, HeldPages
from kvstrata.impl.cache.states import StateBook
from kvstrata.impl.cache.tiers import Tiers
from kvstrata.impl.config import RadixCacheConfig
from kvstrata.impl.fingerprint import FINGERPRINT_BYTES
from kvstrata.model.cache import WritePolicy
from kvstrata.model.keys import Namespace
from kvstrata.model.lifecycles import DEVICE_VALID, HOST_VALID, Residency

__all__ = ["Lookup"]

_DEVICE_VALID_T = tuple(DEVICE_VALID)
_HOST_VALID_T = tuple(HOST_VALID)


def _valid_devices(path: list[Node]) -> Pages:
    """The L1 pages of ``path``'s nodes where they hold valid KV, -1 per page elsewhere."""
    if not path:
        return EMPTY
    parts = []
    for node in path:
        if node.state in _DEVICE_VALID_T:
            assert node.device is not None
            parts.append(node.device)
        else:
            parts.append(np.full(node.num_pages, -1, dtype=np.int64))
    return np.concatenate(parts)


class Lookup:
    """See the module docstring."""

    def __init__(
        self,
        config: RadixCacheConfig,
        clock: StepClock,
        index: TreeIndex,
        locks: LockBook,
        states: StateBook,
        *,
        tiers: Tiers,
        held: HeldPages,
    ) -> None:
        self.config = config
        self.page_size = config.page_size
        self._clock = clock
        self._index = index
        self._locks = locks
        self._states = states
        self._tiers = tiers
        self._held = held
        self._finish = tiers.flush

    def match(self, query: npt.NDArray[np.uint32], namespace: Namespace) -> MatchResult:
        """``match_prefix`` of validated tokens (see the cache's docstring)."""
        index = self._index
        clock = self._clock
        clock.now += 1
        root, path, matched, fps = index.walk_split(query, namespace)
        device: list[Pages] = []
        device_node = host_node = root
        host_pages = 0
        in_device = True
        reached = len(path)
        for position, node in enumerate(path):
            state = node.state
            if in_device and state in _DEVICE_VALID_T:
                assert node.device is not None
                device.append(node.device)
                device_node = host_node = node
                continue
            in_device = False
            if state not in _HOST_VALID_T:
                reached = position + 1  # the match stops here: deeper nodes are not touched
                break
            host_pages += node.num_pages
            host_node = node
        self._locks.touch(path if reached == len(path) else path[:reached])
        state_slot = None
        states = self._states
        if states.enabled:  # cut both parts back to node ends with a usable state
            device_nodes = path[: len(device)]
            host_nodes = []
            for node in path[len(device) :]:
                if node.state not in _HOST_VALID_T:
                    break
                host_nodes.append(node)
            device_nodes, host_nodes = states.usable(device_nodes, host_nodes)
            device = [node.device for node in device_nodes]  # type: ignore[misc]
            device_node = device_nodes[-1] if device_nodes else root
            host_node = host_nodes[-1] if host_nodes else device_node
            host_pages = sum(node.num_pages for node in host_nodes)
            if device_nodes:
                state_slot = states.info[device_node].device
        indices = np.concatenate(device) if device else EMPTY
        index.memo = MatchMemo(
            fps,
            namespace,
            path,
            matched,
            indices if len(device) == len(path) else None,
            clock.version,
            query if frozen(query) else None,
        )
        if self.config.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            self._write_through_hits(path)
        self._finish()
        stats = self._tiers.stats
        stats.match_tokens += len(query)
        stats.l1_hit_tokens += len(indices) * self.page_size
        stats.l2_hit_tokens += host_pages * self.page_size
        return MatchResult(indices, device_node, host_pages, host_node, state_slot)

    def _write_through_hits(self, path: list[Node]) -> None:
        """``write_through_selective``: write through the L1-only nodes (or lone end states) of a
        matched path that reached the hit threshold."""
        states, threshold = self._states, self.config.write_through_threshold
        for node in path:
            if node.hits >= threshold and (
                node.state is Residency.DEVICE or (states.enabled and states.alone(node))
            ):
                self._tiers.write_through_chain(node)

    def insert(
        self,
        query: npt.NDArray[np.uint32],
        namespace: Namespace,
        given: Pages,
        state_slot: int | None,
        tokens: object,
    ) -> InsertResult:
        """``insert`` of validated tokens, one given page per full page and a held state slot (or
        ``None``); ``tokens`` is what the caller passed (an array converted from a list is frozen)."""
        index, tiers, states = self._index, self._tiers, self._states
        total = len(given)
        memo = index.memo
        # the same read-only tokens the match fingerprinted: they cannot have changed since
        fps = memo.fps if memo is not None and memo.tokens is query else index.fingerprint(query)
        if (
            memo is not None
            and memo.version == self._clock.version
            and memo.fps == fps
            and (memo.namespace is namespace or memo.namespace == namespace)
        ):  # the match of this request, with the tree unchanged since
            path, matched, partial, common = list(memo.path), memo.pages, None, 0
            devices = memo.devices
        else:
            path, matched, partial, common = index.descend(fps, namespace)
            devices = None
        # every given page is the scheduler's, or the tree's own valid L1 page at that position
        own = devices if devices is not None else _valid_devices(path)
        differing = self._held.claim(given, own, "device_indices")  # no longer held afterwards
        self._clock.tick()
        root = index.root(namespace, create=True)
        if partial is not None:
            path.append(index.split(partial, common))
            matched += common
        if devices is not None:  # every node holds its L1 pages: no revival, spare = the differing
            revived, spare, loading = 0, tiers.give_back(differing), False
        else:
            revived, spare, loading = tiers.adopt(path, given)
        deepest = path[-1] if path else root
        new_pages = 0 if loading else total - matched
        self._locks.touch(path, child_added=new_pages > 0)
        if new_pages:
            is_frozen = (
                (query is not tokens and query.base is None)
                or (memo is not None and memo.tokens is query)
                or frozen(query)
            )
            hashes = index.chain(query, matched, deepest, namespace, is_frozen)
            fresh = given[matched:].copy()
            deepest = tiers.add_device_leaf(
                deepest, fps[matched * FINGERPRINT_BYTES :], hashes, fresh
            )
        kept = False if state_slot is None else states.keep(deepest, state_slot, loading=loading)
        if (new_pages or kept) and self.config.write_policy is WritePolicy.WRITE_THROUGH:
            tiers.write_through_chain(deepest)
        self._finish()
        return InsertResult(deepest, new_pages, revived, spare, kept)
