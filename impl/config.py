"""Typed configuration of the implementation's components (SPEC §9).

Each component has one attrs class, validated on construction; a bad value raises
:class:`~kvstrata.impl.errors.ConfigError` naming the field, what was expected and what was given.
Enum-valued fields also accept their string names ("write_through", ...).
"""

from __future__ import annotations

import enum
from typing import Any, TypeVar

import attrs

from kvstrata.impl.errors import ConfigError, MisuseError
from kvstrata.model.cache import WritePolicy
from kvstrata.model.hybrid import HitPolicy, SidePool, check_side_pools
from kvstrata.model.l3.health import HealthConfig
from kvstrata.model.l3.policy import PrefetchPolicy

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


def _side_pools(value: object) -> tuple[SidePool, ...]:
    if isinstance(value, SidePool):
        raise ConfigError("side_pools: expected a sequence of SidePool values, got one SidePool")
    if not isinstance(value, tuple | list):
        raise ConfigError(f"side_pools: expected a tuple of SidePool values, got {value!r}")
    pools = tuple(value)
    try:
        check_side_pools(pools)
    except MisuseError as error:
        raise ConfigError(f"side_pools: {error}") from None
    return pools


@attrs.frozen
class RadixCacheConfig:
    """The radix cache's policies. Sizes of the pools are the pools' own configuration.

    ``page_hashes``: keep the SHA-256 page-hash chain (SPEC §4) of every cached page, computed for new
    pages at insert; L3 needs it for its store keys. Off, the cache never hashes (L1/L2 only) and
    ``page_hashes()`` refuses. ``fingerprint_seed``: makes the keys of the page fingerprints the tree
    matches by reproducible (tests); None draws secret keys per cache (:mod:`kvstrata.impl.fingerprint`).
    ``hash_worker``: compute those hashes on a worker thread, off the scheduler path, when the C
    kernels are built (:mod:`kvstrata.impl.hashing`; nodes hold a pending view until a reader needs
    the digests); False, or without the C kernels, ``insert`` hashes inline. Same digests either way.

    Side pools (SPEC §5) are opt-in, as in the model's ``CacheConfig``: ``side_pools`` lists them
    (distinct names). A ``TRAILING_PAGES`` pool (Mamba state, one per node end) needs state slots:
    ``device_states >= 1`` on L1 and, when the cache has an L2, ``host_states >= 1`` (0 without
    one: checked when the cache is built, since the pools are not part of this config); with no
    such pool both must be 0. ``ALL_PAGES`` pools (indexer keys) share the KV page indices.
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
    hash_worker: bool = attrs.field(default=True, validator=_bool)
    side_pools: tuple[SidePool, ...] = attrs.field(default=(), converter=_side_pools)
    device_states: int = attrs.field(default=0, validator=_non_negative)
    host_states: int = attrs.field(default=0, validator=_non_negative)

    def __attrs_post_init__(self) -> None:
        if not self.trailing_pools:
            if self.device_states or self.host_states:
                raise ConfigError(
                    f"device_states/host_states: state slots need a TRAILING_PAGES side pool, "
                    f"got {self.device_states}/{self.host_states} with none"
                )
        elif self.device_states < 1:
            raise ConfigError(
                f"device_states: a TRAILING_PAGES side pool needs an int >= 1, "
                f"got {self.device_states}"
            )

    @property
    def all_pages_pools(self) -> tuple[SidePool, ...]:
        return tuple(p for p in self.side_pools if p.policy is HitPolicy.ALL_PAGES)

    @property
    def trailing_pools(self) -> tuple[SidePool, ...]:
        return tuple(p for p in self.side_pools if p.policy is HitPolicy.TRAILING_PAGES)


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
    bounds the pages of one backup op (a long node is cut across ops). Backups queued behind a
    running one on the write lane go to the store as one call of at most ``backup_merge_pages``
    pages (each op's result is still its own; 0: one call per op): a lane with a backlog makes
    fewer, larger calls (issue 20). Prefetch fetches queued on the read lane likewise share one get
    of at most ``prefetch_merge_pages`` pages (each op's trailing state is still read on its own).

    Faults (issue 17): whatever the policy, a request waits for L3 at most ``prefetch_deadline_s``
    (then proceeds with what arrived). A store call running longer than ``call_deadline_s``
    (``probe_deadline_s`` for a probe) counts as a fault; a fault makes the store suspect, a
    failed probe (or a second fault) makes it down: reads answer nothing at once, backups wait in a
    queue of at most ``backup_deferred_pages`` pages (the oldest are dropped and counted), and
    probes retry after ``probe_backoff_s``, doubling up to ``probe_backoff_cap_s``. For
    ``remount_grace_s`` after the store came back from down (or empty), a backup refused only as
    full spends no retry (a restarted master refuses puts until its clients remount their
    segments: about 1 s).
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
    backup_merge_pages: int = attrs.field(default=256, validator=_non_negative)
    prefetch_merge_pages: int = attrs.field(default=256, validator=_non_negative)
    prefetch_deadline_s: float = attrs.field(default=1.0, validator=_non_negative_float)
    call_deadline_s: float = attrs.field(default=2.0, validator=_non_negative_float)
    probe_deadline_s: float = attrs.field(default=0.5, validator=_non_negative_float)
    probe_backoff_s: float = attrs.field(default=0.05, validator=_non_negative_float)
    probe_backoff_cap_s: float = attrs.field(default=0.5, validator=_non_negative_float)
    backup_deferred_pages: int = attrs.field(default=4096, validator=_non_negative)
    remount_grace_s: float = attrs.field(default=5.0, validator=_non_negative_float)

    def prefetch_timeout(self, tokens: int) -> float:
        """Seconds the ``timeout`` policy waits for a prefetch of ``tokens`` tokens."""
        limit = self.prefetch_timeout_base_s + self.prefetch_timeout_per_1k_s * tokens / 1000
        return min(limit, self.prefetch_timeout_cap_s)

    def health(self) -> HealthConfig:
        """The store link's deadlines and bounds (the model's :class:`HealthConfig`, seconds)."""
        return HealthConfig(
            call_deadline=self.call_deadline_s,
            probe_deadline=self.probe_deadline_s,
            probe_backoff=self.probe_backoff_s,
            probe_backoff_cap=self.probe_backoff_cap_s,
            deferred_pages=self.backup_deferred_pages,
        )

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before retry ``attempt`` (1-based) of a failed backup batch."""
        delay = float(self.backup_backoff_s) * 2.0 ** min(max(attempt - 1, 0), 64)
        return min(delay, float(self.backup_backoff_cap_s))
