"""The values the embedding cache model's calls return (SPEC §6); ``kvstrata.impl.embedding``
returns the same fields."""

from __future__ import annotations

import attrs

from kvstrata.model.embedding.holds import Hold
from kvstrata.model.embedding.ops import OpHandle
from kvstrata.model.keys import PageHash

__all__ = ["EmbeddingStats", "InsertResult", "PrefetchResult", "ReserveResult"]


@attrs.frozen
class ReserveResult:
    """What one ``reserve`` did: ``hold`` names the reservation (commit or abort it); ``new`` are
    the FILLING entries it allocated, in batch order (the caller writes them); the other new items
    did not fit (``skipped_no_space``)."""

    hold: Hold
    new: tuple[PageHash, ...]
    skipped_no_space: int


@attrs.frozen
class InsertResult:
    """What one ``insert_batch`` did. ``stored`` items were handed to the batch PUT (every new
    one, and the local hits the store lacked); ``re_pushed`` local hits were looked at again,
    ``store_skipped`` of them the store already had (or was writing) and stayed READY; ``busy``
    local entries were loading or already pushing and were left alone."""

    op: OpHandle | None
    new: int
    re_pushed: int
    stored: int
    store_skipped: int
    busy: int
    skipped_no_space: int


@attrs.frozen
class PrefetchResult:
    """What one ``prefetch`` did: ``loading`` entries are in the GET ``op``; ``local`` were already
    here; ``missing`` were not visible in the store when it was asked (0 without a probe);
    ``skipped_no_space`` did not fit."""

    op: OpHandle | None
    loading: int
    local: int
    missing: int
    skipped_no_space: int


@attrs.frozen
class EmbeddingStats:
    """Counters since construction."""

    new: int = 0
    re_pushed: int = 0
    pushed: int = 0
    push_failed: int = 0
    loaded: int = 0
    load_failed: int = 0
    evicted: int = 0
