"""The L3 tier of the cache: backup L2 -> L3 and prefetch L3 -> L2 over a storage backend, reaching
the tree only through :class:`~kvstrata.impl.l3.port.TreePort` (it never imports the cache)."""

from kvstrata.impl.l3.backup import BackupOp, Backups, PageRef
from kvstrata.impl.l3.counters import L3Counters
from kvstrata.impl.l3.port import TreePort
from kvstrata.impl.l3.prefetch import Prefetches, PrefetchOp
from kvstrata.impl.l3.tier import L3Tier
from kvstrata.impl.storage.link import Lanes

__all__ = [
    "BackupOp",
    "Backups",
    "L3Counters",
    "L3Tier",
    "Lanes",
    "PageRef",
    "PrefetchOp",
    "Prefetches",
    "TreePort",
]
