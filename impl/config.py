"""Typed configuration of the implementation's components (SPEC §9).

Each component has one attrs class, validated on construction; a bad value raises
:class:`~kvstrata.impl.errors.ConfigError` naming the field, what was expected and what was given.
Enum-valued fields also accept their string names ("write_through", ...).
"""

from __future__ import annotations

import enum
from typing import Any, TypeVar

import attrs

from kvstrata.impl.errors import ConfigError
from kvstrata.model.cache import WritePolicy
from kvstrata.model.prefetch import PrefetchPolicy

__all__ = ["RadixCacheConfig", "StorageConfig", "enum_converter"]

E = TypeVar("E", bound=enum.Enum)


def enum_converter(kind: type[E], field: str) -> Any:
    def convert(value: object) -> E:
        if isinstance(value, kind):
            return value
        try:
            return kind(value)
        except ValueError:
            names = ", ".join(repr(member.value) for member in kind)
            raise ConfigError(f"{field}: expected one of {names}, got {value!r}") from None

    return convert


def _positive(_instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{attribute.name}: expected an int > 0, got {value!r}")


def _non_negative(_instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{attribute.name}: expected an int >= 0, got {value!r}")


def _optional_positive(
    _instance: object, attribute: attrs.Attribute[int | None], value: int | None
) -> None:
    if value is not None:
        _positive(_instance, attribute, value)  # type: ignore[arg-type]


def _bool(_instance: object, attribute: attrs.Attribute[bool], value: bool) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{attribute.name}: expected a bool, got {value!r}")


def _optional_seed(
    _instance: object, attribute: attrs.Attribute[int | None], value: int | None
) -> None:
    if value is not None:
        _non_negative(_instance, attribute, value)  # type: ignore[arg-type]


def _write_policy(value: object) -> WritePolicy:
    converted: WritePolicy = enum_converter(WritePolicy, "write_policy")(value)
    return converted


@attrs.frozen
class RadixCacheConfig:
    """The radix cache's policies. Sizes of the pools are the pools' own configuration.

    ``page_hashes``: keep the SHA-256 page-hash chain (SPEC §4) of every cached page, computed for new
    pages at insert; L3 needs it for its store keys. Off, the cache never hashes (L1/L2 only) and
    ``page_hashes()`` refuses. ``fingerprint_seed``: makes the keys of the page fingerprints the tree
    matches by reproducible (tests); None draws secret keys per cache (:mod:`kvstrata.impl.fingerprint`).
    """

    page_size: int = attrs.field(validator=_positive)
    write_policy: WritePolicy = attrs.field(
        default=WritePolicy.WRITE_THROUGH, converter=_write_policy
    )
    write_through_threshold: int = attrs.field(default=2, validator=_positive)
    load_back_threshold: int = attrs.field(default=0, validator=_non_negative)  # tokens
    load_back_quota: int | None = attrs.field(default=None, validator=_optional_positive)  # pages
    page_hashes: bool = attrs.field(default=True, validator=_bool)
    fingerprint_seed: int | None = attrs.field(default=None, validator=_optional_seed)


def _prefetch_policy(value: object) -> PrefetchPolicy:
    converted: PrefetchPolicy = enum_converter(PrefetchPolicy, "prefetch_policy")(value)
    return converted


def _non_negative_float(_instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ConfigError(f"{attribute.name}: expected a number >= 0, got {value!r}")


def _fraction(_instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ConfigError(f"{attribute.name}: expected a number in (0, 1], got {value!r}")


@attrs.frozen
class StorageConfig:
    """How the cache uses its L3 backend (SPEC §3 prefetch, §9 failures).

    Prefetch: a request's local match must leave at least ``prefetch_threshold`` tokens of whole
    pages before the store is asked; reservations of all prefetches together stay within
    ``prefetch_reserve_fraction`` of the host pool (the model's "half of L2"); how long the
    scheduler waits is ``prefetch_policy`` (``timeout``: ``base + per_1k * tokens / 1000`` seconds,
    capped). Backup: a failed or store-full batch is retried ``backup_retries`` times with
    exponential back-off from ``backup_backoff_s`` (capped at ``backup_backoff_cap_s``), then
    abandoned and counted (``backups_abandoned``), never dropped silently; ``backup_batch_pages``
    bounds the pages of one store call.
    """

    prefetch_threshold: int = attrs.field(default=256, validator=_non_negative)
    prefetch_policy: PrefetchPolicy = attrs.field(
        default=PrefetchPolicy.BEST_EFFORT, converter=_prefetch_policy
    )
    prefetch_timeout_base_s: float = attrs.field(default=0.05, validator=_non_negative_float)
    prefetch_timeout_per_1k_s: float = attrs.field(default=0.01, validator=_non_negative_float)
    prefetch_timeout_cap_s: float = attrs.field(default=1.0, validator=_non_negative_float)
    prefetch_reserve_fraction: float = attrs.field(default=0.5, validator=_fraction)
    backup_retries: int = attrs.field(default=6, validator=_non_negative)
    backup_backoff_s: float = attrs.field(default=0.05, validator=_non_negative_float)
    backup_backoff_cap_s: float = attrs.field(default=2.0, validator=_non_negative_float)
    backup_batch_pages: int = attrs.field(default=256, validator=_positive)

    def prefetch_timeout(self, tokens: int) -> float:
        """Seconds the ``timeout`` policy waits for a prefetch of ``tokens`` tokens."""
        limit = self.prefetch_timeout_base_s + self.prefetch_timeout_per_1k_s * tokens / 1000
        return min(limit, self.prefetch_timeout_cap_s)

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before retry ``attempt`` (1-based) of a failed backup batch."""
        delay = float(self.backup_backoff_s) * 2.0 ** max(attempt - 1, 0)
        return min(delay, float(self.backup_backoff_cap_s))
