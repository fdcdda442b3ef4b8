"""What the storage worker hands back per job (:mod:`kvstrata.impl.storage.worker`): one result
per backup, query or fetch op, each a complete per-page account (failures included)."""

from __future__ import annotations

from typing import TypeAlias

import attrs

from kvstrata.impl.storage.base import GetStatus, PutStatus
from kvstrata.model.keys import Namespace, PageHash

__all__ = ["BackupResult", "FetchResult", "QueryResult", "StorageResult"]


@attrs.frozen
class BackupResult:
    """What happened to each page of backup op ``op_id`` (in the op's page order) and to each
    state it wrote (in the op's state order; empty without states)."""

    op_id: int
    statuses: tuple[PutStatus, ...]
    states: tuple[PutStatus, ...] = ()
    sentinel: tuple[Namespace, PageHash] | None = None  # the last page now in the store
    skipped: bool = False  # the store was down when the lane got to it: nothing was tried


@attrs.frozen
class QueryResult:
    """Prefetch op ``op_id``'s query: the page hashes of the continuation (32 bytes each, as the
    cache's chain computed them) and how many leading pages the store holds completely."""

    op_id: int
    digests: bytes
    hit: int


@attrs.frozen
class FetchResult:
    """What arrived for each reserved page of prefetch op ``op_id``. ``usable`` (side pools with a
    state slot only): how many leading pages are usable, the op's state slot holding the state at
    the end of the last of them (0: none; the slot's bytes are then unspecified)."""

    op_id: int
    statuses: tuple[GetStatus, ...]
    usable: int | None = None


StorageResult: TypeAlias = BackupResult | QueryResult | FetchResult
