"""What the L3 tier's backup and prefetch halves share: the tree port, the store worker, the
configuration, the counters, whether side-pool states travel, the clock and the page size in bytes.
One value, built once by :class:`~kvstrata.impl.l3.tier.L3Tier`."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from kvstrata.impl.config import StorageConfig
from kvstrata.impl.l3.counters import L3Counters
from kvstrata.impl.l3.port import TreePort
from kvstrata.impl.storage.worker import StorageWorker

__all__ = ["L3Context"]


@attrs.frozen
class L3Context:
    tree: TreePort
    worker: StorageWorker
    config: StorageConfig
    counters: L3Counters
    states: bool  # a TRAILING_PAGES pool with hybrid storage: states are backed up and prefetched
    now: Callable[[], float]
    page_nbytes: int
