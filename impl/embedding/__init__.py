"""The multimodal embedding cache (SPEC §6): a host pool of fixed-size units, an object store
adapter (in-memory or Mooncake) and :class:`EmbeddingCache`, which follows
:data:`~kvstrata.model.lifecycles.EMBEDDING_ENTRY` as :class:`~kvstrata.model.embedding.EmbeddingCacheModel`
does.

:class:`EmbeddingCache` (``cache.py``, the facade) is composed of pieces that own their state,
named as the model's: ``entries.py`` (the entry table: the only module that advances the entry
lifecycle), ``ops.py`` (the puts and gets in flight, their executor and results) and ``holds.py``
(the caller's reservations and loans: inserts and reads in place, without a copy)."""

from kvstrata.impl.embedding.cache import (
    EmbeddingCache,
    EmbeddingCounters,
    InsertResult,
    PrefetchResult,
)
from kvstrata.impl.embedding.holds import Loan, Reservation
from kvstrata.impl.embedding.pool import EmbeddingPool, PoolShape
from kvstrata.impl.embedding.store import (
    EmbeddingStore,
    Extent,
    Extents,
    ExtentStatus,
    MemoryEmbeddingStore,
    MooncakeEmbeddingStore,
)

__all__ = [
    "EmbeddingCache",
    "EmbeddingCounters",
    "EmbeddingPool",
    "EmbeddingStore",
    "Extent",
    "ExtentStatus",
    "Extents",
    "InsertResult",
    "Loan",
    "MemoryEmbeddingStore",
    "MooncakeEmbeddingStore",
    "PoolShape",
    "PrefetchResult",
    "Reservation",
]
