"""The hierarchical radix cache (L1 device, L2 host; L3 through :mod:`kvstrata.impl.l3`).

:class:`~kvstrata.impl.cache.api.HierarchicalRadixCache` is the scheduler's face
(:class:`~kvstrata.impl.cache.protocol.SchedulerCache` states its contract); the modules beside it
each own one part of its state (see docs/architecture.md).
"""

from kvstrata.impl.cache.api import HierarchicalRadixCache
from kvstrata.impl.cache.node import (
    CacheEvent,
    InsertResult,
    MatchResult,
    Node,
    PendingWork,
    StateInfo,
)
from kvstrata.impl.cache.protocol import SchedulerCache

__all__ = [
    "CacheEvent",
    "HierarchicalRadixCache",
    "InsertResult",
    "MatchResult",
    "Node",
    "PendingWork",
    "SchedulerCache",
    "StateInfo",
]
