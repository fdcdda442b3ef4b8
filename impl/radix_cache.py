"""The hierarchical radix cache: a paged radix tree over an L1 device pool and an L2 host pool
(SPEC §3), held to :class:`kvstrata.model.cache.CacheModel` by the differential stateful test.

Theory of operation
-------------------
* The scheduler-facing protocol is the model's: ``match_prefix`` (longest cached prefix, splitting the
  node it ends inside), ``alloc_device`` (fresh L1 pages for the KV a request is about to compute,
  evicting as needed), ``insert`` (the cache takes ownership of every page it is given), ``lock`` /
  ``unlock`` (path locks), ``evict`` / ``evict_host``, ``load_back`` and ``check_events``.
* Everything is single-threaded on the scheduler's side. Copies run on the transfer controller's worker
  and only become visible to the tree in :meth:`HierarchicalRadixCache.check_events`, in FIFO order.
* Residency is kept per node (every page of a node shares it) and advanced only through the model's
  ``PAGE_RESIDENCY`` table. A pending copy holds the page index arrays it was enqueued with and the list
  of nodes covering them; a split adds the new prefix node to that list, so an ack always reaches every
  page the copy covered (I4: the "lost split" bug cannot happen by construction).
* ``clock`` is a step counter (one tick per public call), not wall time: LRU order is deterministic and
  identical to the model's.
* Bad input raises a typed error (:mod:`kvstrata.impl.errors`) before anything changes.

Side pools (SPEC §5, opt-in through ``RadixCacheConfig.side_pools``)
-------------------------------------------------------------------
With no side pools nothing below runs (one ``if self._states`` per call) and every result, node id, op
id and page index is what it was before side pools existed.

* ``ALL_PAGES`` pools (indexer keys) share the KV page indices on L1 and L2: their residency *is* the
  page's and nothing is tracked; their bytes follow every KV page copy because the copy function
  :meth:`HierarchicalRadixCache.build` installs is :func:`~kvstrata.impl.pools.group.copy_between`.
* ``TRAILING_PAGES`` pools (Mamba state) hold one *state* per node end in state slots of their own
  (``device_states`` on L1, ``host_states`` on L2; one slot indexes the same entry of every trailing
  pool). A state is a :class:`StateInfo` keyed by the node whose **end** it sits at, with its own
  residency advanced only through the model's ``STATE_RESIDENCY`` table. A split keeps the node
  object on the suffix, which keeps the node end, so a split can neither move nor lose a state: the
  new prefix node simply has none (the model keys states by the last page's hash: the same fact).
* The semantics mirror :class:`kvstrata.model.cache.CacheModel` rule for rule (the hybrid differential
  compares them step by step): ``match_prefix`` cuts the L1 prefix back to the deepest node end whose
  state is valid on L1 and the L2 continuation to the deepest node end whose state is valid on L2;
  write-through, stage, demote, delete and load-back carry the node end's state with its pages (host
  or device allocation atomic over pages and the state slot); a state attached to a node already on
  L2 gets a state-only write-through; ``evict_state`` drops one copy. A copy op fixes its state
  transfer (:class:`~kvstrata.impl.transfer.PoolTransfer` per trailing pool) and the node whose end
  it serves at enqueue (I4).

Indices are page indices (one per ``page_size`` tokens), never token indices.

What a node stores
------------------
No token ids. A node holds its pages' 16-byte keyed NH fingerprints (``fps``, computed for a whole
request in one call, :mod:`kvstrata.impl.fingerprint`, which argues the 2**-64 collision bound per pair
of compared pages) and is found under its parent by its first page's fingerprint. Matching a node is
one ``bytes.startswith`` on the request's fingerprints; matching inside it (a split) one numpy
comparison. With ``RadixCacheConfig.page_hashes`` (the default; L3 needs it) a node also holds the
SHA-256 chain digests of its pages (32 bytes each, SPEC §4), computed only for the pages an insert
adds; without it nothing is hashed, ``hashes`` stays empty and
:meth:`HierarchicalRadixCache.page_hashes` refuses. At page 64 that is 0.25 B/token of fingerprints
(+0.5 with hashes) against 4 B/token of token ids.

Hot path
--------
Nothing on the scheduler path reads a page hash, so ``insert`` does not wait for them: the new pages'
chain goes to a :class:`~kvstrata.impl.hashing.BackgroundHasher` (``RadixCacheConfig.hash_worker``,
with the C kernels) and the node keeps a :class:`~kvstrata.impl.hashing.PendingDigests` view until a
reader (L3 backup or prefetch, ``page_hashes()``) resolves it; a split splits the view, never the
job. Fingerprints come from one C call per request (:mod:`kvstrata.impl.kernels`). The LRU order of
L1 leaves is a lazy heap of ``(last_access, id, node)``: an entry is pushed only where a node may be
an unlocked L1 leaf (see :meth:`HierarchicalRadixCache._touch`), and stale entries are skipped on
pop.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import attrs
import numpy as np
import numpy.typing as npt

from kvstrata.impl.config import RadixCacheConfig, StorageConfig
from kvstrata.impl.errors import CapacityError, ConfigError, MisuseError
from kvstrata.impl.fingerprint import (
    FINGERPRINT_BYTES,
    Fingerprinter,
    common_pages,
    fingerprint_keys,
)
from kvstrata.impl.hashing import (
    BackgroundHasher,
    Digests,
    InlineHasher,
    PageHasher,
    digests_tail,
    resolve,
    split_digests,
)
from kvstrata.impl.kernels import NATIVE, check_pages, sha256_chain
from kvstrata.impl.l3 import L3Tier
from kvstrata.impl.metrics import CacheStats
from kvstrata.impl.pools import KVPool, PageAllocator, copy_pages
from kvstrata.impl.pools.group import PoolGroup, copy_between
from kvstrata.impl.pools.host import HostKVPool
from kvstrata.impl.pools.side import SideBuffer, SideSpec, copy_entries
from kvstrata.impl.storage.base import StorageBackend, check_attachable
from kvstrata.impl.storage.hybrid import HybridStorage
from kvstrata.impl.transfer import (
    Completion,
    Direction,
    Executor,
    PoolTransfer,
    SideCopyFunction,
    TransferController,
)
from kvstrata.model.cache import WritePolicy
from kvstrata.model.hybrid import HitPolicy
from kvstrata.model.keys import DEFAULT_NAMESPACE, Namespace, PageHash
from kvstrata.model.lifecycles import (
    DEVICE_CLAIMED,
    DEVICE_VALID,
    HOST_CLAIMED,
    HOST_VALID,
    L1_DROPPABLE,
    L1_WITH_L2,
    L2_DROPPABLE,
    LOAD_OP,
    PAGE_RESIDENCY,
    STATE_RESIDENCY,
    WRITE_OP,
    OpEvent,
    OpState,
    Residency,
    ResidencyEvent,
    StateEvent,
)

__all__ = [
    "Allocator",
    "CacheEvent",
    "HierarchicalRadixCache",
    "InsertResult",
    "MatchResult",
    "Node",
    "StateInfo",
]

Pages = npt.NDArray[np.int64]
# tuples: membership tests identity first, no Python-level Enum.__hash__ call
_DEVICE_VALID_T = tuple(DEVICE_VALID)
_HOST_VALID_T = tuple(HOST_VALID)
_DEVICE_CLAIMED_T = tuple(DEVICE_CLAIMED)
_HOST_CLAIMED_T = tuple(HOST_CLAIMED)
_EMPTY: Pages = np.zeros(0, dtype=np.int64)
_MAX_TOKEN = 2**32 - 1
_UINT32 = np.dtype("<u4")
_L1_STATE = tuple(L1_DROPPABLE)  # states whose L1 copy may be dropped
_L2_STATE = tuple(L2_DROPPABLE)  # states whose L2 copy may be dropped
_L1_WITH_L2 = tuple(L1_WITH_L2)


class Allocator(Protocol):
    """What the cache needs from a pool's page allocator."""

    @property
    def free_count(self) -> int: ...

    @property
    def num_pages(self) -> int: ...

    def alloc(self, n: int, /) -> npt.NDArray[np.integer[Any]]: ...

    def free(self, pages: npt.NDArray[np.int64], /) -> None: ...


