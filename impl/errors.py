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
    "CapacityError",
    "ConfigError",
    "DoubleRenderError",
    "IllegalTransition",
    "InvariantViolation",
    "KeyParseError",
    "KvStrataError",
    "MisuseError",
    "StoreError",
    "StoreUnavailable",
]


class ConfigError(MisuseError):
    """A configuration value is invalid (names the field, what was expected and what was given)."""


class StoreError(KvStrataError):
    """An L3 store operation failed. Never raised from a scheduler hot-path call: the cache counts
    it and degrades to a smaller cache."""


class StoreUnavailable(StoreError):
    """The store cannot be reached (master down, not set up, closed)."""
