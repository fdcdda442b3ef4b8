"""The multimodal embedding cache model (SPEC §6): :class:`EmbeddingCacheModel` and its values.

:mod:`.cache` holds the facade and the theory of operation; :mod:`.entries` (the entry table, the
only module that advances ``EMBEDDING_ENTRY``, and the slot pool) and :mod:`.ops` (the push and GET
ops in flight, and the prefetch requests) each own one part of the state and state the invariants
they alone uphold. ``kvstrata.impl.embedding`` mirrors the file names.
"""

from __future__ import annotations

from kvstrata.model.embedding.cache import (
    COMPONENT,
    POOL,
    EmbeddingCacheModel,
    EmbeddingStats,
    InsertResult,
    PrefetchResult,
)
from kvstrata.model.embedding.entries import Entry, Unit, embedding_content
from kvstrata.model.embedding.ops import Offset, OpHandle, OpKind

__all__ = [
    "COMPONENT",
    "POOL",
    "EmbeddingCacheModel",
    "EmbeddingStats",
    "Entry",
    "InsertResult",
    "Offset",
    "OpHandle",
    "OpKind",
    "PrefetchResult",
    "Unit",
    "embedding_content",
]
