"""Side-pool (Mamba state) bookkeeping of the cache model (SPEC §5).

Side pools are opt-in through ``CacheConfig.side_pools``. With no side pools every result, op id and
check is what it was before side pools existed.

* ``ALL_PAGES`` pools (sparse-attention indexer keys) share the KV page's indices on L1 and L2, so their
  L1/L2 residency *is* the page's: nothing is tracked for them there. They differ only in L3, where the
  store can evict an indexer object on its own: backup writes them with the KV objects of each page,
  and L3 ``exists`` / prefetch go through :func:`~kvstrata.model.hybrid.hybrid_exists`, so a page
  whose indexer object is missing is not a hit (I6).
* ``TRAILING_PAGES`` pools (Mamba state: a temporal buffer plus conv buffers) hold one *state* per node
  end, keyed by the page hash of the last page of the prefix it belongs to. On L1 and L2 a state (every
  trailing pool's components together) takes one slot of its own pools (``device_states``,
  ``host_states``), separate from the page pools. Like pages, states are kept **per page hash**
  (``state_info``) with their own residency (``STATE_RESIDENCY``), never per node: a split cannot move
  or lose a state, it only creates a new node end that has none. A state's content identity is
  ``("state", page_hash)``.
* A prefix is *usable in a tier* when every page's KV is valid in that tier and the state at its last
  page is valid in that same tier. ``match`` reports the L1 prefix cut back to the deepest node end
  usable on L1, then the L2 continuation: the nodes after that cut whose KV is valid on L2, cut back to
  the deepest node end whose state is valid on L2. Reporting less is always allowed; reporting a
  prefix that is not usable is an I6 violation (checked on every match).
* A state moves with its node: write-through, stage, demote, delete and load-back carry the state of
  the node's last page along with its pages, and host (or device) allocation for such a transfer is
  atomic over pools (KV pages and the state slot: all or nothing). ``evict_state`` drops one state
  from L1 or L2 without touching KV (the tree then reports less). A state is valid in a tier only
  where its page is (accounting).
* Design rationale: why states per page hash and not per node. Keeping the state on the node would
  make every split decide which half keeps it and every pending op follow nodes again (the lost split).
  Keyed by the page hash, a state cannot be lost or moved by a split, ops capture it at enqueue like
  pages, and "state at the node end" is a checked fact (accounting), not a pointer to maintain.

Invariants upheld here alone:

* a state record is advanced only through ``STATE_RESIDENCY`` and forgotten exactly when it reaches
  ``GONE``, its slot freed with its last copy (I5 for the state pools);
* a state is attached only at the end of a node whose KV is valid on L1, and only where that end has
  no L1 state yet (I6: every state sits at a node end);
* a state copy is dropped only when it is idle in that tier (``L1_DROPPABLE`` / ``L2_DROPPABLE``), its
  node is unlocked and (L2) no backup pins it; victims go least recently used node first;
* ``match`` reports a prefix only up to a node end whose state is valid in the tier it is read from
  (:meth:`States.usable`, checked by I6 on every match).

Page residency is read here (through the shared :class:`~kvstrata.model.cache.node.PageTable`),
never advanced: the tier moves that carry a state along with its node's pages call the steps
under "moves" below from :mod:`kvstrata.model.cache.tiers`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import attrs

from kvstrata.model.cache.config import CacheConfig
from kvstrata.model.cache.index import Node, RadixTree
from kvstrata.model.cache.node import PageInfo, PageTable
from kvstrata.model.errors import MisuseError
from kvstrata.model.keys import PageHash
from kvstrata.model.lifecycles import (
    DEVICE_VALID,
    HOST_VALID,
    L1_DROPPABLE,
    L2_DROPPABLE,
    STATE_RESIDENCY,
    Residency,
    StateEvent,
)
from kvstrata.model.slots import SlotPool

__all__ = ["States"]


@attrs.define
class States:
    """The state records (``info``), the L1/L2 state pools and the scheduler's L1 state slots."""

    config: CacheConfig
    tree: RadixTree = attrs.field(repr=False)
    pages: PageTable = attrs.field(repr=False)
    info: dict[PageHash, PageInfo] = attrs.field(init=False, factory=dict)
    device: SlotPool = attrs.field(init=False)
    host: SlotPool = attrs.field(init=False)
    scheduler_slots: set[int] = attrs.field(init=False, factory=set)

    def __attrs_post_init__(self) -> None:
        self.device = SlotPool("L1-state", self.config.device_states)
        self.host = SlotPool("L2-state", self.config.host_states)

    @property
    def enabled(self) -> bool:
        """Whether a ``TRAILING_PAGES`` side pool (a Mamba state per node end) is configured."""
        return bool(self.config.trailing_pools)

    def state_of(self, page: PageHash | None) -> Residency | None:
        info = None if page is None else self.info.get(page)
        return None if info is None else info.residency

    def advance(self, page: PageHash, event: StateEvent) -> None:
        info = self.info[page]
        info.residency = STATE_RESIDENCY.next(info.residency, event)
        if info.residency is Residency.GONE:
            del self.info[page]

    def at_ends(self) -> dict[PageHash, Node]:
        """The node whose end each state sits at (accounting: every state sits at a node end)."""
        return {
            node.pages[-1]: node
            for node in self.tree.non_root_nodes()
            if node.pages[-1] in self.info
        }

    def pinned(self, node: Node) -> bool:
        """Whether a backup still reads the L2 copy of the state at ``node``'s end."""
        info = self.info.get(node.pages[-1])
        return info is not None and info.host_pins > 0

    def pin(self, pages: Iterable[PageHash], delta: int) -> None:
        for page in pages:
            self.info[page].host_pins += delta

    def moving(self, node: Node) -> tuple[PageHash, ...]:
        """The state that moves L1 -> L2 with ``node`` (its end state, if on L1 only)."""
        page = node.pages[-1]
        return (page,) if self.state_of(page) is Residency.DEVICE else ()

    # ----------------------------------------------------------------- dropping copies
    def drop(self, page: PageHash, *, host: bool) -> None:
        """Free one state's L1 (or L2) copy; the state is forgotten when no copy is left."""
        info = self.info[page]
        if host:
            slot = info.host_slot
            event = StateEvent.DROP_HOST if info.residency is Residency.BOTH else StateEvent.DELETE
            info.host_slot = None
            assert slot is not None
            self.host.free([slot])
        else:
            slot = info.device_slot
            event = StateEvent.DEMOTE if info.residency is Residency.BOTH else StateEvent.DELETE
            info.device_slot = None
            assert slot is not None
            self.device.free([slot])
        self.advance(page, event)

    def forget(self, node: Node) -> None:
        """``node`` is deleted: drop the state at its end, with its slot."""
        page = node.pages[-1]
        info = self.info.get(page)
        if info is not None:
            self.drop(page, host=info.residency is Residency.HOST)

    def victims(self, *, host: bool) -> list[PageHash]:
        """States that may lose their L1 (or L2) copy, least recently used node first: not in
        flight, on an unlocked node, and (L2) not pinned by a backup."""
        allowed = L2_DROPPABLE if host else L1_DROPPABLE
        out = [
            (node.last_access, node.node_id, page)
            for page, node in self.at_ends().items()
            if not node.lock_ref
            and self.info[page].residency in allowed
            and not (host and self.info[page].host_pins)
        ]
        return [page for _access, _node, page in sorted(out)]

    def free_slot(self, *, host: bool) -> bool:
        """Make sure one L1 (or L2) state slot is free, dropping the LRU state copy if needed."""
        pool = self.host if host else self.device
        if pool.free_count == 0:
            victims = self.victims(host=host)
            if victims:
                self.drop(victims[0], host=host)
        return pool.free_count > 0

    def droppable(self, node: Node, *, host: bool) -> PageHash:
        """The page of ``node``'s end state if ``evict_state`` may drop its L1 (or L2) copy: one
        that is not being copied (not ``WRITING`` / ``LOADING``), on an unlocked node and (L2) not
        pinned by a backup; else :class:`MisuseError`, nothing changed."""
        if not self.enabled:
            raise MisuseError("no TRAILING_PAGES side pool: this cache keeps no states")
        if node.is_root:
            raise MisuseError("the root holds no state")
        page = node.pages[-1]
        info = self.info.get(page)
        tier = "L2" if host else "L1"
        allowed = L2_DROPPABLE if host else L1_DROPPABLE
        if info is None or info.residency not in allowed:
            state = "none" if info is None else info.residency.value
            node_id = node.node_id
            raise MisuseError(f"node {node_id} has no idle {tier} state to drop (state: {state})")
        if node.lock_ref:
            raise MisuseError(f"node {node.node_id} is locked: its state is in use")
        if host and info.host_pins:
            raise MisuseError(f"the L2 state of node {node.node_id} is pinned by a backup")
        return page

    # ----------------------------------------------------------------- the scheduler's slots
    def take_device(self) -> int | None:
        """One fresh L1 state slot for the scheduler (dropping an LRU L1 copy if needed)."""
        if not self.free_slot(host=False):
            return None
        (slot,) = self.device.alloc(1)
        self.scheduler_slots.add(slot)
        return slot

    def check_scheduler(self, slot: int) -> None:
        if slot not in self.scheduler_slots:
            raise MisuseError(f"L1 state slot {slot} is not held by the scheduler")

    def write_scheduler(self, slot: int, content: Hashable) -> None:
        self.check_scheduler(slot)
        self.device.write(slot, content)

    def free_scheduler(self, slot: int) -> None:
        self.scheduler_slots.discard(slot)
        self.device.free([slot])

    def keep(self, node: Node, slot: int, *, loading: bool) -> bool:
        """``insert`` hands over the scheduler's ``slot`` (the state at the end of its last full
        page): it becomes the L1 state at ``node``'s end (the page is then a node end) unless that
        end already has one on L1 or nothing was cached below a loading node; then it is freed
        (``InsertResult.state_kept`` false)."""
        self.scheduler_slots.discard(slot)
        kept = not loading and self.attach(node, slot)
        if not kept:
            self.device.free([slot])
        return kept

    def attach(self, node: Node, slot: int) -> bool:
        """Make ``slot`` the L1 state at the end of ``node`` (whose pages are valid on L1); False
        if that end already has a state on L1 (or one being loaded there)."""
        page = node.pages[-1]
        assert self.pages.residency_of(node) in DEVICE_VALID
        state = self.state_of(page)
        if state is None:
            self.info[page] = PageInfo(Residency.NEW, device_slot=slot)
            self.advance(page, StateEvent.INSERT)
            return True
        if state is Residency.HOST:
            self.info[page].device_slot = slot
            self.advance(page, StateEvent.REVIVE)
            return True
        return False

    # ----------------------------------------------------------------- moves (called by tiers)
    def reserve_host(self, page: PageHash) -> None:
        (self.info[page].host_slot,) = self.host.alloc(1)

    def copy(self, page: PageHash, *, to_host: bool) -> None:
        """Copy one state between its L1 and L2 slots (reading the source: I5/I7)."""
        info = self.info[page]
        assert info.device_slot is not None and info.host_slot is not None
        if to_host:
            self.host.write(info.host_slot, self.device.read(info.device_slot))
        else:
            self.device.write(info.device_slot, self.host.read(info.host_slot))

    def copy_fail(self, page: PageHash, *, to_host: bool) -> None:
        """A write-through (``to_host``) or load-back of the state failed: free the destination."""
        info = self.info[page]
        if to_host:
            assert info.host_slot is not None
            self.host.free([info.host_slot])
            info.host_slot = None
        else:
            assert info.device_slot is not None
            self.device.free([info.device_slot])
            info.device_slot = None
        self.advance(page, StateEvent.WRITE_FAIL if to_host else StateEvent.LOAD_FAIL)

    def stage(self, page: PageHash) -> None:
        """write_back: the state moves to L2 with its evicted node (blocking copy)."""
        self.copy(page, to_host=True)
        info = self.info[page]
        assert info.device_slot is not None
        self.device.free([info.device_slot])
        info.device_slot = None
        self.advance(page, StateEvent.STAGE)

    def load_start(self, page: PageHash) -> None:
        (self.info[page].device_slot,) = self.device.alloc(1)
        self.advance(page, StateEvent.LOAD_START)

    def commit_prefetched(self, page: PageHash, slot: int) -> None:
        """A prefetched state becomes the L2 state at the end of ``page`` if that page is in the
        tree, valid on L2 and without a state; else its slot is freed."""
        info = self.pages.records.get(page)
        if info is not None and info.residency in HOST_VALID and page not in self.info:
            self.info[page] = PageInfo(Residency.NEW, host_slot=slot)
            self.advance(page, StateEvent.COMMIT_PREFETCH)
        else:
            self.host.free([slot])

    # ----------------------------------------------------------------- match
    def usable(self, device: list[Node], host: list[Node]) -> tuple[list[Node], list[Node]]:
        """Cut the L1 prefix back to the deepest node end whose state is valid on L1; the L2
        continuation is then the nodes after that cut whose KV is valid on L2, cut back to the
        deepest node end whose state is valid on L2. States sit at node ends only, so a node
        that ends without one (a split-off prefix) is never the end of a reported prefix."""
        cut = len(device)
        while cut and self.state_of(device[cut - 1].pages[-1]) not in DEVICE_VALID:
            cut -= 1
        rest: list[Node] = []
        for node in [*device[cut:], *host]:
            if self.pages.residency_of(node) not in HOST_VALID:
                break
            rest.append(node)
        end = len(rest)
        while end and self.state_of(rest[end - 1].pages[-1]) not in HOST_VALID:
            end -= 1
        return device[:cut], rest[:end]
