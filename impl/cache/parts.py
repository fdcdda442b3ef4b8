"""Wiring the cache's pieces (composition, not inheritance): each piece owns its data and gets
references to the pieces it calls. Checked here, before anything is built: an L2 pool comes with a
transfer controller, ``write_back`` with a blocking copy, state-slot allocators with a
``TRAILING_PAGES`` pool (and an L2 state pool exactly when there is an L2).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from kvstrata.impl.cache.clock import StepClock
from kvstrata.impl.cache.index import TreeIndex
from kvstrata.impl.cache.locks import LockBook
from kvstrata.impl.cache.lookup import Lookup
from kvstrata.impl.cache.node import Allocator, Pages
from kvstrata.impl.cache.pages import HeldPages
from kvstrata.impl.cache.port import CachePort
from kvstrata.impl.cache.states import StateBook
from kvstrata.impl.cache.tiers import Tiers
from kvstrata.impl.config import RadixCacheConfig
from kvstrata.impl.errors import ConfigError, MisuseError
from kvstrata.impl.fingerprint import Fingerprinter, fingerprint_keys
from kvstrata.impl.hashing import BackgroundHasher, InlineHasher, PageHasher
from kvstrata.impl.kernels import NATIVE
from kvstrata.impl.pools import PageAllocator
from kvstrata.impl.transfer import Direction, SideCopyFunction, TransferController
from kvstrata.model.cache import WritePolicy

__all__ = ["CacheParts", "assemble"]


@attrs.frozen
class CacheParts:
    """The pieces of one cache, wired to each other."""

    clock: StepClock
    locks: LockBook
    index: TreeIndex
    states: StateBook
    tiers: Tiers
    held: HeldPages
    lookup: Lookup
    port: CachePort


def _state_pools(
    config: RadixCacheConfig,
    host: Allocator | None,
    device_states: Allocator | None,
    host_states: Allocator | None,
) -> tuple[Allocator | None, Allocator | None]:
    if not config.trailing_pools:
        if device_states is not None or host_states is not None:
            raise MisuseError("state slot allocators need a TRAILING_PAGES side pool in the config")
        return None, None
    if (host is not None) != (config.host_states > 0):
        raise ConfigError(
            f"host_states: a TRAILING_PAGES side pool needs an int >= 1 with an L2 and 0 "
            f"without one, got {config.host_states} "
            f"({'with' if host is not None else 'without'} an L2)"
        )
    if device_states is None:
        device_states = PageAllocator(config.device_states, "L1 states")
    if host is not None and host_states is None:
        host_states = PageAllocator(config.host_states, "L2 states")
    return device_states, host_states


def assemble(
    config: RadixCacheConfig,
    device: Allocator,
    host: Allocator | None,
    transfer: TransferController | None,
    copy_now: Callable[[Direction, Pages, Pages], int] | None,
    *,
    device_states: Allocator | None,
    host_states: Allocator | None,
    side_copy_now: SideCopyFunction | None,
) -> CacheParts:
    """The pieces of a cache over ``device`` (and ``host``) page allocators; see the module."""
    if (host is None) != (transfer is None):
        raise MisuseError("an L2 pool needs a transfer controller and vice versa")
    if config.write_policy is WritePolicy.WRITE_BACK and host is not None and copy_now is None:
        raise MisuseError("write_back needs a blocking copy function (copy_now)")
    device_states, host_states = _state_pools(config, host, device_states, host_states)
    hasher: PageHasher = (
        BackgroundHasher(4 * config.page_size)
        if config.page_hashes and config.hash_worker and NATIVE
        else InlineHasher(4 * config.page_size)
    )
    fingerprint = Fingerprinter(
        fingerprint_keys(config.page_size, config.fingerprint_seed), config.page_size
    )
    clock = StepClock()
    selective = config.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE
    locks = LockBook(clock, count_hits=selective)
    index = TreeIndex(
        clock, locks, fingerprint, hasher, page_size=config.page_size, hashing=config.page_hashes
    )
    pools = [pool.name for pool in config.trailing_pools]
    states = StateBook(clock, pools, device_states, host_states)
    tiers = Tiers(
        config,
        clock,
        index,
        locks,
        states,
        device=device,
        host=host,
        transfer=transfer,
        copy_now=copy_now,
        side_copy_now=side_copy_now,
    )
    held = HeldPages(device.num_pages)
    lookup = Lookup(config, clock, index, locks, states, tiers=tiers, held=held)
    port = CachePort(clock, index, locks, states, tiers)
    return CacheParts(clock, locks, index, states, tiers, held, lookup, port)
