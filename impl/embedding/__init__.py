"""The multimodal embedding cache (SPEC §6): a host pool of fixed-size units, an object store
adapter (in-memory or Mooncake) and :class:`EmbeddingCache`, which follows
:data:`~kvstrata.model.lifecycles.EMBEDDING_ENTRY` as :class:`~kvstrata.model.embedding.EmbeddingCacheModel`
does."""

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
