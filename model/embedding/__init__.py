"""The multimodal embedding cache model (SPEC §6): :class:`EmbeddingCacheModel` and its values.

:mod:`.cache` holds the facade and the theory of operation; :mod:`.entries` (the entry table, the
only module that advances ``EMBEDDING_ENTRY``, and the slot pool), :mod:`.ops` (the push and GET
ops in flight, and the prefetch requests) and :mod:`.holds` (the caller's reservations and loans)
each own one part of the state and state the invariants they alone uphold; :mod:`.results` holds
the values the calls return. ``kvstrata.impl.embedding`` mirrors the file names.
"""

from __future__ import annotations

from kvstrata.model.embedding.cache import (
    COMPONENT,
    POOL,
    EmbeddingCacheModel,
    EmbeddingStats,
    InsertResult,
    PrefetchResult,
    ReserveResult,
)
from kvstrata.model.embedding.entries import Entry, Unit, embedding_content
from kvstrata.model.embedding.holds import Hold, HoldKind
from kvstrata.model.embedding.ops import Offset, OpHandle, OpKind

__all__ = [
    "COMPONENT",
    "POOL",
    "EmbeddingCacheModel",
    "EmbeddingStats",
    "Entry",
    "Hold",
    "HoldKind",
    "InsertResult",
    "Offset",
    "OpHandle",
    "OpKind",
    "PrefetchResult",
    "ReserveResult",
    "Unit",
    "embedding_content",
]
