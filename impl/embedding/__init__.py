"""The multimodal embedding cache (SPEC §6): a host pool of fixed-size units, an object store
adapter (in-memory or Mooncake) and :class:`EmbeddingCache`, which follows
:data:`~kvstrata.model.lifecycles.EMBEDDING_ENTRY` as :class:`~kvstrata.model.embedding.EmbeddingCacheModel`
does.

:class:`EmbeddingCache` (``cache.py``, the facade) is composed of pieces that own their state,
named as the model's: ``entries.py`` (the entry table: the only module that advances the entry
lifecycle) and ``ops.py`` (the puts and gets in flight, their executor and results)."""

from kvstrata.impl.embedding.cache import (
    EmbeddingCache,
    EmbeddingCounters,
    InsertResult,
    PrefetchResult,
)
from kvstrata.impl.embedding.pool import EmbeddingPool, PoolShape
from kvstrata.impl.embedding.store import (
    EmbeddingStore,
    Extent,
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
    "InsertResult",
    "MemoryEmbeddingStore",
    "MooncakeEmbeddingStore",
    "PoolShape",
    "PrefetchResult",
]
