"""The tree's value types: :class:`Node` (a run of whole pages and where they are), :class:`StateInfo`
(the trailing state at a node end), :class:`CopyOp` (a pending L1 <-> L2 copy) and the results the
scheduler verbs return (:class:`MatchResult`, :class:`InsertResult`, :class:`CacheEvent`).

Nothing here advances a lifecycle: residency moves only in :mod:`kvstrata.impl.cache.tiers` (pages)
and :mod:`kvstrata.impl.cache.states` (states), through the model's tables. A node's ``state`` is
``None`` only on a root; ``GONE`` once it left the tree (a stale handle: every verb refuses it).
"""

from __future__ import annotations

from typing import Any, Generic, Protocol, TypeVar, cast

import attrs
import numpy as np
import numpy.typing as npt

from kvstrata.impl.fingerprint import FINGERPRINT_BYTES
from kvstrata.impl.hashing import Digests, resolve
from kvstrata.impl.transfer import Direction
from kvstrata.model.keys import Namespace, PageHash
from kvstrata.model.lifecycles import OpState, Residency

__all__ = [
    "Allocator",
    "CacheEvent",
    "CacheStats",
    "CopyOp",
    "Delegate",
    "InsertResult",
    "MatchResult",
    "Node",
    "Pages",
    "PendingWork",
    "StateInfo",
]

Pages = npt.NDArray[np.int64]


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


@attrs.frozen
class PendingWork:
    """Background work the tree has not applied yet: L1 -> L2 copies (``write``), L2 -> L1 copies
    (``load``), L2 -> L3 backup ops (``backup``, retries included) and L3 -> L2 prefetch ops
    (``prefetch``, until committed or aborted and drained). ``deferred``: backup ops waiting for a
    store that is down (not in ``total``: nothing finishes them until it is back)."""

    write: int = 0
    load: int = 0
    backup: int = 0
    prefetch: int = 0
    deferred: int = 0

    @property
    def total(self) -> int:
        return self.write + self.load + self.backup + self.prefetch

    def as_dict(self) -> dict[str, int]:
        return {
            "write": self.write,
            "load": self.load,
            "backup": self.backup,
            "prefetch": self.prefetch,
            "deferred": self.deferred,
        }


@attrs.define
class CacheStats:
    """Counters the scheduler-side calls bump (plain ints: no locks on the hot path)."""

    match_tokens: int = 0
    l1_hit_tokens: int = 0
    l2_hit_tokens: int = 0
    write_pages: int = 0
    load_pages: int = 0
    write_bytes: int = 0
    load_bytes: int = 0

    def count_copy(self, pages: int, page_nbytes: int, *, write: bool) -> None:
        """``pages`` pages of ``page_nbytes`` bytes each were copied L1 -> L2 (``write``) or back."""
        if write:
            self.write_pages += pages
            self.write_bytes += pages * page_nbytes
        else:
            self.load_pages += pages
            self.load_bytes += pages * page_nbytes


T = TypeVar("T")


class Delegate(Generic[T]):
    """A read-only attribute of the cache facade that is a piece's attribute (``piece.name``):
    the piece owns the value, the facade only shows it."""

    def __init__(self, piece: str, name: str) -> None:
        self.piece, self.name = piece, name

    def __get__(self, instance: object, owner: type | None = None) -> T:
        return cast("T", getattr(getattr(instance, self.piece), self.name))

    def __set__(self, instance: object, value: object) -> None:
        raise AttributeError(f"{self.name} is read-only here: {self.piece} owns it")
