"""Typed errors of kvstrata.

Every error the library raises on purpose derives from :class:`KvStrataError`. The implementation's
errors subclass the model's where both can raise the same condition, so a caller (and a differential
test) catches one class for both.
"""

from __future__ import annotations

from kvstrata.model.errors import (
    CapacityError,
    DoubleRenderError,
    IllegalTransition,
    InvariantViolation,
    KeyParseError,
    KvStrataError,
    MisuseError,
)

__all__ = [
    "CacheClosed",
    "CapacityError",
    "ConfigError",
    "DoubleRenderError",
    "HashingError",
    "IllegalTransition",
    "InvariantViolation",
    "KeyParseError",
    "KvStrataError",
    "MisuseError",
    "StoreError",
    "StoreFull",
    "StoreNotReady",
    "StoreTimeout",
    "StoreUnavailable",
    "TpAgreementError",
    "WrongThread",
]


class ConfigError(MisuseError):
    """A configuration value is invalid (names the field, what was expected and what was given)."""


class CacheClosed(MisuseError):
    """A call to a cache after its ``close()`` (nothing is changed; ``close`` itself is idempotent)."""


class WrongThread(MisuseError):
    """A mutating call from a thread other than the cache's owner (the first thread that made one):
    a cache is driven by one scheduler thread; concurrent calls would corrupt it silently."""


class HashingError(KvStrataError):
    """The page-hashing worker failed on a chain (its digests do not exist); raised by every read
    of them (:mod:`kvstrata.impl.hashing`)."""


class StoreError(KvStrataError):
    """An L3 store operation failed. Never raised from a scheduler hot-path call: the cache counts
    it and degrades to a smaller cache."""


class StoreUnavailable(StoreError):
    """The store cannot be reached (master down, not set up, closed)."""


class StoreFull(StoreError):
    """The store had no room for an object (Mooncake ``NO_AVAILABLE_HANDLE``): a counted miss,
    retried later or dropped by policy."""


class StoreNotReady(StoreError):
    """An object exists but cannot be read yet (another writer is mid-put, or it is being
    overwritten): a transient miss."""


class StoreTimeout(StoreUnavailable):
    """A store call did not complete in time (Mooncake ``RPC_TIMEOUT``)."""


class TpAgreementError(KvStrataError):
    """A tensor-parallel agreement did not complete (SPEC §10): another rank is gone or hung (no
    answer within the group's timeout), or the ranks reported facts about different ops (their
    trees already differ). Raised by ``check_events`` on every rank that reached it; the cache then
    refuses every mutating call (:class:`CacheClosed`), since its tree can no longer follow the
    other ranks': the engine restarts the TP group."""
