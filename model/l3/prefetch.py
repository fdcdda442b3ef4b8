"""Prefetch (L3 -> L2) of the cache model: its values, wait policies and ops (SPEC §3).

A prefetch op reserves host slots for exactly the pages the store reported as present (at most half
of L2 over all ops), receives them in order, and is then committed (arrived pages become host-only
nodes) or aborted. Slots that a read may still be writing are never freed before the I/O side confirms
(:attr:`PrefetchState.CANCELLING` until ``drain``): freeing them earlier is a stale-offset bug (I5/I7).

With a ``TRAILING_PAGES`` side pool (a Mamba state) the op also reserves one L2 *state* slot. The state
is read only after the KV range is known (every reserved page arrived, or the store lost one): it is the
state of the last page that arrived, or, if that one is gone from the store, of the deepest arrived page
whose state is still there (the arrived pages after it are dropped: a prefix is usable only up to a
state, I6). The state slot follows the same rule as the page slots: held until commit takes it, or until
the op is ``DONE``.

Invariants upheld here alone: an op's reservation is the usable L3 prefix at the time it starts
(checked with ``check_usable``); an op holds a lock on the node it anchors to while ``LOADING`` or
``COMPLETE``; committed pages are added only under a node with a host copy (I3); a finished op is
forgotten with every slot it still held.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import attrs

from kvstrata.model.errors import MisuseError
from kvstrata.model.hybrid import HitPolicy, check_usable, state_content, usable_prefix
from kvstrata.model.keys import Namespace, PageHash, chain_page_hashes
from kvstrata.model.l3.objects import l3_hit, page_objects, state_objects
from kvstrata.model.l3.policy import PrefetchPolicy, PrefetchTimeout, wait_over
from kvstrata.model.lifecycles import PREFETCH_OP, PrefetchEvent, PrefetchState
from kvstrata.model.store import StoreModel

if TYPE_CHECKING:
    from kvstrata.model.cache.clock import Clock
    from kvstrata.model.cache.config import CacheConfig
    from kvstrata.model.cache.index import Node, RadixTree
    from kvstrata.model.cache.locks import Locks
    from kvstrata.model.cache.states import States
    from kvstrata.model.cache.tiers import Tiers

__all__ = ["Prefetch", "PrefetchOp", "PrefetchPolicy", "PrefetchTimeout", "wait_over"]


@attrs.define
class PrefetchOp:
    """One L3 -> L2 read. ``host_slots[i]`` receives page ``i``; pages ``< arrived`` are complete;
    pages ``>= limit`` will never arrive (the store lost one of them)."""

    op_id: int
    namespace: Namespace
    anchor_id: int
    prefix_tokens: tuple[int, ...]
    page_tokens: tuple[tuple[int, ...], ...]
    pages: tuple[PageHash, ...]
    host_slots: tuple[int, ...]
    started: int
    state: PrefetchState = PrefetchState.LOADING
    arrived: int = 0
    limit: int = attrs.field()
    released: int = 0  # slots [released:] are still held by the op
    state_slot: int | None = None  # the L2 state slot reserved for the trailing state, if any
    state_page: PageHash | None = None  # set once the state of that page was read into state_slot
    state_released: bool = False  # the state slot was taken by commit or freed

    @limit.default
    def _limit_default(self) -> int:
        return len(self.pages)

    @property
    def held_slots(self) -> tuple[int, ...]:
        return self.host_slots[self.released :]

    @property
    def held_state_slot(self) -> int | None:
        """The L2 state slot the op still holds (``None`` if it has none or gave it up)."""
        return None if self.state_released else self.state_slot


@attrs.define
class Prefetch:
    """The prefetch ops in flight, by op id."""

    config: CacheConfig
    store: StoreModel = attrs.field(repr=False)
    tree: RadixTree = attrs.field(repr=False)
    clock: Clock = attrs.field(repr=False)
    tiers: Tiers = attrs.field(repr=False)
    states: States = attrs.field(repr=False)
    locks: Locks = attrs.field(repr=False)
    ops: dict[int, PrefetchOp] = attrs.field(init=False, factory=dict)

    def reserved(self) -> int:
        return sum(len(op.held_slots) for op in self.ops.values())

    def anchor_pins(self, node: Node) -> int:
        """Locks held on ``node`` by prefetch ops (``LOADING`` or ``COMPLETE``) anchored there."""
        return sum(
            1
            for op in self.ops.values()
            if op.anchor_id == node.node_id
            and op.state in (PrefetchState.LOADING, PrefetchState.COMPLETE)
        )

    def op(self, op_id: int, event: PrefetchEvent | None = None) -> PrefetchOp:
        """Op ``op_id`` (``MisuseError`` if none; ``IllegalTransition`` if it cannot take
        ``event``)."""
        op = self.ops.get(op_id)
        if op is None:
            raise MisuseError(f"no prefetch op {op_id}")
        if event is not None:
            PREFETCH_OP.next(op.state, event)
        return op

    def open_op(self, op_id: int, event: PrefetchEvent | None = None) -> PrefetchOp:
        """Op ``op_id`` as the scheduler names it: :meth:`op`, and ``MisuseError`` for an op it
        already committed or aborted (``CANCELLING``: only the drain still names it)."""
        op = self.op(op_id)
        if op.state is PrefetchState.CANCELLING:
            raise MisuseError(f"no prefetch op {op_id}: already committed or aborted")
        return self.op(op_id, event)

    def local_hit(self, tokens: tuple[int, ...], namespace: Namespace) -> int:
        """Pages this store serves after the local match of ``tokens`` (a pure query: what one TP
        rank reports before the ranks agree on the minimum, ``kvstrata.model.tp``)."""
        if not self.config.has_l3:
            return 0
        size = self.config.page_size
        whole = tokens[: len(tokens) // size * size]
        pages = chain_page_hashes(whole, size, namespace, None)
        matched = 0
        while matched < len(pages) and pages[matched] in self.tiers.pages.records:
            matched += 1
        return l3_hit(self.config, self.store, namespace, pages[matched:])

    def start(
        self, tokens: tuple[int, ...], namespace: Namespace, limit: int | None = None
    ) -> PrefetchOp | None:
        """Reserve L2 room for what L3 holds after the local match of ``tokens``, at most ``limit``
        pages (TP: the ranks' agreed minimum); None when nothing is worth fetching or there is no
        room (rate limit, half of L2)."""
        if not self.config.has_l3:
            return None
        walk = self.tree.walk(tokens, namespace, split=True)
        anchor = walk.last
        if not self.tiers.host_claimed_or_root(anchor):
            return None
        size = self.config.page_size
        start = walk.matched_pages
        rest = tokens[start * size :]
        remaining = len(rest) // size
        if remaining == 0 or remaining * size < self.config.prefetch_threshold:
            return None
        pages = chain_page_hashes(rest, size, namespace, anchor.last_page)
        hit = l3_hit(self.config, self.store, namespace, pages)
        hit = hit if limit is None else min(hit, limit)
        if hit == 0 or self.reserved() + hit > self.config.host_pages // 2:
            return None
        if self.config.check and self.config.side_pools:
            assert self.config.keys is not None
            check_usable(
                self.store, self.config.keys, namespace, pages, self.config.side_pools, prefix=hit
            )
        if not self._make_room(anchor, hit):
            return None
        slots = self.tiers.host.alloc(hit)
        state_slot = self.states.host.alloc(1)[0] if self.states.enabled else None
        if not anchor.is_root:
            self.locks.lock(anchor, +1)
        op = PrefetchOp(
            op_id=self.clock.op_id(),
            namespace=namespace,
            anchor_id=anchor.node_id,
            prefix_tokens=tokens[: start * size],
            page_tokens=tuple(self.tree.page_tokens(rest, i) for i in range(hit)),
            pages=pages[:hit],
            host_slots=slots,
            started=self.clock.now,
            state_slot=state_slot,
        )
        self.ops[op.op_id] = op
        return op

    def _make_room(self, anchor: Node, hit: int) -> bool:
        """``hit`` free L2 pages (and one L2 state slot with states), evicting L2 as needed."""
        host = self.tiers.host
        if hit > host.free_count:
            with self.locks.shield(anchor):
                self.tiers.evict_host(hit - host.free_count)
        if hit > host.free_count:
            return False
        if self.states.enabled:
            with self.locks.shield(anchor):
                return self.states.free_slot(host=True)
        return True

    def arrive(self, op: PrefetchOp, pages: int) -> int:
        """Up to ``pages`` more pages of ``op`` are read from the store, in order; a page whose
        objects are not all in the store any more ends the op there. Each page's read covers its
        KV and every ``ALL_PAGES`` side object (one batch). With a ``TRAILING_PAGES`` pool, once
        the KV range is known the state is read (:meth:`_read_state`): that of the last arrived
        page, or of the deepest arrived page whose state is still in the store (the pages after it
        are dropped: usable only up to a state, I6)."""
        read = self.read(op)[:pages]
        self._deliver(op, read)
        if len(read) < pages:
            op.limit = op.arrived
        if op.arrived >= op.limit:
            self._complete(op)
        return op.arrived

    def read(self, op: PrefetchOp) -> tuple[Hashable, ...]:
        """What one read of ``op`` gets from this store now (pure): the KV content of each page
        after the arrived ones, in order, up to the first page whose objects (KV and every
        ``ALL_PAGES`` side object) are not all in the store, or ``op``'s limit."""
        contents: list[Hashable] = []
        for index in range(op.arrived, op.limit):
            objects = [
                self.store.get(key)
                for _component, key in page_objects(self.config, op.namespace, op.pages[index])
            ]
            if any(item is None for item in objects):
                break
            first = objects[0]
            assert isinstance(first, tuple)
            contents.append(first[0])
        return tuple(contents)

    def finish(self, op: PrefetchOp, pages: int, delivered: Sequence[Hashable]) -> int:
        """``op``'s read ends with ``pages`` more pages (TP: the ranks' agreed minimum), taken
        from ``delivered``: what this rank's own read got when it ran (:meth:`read`; its store
        may have lost a page since, but the bytes read are in the host slots already). The rest
        is a miss. The state (side pools) is still read from the store now: the TP model runs no
        side pools, whose state read the implementation agrees on with ``READ_MAX``."""
        if pages > len(delivered):
            raise MisuseError(f"{pages} pages agreed, this rank's read delivered {len(delivered)}")
        self._deliver(op, delivered[:pages])
        op.limit = op.arrived
        self._complete(op)
        return op.arrived

    def _deliver(self, op: PrefetchOp, contents: Sequence[Hashable]) -> None:
        for content in contents:
            self.tiers.host.write(op.host_slots[op.arrived], content)
            op.arrived += 1

    def _complete(self, op: PrefetchOp) -> None:
        if op.state_slot is not None:
            self._read_state(op)
        op.state = PREFETCH_OP.next(op.state, PrefetchEvent.COMPLETE)

    def _read_state(self, op: PrefetchOp) -> None:
        """The KV range of ``op`` is known: read the state of its deepest arrived page that has
        one in the store into the op's state slot, and drop the arrived pages after it."""
        assert op.state_slot is not None

        def probe(index: int) -> bool:
            objects = state_objects(self.config, op.namespace, op.pages[index])
            return all(self.store.contains(key) for _component, key in objects)

        usable = usable_prefix(op.arrived, [(HitPolicy.TRAILING_PAGES, probe)])
        op.arrived = op.limit = usable
        if usable:
            page = op.pages[usable - 1]
            objects = state_objects(self.config, op.namespace, page)
            contents = [self.store.get(key) for _component, key in objects]
            first = contents[0]
            assert isinstance(first, tuple) and None not in contents
            self.states.host.write(op.state_slot, state_content(first[0]))
            op.state_page = page

    def ready(self, op_id: int) -> bool:
        """Whether the scheduler stops waiting for ``op_id`` now, under the configured policy."""
        op = self.open_op(op_id)
        return wait_over(
            self.config.prefetch_policy,
            loading=op.state is PrefetchState.LOADING,
            waited=self.clock.now - op.started,
            limit=self.config.prefetch_timeout.limit(len(op.pages) * self.config.page_size),
            deadline=self.config.prefetch_timeout.deadline,
        )

    def commit(self, op: PrefetchOp) -> int:
        """Insert the pages that arrived as host-only nodes; returns how many were added."""
        state = PREFETCH_OP.next(op.state, PrefetchEvent.COMMIT)
        self._unlock_anchor(op)
        added = self._commit_pages(op)
        if op.state_page is not None and not op.state_released:
            assert op.state_slot is not None
            self.states.commit_prefetched(op.state_page, op.state_slot)
            op.state_released = True
        op.released = op.arrived
        op.state = state
        self._settle(op)
        return added

    def _commit_pages(self, op: PrefetchOp) -> int:
        """Attach the arrived pages under the node the prefix ends at. Pages that are already in the
        tree give their slot back; the rest become one host-only leaf if its parent's L2 copy is
        readable (I3; a parent whose write-through is still in flight may yet fail), else they are
        given back too. Nothing arrived: the tree is not touched (no split
        where the prefix ends: a commit that adds nothing changes nothing)."""
        size = self.config.page_size
        arrived = op.arrived
        if not arrived:
            return 0
        tokens = op.prefix_tokens + tuple(t for page in op.page_tokens[:arrived] for t in page)
        walk = self.tree.walk(tokens, op.namespace, split=True)
        have = min(arrived, walk.matched_pages - len(op.prefix_tokens) // size)
        spare = list(op.host_slots[:have])
        added = 0
        if have < arrived and self.tiers.host_valid_or_root(walk.last):
            pages = op.pages[have:arrived]
            leaf_tokens = tokens[len(op.prefix_tokens) + have * size :]
            self.tiers.add_host_leaf(walk.last, leaf_tokens, pages, op.host_slots[have:arrived])
            added = len(pages)
        else:
            spare.extend(op.host_slots[have:arrived])
        self.tiers.host.free(spare)
        return added

    def abort(self, op: PrefetchOp) -> None:
        """The request went away: release everything the op reserved (in-flight slots after drain)."""
        state = PREFETCH_OP.next(op.state, PrefetchEvent.ABORT)
        self._unlock_anchor(op)
        self.tiers.host.free(op.host_slots[: op.arrived])
        op.released = op.arrived
        op.state = state
        self._settle(op)

    def drain(self, op: PrefetchOp) -> None:
        """The I/O worker confirms it will not write into ``op``'s slots any more."""
        op.state = PREFETCH_OP.next(op.state, PrefetchEvent.DRAIN)
        self._settle(op)

    def _unlock_anchor(self, op: PrefetchOp) -> None:
        anchor = self.tree.node(op.anchor_id)
        if not anchor.is_root:
            self.locks.lock(anchor, -1)

    def _settle(self, op: PrefetchOp) -> None:
        if op.state is PrefetchState.DONE:
            self.tiers.host.free(op.host_slots[op.released :])
            op.released = len(op.host_slots)
            if op.held_state_slot is not None:
                self.states.host.free([op.held_state_slot])
                op.state_released = True
            del self.ops[op.op_id]
