"""The hierarchical cache model: radix tree + L1/L2 slot pools + write-through, load-back, backup and
prefetch queues + the L3 store (SPEC §3, §4, §7).

:class:`CacheModel` is a facade: each public verb validates its arguments and the lifecycle step it
takes (a typed error, nothing changed), advances ``clock`` (the step counter: it orders LRU and
timeouts), delegates to the piece that owns the state it changes, then (``config.check``) runs every
invariant of :mod:`kvstrata.model.invariants`. It builds and wires the pieces, each owning its state
and stating the invariants it alone upholds: the tree (:mod:`kvstrata.model.tree`), :mod:`.clock`,
the page records (:mod:`.node`), :mod:`.locks`, :mod:`.states` (side pools, SPEC §5), :mod:`.tiers`,
:mod:`kvstrata.model.l3.backup` and :mod:`kvstrata.model.l3.prefetch`.

Residency is kept **per page hash** (which names the whole prefix and namespace), never per node, and
every op captures the pages it covers when it is enqueued, so a split cannot change what a pending op
covers (I4, the "lost split"). Slots hold content identities (:mod:`kvstrata.model.slots`) and every
read is checked, so a stale or freed slot shows up at once (I5/I7). With no side pools every result,
op id and check is what it was before side pools existed.

Invariants upheld here alone: a verb that raises changes nothing, and ``clock`` moves exactly once per
mutating verb (``tick`` aside).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence, Sized
from typing import ParamSpec, TypeVar

import attrs

from kvstrata.model.cache.clock import Clock
from kvstrata.model.cache.config import CacheConfig, WritePolicy
from kvstrata.model.cache.index import Node, RadixTree
from kvstrata.model.cache.locks import Locks
from kvstrata.model.cache.node import (
    CopyOp,
    InsertResult,
    MatchResult,
    PageInfo,
    PageTable,
    View,
    check_tokens,
    state_content,
)
from kvstrata.model.cache.states import States
from kvstrata.model.cache.tiers import Tiers
from kvstrata.model.errors import CapacityError, MisuseError, page_count
from kvstrata.model.invariants import check_cache, check_i6_reported
from kvstrata.model.keys import DEFAULT_NAMESPACE, Namespace, PageHash, StoreKey, chain_page_hashes
from kvstrata.model.l3.backup import Backup, BackupOp
from kvstrata.model.l3.objects import Objects, l3_hit, page_objects, state_objects
from kvstrata.model.l3.prefetch import Prefetch, PrefetchOp
from kvstrata.model.lifecycles import (
    DEVICE_VALID,
    HOST_VALID,
    BackupState,
    OpEvent,
    PrefetchEvent,
    Residency,
)
from kvstrata.model.slots import SlotPool
from kvstrata.model.store import StoreModel

__all__ = ["CacheModel"]

P = ParamSpec("P")
T = TypeVar("T")


@attrs.define
class CacheModel:
    config: CacheConfig
    store: StoreModel = attrs.field(factory=StoreModel)
    tree: RadixTree = attrs.field(init=False)
    _clock: Clock = attrs.field(init=False, factory=Clock, repr=False)
    _pages: PageTable = attrs.field(init=False, factory=PageTable, repr=False)
    _states: States = attrs.field(init=False, repr=False)
    _locks: Locks = attrs.field(init=False, repr=False)
    _tiers: Tiers = attrs.field(init=False, repr=False)
    _backup: Backup = attrs.field(init=False, repr=False)
    _prefetch: Prefetch = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        config, store, clock, pages = self.config, self.store, self._clock, self._pages
        self.tree = tree = RadixTree(config.page_size)
        self._states = states = States(config, tree, pages)
        self._locks = locks = Locks(tree, pages, states)
        self._tiers = tiers = Tiers(config, tree, clock, pages, locks, states)
        self._backup = Backup(config, store, clock, tiers, states)
        tiers.backup = self._backup if config.has_l3 else None  # acked host copies go to L3
        self._prefetch = Prefetch(config, store, tree, clock, tiers, states, locks)

    # ----------------------------------------------------------------- what the pieces own
    # read-only views for tests and invariants: the pieces' own containers (never copies) and counters
    page_info = View[dict[PageHash, PageInfo]]("_pages", "records")
    state_info = View[dict[PageHash, PageInfo]]("_states", "info")
    device = View[SlotPool]("_tiers", "device")
    host = View[SlotPool]("_tiers", "host")
    device_state = View[SlotPool]("_states", "device")
    host_state = View[SlotPool]("_states", "host")
    write_ops = View[deque[CopyOp]]("_tiers", "write_ops")
    load_ops = View[deque[CopyOp]]("_tiers", "load_ops")
    backup_ops = View[list[BackupOp]]("_backup", "ops")
    prefetch_ops = View[dict[int, PrefetchOp]]("_prefetch", "ops")
    prefetches = property(lambda self: self._prefetch)  # pure queries: local_hit, read (TP)
    scheduler_slots = View[set[int]]("_tiers", "scheduler_slots")
    scheduler_state_slots = View[set[int]]("_states", "scheduler_slots")
    clock = View[int]("_clock", "now")
    evictable_pages = View[int]("_locks", "evictable_pages")
    protected_pages = View[int]("_locks", "protected_pages")
    page_size = View[int]("config", "page_size")
    has_l3 = View[bool]("config", "has_l3")
    has_states = View[bool]("_states", "enabled")  # a TRAILING_PAGES pool: a state per node end

    state_content = staticmethod(state_content)

    def residency_of(self, node: Node) -> Residency | None:
        """The residency shared by every page of ``node`` (``None`` for a root)."""
        return self._pages.residency_of(node)

    def _state_of(self, page: PageHash | None) -> Residency | None:
        return self._states.state_of(page)

    def _page_objects(self, namespace: Namespace, page: PageHash) -> Objects:
        return page_objects(self.config, namespace, page)

    def _state_objects(self, namespace: Namespace, page: PageHash) -> Objects:
        return state_objects(self.config, namespace, page)

    def _op_pins(self, node: Node) -> int:
        """Locks held on ``node`` by in-flight operations (not by the caller)."""
        return self._tiers.op_pins(node) + self._prefetch.anchor_pins(node)

    def _step(self, apply: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """One mutating step, once its arguments are checked: tick, apply, check every invariant."""
        self._clock.tick()
        result = apply(*args, **kwargs)
        self._finish()
        return result

    def _finish(self) -> None:
        if self.config.check:
            check_cache(self)

    # ----------------------------------------------------------------- queries
    def residency(
        self, tokens: Sequence[int], namespace: Namespace = DEFAULT_NAMESPACE
    ) -> tuple[Residency, ...]:
        """Residency of each full page of ``tokens`` present in the tree (no split, no LRU touch)."""
        walk = self.tree.walk(check_tokens(tokens), namespace, split=False)
        return tuple(self.page_info[page].residency for node in walk.path for page in node.pages)

    def state_residency(
        self, tokens: Sequence[int], namespace: Namespace = DEFAULT_NAMESPACE
    ) -> tuple[Residency | None, ...]:
        """Residency of the trailing state at the end of each full page of ``tokens`` present in
        the tree (``None``: no state there); no split, no LRU touch."""
        walk = self.tree.walk(check_tokens(tokens), namespace, split=False)
        return tuple(self._states.state_of(page) for node in walk.path for page in node.pages)

    def device_content(self, slots: Sequence[int]) -> tuple[Hashable, ...]:
        return tuple(map(self.device.read, slots))

    def host_content(self, slots: Sequence[int]) -> tuple[Hashable, ...]:
        return tuple(map(self.host.read, slots))

    def l3_exists(self, tokens: Sequence[int], namespace: Namespace = DEFAULT_NAMESPACE) -> int:
        """How many leading full pages of ``tokens`` the store holds completely (0 without L3);
        with side pools, the usable prefix over every pool (SPEC §5, I6)."""
        tokens = check_tokens(tokens)
        if not self.has_l3:
            return 0
        pages = chain_page_hashes(tokens, self.page_size, namespace)
        return l3_hit(self.config, self.store, namespace, pages)

    def pending(self) -> dict[str, int]:
        ops: tuple[Sized, ...] = self.write_ops, self.load_ops, self.backup_ops, self.prefetch_ops
        return dict(zip(("write", "load", "backup", "prefetch"), map(len, ops), strict=True))

    def prefetch_reserved(self) -> int:
        return self._prefetch.reserved()

    def prefetch_ready(self, op_id: int) -> bool:
        """Whether the scheduler stops waiting for ``op_id`` now, under the configured policy."""
        return self._prefetch.ready(op_id)

    # ----------------------------------------------------------------- match
    def match_prefix(
        self, tokens: Sequence[int], namespace: Namespace = DEFAULT_NAMESPACE
    ) -> MatchResult:
        """Longest cached page-aligned prefix; splits a node the match ends inside.

        With a ``TRAILING_PAGES`` side pool both parts are cut back to node ends whose state is
        valid in the tier they are read from (L1 for the L1 prefix, L2 for the continuation)."""
        return self._step(self._match, check_tokens(tokens), namespace)

    def _match(self, tokens: tuple[int, ...], namespace: Namespace) -> MatchResult:
        walk = self.tree.walk(tokens, namespace, split=True)
        device: list[Node] = []
        host: list[Node] = []
        for node in walk.path:
            node.last_access = self.clock
            node.hits += 1
            state = self.residency_of(node)
            if not host and state in DEVICE_VALID:
                device.append(node)
                continue
            if state not in HOST_VALID:
                break
            host.append(node)
        if self.has_states:
            device, host = self._states.usable(device, host)
        device_node = device[-1] if device else walk.root
        host_node = host[-1] if host else device_node
        device_pages = sum(len(node.pages) for node in device)
        host_pages = sum(len(node.pages) for node in host)
        slots = tuple(self._pages.device_slot(page) for node in device for page in node.pages)
        state_slot = None
        if self.has_states and device:
            state_slot = self.state_info[device_node.pages[-1]].device_slot
        if self.config.check:
            path_pages = [page for node in walk.path for page in node.pages]
            check_i6_reported(self, path_pages, device_pages, host_pages)
        if self.config.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            self._tiers.write_through_hot(walk.path)
        ids = (device_node.node_id, host_node.node_id)
        return MatchResult(device_pages, host_pages, *ids, slots, state_slot)

    # ----------------------------------------------------------------- insert
    def alloc_device(self, pages: int) -> tuple[int, ...]:
        """The scheduler takes ``pages`` fresh L1 pages for KV it is about to compute, evicting
        unlocked L1 leaves as needed. Raises :class:`CapacityError` if L1 still has too few (what
        was evicted stays evicted; nothing is allocated). The caller owns the slots until it hands
        them to :meth:`insert` or gives them back with :meth:`free_device`."""
        pages = page_count(pages)
        slots = self._step(self._tiers.take_device, pages)
        if slots is None:
            raise CapacityError(f"{pages} L1 pages asked, {self.device.free_count} free")
        return slots

    def write_device(self, slot: int, content: Hashable) -> None:
        """The model computed KV into a slot the scheduler owns (the content identity of a page
        is its page hash)."""
        self._tiers.write_scheduler(slot, content)

    def free_device(self, slots: Sequence[int]) -> None:
        """The scheduler gives back slots it took with :meth:`alloc_device` (an aborted request)."""
        slots = tuple(slots)
        self._tiers.check_scheduler(slots)
        self._step(self._tiers.free_scheduler, slots)

    def alloc_device_state(self) -> int:
        """The scheduler takes one fresh L1 state slot for the trailing state it is about to
        compute (side pools only), dropping the least recently used unlocked L1 state copy if
        none is free. Raises :class:`CapacityError` if still none (a dropped copy stays dropped).
        The caller owns the slot until it hands it to :meth:`insert` or :meth:`free_device_state`."""
        if not self.has_states:
            raise MisuseError("no TRAILING_PAGES side pool: this cache keeps no states")
        slot = self._step(self._states.take_device)
        if slot is None:
            raise CapacityError("no L1 state slot is free and no L1 state can be dropped")
        return slot

    def write_device_state(self, slot: int, content: Hashable) -> None:
        """The model computed a trailing state into a slot the scheduler owns (its content
        identity is :meth:`state_content` of the last full page of the request)."""
        self._states.write_scheduler(slot, content)

    def free_device_state(self, slot: int) -> None:
        """The scheduler gives back a state slot it took with :meth:`alloc_device_state`."""
        self._states.check_scheduler(slot)
        self._step(self._states.free_scheduler, slot)

    def insert(
        self,
        tokens: Sequence[int],
        namespace: Namespace = DEFAULT_NAMESPACE,
        device_slots: Sequence[int] = (),
        state_slot: int | None = None,
    ) -> InsertResult:
        """Cache the KV of ``tokens`` (whole pages; a trailing partial page is ignored).

        ``device_slots`` has one L1 slot per full page, as a scheduler holds them after a request:
        the cached slots of the prefix ``match`` found on L1, then slots from :meth:`alloc_device`
        holding the KV of the other pages; the cache owns them all afterwards (what it does with
        each: :meth:`Tiers.place <kvstrata.model.cache.tiers.Tiers.place>`). ``state_slot``
        (``TRAILING_PAGES`` pools only), from :meth:`alloc_device_state`, holds the state at the end
        of the last full page (:meth:`States.keep <kvstrata.model.cache.states.States.keep>`).
        Invalid slots raise :class:`MisuseError`, nothing changed."""
        tokens = check_tokens(tokens)
        total = len(tokens) // self.page_size
        slots = tuple(device_slots)
        if len(slots) != total or len(set(slots)) != total:
            raise MisuseError(f"{total} distinct L1 slots needed for {total} pages, got {slots}")
        if state_slot is not None:
            self._states.check_scheduler(state_slot)
            if total == 0:
                raise MisuseError("a state belongs to the end of a full page; tokens have none")
        self._tiers.check_insert(self.tree.walk(tokens, namespace, split=False), slots)
        return self._step(self._insert, tokens, namespace, slots, state_slot)

    def _insert(
        self,
        tokens: tuple[int, ...],
        namespace: Namespace,
        slots: tuple[int, ...],
        state_slot: int | None,
    ) -> InsertResult:
        walk = self.tree.walk(tokens, namespace, split=True)
        placed = self._tiers.place(walk, tokens, namespace, slots)
        kept = False
        if state_slot is not None:
            kept = self._states.keep(placed.deepest, state_slot, loading=placed.loading)
        if (placed.new_pages or kept) and self.config.write_policy is WritePolicy.WRITE_THROUGH:
            self._tiers.write_through_chain(placed.deepest)
        node_id = placed.deepest.node_id
        return InsertResult(node_id, placed.new_pages, placed.revived, placed.duplicates, kept)

    # ----------------------------------------------------------------- copies L1 <-> L2
    def ack_write(self) -> int:
        """The oldest pending write-through completes (acks are FIFO). Returns its page count."""
        self._tiers.check_copy(self.write_ops, OpEvent.ACK)
        return self._step(self._tiers.ack_write)

    def fail_write(self) -> int:
        """A write-through copy failed. Every pending write-through fails with it (a later op may
        cover a child of a page that now has no host copy: I3), in FIFO order: their pages stay on
        L1 only and their host slots are given back (a smaller L2, never wrong bytes). Returns the
        number of pages."""
        self._tiers.check_copy(self.write_ops, OpEvent.FAIL)
        return self._step(self._tiers.fail_copies, self.write_ops)

    def load_back(self, node_id: int) -> int | None:
        """Start loading the host-only chain that ends at ``node_id`` (and the state at its end)
        back to L1, all or nothing (:meth:`Tiers.load_back
        <kvstrata.model.cache.tiers.Tiers.load_back>`). Returns the op id, or ``None`` if skipped
        (below the threshold, over the quota, no room)."""
        return self._step(self._tiers.load_back, self.tree.node(node_id))

    def ack_load(self) -> int:
        """The oldest pending load-back completes (FIFO); its nodes become L1-valid and unpinned."""
        self._tiers.check_copy(self.load_ops, OpEvent.ACK)
        return self._step(self._tiers.ack_load)

    def fail_load(self) -> int:
        """A load-back copy failed. Every pending load-back fails with it (I3 for chains loaded by
        later ops), in FIFO order: their pages stay host-only and their device slots are given
        back. Returns the number of pages."""
        self._tiers.check_copy(self.load_ops, OpEvent.FAIL)
        return self._step(self._tiers.fail_copies, self.load_ops)

    # ----------------------------------------------------------------- locks and eviction
    def lock(self, node_id: int) -> None:
        node = self.tree.node(node_id)
        if node.is_root:
            raise MisuseError("the root cannot be locked")
        self._step(self._locks.lock, node, +1)

    def unlock(self, node_id: int) -> None:
        node = self.tree.node(node_id)
        if node.is_root or node.pins - self._op_pins(node) <= 0:
            raise MisuseError(f"node {node_id} is not locked by the caller")
        self._step(self._locks.lock, node, -1)

    def evict(self, pages: int) -> int:
        """Free at least ``pages`` L1 pages if possible (LRU over unlocked L1 leaves)."""
        return self._step(self._tiers.evict_device, page_count(pages))

    def evict_host(self, pages: int) -> int:
        """Free at least ``pages`` L2 pages if possible (LRU over unpinned host-only leaves)."""
        return self._step(self._tiers.evict_host, page_count(pages))

    def evict_state(self, node_id: int, *, host: bool = False) -> None:
        """Drop the trailing state at the end of ``node_id`` from L1 (or, with ``host``, from L2)
        without touching its KV; the tree then reports less, never wrong (side pools only). When
        it may not (:meth:`States.droppable <kvstrata.model.cache.states.States.droppable>`):
        :class:`MisuseError`, nothing changed."""
        page = self._states.droppable(self.tree.node(node_id), host=host)
        self._step(self._states.drop, page, host=host)

    # ----------------------------------------------------------------- backup (L2 -> L3)
    def start_backup(self) -> int:
        """The store worker starts the oldest queued backup: exists-then-put-missing, puts begun."""
        return self._step(self._backup.start, self._backup.op(BackupState.QUEUED))

    def ack_backup(self, op_id: int | None = None, *, agreed: bool = False) -> int:
        """The oldest in-flight backup (or op ``op_id``) completes: its objects become visible, host
        pins drop; a page with an object not visible (another writer's key) is queued again (I2,
        I4), unless ``agreed`` (TP: see ``Backup.ack``). Returns the pages now durable in L3."""
        in_flight = self._backup.op(BackupState.IN_FLIGHT, op_id)
        return self._step(self._backup.ack, in_flight, agreed=agreed)

    def fail_backup(self, op_id: int | None = None) -> int:
        """The oldest in-flight backup (or op ``op_id``) fails: puts aborted, queued again."""
        return self._step(self._backup.fail, self._backup.op(BackupState.IN_FLIGHT, op_id))

    def store_evict(self, key: StoreKey) -> bool:
        """The store drops one object on its own (eviction, owner gone)."""
        if not isinstance(key, StoreKey):
            raise MisuseError(f"the store takes StoreKey values only, got {type(key).__name__}")
        return self._step(self._backup.store_evict, key)

    # ----------------------------------------------------------------- prefetch (L3 -> L2)
    def prefetch(
        self,
        tokens: Sequence[int],
        namespace: Namespace = DEFAULT_NAMESPACE,
        limit: int | None = None,
    ) -> int | None:
        """Start reading from L3 what follows the local match of ``tokens``, at most ``limit`` pages
        (TP: agreed). The op id, or ``None``: nothing worth fetching, or no room (half of L2)."""
        op: PrefetchOp | None = self._step(
            self._prefetch.start, check_tokens(tokens), namespace, limit
        )
        return None if op is None else op.op_id

    def prefetch_finish(self, op_id: int, pages: int, delivered: Sequence[Hashable]) -> int:
        """The read of ``op_id`` ends with ``pages`` more pages (TP: agreed) out of ``delivered``,
        what this rank's read got when it ran; the rest misses."""
        op = self._prefetch.op(op_id, PrefetchEvent.ARRIVE)
        return self._step(self._prefetch.finish, op, pages, delivered)

    def prefetch_arrive(self, op_id: int, pages: int = 1) -> int:
        """Up to ``pages`` more pages of op ``op_id`` are read from the store, in order; a page whose
        objects are not all in the store any more ends the op there (the rest is a miss). Then the
        state, if any (:meth:`Prefetch.arrive <kvstrata.model.l3.prefetch.Prefetch.arrive>`)."""
        op = self._prefetch.op(op_id, PrefetchEvent.ARRIVE)
        if pages <= 0:
            raise MisuseError(f"pages must be > 0, got {pages}")
        return self._step(self._prefetch.arrive, op, pages)

    def tick(self, steps: int = 1) -> None:  # let ``steps`` steps of time pass (for timeouts)
        self._clock.tick(steps)

    def prefetch_commit(self, op_id: int) -> int:
        """Insert the pages that arrived as host-only nodes; returns how many were added. Slots of
        pages still in flight stay reserved until :meth:`prefetch_drain`."""
        op = self._prefetch.open_op(op_id, PrefetchEvent.COMMIT)
        return self._step(self._prefetch.commit, op)

    def prefetch_abort(self, op_id: int) -> None:
        """The request went away: release everything the op reserved (in-flight slots after drain)."""
        self._step(self._prefetch.abort, self._prefetch.open_op(op_id, PrefetchEvent.ABORT))

    def prefetch_drain(self, op_id: int) -> None:
        """The I/O worker confirms it will not write into op ``op_id``'s slots any more."""
        self._step(self._prefetch.drain, self._prefetch.op(op_id, PrefetchEvent.DRAIN))