class Node:
    """A run of whole pages. ``fps`` holds the pages' fingerprints (16 bytes each; the first one is the
    node's key among its parent's children), ``digests`` their SHA-256 chain digests (32 bytes each,
    a :class:`~kvstrata.impl.hashing.PendingDigests` view while a worker hashes them, or empty when
    page hashes are off; ``hashes`` resolves them), ``device`` / ``host`` their page indices. A root
    has no pages and no parent."""

    __slots__ = (
        "backup_pins",
        "children",
        "device",
        "digests",
        "fps",
        "hits",
        "host",
        "id",
        "last_access",
        "load_op",
        "lock_ref",
        "namespace",
        "parent",
        "pins",
        "state",
        "write_op",
    )

    def __init__(
        self,
        node_id: int,
        parent: Node | None,
        namespace: Namespace,
        *,
        fps: bytes,
        hashes: Digests,
        state: Residency | None,
    ) -> None:
        self.id = node_id
        self.parent = parent
        self.namespace = namespace
        self.fps = fps
        self.digests = hashes
        self.state = state
        self.children: dict[bytes, Node] = {}
        self.device: Pages | None = None
        self.host: Pages | None = None
        self.lock_ref = 0
        self.pins = 0
        self.last_access = 0
        self.hits = 0
        self.write_op: CopyOp | None = None
        self.load_op: CopyOp | None = None
        self.backup_pins = 0  # L3 backup ops reading this node's host pages

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def num_pages(self) -> int:
        return len(self.fps) // FINGERPRINT_BYTES

    @property
    def hashes(self) -> bytes:
        """The page digests as bytes (waiting for the hashing worker if they are pending)."""
        digests = self.digests
        if type(digests) is not bytes:
            digests = self.digests = resolve(digests)
        return digests

    def page_hash(self, index: int) -> PageHash:
        """The SHA-256 page hash of page ``index`` (page hashes on)."""
        return PageHash(self.hashes[index * 32 : (index + 1) * 32])

    @property
    def last_hash(self) -> PageHash | None:
        return self.page_hash(self.num_pages - 1) if self.digests else None

    def __repr__(self) -> str:
        state = None if self.state is None else self.state.value
        return (
            f"Node(id={self.id}, pages={self.num_pages}, state={state}, lock_ref={self.lock_ref})"
        )


class StateInfo:
    """The trailing (Mamba) state at one node end (side pools, SPEC §5): its residency, advanced only
    through ``STATE_RESIDENCY``, and its L1 / L2 state slots. Invariants (as the model's): a slot is
    held in a tier exactly where the residency claims one (``device`` for DEVICE / WRITING / BOTH /
    LOADING, ``host`` for WRITING / BOTH / HOST / LOADING), and the state is valid in a tier only where
    its node's pages are. ``host_pins`` counts L3 backup ops still reading the L2 copy: a pinned L2
    copy is never dropped (the model's ``PageInfo.host_pins`` of a state)."""

    __slots__ = ("device", "host", "host_pins", "residency")

    def __init__(self, residency: Residency, *, device: int | None = None) -> None:
        self.residency = residency
        self.device = device
        self.host: int | None = None
        self.host_pins = 0

    def __repr__(self) -> str:
        return f"StateInfo({self.residency.value}, device={self.device}, host={self.host})"


@attrs.define(eq=False)
class CopyOp:
    """A pending L1 <-> L2 copy. ``nodes`` are the nodes covering its pages (grown by splits);
    ``state_node`` is the node whose end state it moves too (fixed at enqueue: a split keeps the
    node end on that node object). A state-only write-through or load has no ``nodes``."""

    op_id: int
    direction: Direction
    node: Node  # the node it locks while in flight
    nodes: list[Node]
    state: OpState = OpState.PENDING
    state_node: Node | None = None


@attrs.frozen
class MatchResult:
    device_indices: Pages  # L1 pages of the cached prefix, in order
    device_node: Node  # deepest node of the L1 prefix (a root if none)
    host_pages: int  # pages of the L2-only continuation
    host_node: Node  # deepest node of that continuation (== device_node if none)
    device_state_slot: int | None = None  # L1 state slot at the end of the L1 prefix (side pools)

    @property
    def device_pages(self) -> int:
        return len(self.device_indices)


@attrs.frozen
class InsertResult:
    node: Node
    new_pages: int
    revived_pages: int
    duplicate_pages: int
    state_kept: bool = False  # the state slot given to insert now holds the last page's state


@attrs.frozen
class CacheEvent:
    """One finished copy batch as ``check_events`` applied it."""

    direction: Direction
    op_ids: tuple[int, ...]
    ok: bool


def _frozen(array: npt.NDArray[Any]) -> bool:
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


def _as_tokens(tokens: object) -> npt.NDArray[np.uint32]:
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
class _MatchMemo:
    """What ``match_prefix`` found, for the ``insert`` of the same request: valid while the tree's
    ``version`` is unchanged (no node added, removed, split or moved between residencies)."""

    fps: bytes
    namespace: Namespace
    path: list[Node]  # ends on a node boundary (the match split the node it ended inside)
    pages: int
    devices: Pages | None  # the path's L1 pages if every node of it holds valid L1 pages
    version: int
    tokens: npt.NDArray[np.uint32] | None  # the matched tokens, if frozen (see _frozen)


def _valid_device(node: Node) -> Pages:
    """The node's L1 pages if they hold valid KV, else -1 per page."""
    if node.state in _DEVICE_VALID_T:
        assert node.device is not None
        return node.device
    return np.full(node.num_pages, -1, dtype=np.int64)


class _LockstepSlots:
    """State slots of several ``TRAILING_PAGES`` pools of one tier as one allocator: slot ``s`` is
    entry ``s`` of every pool. Invariant: the pools' allocators see the same calls, so (lowest
    first) they hand out the same slots and hold the same free counts."""

    def __init__(self, allocators: Sequence[PageAllocator]) -> None:
        self._allocators = tuple(allocators)

    @property
    def free_count(self) -> int:
        return self._allocators[0].free_count

    @property
    def num_pages(self) -> int:
        return self._allocators[0].num_pages

    def alloc(self, n: int, /) -> npt.NDArray[np.integer[Any]]:
        out = [allocator.alloc(n) for allocator in self._allocators]
        assert all(np.array_equal(out[0], other) for other in out[1:]), "state pools diverged"
        return out[0]

    def free(self, pages: npt.NDArray[np.int64], /) -> None:
        for allocator in self._allocators:
            allocator.free(pages)


def _state_allocator(group: PoolGroup) -> Allocator:
    """One allocator over the state slots of every ``TRAILING_PAGES`` pool of ``group``."""
    allocators = [buffer.allocator for buffer in group.stateful if buffer.allocator is not None]
    return allocators[0] if len(allocators) == 1 else _LockstepSlots(allocators)


