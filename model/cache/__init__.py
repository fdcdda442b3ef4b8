"""The hierarchical cache model (SPEC §3, §4, §7): :class:`CacheModel` and its values.

:mod:`.api` holds the facade and the theory of operation; each other module of this package (and of
:mod:`kvstrata.model.l3`) owns one part of the state and states the invariants it alone upholds.
"""

from __future__ import annotations

from kvstrata.model.cache.api import CacheModel
from kvstrata.model.cache.config import CacheConfig, WritePolicy
from kvstrata.model.cache.node import CopyOp, InsertResult, MatchResult, PageInfo
from kvstrata.model.l3.backup import BackupOp
from kvstrata.model.lifecycles import DEVICE_CLAIMED, DEVICE_VALID, HOST_CLAIMED, HOST_VALID

__all__ = [
    "DEVICE_CLAIMED",
    "DEVICE_VALID",
    "HOST_CLAIMED",
    "HOST_VALID",
    "BackupOp",
    "CacheConfig",
    "CacheModel",
    "CopyOp",
    "InsertResult",
    "MatchResult",
    "PageInfo",
    "WritePolicy",
]
