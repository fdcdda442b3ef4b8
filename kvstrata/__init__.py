"""kvstrata: a hierarchical, shareable KV cache for LLM schedulers (SPEC §1): a paged radix tree over
L1 device and L2 host pools, backed up to an L3 store (Mooncake, shared by every instance of the same
key space), held to a pure reference model. The public face: a scheduler imports from ``kvstrata``
and nothing deeper (``SchedulerCache`` is the contract; docs/scheduler.md). Names load on first use,
so ``kvstrata.model`` (no torch) stays importable alone; tests/unit/test_face.py checks both lists."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# fmt: off
_EXPORTS: dict[str, tuple[str, ...]] = {
    "kvstrata.impl.cache": (
        "CacheEvent", "HierarchicalRadixCache", "InsertResult", "MatchResult", "Node",
        "PendingWork", "SchedulerCache",
    ),
    "kvstrata.impl.config": ("RadixCacheConfig", "StorageConfig"),
    "kvstrata.impl.embedding": (
        "EmbeddingCache", "EmbeddingPool", "MemoryEmbeddingStore", "MooncakeEmbeddingStore", "PoolShape",
    ),
    "kvstrata.impl.errors": (
        "CacheClosed", "CapacityError", "ConfigError", "KvStrataError", "MisuseError",
        "StoreError", "TpAgreementError", "WrongThread",
    ),
    "kvstrata.impl.pools": ("DeviceKVPool", "HostKVPool", "HostLayout", "KVShape"),
    "kvstrata.impl.pools.side": ("SideSpec", "indexer_spec", "mamba_spec"),
    "kvstrata.impl.replay.background": ("Progress", "signalling_executor"),
    "kvstrata.impl.storage.file": ("FileBackend",),
    "kvstrata.impl.storage.memory": ("MemoryBackend",),
    "kvstrata.impl.storage.mooncake": ("LocalCluster", "MooncakeBackend", "MooncakeClient",
                                        "MooncakeConfig"),
    "kvstrata.impl.tp": ("TorchTpGroup", "TpGroup"),
    "kvstrata.impl.transfer": ("Direction",),
    "kvstrata.model.cache": ("WritePolicy",),
    "kvstrata.model.keys": ("KeySpace", "KVKind", "ModelIdentity", "Namespace", "PageHash", "Shard",
                            "content_hash"),
    "kvstrata.model.l3.policy": ("PrefetchPolicy",),
}
# fmt: on
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)  # noqa: PLE0605 (built from _EXPORTS, checked by the face's tests)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstrata' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # loaded once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # what type checkers see: the same names, imported eagerly
    # isort: off
    from kvstrata.impl.cache import CacheEvent, HierarchicalRadixCache, InsertResult, MatchResult
    from kvstrata.impl.cache import Node, PendingWork, SchedulerCache
    from kvstrata.impl.config import RadixCacheConfig, StorageConfig
    from kvstrata.impl.embedding import EmbeddingCache, EmbeddingPool, MemoryEmbeddingStore
    from kvstrata.impl.embedding import MooncakeEmbeddingStore, PoolShape
    from kvstrata.impl.errors import CacheClosed, CapacityError, ConfigError, KvStrataError
    from kvstrata.impl.errors import MisuseError, StoreError, TpAgreementError, WrongThread
    from kvstrata.impl.pools import DeviceKVPool, HostKVPool, HostLayout, KVShape
    from kvstrata.impl.pools.side import SideSpec, indexer_spec, mamba_spec
    from kvstrata.impl.replay.background import Progress, signalling_executor
    from kvstrata.impl.storage.file import FileBackend
    from kvstrata.impl.storage.memory import MemoryBackend
    from kvstrata.impl.storage.mooncake import LocalCluster, MooncakeBackend, MooncakeClient
    from kvstrata.impl.storage.mooncake import MooncakeConfig
    from kvstrata.impl.tp import TorchTpGroup, TpGroup
    from kvstrata.impl.transfer import Direction
    from kvstrata.model.cache import WritePolicy
    from kvstrata.model.keys import KeySpace, KVKind, ModelIdentity, Namespace, PageHash, Shard
    from kvstrata.model.keys import content_hash
    from kvstrata.model.l3.policy import PrefetchPolicy
    # isort: on