class HierarchicalRadixCache:
    """L1/L2 radix cache. See the module docstring for the protocol and its invariants."""

    def __init__(
        self,
        config: RadixCacheConfig,
        device: Allocator,
        host: Allocator | None = None,
        transfer: TransferController | None = None,
        copy_now: Callable[[Direction, Pages, Pages], int] | None = None,
        *,
        device_states: Allocator | None = None,
        host_states: Allocator | None = None,
        side_copy_now: SideCopyFunction | None = None,
    ) -> None:
        if (host is None) != (transfer is None):
            raise MisuseError("an L2 pool needs a transfer controller and vice versa")
        if config.write_policy is WritePolicy.WRITE_BACK and host is not None and copy_now is None:
            raise MisuseError("write_back needs a blocking copy function (copy_now)")
        self._states = bool(config.trailing_pools)  # the one check guarding all state work
        if self._states:
            if (host is not None) != (config.host_states > 0):
                raise ConfigError(
                    f"host_states: a TRAILING_PAGES side pool needs an int >= 1 with an L2 and 0 "
                    f"without one, got {config.host_states} "
                    f"({'with' if host is not None else 'without'} an L2)"
                )
            if device_states is None:
                device_states = PageAllocator(config.device_states, "L1 states")
            if host is not None and host_states is None:
                host_states = PageAllocator(config.host_states, "L2 states")
        elif device_states is not None or host_states is not None:
            raise MisuseError("state slot allocators need a TRAILING_PAGES side pool in the config")
        self._device_states = device_states
        self._host_states = host_states
        self._side_copy_now = side_copy_now
        self._state_pools = tuple(pool.name for pool in config.trailing_pools)
        self._state_info: dict[Node, StateInfo] = {}  # node -> the state at its end
        self._held_states: set[int] = set()  # L1 state slots the scheduler owns
        self.device_group: PoolGroup | None = None  # set by build() with side pools
        self.host_group: PoolGroup | None = None
        self.config = config
        self.page_size = config.page_size
        self._device = device
        self._host = host
        self._transfer = transfer
        self._copy_now = copy_now
        self._page_bytes = 4 * config.page_size
        self._hashing = config.page_hashes
        self._count_hits = config.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE
        self._fingerprint = Fingerprinter(
            fingerprint_keys(config.page_size, config.fingerprint_seed), config.page_size
        )
        self._hasher: PageHasher = (
            BackgroundHasher(self._page_bytes)
            if config.page_hashes and config.hash_worker and NATIVE
            else InlineHasher(self._page_bytes)
        )
        self.clock = 0
        self._version = 0  # bumped by every change to the tree's shape or a node's residency
        self._memo: _MatchMemo | None = None
        self._next_id = 0
        self._next_op = 0
        self.roots: dict[Namespace, Node] = {}
        self.write_ops: deque[CopyOp] = deque()
        self.load_ops: deque[CopyOp] = deque()
        self._held = np.zeros(device.num_pages, dtype=bool)  # pages the scheduler owns
        self._stamp = np.zeros(device.num_pages, dtype=np.uint32)  # check_pages' repeat marks
        self._generation = 0
        self.evictable_pages = 0
        self._device_nodes = 0  # nodes holding L1 pages, for the heap's rebuild threshold
        self._leaves: list[tuple[int, int, Node]] = []  # lazy LRU heap of L1 leaf candidates
        self.protected_pages = 0
        self._l3: L3Tier | None = None
        self.stats = CacheStats()
        self.page_nbytes = 0  # bytes of one KV page (set by build; for the byte counters)

    @classmethod
    def build(
        cls,
        config: RadixCacheConfig,
        device_pool: KVPool,
        host_pool: KVPool | None = None,
        executor: Executor | None = None,
        *,
        storage: StorageBackend | None = None,
        storage_config: StorageConfig | None = None,
        storage_executor: Executor | None = None,
        side_specs: Sequence[SideSpec] = (),
    ) -> HierarchicalRadixCache:
        """A cache over real pools: copies run on ``executor`` (a worker thread by default). With a
        ``storage`` backend (which needs a page-first host pool) L2 is backed up to L3 and
        prefetched from it; store I/O runs on ``storage_executor`` (another worker thread by
        default).

        Side pools: ``side_specs`` gives the shapes of ``config.side_pools`` (one spec per pool, in
        the same order). The cache allocates their buffers next to each KV pool: an ``ALL_PAGES``
        buffer of one entry per KV page, a ``TRAILING_PAGES`` one of ``device_states`` /
        ``host_states`` slots. ``device_group`` / ``host_group`` hold them (the scheduler writes a
        request's indexer keys at its KV pages and its state at the slot from
        ``alloc_device_state``). Every L1 <-> L2 copy moves the indexer entries of its pages and the
        state slots it carries in the same batch. With a ``storage`` backend too, the L3 tier
        drives a :class:`~kvstrata.impl.storage.hybrid.HybridStorage` over the host side buffers:
        backups carry indexer objects and node-end states, prefetch reads the usable prefix."""
        if device_pool.shape.page_size != config.page_size:
            raise ConfigError("the device pool's page size differs from the cache's page_size")
        specs = tuple(side_specs)
        if tuple(getattr(spec, "pool", None) for spec in specs) != config.side_pools:
            raise ConfigError(
                f"side_specs: expected one SideSpec per side pool of the config "
                f"{[p.name for p in config.side_pools]}, got {specs!r}"
            )
        if specs and host_pool is None and config.host_states:
            raise ConfigError(
                f"host_states: expected 0 without a host pool, got {config.host_states}"
            )
        if specs and host_pool is not None and config.trailing_pools and config.host_states < 1:
            raise ConfigError(
                f"host_states: a TRAILING_PAGES side pool with a host pool needs an int >= 1, "
                f"got {config.host_states}"
            )
        device_group = cls._side_group(specs, device_pool, config.device_states, host=False)
        if host_pool is None:
            if storage is not None:
                raise ConfigError("an L3 storage backend needs a host pool (L2) to stage pages")
            alone = cls(
                config,
                device_pool.allocator,
                device_states=_state_allocator(device_group) if config.trailing_pools else None,
            )
            alone.page_nbytes = device_pool.shape.bytes_per_page
            alone.device_group = device_group if specs else None
            return alone
        if storage is not None:
            if not isinstance(host_pool, HostKVPool):
                raise ConfigError("an L3 storage backend needs a HostKVPool as the host pool")
            if storage.keyspace.model.page_size != config.page_size:
                raise ConfigError(
                    f"the storage key space's page size ({storage.keyspace.model.page_size}) "
                    f"differs from the cache's page_size ({config.page_size})"
                )
            if not config.page_hashes:
                raise ConfigError("an L3 storage backend needs page_hashes=True (its keys)")
            if specs:  # refuse a layer_first pool before building anything
                check_attachable(host_pool, "HierarchicalRadixCache.build")
            else:
                storage.attach(host_pool)

        if specs:
            cache = cls._build_hybrid(config, device_group, host_pool, executor)
            if storage is not None:  # KV pages with their side objects (attached here)
                assert cache.host_group is not None and isinstance(host_pool, HostKVPool)
                hybrid = HybridStorage(storage, list(cache.host_group.side.values()))
                hybrid.attach(host_pool)
                cache._l3 = L3Tier(
                    cache,
                    hybrid,
                    storage_config or StorageConfig(),
                    storage_executor,
                    page_nbytes=host_pool.shape.bytes_per_page,
                )
            return cache

        def copy(direction: Direction, src: Pages, dst: Pages) -> int:
            if direction is Direction.WRITE:
                return copy_pages(device_pool, src, host_pool, dst)
            return copy_pages(host_pool, src, device_pool, dst)

        transfer = TransferController(copy, executor)
        cache = cls(config, device_pool.allocator, host_pool.allocator, transfer, copy)
        cache.page_nbytes = device_pool.shape.bytes_per_page
        if storage is not None:
            cache._l3 = L3Tier(
                cache,
                storage,
                storage_config or StorageConfig(),
                storage_executor,
                page_nbytes=host_pool.shape.bytes_per_page,
            )
        return cache

    @staticmethod
    def _side_group(
        specs: tuple[SideSpec, ...], pool: KVPool, states: int, *, host: bool
    ) -> PoolGroup:
        """``pool`` with a buffer per side spec: one entry per KV page (``ALL_PAGES``) or
        ``states`` slots (``TRAILING_PAGES``)."""
        buffers = [
            SideBuffer(
                spec,
                pool.num_pages if spec.policy is HitPolicy.ALL_PAGES else states,
                host=host,
                device=None if host else pool.device,
                pin_memory=None if host else False,
            )
            for spec in specs
        ]
        return PoolGroup(pool, buffers)

    @classmethod
    def _build_hybrid(
        cls,
        config: RadixCacheConfig,
        device_group: PoolGroup,
        host_pool: KVPool,
        executor: Executor | None,
    ) -> HierarchicalRadixCache:
        """``build`` with side pools and an L2: KV copies carry the ``ALL_PAGES`` entries of their
        pages (:func:`copy_between`), state slots travel as :class:`PoolTransfer` s."""
        specs = tuple(buffer.spec for buffer in device_group.side.values())
        host_group = cls._side_group(specs, host_pool, config.host_states, host=True)

        def copy(direction: Direction, src: Pages, dst: Pages) -> int:
            if direction is Direction.WRITE:
                return copy_between(device_group, host_group, src, dst)
            return copy_between(host_group, device_group, src, dst)

        def side_copy(direction: Direction, transfer: PoolTransfer) -> int:
            source, target = (
                (device_group, host_group)
                if direction is Direction.WRITE
                else (host_group, device_group)
            )
            buffer = source.side[transfer.pool]
            copy_entries(buffer, transfer.src, target.side[transfer.pool], transfer.dst)
            return buffer.spec.bytes_per_entry * len(transfer.src)

        transfer = TransferController(copy, executor, side_copy)
        trailing = bool(config.trailing_pools)
        cache = cls(
            config,
            device_group.kv.allocator,
            host_pool.allocator,
            transfer,
            copy,
            device_states=_state_allocator(device_group) if trailing else None,
            host_states=_state_allocator(host_group) if trailing else None,
            side_copy_now=side_copy,
        )
        cache.page_nbytes = device_group.kv.shape.bytes_per_page
        cache.device_group = device_group
        cache.host_group = host_group
        return cache

    @property
    def transfer(self) -> TransferController | None:
        return self._transfer

    @property
    def l3(self) -> L3Tier | None:
        """The L3 side (backup and prefetch state, counters), if a storage backend is attached."""
        return self._l3

    def close(self) -> None:
        """Finish queued copies, store I/O and page hashing, stop the workers and close the
        backend."""
        if self._transfer is not None:
            self._transfer.close()
        if self._l3 is not None:
            self._l3.close()
        self._hasher.close()

    @property
    def hasher(self) -> PageHasher:
        """What computes the page hashes of inserted pages (a worker thread or the caller's)."""
        return self._hasher

    # ------------------------------------------------------------------ basics
    @property
    def has_host(self) -> bool:
        return self._host is not None

    @property
    def device_free(self) -> int:
        return self._device.free_count

    @property
    def host_free(self) -> int:
        return 0 if self._host is None else self._host.free_count

    @property
    def has_states(self) -> bool:
        """Whether a ``TRAILING_PAGES`` side pool (a Mamba state per node end) is configured."""
        return self._states

    @property
    def device_states_free(self) -> int:
        """Free L1 state slots (0 without a ``TRAILING_PAGES`` pool)."""
        return 0 if self._device_states is None else self._device_states.free_count

    @property
    def host_states_free(self) -> int:
        """Free L2 state slots (0 without a ``TRAILING_PAGES`` pool or without L2)."""
        return 0 if self._host_states is None else self._host_states.free_count

    def _tick(self) -> None:
        self.clock += 1

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _new_op(self) -> int:
        self._next_op += 1
        return self._next_op

    @staticmethod
    def namespace_of(extra_key: str | Namespace | None) -> Namespace:
        if extra_key is None:
            return DEFAULT_NAMESPACE
        if isinstance(extra_key, Namespace):
            return extra_key
        if not isinstance(extra_key, str):
            raise MisuseError(f"extra_key must be a str or None, got {type(extra_key).__name__}")
        return Namespace(extra_key=extra_key)

    def _root(self, namespace: Namespace, create: bool) -> Node:
        root = self.roots.get(namespace)
        if root is None:
            if not create:
                return Node(0, None, namespace, fps=b"", hashes=b"", state=None)
            root = Node(self._new_id(), None, namespace, fps=b"", hashes=b"", state=None)
            self.roots[namespace] = root
        return root

    def _advance(self, node: Node, event: ResidencyEvent) -> None:
        assert node.state is not None
        node.state = PAGE_RESIDENCY.next(node.state, event)
        self._version += 1

    def _count_device(self, node: Node, sign: int) -> None:
        self._device_nodes += sign
        if node.lock_ref:
            self.protected_pages += sign * node.num_pages
        else:
            self.evictable_pages += sign * node.num_pages

    def _lock(self, node: Node, delta: int) -> None:
        """Add ``delta`` to the path lock of ``node``: its ``lock_ref`` and every ancestor's. L1 pages
        move between evictable and protected where a count leaves or reaches zero; a node whose count
        reaches zero gets a heap entry unless the node below it on the path holds L1 pages (then it is
        no L1 leaf, and whatever makes it one pushes it)."""
        node.pins += delta
        leaves = self._leaves
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

    def _raw_lock(self, node: Node, delta: int) -> None:
        """A lock that only keeps eviction away for the length of one call (no accounting)."""
        node.pins += delta
        current = node
        while current.parent is not None:
            current.lock_ref += delta
            current = current.parent

    def _finish(self) -> None:
        if self._transfer is not None:
            self._transfer.flush()

    # ------------------------------------------------------------------ side-pool states
    def _state_of(self, node: Node) -> Residency | None:
        """The residency of the state at ``node``'s end (``None``: it has none)."""
        info = self._state_info.get(node)
        return None if info is None else info.residency

    def _advance_state(self, node: Node, info: StateInfo, event: StateEvent) -> None:
        info.residency = STATE_RESIDENCY.next(info.residency, event)
        if info.residency is Residency.GONE:
            del self._state_info[node]

    def _alloc_state(self, *, host: bool) -> int:
        pool = self._host_states if host else self._device_states
        assert pool is not None
        return int(pool.alloc(1)[0])

    def _free_state(self, slot: int, *, host: bool) -> None:
        pool = self._host_states if host else self._device_states
        assert pool is not None
        pool.free(np.array([slot], dtype=np.int64))

    def _state_transfers(self, src: int, dst: int) -> tuple[PoolTransfer, ...]:
        """One state's copy, as one :class:`PoolTransfer` per trailing pool (fixed at enqueue)."""
        return tuple(PoolTransfer(name, [src], [dst]) for name in self._state_pools)

    def _drop_state(self, node: Node, *, host: bool) -> None:
        """Free the L1 (or L2) copy of the state at ``node``'s end; forgotten when none is left."""
        info = self._state_info[node]
        if host:
            slot, info.host = info.host, None
            event = StateEvent.DROP_HOST if info.residency is Residency.BOTH else StateEvent.DELETE
        else:
            slot, info.device = info.device, None
            event = StateEvent.DEMOTE if info.residency is Residency.BOTH else StateEvent.DELETE
        assert slot is not None
        self._free_state(slot, host=host)
        self._advance_state(node, info, event)

    def _forget_state(self, node: Node) -> None:
        """``node`` is being deleted: the state at its end goes with it."""
        info = self._state_info.get(node)
        if info is not None:
            self._drop_state(node, host=info.residency is Residency.HOST)

    def _state_victim(self, *, host: bool) -> Node | None:
        """The least recently used node whose end state may lose its L1 (or L2) copy: not in
        flight, on an unlocked node (the model's ``_state_victims`` order)."""
        allowed = _L2_STATE if host else _L1_STATE
        best: tuple[int, int] | None = None
        victim = None
        for node, info in self._state_info.items():
            if node.lock_ref or info.residency not in allowed or (host and info.host_pins):
                continue
            key = (node.last_access, node.id)
            if best is None or key < best:
                best, victim = key, node
        return victim

    def _new_state_info(self, node: Node, *, host: int) -> StateInfo:
        """A NEW state at ``node``'s end whose L2 copy is in ``host`` (a prefetched state)."""
        info = self._state_info[node] = StateInfo(Residency.NEW)
        info.host = host
        self._version += 1
        return info

    def _free_state_slot(self, *, host: bool) -> bool:
        """Make sure one L1 (or L2) state slot is free, dropping the LRU state copy if needed."""
        pool = self._host_states if host else self._device_states
        assert pool is not None
        if pool.free_count == 0:
            victim = self._state_victim(host=host)
            if victim is not None:
                self._drop_state(victim, host=host)
        return pool.free_count > 0

    def _moving_state(self, node: Node) -> StateInfo | None:
        """The state that moves L1 -> L2 with ``node``: its end state, if on L1 only."""
        info = self._state_info.get(node)
        return info if info is not None and info.residency is Residency.DEVICE else None

    def _state_alone(self, node: Node) -> bool:
        """Whether ``node``'s end state is on L1 only while its KV has (or is getting) an L2 copy:
        a state attached after the node was written through."""
        return (
            not node.is_root and node.state in _L1_WITH_L2 and self._moving_state(node) is not None
        )

    def _attach_state(self, node: Node, slot: int) -> bool:
        """Make ``slot`` the L1 state at the end of ``node`` (whose pages are valid on L1); False if
        that end already has a state on L1 (or one being loaded there)."""
        assert node.state in _DEVICE_VALID_T
        info = self._state_info.get(node)
        if info is None:
            info = self._state_info[node] = StateInfo(Residency.NEW, device=slot)
            self._advance_state(node, info, StateEvent.INSERT)
            return True
        if info.residency is Residency.HOST:
            info.device = slot
            self._advance_state(node, info, StateEvent.REVIVE)
            return True
        return False

    def _usable_by_state(
        self, device: list[Node], host: list[Node]
    ) -> tuple[list[Node], list[Node]]:
        """Cut the L1 prefix back to the deepest node end whose state is valid on L1; the L2
        continuation is then the nodes after that cut whose KV is valid on L2, cut back to the
        deepest node end whose state is valid on L2 (the model's rule, I6)."""
        cut = len(device)
        while cut and self._state_of(device[cut - 1]) not in _DEVICE_VALID_T:
            cut -= 1
        rest: list[Node] = []
        for node in [*device[cut:], *host]:
            if node.state not in _HOST_VALID_T:
                break
            rest.append(node)
        end = len(rest)
        while end and self._state_of(rest[end - 1]) not in _HOST_VALID_T:
            end -= 1
        return device[:cut], rest[:end]

    def _require_states(self) -> None:
        if not self._states:
            raise MisuseError("no TRAILING_PAGES side pool: this cache keeps no states")

    def alloc_device_state(self) -> int:
        """One fresh L1 state slot for the trailing state a request is about to compute, dropping
        the least recently used unlocked L1 state copy if none is free. :class:`CapacityError` if
        still none (a dropped copy stays dropped). The caller owns the slot until ``insert``
        (``state_slot=``) or :meth:`free_device_state`; it writes the state into entry ``slot`` of
        every trailing pool of ``device_group``."""
        self._require_states()
        self._tick()
        if not self._free_state_slot(host=False):
            self._finish()
            raise CapacityError("no L1 state slot is free and no L1 state can be dropped")
        slot = self._alloc_state(host=False)
        self._held_states.add(slot)
        self._finish()
        return slot

    def free_device_state(self, slot: int) -> None:
        """Give back a state slot taken with :meth:`alloc_device_state` (a request that went away)."""
        if slot not in self._held_states:
            raise MisuseError(f"L1 state slot {slot!r} is not held by the scheduler")
        self._tick()
        self._held_states.discard(slot)
        self._free_state(slot, host=False)
        self._finish()

    def held_state_slots(self) -> frozenset[int]:
        """L1 state slots the scheduler took and has not handed back yet."""
        return frozenset(self._held_states)

    def evict_state(self, node: Node, *, host: bool = False) -> None:
        """Drop the state at ``node``'s end from L1 (or, with ``host``, from L2) without touching its
        KV; matches then report less, never wrong. :class:`MisuseError`, nothing changed, unless the
        state has an idle copy in that tier (not being copied) and the node is unlocked."""
        self._require_states()
        self._check_node(node)
        info = self._state_info.get(node)
        tier = "L2" if host else "L1"
        if info is None or info.residency not in (_L2_STATE if host else _L1_STATE):
            state = "none" if info is None else info.residency.value
            raise MisuseError(f"{node!r} has no idle {tier} state to drop (state: {state})")
        if node.lock_ref:
            raise MisuseError(f"{node!r} is locked: its state is in use")
        if host and info.host_pins:
            raise MisuseError(f"the L2 state of {node!r} is pinned by a backup")
        self._tick()
        self._drop_state(node, host=host)
        self._finish()

    def state_residency(
        self,
        tokens: Sequence[int] | npt.NDArray[np.integer],
        extra_key: str | Namespace | None = None,
    ) -> tuple[Residency | None, ...]:
        """Residency of the state at the end of each full page of ``tokens`` in the tree (``None``:
        no state there); no split, no LRU touch."""
        out: list[Residency | None] = []
        for node in self._cached_path(tokens, extra_key):
            out.extend([None] * (node.num_pages - 1))
            out.append(self._state_of(node))
        return tuple(out)

    # ------------------------------------------------------------------ the tree
    def _descend(
        self, fps: bytes, namespace: Namespace
    ) -> tuple[list[Node], int, Node | None, int]:
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

    def _split(self, node: Node, pages: int) -> Node:
        """``node`` keeps the suffix (and its id, children, pins, pending ops); a new node takes the
        first ``pages`` pages and joins every pending op that covers ``node``."""
        parent = node.parent
        assert parent is not None and 0 < pages < node.num_pages
        self._version += 1
        cut = pages * FINGERPRINT_BYTES
        prefix = Node(
            self._new_id(),
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
            self._device_nodes += 1
        if node.host is not None:
            prefix.host, node.host = node.host[:pages], node.host[pages:]
        for op in (node.write_op, node.load_op):
            if op is not None:
                op.nodes.insert(op.nodes.index(node), prefix)
        prefix.write_op, prefix.load_op = node.write_op, node.load_op
        if node.backup_pins and self._l3 is not None:  # sets the prefix's pins
            self._l3.on_split(node, prefix)
        parent.children[prefix.fps[:FINGERPRINT_BYTES]] = prefix
        node.fps = node.fps[cut:]
        node.parent = prefix
        prefix.children[node.fps[:FINGERPRINT_BYTES]] = node
        return prefix

    def _add_leaf(self, parent: Node, fps: bytes, hashes: Digests, state: Residency) -> Node:
        self._version += 1
        leaf = Node(self._new_id(), parent, parent.namespace, fps=fps, hashes=hashes, state=state)
        leaf.last_access = self.clock
        parent.children[fps[:FINGERPRINT_BYTES]] = leaf
        return leaf

    def _remove_leaf(self, node: Node) -> None:
        assert node.parent is not None and not node.children and not node.lock_ref
        self._version += 1
        del node.parent.children[node.fps[:FINGERPRINT_BYTES]]
        node.parent = None
        node.state = Residency.GONE

    def _touch(self, path: list[Node], child_added: bool = False) -> None:
        """Mark ``path`` (root side first) as used now: LRU time of every node, and its hit count
        under ``write_through_selective`` (the only policy that reads it). The lazy
        heap gets a current entry for each node that may be an L1 leaf: the deepest, and any whose
        successor on the path holds no L1 pages. A node with an L1 child is no leaf; the eviction,
        ack or unlock that makes it one pushes it then, with its ``last_access`` of that time.
        ``child_added``: the caller adds an L1 leaf below the deepest node next (no leaf then)."""
        clock = self.clock
        leaves = self._leaves
        push = heapq.heappush
        claimed_below = child_added
        if self._count_hits:  # only write_through_selective reads the hit counts
            for node in path:
                node.hits += 1
        for node in reversed(path):
            node.last_access = clock
            if not claimed_below:
                push(leaves, (clock, node.id, node))
            claimed_below = node.state in _DEVICE_CLAIMED_T

    def _chain(
        self,
        query: npt.NDArray[np.uint32],
        first: int,
        parent: Node,
        namespace: Namespace,
        frozen: bool,
    ) -> Digests:
        """The SHA-256 digests of the whole pages of ``query`` from page ``first`` on, chained from
        ``parent``'s last page (or the namespace seed), as the hasher returns them (pending while a
        worker hashes); empty when page hashes are off. ``frozen``: nobody writes to ``query``
        again (:func:`_frozen`), so a worker may read it in place."""
        if not self._hashing:
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
        return self._hasher.submit(seed, new, pages - first, frozen=frozen)

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

    # ------------------------------------------------------------------ queries
    def _walk_split(
        self, query: npt.NDArray[np.uint32], namespace: Namespace
    ) -> tuple[Node, list[Node], int, bytes]:
        """Follow ``query`` from its namespace's root (created if needed), splitting the node the
        match ends inside: the root, the matched path, its pages and the query's fingerprints."""
        fps = self._fingerprint(query)
        root = self._root(namespace, create=True)
        path, matched, partial, common = self._descend(fps, namespace)
        if partial is not None:
            path.append(self._split(partial, common))
            matched += common
        return root, path, matched, fps

    def _cached_path(
        self,
        tokens: Sequence[int] | npt.NDArray[np.integer],
        extra_key: str | Namespace | None,
    ) -> list[Node]:
        """The nodes fully covered by ``tokens`` (no split, no LRU touch)."""
        query = _as_tokens(tokens)
        namespace = self.namespace_of(extra_key)
        path, _, _, _ = self._descend(self._fingerprint(query), namespace)
        return path

    def residency(
        self,
        tokens: Sequence[int] | npt.NDArray[np.integer],
        extra_key: str | Namespace | None = None,
    ) -> tuple[Residency, ...]:
        """Residency of each full page of ``tokens`` in the tree (no split, no LRU touch)."""
        out: list[Residency] = []
        for node in self._cached_path(tokens, extra_key):
            assert node.state is not None
            out.extend([node.state] * node.num_pages)
        return tuple(out)

    def page_hashes(
        self,
        tokens: Sequence[int] | npt.NDArray[np.integer],
        extra_key: str | Namespace | None = None,
    ) -> tuple[PageHash, ...]:
        """The page hashes the tree holds for the cached pages of ``tokens`` (for L3 keys).
        :class:`MisuseError` when the cache keeps none (``RadixCacheConfig.page_hashes=False``)."""
        if not self._hashing:
            raise MisuseError(
                "page hashes are off for this cache (RadixCacheConfig.page_hashes=False)"
            )
        path = self._cached_path(tokens, extra_key)
        return tuple(node.page_hash(i) for node in path for i in range(node.num_pages))

    # ------------------------------------------------------------------ match
    def match_prefix(
        self,
        tokens: Sequence[int] | npt.NDArray[np.integer],
        extra_key: str | Namespace | None = None,
    ) -> MatchResult:
        query = _as_tokens(tokens)
        namespace = self.namespace_of(extra_key)
        self._tick()
        root, path, matched, fps = self._walk_split(query, namespace)
        device: list[Pages] = []
        device_node = host_node = root
        host_pages = 0
        in_device = True
        reached = len(path)
        for index, node in enumerate(path):
            state = node.state
            if in_device and state in _DEVICE_VALID_T:
                assert node.device is not None
                device.append(node.device)
                device_node = host_node = node
                continue
            in_device = False
            if state not in _HOST_VALID_T:
                reached = index + 1  # the match stops here: deeper nodes are not touched
                break
            host_pages += node.num_pages
            host_node = node
        self._touch(path if reached == len(path) else path[:reached])
        state_slot = None
        if self._states:  # cut both parts back to node ends with a usable state
            device_nodes = path[: len(device)]
            host_nodes = []
            for node in path[len(device) :]:
                if node.state not in _HOST_VALID_T:
                    break
                host_nodes.append(node)
            device_nodes, host_nodes = self._usable_by_state(device_nodes, host_nodes)
            device = [node.device for node in device_nodes]  # type: ignore[misc]
            device_node = device_nodes[-1] if device_nodes else root
            host_node = host_nodes[-1] if host_nodes else device_node
            host_pages = sum(node.num_pages for node in host_nodes)
            if device_nodes:
                state_slot = self._state_info[device_node].device
        indices = np.concatenate(device) if device else _EMPTY
        self._memo = _MatchMemo(
            fps,
            namespace,
            path,
            matched,
            indices if len(device) == len(path) else None,
            self._version,
            query if _frozen(query) else None,
        )
        if self.config.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            for node in path:
                if node.hits >= self.config.write_through_threshold and (
                    node.state is Residency.DEVICE or (self._states and self._state_alone(node))
                ):
                    self._write_through_chain(node)
        self._finish()
        stats = self.stats
        stats.match_tokens += len(query)
        stats.l1_hit_tokens += len(indices) * self.page_size
        stats.l2_hit_tokens += host_pages * self.page_size
        return MatchResult(indices, device_node, host_pages, host_node, state_slot)

    # ------------------------------------------------------------------ allocation and insert
    def alloc_device(self, pages: int) -> Pages:
        """Fresh L1 pages for a request's new KV (evicting unlocked L1 leaves as needed). Raises
        :class:`CapacityError` if L1 is still short; the caller owns the pages until ``insert`` or
        ``free_device``."""
        if not isinstance(pages, int) or isinstance(pages, bool) or pages < 0:
            raise MisuseError(f"pages must be an int >= 0, got {pages!r}")
        self._tick()
        if pages > self._device.free_count:
            self._evict_device(pages - self._device.free_count)
        if pages > self._device.free_count:
            self._finish()
            raise CapacityError(f"{pages} L1 pages asked, {self._device.free_count} free")
        out = np.asarray(self._device.alloc(pages), dtype=np.int64)
        self._held[out] = True
        self._finish()
        return out

    def held_pages(self) -> Pages:
        """L1 pages the scheduler took with :meth:`alloc_device` and has not handed back yet."""
        return np.flatnonzero(self._held).astype(np.int64)

    @staticmethod
    def _page_array(pages: object, what: str) -> Pages:
        """``pages`` as a 1-D C-contiguous int64 array; :class:`MisuseError` if it is no 1-D
        sequence of ints (range, repeats and ownership are :meth:`_claim`'s)."""
        if (
            type(pages) is np.ndarray
            and pages.dtype == np.int64
            and pages.ndim == 1
            and pages.flags.c_contiguous
        ):
            return pages
        array = np.asarray(pages)
        if array.size == 0:
            return _EMPTY
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise MisuseError(
                f"{what} must be a 1-D array of ints, got {array.dtype} {array.shape}"
            )
        if array.dtype.kind == "u" and int(array.max()) > np.iinfo(np.int64).max:
            raise MisuseError(f"{what}: page {int(array.max())} is out of range")
        return np.ascontiguousarray(array, dtype=np.int64)

    def _claim(self, given: Pages, own: Pages, what: str) -> Pages:
        """Check ``given`` (one L1 page per position) and take it from the scheduler: every page in
        range, none twice, each held by the scheduler or, at a position of ``own``, the tree's own
        page there. Returns the given pages at ``own``'s positions that differ from it (spare);
        :class:`MisuseError` with nothing changed otherwise (:func:`kernels.check_pages`)."""
        generation = self._generation = (self._generation + 1) & 0xFFFFFFFF
        if not generation:  # the marks wrapped around: start them afresh
            self._stamp[:] = 0
            generation = self._generation = 1
        spare = np.empty(len(own), dtype=np.int64)
        try:
            count = check_pages(given, self._held, self._stamp, generation, own, spare, True)
        except ValueError as error:
            raise MisuseError(f"{what}: {error}") from None
        return spare[:count]

    def free_device(self, pages: Sequence[int] | Pages) -> None:
        """Give back pages taken with :meth:`alloc_device` (a request that went away)."""
        array = self._page_array(pages, "pages")
        self._claim(array, _EMPTY, "pages")  # all of them the scheduler's; no longer held
        self._tick()
        self._device.free(array)
        self._finish()

    def insert(
        self,
        tokens: Sequence[int] | npt.NDArray[np.integer],
        device_indices: Sequence[int] | Pages,
        extra_key: str | Namespace | None = None,
        state_slot: int | None = None,
    ) -> InsertResult:
        """Cache the KV of ``tokens`` (whole pages; a trailing partial page is ignored).

        ``device_indices`` has one L1 page per full page: the cached pages ``match_prefix`` returned
        for the L1 prefix, pages from :meth:`alloc_device` (holding the computed KV) for the rest.
        The cache owns all of them afterwards: pages it already holds on L1 give their fresh page
        back, host-only pages are revived with it, new pages form a new leaf.

        ``state_slot`` (a ``TRAILING_PAGES`` pool only): an L1 state slot from
        :meth:`alloc_device_state` holding the state at the end of the last full page. It becomes
        that page's L1 state (the page is then a node end) unless the page already has one on L1
        (or loading), or nothing was cached below a loading node: then it is given back
        (``state_kept`` False). A slot the scheduler does not hold is a :class:`MisuseError`."""
        query = _as_tokens(tokens)
        namespace = self.namespace_of(extra_key)
        total = len(query) // self.page_size
        given = self._page_array(device_indices, "device_indices")
        if len(given) != total:
            raise MisuseError(f"{total} L1 pages needed for {total} pages, got {len(given)}")
        if state_slot is not None:
            if state_slot not in self._held_states:
                raise MisuseError(f"L1 state slot {state_slot!r} is not held by the scheduler")
            if total == 0:
                raise MisuseError("a state belongs to the end of a full page; tokens have none")
        memo = self._memo
        # the same read-only tokens the match fingerprinted: they cannot have changed since
        fps = memo.fps if memo is not None and memo.tokens is query else self._fingerprint(query)
        if (
            memo is not None
            and memo.version == self._version
            and memo.fps == fps
            and (memo.namespace is namespace or memo.namespace == namespace)
        ):  # the match of this request, with the tree unchanged since
            path, matched, partial, common = list(memo.path), memo.pages, None, 0
            devices = memo.devices
        else:
            path, matched, partial, common = self._descend(fps, namespace)
            devices = None
        # every given page is the scheduler's, or the tree's own valid L1 page at that position
        if devices is not None:
            own = devices
        else:
            own = np.concatenate([_valid_device(node) for node in path]) if path else _EMPTY
        differing = self._claim(given, own, "device_indices")  # no longer held afterwards
        self._tick()
        root = self._root(namespace, create=True)
        if partial is not None:
            path.append(self._split(partial, common))
            matched += common
        if devices is not None:  # every node holds its L1 pages: no revival, spare = the differing
            revived, spare = 0, self._give_back(differing)
            loading = False
        else:
            revived, spare, loading = self._adopt(path, given)
        deepest = path[-1] if path else root
        new_pages = 0 if loading else total - matched
        self._touch(path, child_added=new_pages > 0)
        if new_pages:
            hashes = self._chain(
                query,
                matched,
                deepest,
                namespace,
                (query is not tokens and query.base is None)
                or (memo is not None and memo.tokens is query)
                or _frozen(query),
            )
            leaf = self._add_leaf(
                deepest, fps[matched * FINGERPRINT_BYTES :], hashes, Residency.NEW
            )
            heapq.heappush(self._leaves, (leaf.last_access, leaf.id, leaf))
            self._advance(leaf, ResidencyEvent.INSERT)
            leaf.device = given[matched:].copy()
            self._count_device(leaf, +1)
            deepest = leaf
        kept = False
        if state_slot is not None:
            self._held_states.discard(state_slot)
            kept = not loading and self._attach_state(deepest, state_slot)
            if not kept:
                self._free_state(state_slot, host=False)
        if (new_pages or kept) and self.config.write_policy is WritePolicy.WRITE_THROUGH:
            self._write_through_chain(deepest)
        self._finish()
        return InsertResult(deepest, new_pages, revived, spare, kept)

    def _adopt(self, path: list[Node], given: Pages) -> tuple[int, int, bool]:
        """The cached ``path`` takes its pages of ``given``: host-only nodes are revived with them;
        where the tree already holds an L1 page (valid or loading) a different given page is spare
        and goes back to the pool. Below a node still loading back nothing is adopted: all its
        given pages are spare (the model's rule; a failed load would leave L1 pages under a
        host-only parent). Returns (revived pages, spare pages, whether a loading node cut it)."""
        revived = 0
        offset = 0
        owned: list[Pages] = []
        loading = False
        for node in path:
            pages = len(node.fps) // FINGERPRINT_BYTES
            if node.state is Residency.LOADING:  # nothing below it is adopted (I3 if it fails)
                assert node.device is not None
                owned.append(node.device)
                offset += pages
                loading = True
                break
            if node.state is Residency.HOST:
                node.device = given[offset : offset + pages].copy()
                self._advance(node, ResidencyEvent.REVIVE)
                self._count_device(node, +1)
                revived += pages
            assert node.device is not None
            owned.append(node.device)
            offset += pages
        if not owned:
            return revived, 0, False
        head = given[:offset]
        spare = head[np.concatenate(owned) != head]
        if loading:
            spare = np.concatenate([spare, given[offset:]])
        return revived, self._give_back(spare), loading

    def _give_back(self, spare: Pages) -> int:
        """Free given pages the tree did not need (it holds those positions already)."""
        if len(spare):
            self._device.free(spare)
        return len(spare)

    # ------------------------------------------------------------------ write-through
    def _write_through_chain(self, node: Node) -> None:
        if self._host is None or self._transfer is None:
            return
        chain = [n for n in self.ancestors(node) if n.state is Residency.DEVICE]
        for current in reversed(chain):
            parent = current.parent
            assert parent is not None
            if not (parent.is_root or parent.state in _HOST_CLAIMED_T):
                return
            host = self._alloc_host_for(current)
            if host is None:
                return
            current.host = host
            self._lock(current, +1)
            self._advance(current, ResidencyEvent.WRITE_START)
            op = CopyOp(self._new_op(), Direction.WRITE, current, [current])
            side: tuple[PoolTransfer, ...] = ()
            if self._states:
                info = self._moving_state(current)
                if info is not None:  # its host slot came with the pages (_alloc_host_for)
                    assert info.device is not None and info.host is not None
                    self._advance_state(current, info, StateEvent.WRITE_START)
                    op.state_node = current
                    side = self._state_transfers(info.device, info.host)
            current.write_op = op
            self.write_ops.append(op)
            assert current.device is not None
            self._transfer.enqueue(Direction.WRITE, op.op_id, current.device, host, side)
        if self._states and self._state_alone(node):
            self._write_state_through(node)

    def _write_state_through(self, node: Node) -> None:
        """A state-only write-through of ``node``'s end state (queued FIFO behind the node's own
        write-through), if L2 has a state slot (dropping the LRU idle L2 state copy if needed)."""
        assert self._transfer is not None
        self._raw_lock(node, +1)
        room = self._free_state_slot(host=True)
        self._raw_lock(node, -1)
        if not room:
            return
        info = self._state_info[node]
        assert info.device is not None
        info.host = self._alloc_state(host=True)
        self._lock(node, +1)
        self._advance_state(node, info, StateEvent.WRITE_START)
        op = CopyOp(self._new_op(), Direction.WRITE, node, [], state_node=node)
        self.write_ops.append(op)
        self._transfer.enqueue(
            Direction.WRITE, op.op_id, _EMPTY, _EMPTY, self._state_transfers(info.device, info.host)
        )

    def _alloc_host_for(self, node: Node) -> Pages | None:
        """Host pages for every page of ``node`` and, with states, a host state slot for its L1-only
        end state (set on its :class:`StateInfo`), evicting L2 if needed: all or nothing."""
        assert self._host is not None
        needed = node.num_pages
        if needed > self._host.free_count:
            self._raw_lock(node, +1)
            self._evict_host(needed - self._host.free_count)
            self._raw_lock(node, -1)
        if needed > self._host.free_count:
            return None
        if self._states:
            info = self._moving_state(node)
            if info is not None:
                self._raw_lock(node, +1)
                room = self._free_state_slot(host=True)
                self._raw_lock(node, -1)
                if not room:
                    return None
                info.host = self._alloc_state(host=True)
        return np.asarray(self._host.alloc(needed), dtype=np.int64)

    # ------------------------------------------------------------------ locks
    def _check_node(self, node: Node) -> None:
        if not isinstance(node, Node):
            raise MisuseError(f"expected a Node, got {type(node).__name__}")
        if node.is_root or node.state in (None, Residency.GONE):
            raise MisuseError(f"{node!r} is not a node of this cache")

    def _op_pins(self, node: Node) -> int:
        if not self.write_ops and not self.load_ops:
            return 0
        return sum(1 for op in (*self.write_ops, *self.load_ops) if op.node is node)

    def lock(self, node: Node) -> None:
        """Lock ``node`` and its path: none of them is evicted until :meth:`unlock`."""
        self._check_node(node)
        self._tick()
        self._lock(node, +1)

    def unlock(self, node: Node) -> None:
        self._check_node(node)
        if node.pins - self._op_pins(node) <= 0:
            raise MisuseError(f"{node!r} is not locked by the caller")
        self._tick()
        self._lock(node, -1)

    # ------------------------------------------------------------------ eviction
    def evict(self, pages: int) -> int:
        """Free at least ``pages`` L1 pages if possible (LRU over unlocked L1 leaves)."""
        if not isinstance(pages, int) or isinstance(pages, bool) or pages < 0:
            raise MisuseError(f"pages must be an int >= 0, got {pages!r}")
        self._tick()
        freed = self._evict_device(pages)
        self._finish()
        return freed

    def _is_device_leaf(self, node: Node) -> bool:
        return (
            not node.lock_ref
            and node.state in _DEVICE_VALID_T
            and not any(child.state in _DEVICE_CLAIMED_T for child in node.children.values())
        )

    def _evict_device(self, pages: int) -> int:
        if pages <= 0:
            return 0
        heap = self._leaves
        if len(heap) > 1024 and len(heap) > 8 * self._node_estimate():
            heap[:] = [(n.last_access, n.id, n) for n in self.nodes() if self._is_device_leaf(n)]
            heapq.heapify(heap)
        freed = 0
        released_all: list[Pages] = []  # freed in one allocator call at the end
        pop = heapq.heappop
        while freed < pages and heap:
            access, _, node = pop(heap)
            if (
                access != node.last_access
                or node.lock_ref
                or node.state not in _DEVICE_VALID_T
                or (node.children and not self._is_device_leaf(node))
            ):
                continue  # stale: touched since, evicted, or not an unlocked L1 leaf now
            assert node.device is not None
            released = node.device
            freed += node.num_pages
            self._count_device(node, -1)
            parent = node.parent
            if node.state is Residency.BOTH:
                self._advance(node, ResidencyEvent.DEMOTE)
                if self._states and self._state_of(node) in _L1_STATE:
                    self._drop_state(node, host=False)
            elif not (self.config.write_policy is WritePolicy.WRITE_BACK and self._stage(node)):
                self._advance(node, ResidencyEvent.DELETE)
                if self._states:
                    self._forget_state(node)
                self._remove_leaf(node)
            node.device = None
            released_all.append(released)
            if parent is not None and not parent.is_root and self._is_device_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        if released_all:
            self._device.free(
                released_all[0] if len(released_all) == 1 else np.concatenate(released_all)
            )
        return freed

    def _refresh_leaves(self, nodes: list[Node]) -> None:
        """A copy finished: its nodes (and the parent of the first) may have become L1 leaf
        candidates; give the lazy heap a current entry for each (stale ones are skipped on pop)."""
        push = heapq.heappush
        for node in (*nodes, nodes[0].parent):
            if node is not None and not node.is_root:
                push(self._leaves, (node.last_access, node.id, node))

    def _node_estimate(self) -> int:
        """About the number of nodes holding L1 pages (a heap much longer than that is mostly
        stale entries: rebuilding it keeps every pop short)."""
        return max(self._device_nodes, 1)

    def _stage(self, node: Node) -> bool:
        """write_back: a blocking L1 -> L2 copy of an evicted L1-only node, if it keeps I3."""
        parent = node.parent
        if (
            self._host is None
            or parent is None
            or not (parent.is_root or parent.state in _HOST_CLAIMED_T)
        ):
            return False
        host = self._alloc_host_for(node)
        if host is None:
            return False
        assert self._copy_now is not None and node.device is not None
        info = self._moving_state(node) if self._states else None
        try:
            self._copy_now(Direction.WRITE, node.device, host)
            if info is not None:
                assert self._side_copy_now is not None
                assert info.device is not None and info.host is not None
                for transfer in self._state_transfers(info.device, info.host):
                    self._side_copy_now(Direction.WRITE, transfer)
        except Exception:  # a failed staging copy: the node is dropped instead (smaller cache)
            self._host.free(host)
            if info is not None and info.host is not None:
                self._free_state(info.host, host=True)
                info.host = None
            return False
        node.host = host
        self._advance(node, ResidencyEvent.STAGE)
        if info is not None:
            assert info.device is not None
            self._free_state(info.device, host=False)
            info.device = None
            self._advance_state(node, info, StateEvent.STAGE)
        if self._l3 is not None:
            self._l3.enqueue_backup(node.namespace, [node], node if info is not None else None)
        return True

    def evict_host(self, pages: int) -> int:
        """Free at least ``pages`` L2 pages if possible (LRU over unlocked host-only leaves)."""
        if not isinstance(pages, int) or isinstance(pages, bool) or pages < 0:
            raise MisuseError(f"pages must be an int >= 0, got {pages!r}")
        self._tick()
        freed = self._evict_host(pages)
        self._finish()
        return freed

    def _is_host_leaf(self, node: Node) -> bool:
        if node.children or node.lock_ref or node.backup_pins or node.state is not Residency.HOST:
            return False
        if self._states:  # a backup still reading the L2 state at its end pins it too
            info = self._state_info.get(node)
            return info is None or not info.host_pins
        return True

    def _evict_host(self, pages: int) -> int:
        if pages <= 0 or self._host is None:
            return 0
        heap = [(n.last_access, n.id, n) for n in self.nodes() if self._is_host_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < pages and heap:
            _, _, node = heapq.heappop(heap)
            assert node.host is not None
            released = node.host
            parent = node.parent
            self._advance(node, ResidencyEvent.DELETE)
            if self._states:
                self._forget_state(node)
            self._remove_leaf(node)
            node.host = None
            self._host.free(released)
            freed += len(released)
            if parent is not None and not parent.is_root and self._is_host_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    # ------------------------------------------------------------------ load-back
    def load_back(self, node: Node) -> int | None:
        """Start loading the host-only chain ending at ``node`` back to L1, all or nothing. Returns
        the op id, or ``None`` when skipped (below the threshold, over the quota, no L1 room).

        With a ``TRAILING_PAGES`` pool the state at ``node``'s end comes along if it is on L2 only
        (its L1 state slot is part of the all-or-nothing allocation). A state-only load (the node's
        KV already on L1) moves no KV, so the threshold and the quota do not apply to it."""
        self._check_node(node)
        self._tick()
        chain = []
        for current in self.ancestors(node):
            if current.state is not Residency.HOST:
                break
            chain.append(current)
        chain.reverse()
        pages = sum(n.num_pages for n in chain)
        quota = self.config.load_back_quota
        info = None
        if self._states:
            info = self._state_info.get(node)
            if info is not None and info.residency is not Residency.HOST:
                info = None
        if (
            (not chain and info is None)
            or self._transfer is None
            or (
                chain
                and (
                    pages * self.page_size < self.config.load_back_threshold
                    or (quota is not None and pages > quota)
                )
            )
        ):
            return None
        self._lock(node, +1)
        if pages > self._device.free_count:
            self._evict_device(pages - self._device.free_count)
        if pages > self._device.free_count or (
            info is not None and not self._free_state_slot(host=False)
        ):
            self._lock(node, -1)
            self._finish()
            return None
        op = CopyOp(self._new_op(), Direction.LOAD, node, list(chain))
        sources: list[Pages] = []
        targets: list[Pages] = []
        for current in chain:
            current.device = np.asarray(self._device.alloc(current.num_pages), dtype=np.int64)
            assert current.host is not None
            sources.append(current.host)
            targets.append(current.device)
            current.load_op = op
            self._advance(current, ResidencyEvent.LOAD_START)
        side: tuple[PoolTransfer, ...] = ()
        if info is not None:
            assert info.host is not None
            info.device = self._alloc_state(host=False)
            self._advance_state(node, info, StateEvent.LOAD_START)
            op.state_node = node
            side = self._state_transfers(info.host, info.device)
        self.load_ops.append(op)
        self._transfer.enqueue(
            Direction.LOAD,
            op.op_id,
            np.concatenate(sources) if sources else _EMPTY,
            np.concatenate(targets) if targets else _EMPTY,
            side,
        )
        self._finish()
        return op.op_id

    # ------------------------------------------------------------------ acks
    def check_events(self) -> list[CacheEvent]:
        """Apply every copy batch that finished since the last call (FIFO); returns what was
        applied. The only place where background work changes the tree."""
        if self._transfer is None:
            return []
        events: list[CacheEvent] = []
        for completion in self._transfer.completed():
            events.append(self._apply(completion))
        if self._l3 is not None:
            self._tick()
            self._l3.poll()
            self._finish()
        return events

    def _apply(self, completion: Completion) -> CacheEvent:
        queue = self.write_ops if completion.direction is Direction.WRITE else self.load_ops
        pending = [op for op in completion.op_ids if queue and any(o.op_id == op for o in queue)]
        if not pending:  # already failed together with an earlier batch
            return CacheEvent(completion.direction, (), completion.ok)
        if not completion.ok:
            self._tick()
            failed = tuple(op.op_id for op in queue)
            while queue:
                self._fail(queue.popleft())
            return CacheEvent(completion.direction, failed, False)
        for op_id in pending:
            op = queue[0]
            assert op.op_id == op_id, "copy batches complete out of FIFO order"
            self._tick()
            queue.popleft()
            self._ack(op)
        return CacheEvent(completion.direction, tuple(pending), True)

    def _ack(self, op: CopyOp) -> None:
        table = WRITE_OP if op.direction is Direction.WRITE else LOAD_OP
        op.state = table.next(op.state, OpEvent.ACK)
        pages = sum(node.num_pages for node in op.nodes)
        if op.direction is Direction.WRITE:
            self.stats.write_pages += pages
            self.stats.write_bytes += pages * self.page_nbytes
        else:
            self.stats.load_pages += pages
            self.stats.load_bytes += pages * self.page_nbytes
        for node in op.nodes:
            if op.direction is Direction.WRITE:
                self._advance(node, ResidencyEvent.WRITE_ACK)
                node.write_op = None
            else:
                self._advance(node, ResidencyEvent.LOAD_ACK)
                node.load_op = None
                self._count_device(node, +1)
        if op.state_node is not None:
            write = op.direction is Direction.WRITE
            event = StateEvent.WRITE_ACK if write else StateEvent.LOAD_ACK
            self._advance_state(op.state_node, self._state_info[op.state_node], event)
        self._lock(op.node, -1)
        if op.nodes:
            self._refresh_leaves(op.nodes)
        if op.direction is Direction.WRITE and self._l3 is not None:
            self._l3.enqueue_backup(op.node.namespace, op.nodes, op.state_node)

    def _fail(self, op: CopyOp) -> None:
        table = WRITE_OP if op.direction is Direction.WRITE else LOAD_OP
        op.state = table.next(op.state, OpEvent.FAIL)
        for node in op.nodes:
            if op.direction is Direction.WRITE:
                assert node.host is not None and self._host is not None
                self._host.free(node.host)
                node.host = None
                node.write_op = None
                self._advance(node, ResidencyEvent.WRITE_FAIL)
            else:
                assert node.device is not None
                self._device.free(node.device)
                node.device = None
                node.load_op = None
                self._advance(node, ResidencyEvent.LOAD_FAIL)
        if op.state_node is not None:
            info = self._state_info[op.state_node]
            if op.direction is Direction.WRITE:
                assert info.host is not None
                self._free_state(info.host, host=True)
                info.host = None
                self._advance_state(op.state_node, info, StateEvent.WRITE_FAIL)
            else:
                assert info.device is not None
                self._free_state(info.device, host=False)
                info.device = None
                self._advance_state(op.state_node, info, StateEvent.LOAD_FAIL)
        self._lock(op.node, -1)
        if op.nodes:
            self._refresh_leaves(op.nodes)

    # ------------------------------------------------------------------ prefetch (L3 -> L2)
    def prefetch(
        self,
        tokens: Sequence[int] | npt.NDArray[np.integer],
        extra_key: str | Namespace | None = None,
    ) -> int | None:
        """Start reading from L3 what follows the local match of ``tokens`` (SPEC §3). Returns an
        op id for :meth:`prefetch_ready` / :meth:`prefetch_commit` / :meth:`prefetch_abort`, or
        ``None`` when there is no L3, the match does not end at a host-backed node (or a root), or
        fewer than ``prefetch_threshold`` tokens of whole pages follow it. The store query itself
        runs in the background; its result is applied by :meth:`check_events`."""
        query = _as_tokens(tokens)
        namespace = self.namespace_of(extra_key)
        if self._l3 is None:
            return None
        self._tick()
        root, path, matched, _ = self._walk_split(query, namespace)
        anchor = path[-1] if path else root
        total = len(query) // self.page_size
        remaining = total - matched
        threshold = self._l3.config.prefetch_threshold
        if (
            not (anchor.is_root or anchor.state in _HOST_CLAIMED_T)
            or remaining == 0
            or remaining * self.page_size < threshold
        ):
            self._finish()
            return None
        whole = query[: total * self.page_size].copy()
        rest = whole[matched * self.page_size :].tobytes()
        seed = digests_tail(anchor.digests) if anchor.digests else namespace.seed()
        page_bytes = self._page_bytes
        op = self._l3.start_prefetch(
            whole,
            namespace,
            anchor,
            matched,
            lambda: sha256_chain(resolve(seed), rest, page_bytes),
        )
        self._finish()
        return op.op_id

    def _l3_tier(self) -> L3Tier:
        if self._l3 is None:
            raise MisuseError("this cache has no L3 storage backend")
        return self._l3

    def prefetch_ready(self, op_id: int) -> bool:
        """Whether the scheduler should stop waiting for prefetch ``op_id`` now (its policy:
        ``best_effort`` always, ``wait_complete`` once every reserved page arrived or failed,
        ``timeout`` then or after the configured time)."""
        return self._l3_tier().ready(op_id)

    def prefetch_commit(self, op_id: int) -> int:
        """Insert the pages of ``op_id`` that arrived as host-only nodes; returns how many pages
        the tree gained. Pages still in flight are released when their read is drained."""
        tier = self._l3_tier()
        tier.op(op_id)
        self._tick()
        added = tier.commit(op_id)
        self._finish()
        return added

    def prefetch_abort(self, op_id: int) -> None:
        """Release everything prefetch ``op_id`` reserved (the request went away)."""
        tier = self._l3_tier()
        tier.op(op_id)
        self._tick()
        tier.abort(op_id)
        self._finish()

    def prefetch_reserved(self) -> int:
        """Host pages currently reserved by prefetches (arrived or in flight, not committed)."""
        return 0 if self._l3 is None else self._l3.reserved()

    # ------------------------------------------------------------------ sizes and reset
    def cached_pages(self) -> dict[str, int]:
        """Pages per tier held by the tree."""
        device = host = 0
        for node in self.nodes():
            device += node.num_pages if node.state in _DEVICE_VALID_T else 0
            host += node.num_pages if node.state in _HOST_VALID_T else 0
        return {"device": device, "host": host}

    def reset(self) -> None:
        """Drop every cached page (pending copies must have been drained first)."""
        if self.write_ops or self.load_ops or (self._l3 is not None and not self._l3.idle()):
            raise MisuseError(
                "reset with copies, backups or prefetches in flight: "
                "call check_events until none is pending"
            )
        if any(node.lock_ref for node in self.nodes()):
            raise MisuseError("reset while nodes are locked")
        for node in list(self.nodes()):
            if node.device is not None:
                self._device.free(node.device)
            if node.host is not None and self._host is not None:
                self._host.free(node.host)
            node.state = Residency.GONE
        for info in self._state_info.values():
            if info.device is not None:
                self._free_state(info.device, host=False)
            if info.host is not None:
                self._free_state(info.host, host=True)
        self._state_info.clear()
        self.roots.clear()
        self.evictable_pages = self.protected_pages = 0
        self._device_nodes = 0
        self._leaves.clear()
        self._version += 1
        self._memo = None
        self._fingerprint.forget()
