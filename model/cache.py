"""The hierarchical cache model: radix tree + L1/L2 slot pools + write-through, load-back, backup and
prefetch queues + the L3 store (SPEC §3, §4, §7).

Theory of operation
-------------------
* Residency is kept **per page** (keyed by its page hash, which names the whole prefix and namespace),
  never per node. Nodes only group pages. Every operation captures the exact pages it covers when it is
  enqueued; a split regroups pages and so cannot change what a pending operation covers (I4, the
  "lost split" bug).
* Slots hold content identities (:mod:`kvstrata.model.slots`): the content of a KV page is its page hash,
  the content of a store object is ``(page hash, component)``. Every copy reads its source and every read
  is checked, so a stale or freed slot shows up as a wrong identity or an I5/I7 violation at once.
* Every public method validates its arguments first and raises a typed error with nothing changed, then
  advances lifecycles only through the tables of :mod:`kvstrata.model.lifecycles`, then (if
  ``config.check``) runs every invariant of :mod:`kvstrata.model.invariants`.
* ``clock`` is the step counter: it advances once per public operation and orders LRU and timeouts.

Side pools (SPEC §5, opt-in through ``CacheConfig.side_pools``)
-----------------------------------------------------------------
With no side pools every result, op id and check is what it was before side pools existed.

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
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Hashable, Sequence

import attrs

from kvstrata.model.errors import CapacityError, MisuseError
from kvstrata.model.hybrid import (
    HitPolicy,
    SidePool,
    check_side_pools,
    check_usable,
    hybrid_exists,
    side_page_keys,
    usable_prefix,
)
from kvstrata.model.invariants import check_cache, check_i6_reported
from kvstrata.model.keys import (
    DEFAULT_NAMESPACE,
    KeySpace,
    Namespace,
    PageHash,
    StoreKey,
    chain_page_hashes,
)
from kvstrata.model.lifecycles import (
    BACKUP_OP,
    DEVICE_CLAIMED,
    DEVICE_VALID,
    HOST_CLAIMED,
    HOST_VALID,
    L1_DROPPABLE,
    L1_WITH_L2,
    L2_DROPPABLE,
    LOAD_OP,
    PAGE_RESIDENCY,
    PREFETCH_OP,
    STATE_RESIDENCY,
    WRITE_OP,
    BackupEvent,
    BackupState,
    OpEvent,
    OpState,
    PrefetchEvent,
    PrefetchState,
    Residency,
    ResidencyEvent,
    StateEvent,
)
from kvstrata.model.prefetch import PrefetchOp, PrefetchPolicy, PrefetchTimeout, wait_over
from kvstrata.model.slots import SlotPool
from kvstrata.model.store import StoreModel
from kvstrata.model.tree import Node, RadixTree

__all__ = [
    "DEVICE_CLAIMED",
    "DEVICE_VALID",
    "HOST_CLAIMED",
    "HOST_VALID",
    "BackupOp",
    "CacheConfig",
    "CacheModel",
    "CopyOp",
    "InsertResult",
    "MatchResult",
    "PageInfo",
    "WritePolicy",
]


class WritePolicy(enum.Enum):
    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"


def _positive(_instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise MisuseError(f"{attribute.name} must be a positive int, got {value!r}")


def _non_negative(_instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or value < 0:
        raise MisuseError(f"{attribute.name} must be an int >= 0, got {value!r}")


def _to_side_pools(value: object) -> tuple[SidePool, ...]:
    if isinstance(value, SidePool):
        raise MisuseError("side_pools is a sequence of SidePool values, got one SidePool")
    if not isinstance(value, tuple | list):
        raise MisuseError(f"side_pools must be a tuple of SidePool values, got {value!r}")
    return tuple(value)


@attrs.frozen
class CacheConfig:
    """Sizes in pages, thresholds in tokens. ``host_pages == 0`` means no L2 (and so no L3);
    ``keys is None`` means no L3.

    Side pools (SPEC §5) are opt-in: ``side_pools`` lists them (distinct names). A
    ``TRAILING_PAGES`` pool needs state slots: ``device_states >= 1``, and ``host_states >= 1``
    when there is an L2 (``host_states == 0`` without one); with no such pool both are 0.
    """

    page_size: int = attrs.field(validator=_positive)
    device_pages: int = attrs.field(validator=_positive)
    host_pages: int = attrs.field(default=0, validator=_non_negative)
    write_policy: WritePolicy = attrs.field(
        default=WritePolicy.WRITE_THROUGH, validator=attrs.validators.instance_of(WritePolicy)
    )
    write_through_threshold: int = attrs.field(default=2, validator=_positive)
    load_back_threshold: int = attrs.field(default=0, validator=_non_negative)
    load_back_quota: int | None = None
    prefetch_threshold: int = attrs.field(default=256, validator=_non_negative)
    prefetch_policy: PrefetchPolicy = attrs.field(
        default=PrefetchPolicy.BEST_EFFORT, validator=attrs.validators.instance_of(PrefetchPolicy)
    )
    prefetch_timeout: PrefetchTimeout = attrs.field(factory=PrefetchTimeout)
    keys: KeySpace | None = None
    check: bool = True
    side_pools: tuple[SidePool, ...] = attrs.field(default=(), converter=_to_side_pools)
    device_states: int = attrs.field(default=0, validator=_non_negative)
    host_states: int = attrs.field(default=0, validator=_non_negative)

    def __attrs_post_init__(self) -> None:
        if self.keys is not None and self.keys.model.page_size != self.page_size:
            raise MisuseError("the key space's page size differs from the cache's page size")
        if self.load_back_quota is not None and self.load_back_quota <= 0:
            raise MisuseError(f"load_back_quota must be > 0 or None, got {self.load_back_quota}")
        check_side_pools(self.side_pools)
        if not self.trailing_pools:
            if self.device_states or self.host_states:
                raise MisuseError("state slots need a TRAILING_PAGES side pool")
        else:
            if self.device_states < 1:
                raise MisuseError("a TRAILING_PAGES side pool needs device_states >= 1")
            if (self.host_pages > 0) != (self.host_states > 0):
                raise MisuseError("host_states must be >= 1 with an L2 and 0 without one")

    @property
    def all_pages_pools(self) -> tuple[SidePool, ...]:
        return tuple(p for p in self.side_pools if p.policy is HitPolicy.ALL_PAGES)

    @property
    def trailing_pools(self) -> tuple[SidePool, ...]:
        return tuple(p for p in self.side_pools if p.policy is HitPolicy.TRAILING_PAGES)


@attrs.define
class PageInfo:
    """Where one page's bytes (or one state's, in ``CacheModel.state_info``) are. ``host_pins``
    counts backup ops still reading the host copy."""

    residency: Residency
    device_slot: int | None = None
    host_slot: int | None = None
    host_pins: int = 0


@attrs.define
class CopyOp:
    """A device<->host copy (write-through or load-back): the pages it covers are fixed at enqueue."""

    op_id: int
    node_id: int  # the node it locks while in flight; never used to find the pages it covers
    pages: tuple[PageHash, ...]
    state: OpState = OpState.PENDING
    states: tuple[PageHash, ...] = ()  # trailing states it copies too (keyed by their page)


@attrs.define
class BackupOp:
    """An L2 -> L3 write of whole pages; host copies are pinned until it is done."""

    op_id: int
    namespace: Namespace
    pages: tuple[PageHash, ...]
    state: BackupState = BackupState.QUEUED
    begun: tuple[StoreKey, ...] = ()
    attempts: int = 0
    states: tuple[PageHash, ...] = ()  # trailing states to write (host state slots pinned)


@attrs.frozen
class MatchResult:
    """What ``match`` reports: the L1 prefix, then the L2-only continuation (SPEC §3)."""

    device_pages: int
    host_pages: int
    device_node: int  # deepest node of the L1 prefix (a root if none)
    host_node: int  # deepest node of the L2 continuation (== device_node if none)
    device_slots: tuple[int, ...]
    device_state_slot: int | None = None  # L1 state slot at the end of the L1 prefix (side pools)


@attrs.frozen
class InsertResult:
    node_id: int  # deepest node covering what was inserted (a root if nothing)
    new_pages: int  # pages the tree did not have (a new leaf)
    revived_pages: int  # host-only pages now valid on L1 again
    duplicate_pages: int  # fresh slots given back: the tree already held those pages on L1
    state_kept: bool = False  # the state slot given to insert now holds the last page's state


def _check_tokens(tokens: object) -> tuple[int, ...]:
    if isinstance(tokens, str | bytes) or not isinstance(tokens, Sequence):
        raise MisuseError(f"tokens must be a sequence of ints, got {type(tokens).__name__}")
    out = tuple(tokens)
    for token in out:
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < 2**32:
            raise MisuseError(f"token ids must be ints in [0, 2**32), got {token!r}")
    return out


@attrs.define
class CacheModel:
    config: CacheConfig
    store: StoreModel = attrs.field(factory=StoreModel)
    tree: RadixTree = attrs.field(init=False)
    device: SlotPool = attrs.field(init=False)
    host: SlotPool = attrs.field(init=False)
    page_info: dict[PageHash, PageInfo] = attrs.field(init=False, factory=dict)
    write_ops: deque[CopyOp] = attrs.field(init=False, factory=deque)
    load_ops: deque[CopyOp] = attrs.field(init=False, factory=deque)
    backup_ops: list[BackupOp] = attrs.field(init=False, factory=list)
    prefetch_ops: dict[int, PrefetchOp] = attrs.field(init=False, factory=dict)
    evictable_pages: int = attrs.field(init=False, default=0)
    protected_pages: int = attrs.field(init=False, default=0)
    clock: int = attrs.field(init=False, default=0)
    scheduler_slots: set[int] = attrs.field(init=False, factory=set)
    _next_op: int = attrs.field(init=False, default=0)
    device_state: SlotPool = attrs.field(init=False)
    host_state: SlotPool = attrs.field(init=False)
    state_info: dict[PageHash, PageInfo] = attrs.field(init=False, factory=dict)
    scheduler_state_slots: set[int] = attrs.field(init=False, factory=set)

    def __attrs_post_init__(self) -> None:
        self.tree = RadixTree(self.config.page_size)
        self.device = SlotPool("L1", self.config.device_pages)
        self.host = SlotPool("L2", self.config.host_pages)
        self.device_state = SlotPool("L1-state", self.config.device_states)
        self.host_state = SlotPool("L2-state", self.config.host_states)

    # ----------------------------------------------------------------- helpers
    @property
    def page_size(self) -> int:
        return self.config.page_size

    @property
    def has_l3(self) -> bool:
        return self.config.keys is not None and self.config.host_pages > 0

    def _op_id(self) -> int:
        self._next_op += 1
        return self._next_op

    def _tick(self) -> None:
        self.clock += 1

    def _finish(self) -> None:
        if self.config.check:
            check_cache(self)

    def residency_of(self, node: Node) -> Residency | None:
        """The residency shared by every page of ``node`` (``None`` for a root)."""
        if node.is_root:
            return None
        return self.page_info[node.pages[0]].residency

    def _advance(self, node: Node, event: ResidencyEvent) -> None:
        for page in node.pages:
            self._advance_page(page, event)

    def _advance_page(self, page: PageHash, event: ResidencyEvent) -> None:
        info = self.page_info[page]
        info.residency = PAGE_RESIDENCY.next(info.residency, event)

    def _host_claimed_or_root(self, node: Node) -> bool:
        return node.is_root or self.residency_of(node) in HOST_CLAIMED

    def _page_keys(self, namespace: Namespace, page: PageHash) -> tuple[StoreKey, ...]:
        assert self.config.keys is not None
        return self.config.keys.page_keys(namespace, page)

    @staticmethod
    def _content(page: PageHash) -> Hashable:
        """The bytes of a KV page, as an identity: the page hash names its prefix exactly."""
        return page

    # ----------------------------------------------------------------- side-pool helpers
    @property
    def has_states(self) -> bool:
        """Whether a ``TRAILING_PAGES`` side pool (a Mamba state per node end) is configured."""
        return bool(self.config.trailing_pools)

    @staticmethod
    def state_content(page: PageHash) -> Hashable:
        """The bytes of the trailing state at the end of ``page``'s prefix, as an identity."""
        return ("state", page)

    @staticmethod
    def _state_page(content: Hashable) -> PageHash:
        """The page a state identity names (what a copy of the state would be keyed by)."""
        assert isinstance(content, tuple) and content[0] == "state"
        page = content[1]
        assert isinstance(page, PageHash)
        return page

    def _state_of(self, page: PageHash | None) -> Residency | None:
        info = None if page is None else self.state_info.get(page)
        return None if info is None else info.residency

    def _advance_state(self, page: PageHash, event: StateEvent) -> None:
        info = self.state_info[page]
        info.residency = STATE_RESIDENCY.next(info.residency, event)
        if info.residency is Residency.GONE:
            del self.state_info[page]

    def _page_objects(
        self, namespace: Namespace, page: PageHash
    ) -> tuple[tuple[str, StoreKey], ...]:
        """(component, key) of every store object of one page: the KV components, then every
        ``ALL_PAGES`` side pool's, each key rendered once by the key space."""
        keys = self.config.keys
        assert keys is not None
        out = tuple(zip(keys.model.components, self._page_keys(namespace, page), strict=True))
        for pool in self.config.all_pages_pools:
            out += tuple(
                zip(pool.components, side_page_keys(keys, namespace, pool, page), strict=True)
            )
        return out

    def _state_objects(
        self, namespace: Namespace, page: PageHash
    ) -> tuple[tuple[str, StoreKey], ...]:
        """(component, key) of every store object of the state at the end of ``page``'s prefix:
        every component of every ``TRAILING_PAGES`` pool, keyed by that (last) page's hash."""
        keys = self.config.keys
        assert keys is not None
        out: tuple[tuple[str, StoreKey], ...] = ()
        for pool in self.config.trailing_pools:
            out += tuple(
                zip(pool.components, side_page_keys(keys, namespace, pool, page), strict=True)
            )
        return out

    def _l3_hit(self, namespace: Namespace, pages: Sequence[PageHash]) -> int:
        """Leading pages of ``pages`` L3 can serve in every pool (SPEC §5; the KV hit without side
        pools)."""
        if not self.config.side_pools:
            return self.store.exists_pages(self._page_keys(namespace, page) for page in pages)
        keys = self.config.keys
        assert keys is not None
        return hybrid_exists(self.store, keys, namespace, pages, self.config.side_pools)

    def _state_nodes(self) -> dict[PageHash, Node]:
        """The node whose end each state sits at (accounting: every state sits at a node end)."""
        return {
            node.pages[-1]: node
            for node in self.tree.non_root_nodes()
            if node.pages[-1] in self.state_info
        }

    def _drop_state(self, page: PageHash, *, host: bool) -> None:
        """Free one state's L1 (or L2) copy; the state is forgotten when no copy is left."""
        info = self.state_info[page]
        if host:
            slot = info.host_slot
            event = StateEvent.DROP_HOST if info.residency is Residency.BOTH else StateEvent.DELETE
            info.host_slot = None
            assert slot is not None
            self.host_state.free([slot])
        else:
            slot = info.device_slot
            event = StateEvent.DEMOTE if info.residency is Residency.BOTH else StateEvent.DELETE
            info.device_slot = None
            assert slot is not None
            self.device_state.free([slot])
        self._advance_state(page, event)

    def _state_victims(self, *, host: bool) -> list[PageHash]:
        """States that may lose their L1 (or L2) copy, least recently used node first: not in
        flight, on an unlocked node, and (L2) not pinned by a backup."""
        allowed = L2_DROPPABLE if host else L1_DROPPABLE
        out = [
            (node.last_access, node.node_id, page)
            for page, node in self._state_nodes().items()
            if not node.lock_ref
            and self.state_info[page].residency in allowed
            and not (host and self.state_info[page].host_pins)
        ]
        return [page for _access, _node, page in sorted(out)]

    def _free_state_slot(self, *, host: bool) -> bool:
        """Make sure one L1 (or L2) state slot is free, dropping the LRU state copy if needed."""
        pool = self.host_state if host else self.device_state
        if pool.free_count == 0:
            victims = self._state_victims(host=host)
            if victims:
                self._drop_state(victims[0], host=host)
        return pool.free_count > 0

    def _lock(self, node: Node, delta: int) -> None:
        for crossed in self.tree.add_lock(node, delta):
            device = len(crossed.pages) if self.residency_of(crossed) in DEVICE_VALID else 0
            if crossed.lock_ref:  # became protected
                self.evictable_pages -= device
                self.protected_pages += device
            else:
                self.evictable_pages += device
                self.protected_pages -= device

    def _count_device(self, node: Node, sign: int) -> None:
        """``node``'s pages start (+1) or stop (-1) being device-valid."""
        if node.lock_ref:
            self.protected_pages += sign * len(node.pages)
        else:
            self.evictable_pages += sign * len(node.pages)

    # ----------------------------------------------------------------- queries
    def residency(
        self, tokens: Sequence[int], namespace: Namespace = DEFAULT_NAMESPACE
    ) -> tuple[Residency, ...]:
        """Residency of each full page of ``tokens`` present in the tree (no split, no LRU touch)."""
        tokens = _check_tokens(tokens)
        walk = self.tree.walk(tokens, namespace, split=False)
        out: list[Residency] = []
        for node in walk.path:
            out.extend(self.page_info[page].residency for page in node.pages)
        return tuple(out)

    def state_residency(
        self, tokens: Sequence[int], namespace: Namespace = DEFAULT_NAMESPACE
    ) -> tuple[Residency | None, ...]:
        """Residency of the trailing state at the end of each full page of ``tokens`` present in
        the tree (``None``: no state there); no split, no LRU touch."""
        tokens = _check_tokens(tokens)
        walk = self.tree.walk(tokens, namespace, split=False)
        return tuple(self._state_of(page) for node in walk.path for page in node.pages)

    def device_content(self, slots: Sequence[int]) -> tuple[Hashable, ...]:
        return tuple(self.device.read(slot) for slot in slots)

    def host_content(self, slots: Sequence[int]) -> tuple[Hashable, ...]:
        return tuple(self.host.read(slot) for slot in slots)

    def l3_exists(self, tokens: Sequence[int], namespace: Namespace = DEFAULT_NAMESPACE) -> int:
        """How many leading full pages of ``tokens`` the store holds completely (0 without L3);
        with side pools, the usable prefix over every pool (SPEC §5, I6)."""
        tokens = _check_tokens(tokens)
        if not self.has_l3:
            return 0
        pages = chain_page_hashes(tokens, self.page_size, namespace)
        return self._l3_hit(namespace, pages)

    # ----------------------------------------------------------------- match
    def match(self, tokens: Sequence[int], namespace: Namespace = DEFAULT_NAMESPACE) -> MatchResult:
        """Longest cached page-aligned prefix; splits a node the match ends inside.

        With a ``TRAILING_PAGES`` side pool both parts are cut back to node ends whose state is
        valid in the tier they are read from (L1 for the L1 prefix, L2 for the continuation)."""
        tokens = _check_tokens(tokens)
        self._tick()
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
            device, host = self._usable_by_state(device, host)
        device_node = device[-1] if device else walk.root
        host_node = host[-1] if host else device_node
        device_pages = sum(len(node.pages) for node in device)
        host_pages = sum(len(node.pages) for node in host)
        slots = [self._device_slot(page) for node in device for page in node.pages]
        state_slot = None
        if self.has_states and device:
            state_slot = self.state_info[device_node.pages[-1]].device_slot
        if self.config.check:
            path_pages = [page for node in walk.path for page in node.pages]
            check_i6_reported(self, path_pages, device_pages, host_pages)
        if self.config.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            for node in walk.path:
                if node.hits >= self.config.write_through_threshold and (
                    self.residency_of(node) is Residency.DEVICE or self._state_alone(node)
                ):
                    self._write_through_chain(node)
        self._finish()
        return MatchResult(
            device_pages,
            host_pages,
            device_node.node_id,
            host_node.node_id,
            tuple(slots),
            state_slot,
        )

    def _usable_by_state(
        self, device: list[Node], host: list[Node]
    ) -> tuple[list[Node], list[Node]]:
        """Cut the L1 prefix back to the deepest node end whose state is valid on L1; the L2
        continuation is then the nodes after that cut whose KV is valid on L2, cut back to the
        deepest node end whose state is valid on L2. States sit at node ends only, so a node
        that ends without one (a split-off prefix) is never the end of a reported prefix."""
        cut = len(device)
        while cut and self._state_of(device[cut - 1].pages[-1]) not in DEVICE_VALID:
            cut -= 1
        rest: list[Node] = []
        for node in [*device[cut:], *host]:
            if self.residency_of(node) not in HOST_VALID:
                break
            rest.append(node)
        end = len(rest)
        while end and self._state_of(rest[end - 1].pages[-1]) not in HOST_VALID:
            end -= 1
        return device[:cut], rest[:end]

    def _device_slot(self, page: PageHash) -> int:
        slot = self.page_info[page].device_slot
        assert slot is not None
        return slot

    # ----------------------------------------------------------------- insert
    def alloc_device(self, pages: int) -> tuple[int, ...]:
        """The scheduler takes ``pages`` fresh L1 pages for KV it is about to compute, evicting
        unlocked L1 leaves as needed. Raises :class:`CapacityError` if L1 still has too few (what
        was evicted stays evicted; nothing is allocated). The caller owns the slots until it hands
        them to :meth:`insert` or gives them back with :meth:`free_device`."""
        if not isinstance(pages, int) or isinstance(pages, bool) or pages < 0:
            raise MisuseError(f"pages must be an int >= 0, got {pages!r}")
        self._tick()
        if pages > self.device.free_count:
            self._evict_device(pages - self.device.free_count)
        if pages > self.device.free_count:
            self._finish()
            raise CapacityError(f"{pages} L1 pages asked, {self.device.free_count} free")
        slots = self.device.alloc(pages)
        self.scheduler_slots.update(slots)
        self._finish()
        return slots

    def write_device(self, slot: int, content: Hashable) -> None:
        """The model computed KV into a slot the scheduler owns (the content identity of a page
        is its page hash)."""
        if slot not in self.scheduler_slots:
            raise MisuseError(f"L1 slot {slot} is not held by the scheduler")
        self.device.write(slot, content)

    def free_device(self, slots: Sequence[int]) -> None:
        """The scheduler gives back slots it took with :meth:`alloc_device` (an aborted request)."""
        slots = tuple(slots)
        if len(set(slots)) != len(slots) or not set(slots) <= self.scheduler_slots:
            raise MisuseError(f"L1 slots {slots} are not all held by the scheduler")
        self._tick()
        self.scheduler_slots.difference_update(slots)
        self.device.free(slots)
        self._finish()

    def alloc_device_state(self) -> int:
        """The scheduler takes one fresh L1 state slot for the trailing state it is about to
        compute (side pools only), dropping the least recently used unlocked L1 state copy if
        none is free. Raises :class:`CapacityError` if still none (a dropped copy stays dropped).
        The caller owns the slot until it hands it to :meth:`insert` or :meth:`free_device_state`."""
        if not self.has_states:
            raise MisuseError("no TRAILING_PAGES side pool: this cache keeps no states")
        self._tick()
        if not self._free_state_slot(host=False):
            self._finish()
            raise CapacityError("no L1 state slot is free and no L1 state can be dropped")
        (slot,) = self.device_state.alloc(1)
        self.scheduler_state_slots.add(slot)
        self._finish()
        return slot

    def write_device_state(self, slot: int, content: Hashable) -> None:
        """The model computed a trailing state into a slot the scheduler owns (its content
        identity is :meth:`state_content` of the last full page of the request)."""
        if slot not in self.scheduler_state_slots:
            raise MisuseError(f"L1 state slot {slot} is not held by the scheduler")
        self.device_state.write(slot, content)

    def free_device_state(self, slot: int) -> None:
        """The scheduler gives back a state slot it took with :meth:`alloc_device_state`."""
        if slot not in self.scheduler_state_slots:
            raise MisuseError(f"L1 state slot {slot} is not held by the scheduler")
        self._tick()
        self.scheduler_state_slots.discard(slot)
        self.device_state.free([slot])
        self._finish()

    def insert(
        self,
        tokens: Sequence[int],
        namespace: Namespace = DEFAULT_NAMESPACE,
        device_slots: Sequence[int] = (),
        state_slot: int | None = None,
    ) -> InsertResult:
        """Cache the KV of ``tokens`` (whole pages; a trailing partial page is ignored).

        ``device_slots`` has one L1 slot per full page, as a scheduler holds them after a request:
        for the prefix ``match`` found on L1, the cached slots themselves; for every other page, a
        slot from :meth:`alloc_device` holding that page's KV. The cache takes ownership of every
        slot it is given: pages it already holds on L1 (or is loading) give their fresh slot back
        to the pool (``duplicate_pages``), host-only pages are revived on L1 with it, and pages it
        does not have form a new leaf. Below a node that is still loading back to L1 nothing is
        revived or added (those slots go back too): if that load failed, L1 pages would hang under
        a host-only parent (I3). Invalid slots raise :class:`MisuseError`, nothing changed.

        ``state_slot`` (side pools with a ``TRAILING_PAGES`` pool only) is an L1 state slot from
        :meth:`alloc_device_state` holding the state at the end of the last full page. It becomes
        that page's L1 state (the page is then a node end) unless the page already has one on
        L1 or nothing was cached below a loading node; then it is given back (``state_kept``).
        """
        tokens = _check_tokens(tokens)
        total = len(tokens) // self.page_size
        slots = tuple(device_slots)
        if len(slots) != total or len(set(slots)) != total:
            raise MisuseError(f"{total} distinct L1 slots needed for {total} pages, got {slots}")
        if state_slot is not None:
            if state_slot not in self.scheduler_state_slots:
                raise MisuseError(f"L1 state slot {state_slot} is not held by the scheduler")
            if total == 0:
                raise MisuseError("a state belongs to the end of a full page; tokens have none")
        walk = self.tree.walk(tokens, namespace, split=False)
        cached = [
            self.page_info[page].device_slot if self.residency_of(node) in DEVICE_VALID else None
            for node in walk.path
            for page in node.pages
        ]
        for index, slot in enumerate(slots):
            if slot in self.scheduler_slots:
                continue
            if index >= len(cached) or cached[index] != slot:
                raise MisuseError(f"L1 slot {slot} for page {index} is not the scheduler's")
        self._tick()
        walk = self.tree.walk(tokens, namespace, split=True)
        self.scheduler_slots.difference_update(slots)
        duplicates: list[int] = []
        revived = 0
        offset = 0
        loading = False  # a node on the path so far is still loading back to L1
        for node in walk.path:
            node.last_access = self.clock
            node.hits += 1
            given = slots[offset : offset + len(node.pages)]
            offset += len(node.pages)
            state = self.residency_of(node)
            if loading:
                duplicates.extend(given)
            elif state is Residency.HOST:
                self._revive(node, given)
                revived += len(node.pages)
            else:
                own = [self.page_info[page].device_slot for page in node.pages]
                duplicates.extend(s for s, o in zip(given, own, strict=True) if s != o)
            loading = loading or state is Residency.LOADING
        new_pages = 0 if loading else total - walk.matched_pages
        if loading:
            duplicates.extend(slots[walk.matched_pages :])
        self.device.free(duplicates)
        deepest = walk.last
        if new_pages:
            start = walk.matched_pages * self.page_size
            leaf_tokens = tokens[start : total * self.page_size]
            pages = chain_page_hashes(leaf_tokens, self.page_size, namespace, deepest.last_page)
            leaf = self.tree.add_leaf(deepest, leaf_tokens, pages, self.clock)
            for page, slot in zip(pages, slots[walk.matched_pages :], strict=True):
                self.page_info[page] = PageInfo(Residency.NEW, device_slot=slot)
                self._advance_page(page, ResidencyEvent.INSERT)
            self._count_device(leaf, +1)
            deepest = leaf
        kept = False
        if state_slot is not None:
            self.scheduler_state_slots.discard(state_slot)
            kept = not loading and self._attach_state(deepest, state_slot)
            if not kept:
                self.device_state.free([state_slot])
        if (new_pages or kept) and self.config.write_policy is WritePolicy.WRITE_THROUGH:
            self._write_through_chain(deepest)
        self._finish()
        return InsertResult(deepest.node_id, new_pages, revived, len(duplicates), kept)

    def _attach_state(self, node: Node, slot: int) -> bool:
        """Make ``slot`` the L1 state at the end of ``node`` (whose pages are valid on L1); False
        if that end already has a state on L1 (or one being loaded there)."""
        page = node.pages[-1]
        assert self.residency_of(node) in DEVICE_VALID
        state = self._state_of(page)
        if state is None:
            self.state_info[page] = PageInfo(Residency.NEW, device_slot=slot)
            self._advance_state(page, StateEvent.INSERT)
            return True
        if state is Residency.HOST:
            self.state_info[page].device_slot = slot
            self._advance_state(page, StateEvent.REVIVE)
            return True
        return False

    def _revive(self, node: Node, slots: Sequence[int]) -> None:
        for page, slot in zip(node.pages, slots, strict=True):
            self.page_info[page].device_slot = slot
            self._advance_page(page, ResidencyEvent.REVIVE)
        self._count_device(node, +1)

    # ----------------------------------------------------------------- write-through
    def _write_through_chain(self, node: Node) -> None:
        """Write ``node`` and its ancestors that have no host copy yet, top-down, as far as L2 room
        allows (host copies stay root-anchored: I3; FIFO acks keep it so while in flight)."""
        if self.config.host_pages == 0:
            return
        chain = [n for n in self.tree.ancestors(node) if self.residency_of(n) is Residency.DEVICE]
        for current in reversed(chain):
            parent = self.tree.parent(current)
            assert parent is not None
            if not self._host_claimed_or_root(parent):
                return
            if not self._alloc_host_for(current):
                return
            self._lock(current, +1)
            self._advance(current, ResidencyEvent.WRITE_START)
            states = self._moving_state(current)
            for page in states:
                self._advance_state(page, StateEvent.WRITE_START)
            self.write_ops.append(
                CopyOp(self._op_id(), current.node_id, current.pages, states=states)
            )
        if self._state_alone(node):
            self._write_state_through(node)

    def _state_alone(self, node: Node) -> bool:
        """Whether ``node``'s end state is on L1 only while its KV has (or is getting) an L2
        copy: a state attached after the node was written through."""
        return (
            not node.is_root
            and self.residency_of(node) in L1_WITH_L2
            and bool(self._moving_state(node))
        )

    def _write_state_through(self, node: Node) -> None:
        """A state-only write-through (queued behind the node's own, FIFO), if L2 has room."""
        self.tree.add_lock(node, +1)
        room = self._free_state_slot(host=True)
        self.tree.add_lock(node, -1)
        if not room:
            return
        (page,) = self._moving_state(node)
        (self.state_info[page].host_slot,) = self.host_state.alloc(1)
        self._lock(node, +1)
        self._advance_state(page, StateEvent.WRITE_START)
        self.write_ops.append(CopyOp(self._op_id(), node.node_id, (), states=(page,)))

    def _moving_state(self, node: Node) -> tuple[PageHash, ...]:
        """The state that moves L1 -> L2 with ``node`` (its end state, if on L1 only)."""
        page = node.pages[-1]
        return (page,) if self._state_of(page) is Residency.DEVICE else ()

    def _alloc_host_for(self, node: Node) -> bool:
        """Give every page of ``node`` a host slot, and its L1-only end state a host state slot
        (evicting L2 if needed); all or nothing: False, nothing allocated, if impossible."""
        needed = len(node.pages)
        if needed > self.host.free_count:
            self.tree.add_lock(node, +1)
            self._evict_host(needed - self.host.free_count)
            self.tree.add_lock(node, -1)
        if needed > self.host.free_count:
            return False
        states = self._moving_state(node)
        if states:
            self.tree.add_lock(node, +1)
            room = self._free_state_slot(host=True)
            self.tree.add_lock(node, -1)
            if not room:
                return False
            (self.state_info[states[0]].host_slot,) = self.host_state.alloc(1)
        for page, slot in zip(node.pages, self.host.alloc(needed), strict=True):
            self.page_info[page].host_slot = slot
        return True

    def ack_write(self) -> int:
        """The oldest pending write-through completes (acks are FIFO). Returns its page count."""
        if not self.write_ops:
            raise MisuseError("no write-through is pending")
        op = self.write_ops[0]
        state = WRITE_OP.next(op.state, OpEvent.ACK)
        self._tick()
        self.write_ops.popleft()
        op.state = state
        for page in op.pages:
            info = self.page_info[page]
            assert info.device_slot is not None and info.host_slot is not None
            self.host.write(info.host_slot, self.device.read(info.device_slot))
            self._advance_page(page, ResidencyEvent.WRITE_ACK)
        for page in op.states:
            self._copy_state(page, to_host=True)
            self._advance_state(page, StateEvent.WRITE_ACK)
        self._lock(self.tree.node(op.node_id), -1)
        node = self.tree.node(op.node_id)
        if self.has_l3:
            self._enqueue_backup(node.namespace, op.pages, op.states)
        self._finish()
        return len(op.pages)

    def _copy_state(self, page: PageHash, *, to_host: bool) -> None:
        """Copy one state between its L1 and L2 slots (reading the source: I5/I7)."""
        info = self.state_info[page]
        assert info.device_slot is not None and info.host_slot is not None
        if to_host:
            self.host_state.write(info.host_slot, self.device_state.read(info.device_slot))
        else:
            self.device_state.write(info.device_slot, self.host_state.read(info.host_slot))

    def fail_write(self) -> int:
        """A write-through copy failed. Every pending write-through fails with it (a later op may
        cover a child of a page that now has no host copy: I3), in FIFO order: their pages stay on
        L1 only and their host slots are given back (a smaller L2, never wrong bytes). Returns the
        number of pages."""
        if not self.write_ops:
            raise MisuseError("no write-through is pending")
        for op in self.write_ops:
            WRITE_OP.next(op.state, OpEvent.FAIL)
        self._tick()
        pages = 0
        while self.write_ops:
            op = self.write_ops.popleft()
            op.state = WRITE_OP.next(op.state, OpEvent.FAIL)
            slots = []
            for page in op.pages:
                info = self.page_info[page]
                assert info.host_slot is not None
                slots.append(info.host_slot)
                info.host_slot = None
                self._advance_page(page, ResidencyEvent.WRITE_FAIL)
            self.host.free(slots)
            for page in op.states:
                info = self.state_info[page]
                assert info.host_slot is not None
                self.host_state.free([info.host_slot])
                info.host_slot = None
                self._advance_state(page, StateEvent.WRITE_FAIL)
            self._lock(self.tree.node(op.node_id), -1)
            pages += len(op.pages)
        self._finish()
        return pages

    # ----------------------------------------------------------------- backup (L2 -> L3)
    def _enqueue_backup(
        self,
        namespace: Namespace,
        pages: tuple[PageHash, ...],
        states: tuple[PageHash, ...] = (),
    ) -> None:
        for page in pages:
            self.page_info[page].host_pins += 1
        for page in states:
            self.state_info[page].host_pins += 1
        self.backup_ops.append(BackupOp(self._op_id(), namespace, pages, states=states))

    def _backup_op(self, state: BackupState) -> BackupOp:
        for op in self.backup_ops:
            if op.state is state:
                return op
        raise MisuseError(f"no backup op is {state.value}")

    def start_backup(self) -> int:
        """The store worker starts the oldest queued backup: exists-then-put-missing, puts begun."""
        op = self._backup_op(BackupState.QUEUED)
        state = BACKUP_OP.next(op.state, BackupEvent.START)
        self._tick()
        begun: list[StoreKey] = []
        for page in op.pages:
            for _component, key in self._page_objects(op.namespace, page):
                if self.store.begin_put(key):
                    begun.append(key)
        for page in op.states:
            for _component, key in self._state_objects(op.namespace, page):
                if self.store.begin_put(key):
                    begun.append(key)
        op.begun = tuple(begun)
        op.attempts += 1
        op.state = state
        self._finish()
        return op.op_id

    def ack_backup(self) -> int:
        """The oldest in-flight backup completes: its objects become visible, host pins drop.

        A key this op did not write (``begin_put`` said another writer had it) may still be
        invisible if that writer has not finished or failed; such pages are queued again rather
        than reported as backed up (I2, I4). Returns the number of pages now durable in L3."""
        op = self._backup_op(BackupState.IN_FLIGHT)
        begun = set(op.begun)
        page_objects = [self._page_objects(op.namespace, p) for p in op.pages]
        state_objects = [self._state_objects(op.namespace, p) for p in op.states]
        visible_after = [
            all(key in begun or self.store.contains(key) for _c, key in objects)
            for objects in page_objects
        ]
        states_after = [
            all(key in begun or self.store.contains(key) for _c, key in objects)
            for objects in state_objects
        ]
        event = BackupEvent.ACK if all(visible_after + states_after) else BackupEvent.RETRY
        state = BACKUP_OP.next(op.state, event)
        self._tick()
        for page, objects in zip(op.pages, page_objects, strict=True):
            info = self.page_info[page]
            assert info.host_slot is not None
            content = self.host.read(info.host_slot)
            for component, key in objects:
                if key in begun:
                    self.store.end_put(key, (content, component))
        for page, objects in zip(op.states, state_objects, strict=True):
            info = self.state_info[page]
            assert info.host_slot is not None
            named = self._state_page(self.host_state.read(info.host_slot))
            for component, key in objects:
                if key in begun:
                    self.store.end_put(key, (named, component))
        done = [page for page, ok in zip(op.pages, visible_after, strict=True) if ok]
        for page in done:
            self.page_info[page].host_pins -= 1
        for page, ok in zip(op.states, states_after, strict=True):
            if ok:
                self.state_info[page].host_pins -= 1
        op.state = state
        op.begun = ()
        self.backup_ops.remove(op)
        if state is BackupState.QUEUED:
            op.pages = tuple(p for p, ok in zip(op.pages, visible_after, strict=True) if not ok)
            op.states = tuple(p for p, ok in zip(op.states, states_after, strict=True) if not ok)
            self.backup_ops.append(op)
        self._finish()
        return len(done)

    def fail_backup(self) -> int:
        """The oldest in-flight backup fails: its puts are aborted and it is queued again (retried
        later, never dropped; host pages stay pinned)."""
        op = self._backup_op(BackupState.IN_FLIGHT)
        state = BACKUP_OP.next(op.state, BackupEvent.FAIL)
        self._tick()
        for key in op.begun:
            self.store.abort_put(key)
        op.begun = ()
        op.state = state
        self.backup_ops.remove(op)
        self.backup_ops.append(op)
        self._finish()
        return len(op.pages)

    def store_evict(self, key: StoreKey) -> bool:
        """The store drops one object on its own (eviction, owner gone)."""
        if not isinstance(key, StoreKey):
            raise MisuseError(f"the store takes StoreKey values only, got {type(key).__name__}")
        self._tick()
        dropped = self.store.evict(key)
        self._finish()
        return dropped

    # ----------------------------------------------------------------- locks
    def lock(self, node_id: int) -> None:
        node = self.tree.node(node_id)
        if node.is_root:
            raise MisuseError("the root cannot be locked")
        self._tick()
        self._lock(node, +1)
        self._finish()

    def unlock(self, node_id: int) -> None:
        node = self.tree.node(node_id)
        external = node.pins - self._op_pins(node)
        if node.is_root or external <= 0:
            raise MisuseError(f"node {node_id} is not locked by the caller")
        self._tick()
        self._lock(node, -1)
        self._finish()

    def _op_pins(self, node: Node) -> int:
        """Locks held on ``node`` by in-flight operations (not by the caller)."""
        ops = [*self.write_ops, *self.load_ops]
        held = sum(1 for op in ops if op.node_id == node.node_id)
        held += sum(
            1
            for op in self.prefetch_ops.values()
            if op.anchor_id == node.node_id
            and op.state in (PrefetchState.LOADING, PrefetchState.COMPLETE)
        )
        return held

    # ----------------------------------------------------------------- eviction
    def evict_device(self, pages: int) -> int:
        """Free at least ``pages`` L1 pages if possible (LRU over unlocked L1 leaves)."""
        if not isinstance(pages, int) or pages < 0:
            raise MisuseError(f"pages must be an int >= 0, got {pages!r}")
        self._tick()
        freed = self._evict_device(pages)
        self._finish()
        return freed

    def _device_leaves(self) -> list[Node]:
        out = []
        for node in self.tree.non_root_nodes():
            if node.lock_ref or self.residency_of(node) not in DEVICE_VALID:
                continue
            children = (self.tree.nodes[c] for c in node.children.values())
            if any(self.residency_of(child) in DEVICE_CLAIMED for child in children):
                continue
            out.append(node)
        return sorted(out, key=lambda n: (n.last_access, n.node_id))

    def _evict_device(self, pages: int) -> int:
        freed = 0
        while freed < pages:
            leaves = self._device_leaves()
            if not leaves:
                break
            node = leaves[0]
            freed += len(node.pages)
            slots = [self._device_slot(page) for page in node.pages]
            self._count_device(node, -1)
            state = self.residency_of(node)
            if state is Residency.BOTH:
                self._advance(node, ResidencyEvent.DEMOTE)
                if self._state_of(node.pages[-1]) in L1_DROPPABLE:
                    self._drop_state(node.pages[-1], host=False)
            elif self.config.write_policy is WritePolicy.WRITE_BACK and self._stage(node):
                pass
            else:
                self._advance(node, ResidencyEvent.DELETE)
                self._forget(node)
            for page in node.pages:
                if page in self.page_info:
                    self.page_info[page].device_slot = None
            self.device.free(slots)
        return freed

    def _stage(self, node: Node) -> bool:
        """write_back: copy an evicted L1-only node to L2 (blocking) if it keeps I3 and fits."""
        parent = self.tree.parent(node)
        if parent is None or not self._host_claimed_or_root(parent) or self.config.host_pages == 0:
            return False
        if not self._alloc_host_for(node):
            return False
        for page in node.pages:
            info = self.page_info[page]
            assert info.device_slot is not None and info.host_slot is not None
            self.host.write(info.host_slot, self.device.read(info.device_slot))
        self._advance(node, ResidencyEvent.STAGE)
        states = self._moving_state(node)
        for page in states:
            self._copy_state(page, to_host=True)
            info = self.state_info[page]
            assert info.device_slot is not None
            self.device_state.free([info.device_slot])
            info.device_slot = None
            self._advance_state(page, StateEvent.STAGE)
        if self.has_l3:
            self._enqueue_backup(node.namespace, node.pages, states)
        return True

    def _forget(self, node: Node) -> None:
        """Drop a deleted node: its page records, and the state at its end with its slot."""
        page = node.pages[-1]
        info = self.state_info.get(page)
        if info is not None:
            self._drop_state(page, host=info.residency is Residency.HOST)
        for page in node.pages:
            del self.page_info[page]
        self.tree.remove_leaf(node)

    def evict_host(self, pages: int) -> int:
        """Free at least ``pages`` L2 pages if possible (LRU over unpinned host-only leaves)."""
        if not isinstance(pages, int) or pages < 0:
            raise MisuseError(f"pages must be an int >= 0, got {pages!r}")
        self._tick()
        freed = self._evict_host(pages)
        self._finish()
        return freed

    def _host_leaves(self) -> list[Node]:
        out = [
            node
            for node in self.tree.non_root_nodes()
            if not node.children
            and not node.lock_ref
            and self.residency_of(node) is Residency.HOST
            and all(self.page_info[page].host_pins == 0 for page in node.pages)
            and not self._state_pinned(node)
        ]
        return sorted(out, key=lambda n: (n.last_access, n.node_id))

    def _state_pinned(self, node: Node) -> bool:
        """Whether a backup still reads the L2 copy of the state at ``node``'s end."""
        info = self.state_info.get(node.pages[-1])
        return info is not None and info.host_pins > 0

    def evict_state(self, node_id: int, *, host: bool = False) -> None:
        """Drop the trailing state at the end of ``node_id`` from L1 (or, with ``host``, from L2)
        without touching its KV; the tree then reports less, never wrong (side pools only).

        The state must have a copy in that tier that is not being copied (not ``WRITING`` or
        ``LOADING``), its node must be unlocked, and an L2 copy must not be pinned by a backup;
        otherwise :class:`MisuseError`, nothing changed."""
        node = self.tree.node(node_id)
        if not self.has_states:
            raise MisuseError("no TRAILING_PAGES side pool: this cache keeps no states")
        if node.is_root:
            raise MisuseError("the root holds no state")
        page = node.pages[-1]
        info = self.state_info.get(page)
        tier = "L2" if host else "L1"
        allowed = L2_DROPPABLE if host else L1_DROPPABLE
        if info is None or info.residency not in allowed:
            state = "none" if info is None else info.residency.value
            raise MisuseError(f"node {node_id} has no idle {tier} state to drop (state: {state})")
        if node.lock_ref:
            raise MisuseError(f"node {node_id} is locked: its state is in use")
        if host and info.host_pins:
            raise MisuseError(f"the L2 state of node {node_id} is pinned by a backup")
        self._tick()
        self._drop_state(page, host=host)
        self._finish()

    def _evict_host(self, pages: int) -> int:
        freed = 0
        while freed < pages:
            leaves = self._host_leaves()
            if not leaves:
                break
            node = leaves[0]
            slots = [self.page_info[page].host_slot for page in node.pages]
            self._advance(node, ResidencyEvent.DELETE)
            self._forget(node)
            self.host.free(slot for slot in slots if slot is not None)
            freed += len(slots)
        return freed

    # ----------------------------------------------------------------- load-back (L2 -> L1)
    def load_back(self, node_id: int) -> int | None:
        """Start loading the host-only chain that ends at ``node_id`` back to L1, all or nothing.
        Returns the op id, or ``None`` if skipped (below the threshold, over the quota, no room).

        With a ``TRAILING_PAGES`` side pool the state at ``node_id``'s end comes along if it is on
        L2 only (states at other node ends of the chain stay where they are); the L1 state slot
        is part of the all-or-nothing allocation. A state-only load (its node's KV already on L1)
        moves no KV, so the threshold and the quota, which bound KV pages, do not apply to it."""
        node = self.tree.node(node_id)
        self._tick()
        chain: list[Node] = []
        for current in self.tree.ancestors(node):
            if self.residency_of(current) is not Residency.HOST:
                break
            chain.append(current)
        chain.reverse()
        pages = sum(len(n.pages) for n in chain)
        quota = self.config.load_back_quota
        states = (
            (node.pages[-1],)
            if not node.is_root and self._state_of(node.pages[-1]) is Residency.HOST
            else ()
        )
        if (not chain and not states) or (
            chain
            and (
                pages * self.page_size < self.config.load_back_threshold
                or (quota is not None and pages > quota)
            )
        ):
            self._finish()
            return None
        self._lock(node, +1)
        if pages > self.device.free_count:
            self._evict_device(pages - self.device.free_count)
        if pages > self.device.free_count or (states and not self._free_state_slot(host=False)):
            self._lock(node, -1)
            self._finish()
            return None
        for current in chain:
            slots = self.device.alloc(len(current.pages))
            for page, slot in zip(current.pages, slots, strict=True):
                self.page_info[page].device_slot = slot
            self._advance(current, ResidencyEvent.LOAD_START)
        for page in states:
            (self.state_info[page].device_slot,) = self.device_state.alloc(1)
            self._advance_state(page, StateEvent.LOAD_START)
        covered = tuple(page for current in chain for page in current.pages)
        op = CopyOp(self._op_id(), node.node_id, covered, states=states)
        self.load_ops.append(op)
        self._finish()
        return op.op_id

    def ack_load(self) -> int:
        """The oldest pending load-back completes (FIFO); its nodes become L1-valid and unpinned."""
        if not self.load_ops:
            raise MisuseError("no load-back is pending")
        op = self.load_ops[0]
        state = LOAD_OP.next(op.state, OpEvent.ACK)
        self._tick()
        self.load_ops.popleft()
        op.state = state
        node = self.tree.node(op.node_id)
        for page in op.pages:
            info = self.page_info[page]
            assert info.device_slot is not None and info.host_slot is not None
            self.device.write(info.device_slot, self.host.read(info.host_slot))
            self._advance_page(page, ResidencyEvent.LOAD_ACK)
        for page in op.states:
            self._copy_state(page, to_host=False)
            self._advance_state(page, StateEvent.LOAD_ACK)
        for current in self.tree.ancestors(node):
            if current.pages[0] in op.pages:
                self._count_device(current, +1)
        self._lock(node, -1)
        self._finish()
        return len(op.pages)

    def fail_load(self) -> int:
        """A load-back copy failed. Every pending load-back fails with it (I3 for chains loaded by
        later ops), in FIFO order: their pages stay host-only and their device slots are given
        back. Returns the number of pages."""
        if not self.load_ops:
            raise MisuseError("no load-back is pending")
        for op in self.load_ops:
            LOAD_OP.next(op.state, OpEvent.FAIL)
        self._tick()
        pages = 0
        while self.load_ops:
            op = self.load_ops.popleft()
            op.state = LOAD_OP.next(op.state, OpEvent.FAIL)
            slots = []
            for page in op.pages:
                info = self.page_info[page]
                assert info.device_slot is not None
                slots.append(info.device_slot)
                info.device_slot = None
                self._advance_page(page, ResidencyEvent.LOAD_FAIL)
            self.device.free(slots)
            for page in op.states:
                info = self.state_info[page]
                assert info.device_slot is not None
                self.device_state.free([info.device_slot])
                info.device_slot = None
                self._advance_state(page, StateEvent.LOAD_FAIL)
            self._lock(self.tree.node(op.node_id), -1)
            pages += len(op.pages)
        self._finish()
        return pages

    # ----------------------------------------------------------------- prefetch (L3 -> L2)
    def prefetch_reserved(self) -> int:
        return sum(len(op.held_slots) for op in self.prefetch_ops.values())

    def prefetch(
        self, tokens: Sequence[int], namespace: Namespace = DEFAULT_NAMESPACE
    ) -> int | None:
        """Start reading from L3 what follows the local match of ``tokens``. Returns the op id, or
        ``None`` when there is nothing worth fetching or no room (rate limit: half of L2)."""
        tokens = _check_tokens(tokens)
        self._tick()
        op = self._start_prefetch(tokens, namespace)
        self._finish()
        return None if op is None else op.op_id

    def _start_prefetch(self, tokens: tuple[int, ...], namespace: Namespace) -> PrefetchOp | None:
        if not self.has_l3:
            return None
        walk = self.tree.walk(tokens, namespace, split=True)
        anchor = walk.last
        if not self._host_claimed_or_root(anchor):
            return None
        start = walk.matched_pages
        rest = tokens[start * self.page_size :]
        remaining = len(rest) // self.page_size
        if remaining == 0 or remaining * self.page_size < self.config.prefetch_threshold:
            return None
        pages = chain_page_hashes(rest, self.page_size, namespace, anchor.last_page)
        hit = self._l3_hit(namespace, pages)
        if hit == 0 or self.prefetch_reserved() + hit > self.config.host_pages // 2:
            return None
        if self.config.check and self.config.side_pools:
            assert self.config.keys is not None
            check_usable(
                self.store, self.config.keys, namespace, pages, self.config.side_pools, prefix=hit
            )
        if hit > self.host.free_count:
            self.tree.add_lock(anchor, +1)
            self._evict_host(hit - self.host.free_count)
            self.tree.add_lock(anchor, -1)
        if hit > self.host.free_count:
            return None
        if self.has_states:
            self.tree.add_lock(anchor, +1)
            room = self._free_state_slot(host=True)
            self.tree.add_lock(anchor, -1)
            if not room:
                return None
        slots = self.host.alloc(hit)
        state_slot = self.host_state.alloc(1)[0] if self.has_states else None
        if not anchor.is_root:
            self._lock(anchor, +1)
        op = PrefetchOp(
            op_id=self._op_id(),
            namespace=namespace,
            anchor_id=anchor.node_id,
            prefix_tokens=tokens[: start * self.page_size],
            page_tokens=tuple(self.tree.page_tokens(rest, i) for i in range(hit)),
            pages=pages[:hit],
            host_slots=slots,
            started=self.clock,
            state_slot=state_slot,
        )
        self.prefetch_ops[op.op_id] = op
        return op

    def _prefetch_op(self, op_id: int) -> PrefetchOp:
        op = self.prefetch_ops.get(op_id)
        if op is None:
            raise MisuseError(f"no prefetch op {op_id}")
        return op

    def prefetch_arrive(self, op_id: int, pages: int = 1) -> int:
        """Up to ``pages`` more pages of op ``op_id`` are read from the store, in order. A page whose
        objects are not all in the store any more ends the op there (the rest is a miss).

        Each page's read covers its KV and every ``ALL_PAGES`` side object (one batch). With a
        ``TRAILING_PAGES`` pool, once the KV range is known (every page arrived or the rest is a
        miss) the state is read: that of the last arrived page, or of the deepest arrived page
        whose state is still in the store (the pages after it are dropped: usable only up to a
        state, I6)."""
        op = self._prefetch_op(op_id)
        PREFETCH_OP.next(op.state, PrefetchEvent.ARRIVE)
        if pages <= 0:
            raise MisuseError(f"pages must be > 0, got {pages}")
        self._tick()
        for _ in range(pages):
            if op.arrived >= op.limit:
                break
            index = op.arrived
            page = op.pages[index]
            keys = [key for _component, key in self._page_objects(op.namespace, page)]
            contents = [self.store.get(key) for key in keys]
            if any(content is None for content in contents):
                op.limit = index
                break
            first = contents[0]
            assert isinstance(first, tuple)
            self.host.write(op.host_slots[index], first[0])
            op.arrived += 1
        if op.arrived >= op.limit:
            if op.state_slot is not None:
                self._read_state(op)
            op.state = PREFETCH_OP.next(op.state, PrefetchEvent.COMPLETE)
        self._finish()
        return op.arrived

    def _read_state(self, op: PrefetchOp) -> None:
        """The KV range of ``op`` is known: read the state of its deepest arrived page that has
        one in the store into the op's state slot, and drop the arrived pages after it."""
        assert op.state_slot is not None

        def probe(index: int) -> bool:
            objects = self._state_objects(op.namespace, op.pages[index])
            return all(self.store.contains(key) for _component, key in objects)

        usable = usable_prefix(op.arrived, [(HitPolicy.TRAILING_PAGES, probe)])
        op.arrived = op.limit = usable
        if usable:
            page = op.pages[usable - 1]
            contents = [
                self.store.get(key) for _component, key in self._state_objects(op.namespace, page)
            ]
            first = contents[0]
            assert isinstance(first, tuple) and None not in contents
            self.host_state.write(op.state_slot, self.state_content(first[0]))
            op.state_page = page

    def prefetch_ready(self, op_id: int) -> bool:
        """Whether the scheduler stops waiting for ``op_id`` now, under the configured policy."""
        op = self._prefetch_op(op_id)
        return wait_over(
            self.config.prefetch_policy,
            loading=op.state is PrefetchState.LOADING,
            waited=self.clock - op.started,
            limit=self.config.prefetch_timeout.limit(len(op.pages) * self.page_size),
        )

    def tick(self, steps: int = 1) -> None:
        """Let ``steps`` steps of time pass (for timeouts)."""
        if steps < 0:
            raise MisuseError("time does not run backwards")
        self.clock += steps

    def prefetch_commit(self, op_id: int) -> int:
        """Insert the pages that arrived as host-only nodes; returns how many were added. Slots of
        pages still in flight stay reserved until :meth:`prefetch_drain`."""
        op = self._prefetch_op(op_id)
        state = PREFETCH_OP.next(op.state, PrefetchEvent.COMMIT)
        self._tick()
        anchor = self.tree.node(op.anchor_id)
        if not anchor.is_root:
            self._lock(anchor, -1)
        added = self._commit_pages(op)
        if op.state_page is not None and not op.state_released:
            self._commit_state(op)
        op.released = op.arrived
        op.state = state
        self._settle(op)
        self._finish()
        return added

    def _commit_pages(self, op: PrefetchOp) -> int:
        """Attach the arrived pages under the node the prefix ends at. Pages that are already in the
        tree give their slot back; the rest become one host-only leaf if its parent has a host copy
        (I3), else they are given back too."""
        arrived = op.arrived
        tokens = op.prefix_tokens + tuple(t for page in op.page_tokens[:arrived] for t in page)
        walk = self.tree.walk(tokens, op.namespace, split=True)
        have = min(arrived, walk.matched_pages - len(op.prefix_tokens) // self.page_size)
        spare = list(op.host_slots[:have])
        added = 0
        if have < arrived and self._host_claimed_or_root(walk.last):
            pages = op.pages[have:arrived]
            leaf_tokens = tokens[len(op.prefix_tokens) + have * self.page_size :]
            self.tree.add_leaf(walk.last, leaf_tokens, pages, self.clock)
            for page, slot in zip(pages, op.host_slots[have:arrived], strict=True):
                self.page_info[page] = PageInfo(Residency.NEW, host_slot=slot)
                self._advance_page(page, ResidencyEvent.COMMIT_PREFETCH)
            added = len(pages)
        else:
            spare.extend(op.host_slots[have:arrived])
        self.host.free(spare)
        return added

    def _commit_state(self, op: PrefetchOp) -> None:
        """The state read by ``op`` becomes the L2 state at the end of its last arrived page if
        that page is in the tree, valid on L2 and without a state; else its slot is freed."""
        page, slot = op.state_page, op.state_slot
        assert page is not None and slot is not None
        info = self.page_info.get(page)
        if info is not None and info.residency in HOST_VALID and page not in self.state_info:
            self.state_info[page] = PageInfo(Residency.NEW, host_slot=slot)
            self._advance_state(page, StateEvent.COMMIT_PREFETCH)
        else:
            self.host_state.free([slot])
        op.state_released = True

    def prefetch_abort(self, op_id: int) -> None:
        """The request went away: release everything the op reserved (in-flight slots after drain)."""
        op = self._prefetch_op(op_id)
        state = PREFETCH_OP.next(op.state, PrefetchEvent.ABORT)
        self._tick()
        anchor = self.tree.node(op.anchor_id)
        if not anchor.is_root:
            self._lock(anchor, -1)
        self.host.free(op.host_slots[: op.arrived])
        op.released = op.arrived
        op.state = state
        self._settle(op)
        self._finish()

    def prefetch_drain(self, op_id: int) -> None:
        """The I/O worker confirms it will not write into op ``op_id``'s slots any more."""
        op = self._prefetch_op(op_id)
        state = PREFETCH_OP.next(op.state, PrefetchEvent.DRAIN)
        self._tick()
        op.state = state
        self._settle(op)
        self._finish()

    def _settle(self, op: PrefetchOp) -> None:
        if op.state is PrefetchState.DONE:
            self.host.free(op.host_slots[op.released :])
            op.released = len(op.host_slots)
            if op.held_state_slot is not None:
                self.host_state.free([op.held_state_slot])
                op.state_released = True
            del self.prefetch_ops[op.op_id]

    # ----------------------------------------------------------------- misc
    def pending(self) -> dict[str, int]:
        return {
            "write": len(self.write_ops),
            "load": len(self.load_ops),
            "backup": len(self.backup_ops),
            "prefetch": len(self.prefetch_ops),
        }
