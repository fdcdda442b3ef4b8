"""The cache model's values: page records, op records and the results of its public verbs.

Invariants upheld here alone: residency is recorded **per page hash** (``PageTable``), never per
node, so that nodes only group pages and a split cannot change what a record says; an op record
captures the exact pages (and trailing states) it covers when it is made (``CopyOp.pages``,
``BackupOp.pages``), never a node to look them up from (I4, the "lost split" bug). The content
identity of a KV page is its page hash; that of a trailing state is ``("state", page hash)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar, cast

import attrs

from kvstrata.model.cache.index import Node
from kvstrata.model.errors import MisuseError
from kvstrata.model.hybrid import state_content, state_page
from kvstrata.model.keys import Namespace, PageHash
from kvstrata.model.lifecycles import OpState, Residency

T = TypeVar("T")

__all__ = [
    "BackupQueue",
    "CopyOp",
    "InsertResult",
    "MatchResult",
    "PageInfo",
    "PageTable",
    "Placed",
    "View",
    "check_tokens",
    "state_content",
    "state_page",
]


@attrs.define
class PageInfo:
    """Where one page's bytes (or one state's, in ``CacheModel.state_info``) are. ``host_pins``
    counts backup ops still reading the host copy."""

    residency: Residency
    device_slot: int | None = None
    host_slot: int | None = None
    host_pins: int = 0


@attrs.define
class PageTable:
    """The page records, keyed by page hash. Every piece reads them; only
    :mod:`kvstrata.model.cache.tiers` adds, advances or drops one."""

    records: dict[PageHash, PageInfo] = attrs.field(factory=dict)

    def residency_of(self, node: Node) -> Residency | None:
        """The residency shared by every page of ``node`` (``None`` for a root)."""
        if node.is_root:
            return None
        return self.records[node.pages[0]].residency

    def device_slot(self, page: PageHash) -> int:
        slot = self.records[page].device_slot
        assert slot is not None
        return slot


@attrs.define
class CopyOp:
    """A device<->host copy (write-through or load-back): the pages it covers are fixed at enqueue."""

    op_id: int
    node_id: int  # the node it locks while in flight; never used to find the pages it covers
    pages: tuple[PageHash, ...]
    state: OpState = OpState.PENDING
    states: tuple[PageHash, ...] = ()  # trailing states it copies too (keyed by their page)


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


@attrs.frozen
class Placed:
    """What ``insert`` did along its path (``Tiers.place``)."""

    deepest: Node
    new_pages: int
    revived: int
    duplicates: int
    loading: bool  # a node on the path was still loading back to L1: nothing was added below it


class View(Generic[T]):
    """A read-only attribute of :class:`~kvstrata.model.cache.CacheModel`: the container one piece owns."""

    def __init__(self, piece: str, name: str) -> None:
        self.piece, self.name = piece, name

    def __get__(self, instance: object, owner: type | None = None) -> T:
        return cast("T", getattr(getattr(instance, self.piece), self.name))


def check_tokens(tokens: object) -> tuple[int, ...]:
    if isinstance(tokens, str | bytes) or not isinstance(tokens, Sequence):
        raise MisuseError(f"tokens must be a sequence of ints, got {type(tokens).__name__}")
    out = tuple(tokens)
    for token in out:
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < 2**32:
            raise MisuseError(f"token ids must be ints in [0, 2**32), got {token!r}")
    return out


class BackupQueue(Protocol):
    """Where pages that reached L2 go for an L3 backup (``kvstrata.model.l3.backup.Backup``)."""

    def enqueue(
        self, namespace: Namespace, pages: tuple[PageHash, ...], states: tuple[PageHash, ...] = ()
    ) -> None: ...
