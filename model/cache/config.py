"""The cache model's configuration: sizes, write policy, thresholds, prefetch policy, key space and
side pools (SPEC §3, §5).

Invariants upheld here alone: a ``CacheConfig`` that exists is consistent, so no other module
re-checks it: sizes are positive ints (``host_pages == 0``: no L2 and so no L3; ``keys is None``: no
L3), the key space's page size is the cache's, side pools have distinct names, and state slots exist
exactly when a ``TRAILING_PAGES`` pool does (``host_states >= 1`` exactly when there is an L2).
"""

from __future__ import annotations

import enum

import attrs

from kvstrata.model.errors import MisuseError
from kvstrata.model.hybrid import HitPolicy, SidePool, check_side_pools
from kvstrata.model.keys import KeySpace
from kvstrata.model.l3.policy import PrefetchPolicy, PrefetchTimeout

__all__ = ["CacheConfig", "WritePolicy"]


class WritePolicy(enum.Enum):
    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"


def _positive(_instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise MisuseError(f"{attribute.name} must be a positive int, got {value!r}")


def _non_negative(_instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or value < 0:
        raise MisuseError(f"{attribute.name} must be an int >= 0, got {value!r}")


def _to_side_pools(value: object) -> tuple[SidePool, ...]:
    if isinstance(value, SidePool):
        raise MisuseError("side_pools is a sequence of SidePool values, got one SidePool")
    if not isinstance(value, tuple | list):
        raise MisuseError(f"side_pools must be a tuple of SidePool values, got {value!r}")
    return tuple(value)


@attrs.frozen
class CacheConfig:
    """Sizes in pages, thresholds in tokens. ``host_pages == 0`` means no L2 (and so no L3);
    ``keys is None`` means no L3.

    Side pools (SPEC §5) are opt-in: ``side_pools`` lists them (distinct names). A
    ``TRAILING_PAGES`` pool needs state slots: ``device_states >= 1``, and ``host_states >= 1``
    when there is an L2 (``host_states == 0`` without one); with no such pool both are 0.
    ``backup_batch_pages`` cuts a node's backup into ops of at most that many pages (the states go
    with the last one), as the implementation's ``StorageConfig.backup_batch_pages``; ``None``: one op.
    """

    page_size: int = attrs.field(validator=_positive)
    device_pages: int = attrs.field(validator=_positive)
    host_pages: int = attrs.field(default=0, validator=_non_negative)
    write_policy: WritePolicy = attrs.field(
        default=WritePolicy.WRITE_THROUGH, validator=attrs.validators.instance_of(WritePolicy)
    )
    write_through_threshold: int = attrs.field(default=2, validator=_positive)
    load_back_threshold: int = attrs.field(default=0, validator=_non_negative)
    load_back_quota: int | None = None
    prefetch_threshold: int = attrs.field(default=256, validator=_non_negative)
    prefetch_policy: PrefetchPolicy = attrs.field(
        default=PrefetchPolicy.BEST_EFFORT, validator=attrs.validators.instance_of(PrefetchPolicy)
    )
    prefetch_timeout: PrefetchTimeout = attrs.field(factory=PrefetchTimeout)
    keys: KeySpace | None = None
    check: bool = True
    side_pools: tuple[SidePool, ...] = attrs.field(default=(), converter=_to_side_pools)
    device_states: int = attrs.field(default=0, validator=_non_negative)
    host_states: int = attrs.field(default=0, validator=_non_negative)
    backup_batch_pages: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_positive)
    )

    def __attrs_post_init__(self) -> None:
        if self.keys is not None and self.keys.model.page_size != self.page_size:
            raise MisuseError("the key space's page size differs from the cache's page size")
        if self.load_back_quota is not None and self.load_back_quota <= 0:
            raise MisuseError(f"load_back_quota must be > 0 or None, got {self.load_back_quota}")
        check_side_pools(self.side_pools)
        if not self.trailing_pools:
            if self.device_states or self.host_states:
                raise MisuseError("state slots need a TRAILING_PAGES side pool")
        else:
            if self.device_states < 1:
                raise MisuseError("a TRAILING_PAGES side pool needs device_states >= 1")
            if (self.host_pages > 0) != (self.host_states > 0):
                raise MisuseError("host_states must be >= 1 with an L2 and 0 without one")

    @property
    def all_pages_pools(self) -> tuple[SidePool, ...]:
        return tuple(p for p in self.side_pools if p.policy is HitPolicy.ALL_PAGES)

    @property
    def trailing_pools(self) -> tuple[SidePool, ...]:
        return tuple(p for p in self.side_pools if p.policy is HitPolicy.TRAILING_PAGES)

    @property
    def has_l3(self) -> bool:
        """Whether there is an L3: a key space and an L2 to back up from and prefetch into."""
        return self.keys is not None and self.host_pages > 0
