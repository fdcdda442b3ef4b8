"""Building a cache over real pools (SPEC §2, §5): the copy functions between the device and host
pools (with side-pool entries), the state-slot allocators of the trailing pools, and the L3 tier
attached through the cache's port. Every check that can refuse a configuration runs before anything
is built (:class:`~kvstrata.impl.errors.ConfigError`, naming the field).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, Self, TypeVar, cast

import attrs
import numpy as np
import numpy.typing as npt

from kvstrata.impl.cache.node import Allocator, Pages
from kvstrata.impl.config import RadixCacheConfig, StorageConfig
from kvstrata.impl.errors import ConfigError
from kvstrata.impl.l3 import L3Tier, TreePort
from kvstrata.impl.pools import KVPool, PageAllocator, copy_pages
from kvstrata.impl.pools.group import PoolGroup, copy_between
from kvstrata.impl.pools.host import HostKVPool
from kvstrata.impl.pools.side import SideBuffer, SideSpec, copy_entries
from kvstrata.impl.storage.base import StorageBackend, check_attachable
from kvstrata.impl.storage.hybrid import HybridStorage
from kvstrata.impl.storage.link import Lanes
from kvstrata.impl.tp import TpGroup
from kvstrata.impl.transfer import Direction, Executor, PoolTransfer, TransferController
from kvstrata.model.hybrid import HitPolicy, SidePool

__all__ = ["BuildTarget", "build_cache"]


class BuildTarget(Protocol):
    """What :func:`build_cache` sets on the cache it makes (``HierarchicalRadixCache``)."""

    device_group: PoolGroup | None
    host_group: PoolGroup | None

    @property
    def port(self) -> TreePort: ...

    def attach_l3(self, tier: L3Tier) -> None: ...

    def agree_with(self, group: TpGroup) -> None: ...


C = TypeVar("C", bound=BuildTarget)


class _LockstepSlots:
    """State slots of several ``TRAILING_PAGES`` pools of one tier as one allocator: slot ``s`` is
    entry ``s`` of every pool. Invariant: the pools' allocators see the same calls, so (lowest
    first) they hand out the same slots and hold the same free counts."""

    def __init__(self, allocators: Sequence[PageAllocator]) -> None:
        self._allocators = tuple(allocators)

    @property
    def free_count(self) -> int:
        return self._allocators[0].free_count

    @property
    def num_pages(self) -> int:
        return self._allocators[0].num_pages

    def alloc(self, n: int, /) -> npt.NDArray[np.integer[Any]]:
        out = [allocator.alloc(n) for allocator in self._allocators]
        assert all(np.array_equal(out[0], other) for other in out[1:]), "state pools diverged"
        return out[0]

    def free(self, pages: npt.NDArray[np.int64], /) -> None:
        for allocator in self._allocators:
            allocator.free(pages)


def _state_allocator(group: PoolGroup) -> Allocator:
    """One allocator over the state slots of every ``TRAILING_PAGES`` pool of ``group``."""
    allocators = [buffer.allocator for buffer in group.stateful if buffer.allocator is not None]
    return allocators[0] if len(allocators) == 1 else _LockstepSlots(allocators)


def _names(pool: SidePool, spec: object) -> bool:
    """Whether a config's side pool names ``spec``'s: the same pool, or the same but for the
    layout the spec filled in (a config may list pools without one: the cache reads their names
    and policies only, and keys every entry by the spec's pool, layout included)."""
    given = getattr(spec, "pool", None)
    if not isinstance(given, SidePool):
        return False
    return pool == given or (not pool.layout and pool == attrs.evolve(given, layout=""))


def _check(
    config: RadixCacheConfig,
    device_pool: KVPool,
    host_pool: KVPool | None,
    specs: tuple[SideSpec, ...],
) -> None:
    if device_pool.shape.page_size != config.page_size:
        raise ConfigError("the device pool's page size differs from the cache's page_size")
    if len(specs) != len(config.side_pools) or not all(
        _names(pool, spec) for pool, spec in zip(config.side_pools, specs, strict=False)
    ):
        raise ConfigError(
            f"side_specs: expected one SideSpec per side pool of the config "
            f"{[p.name for p in config.side_pools]}, in order, got {specs!r}"
        )
    if specs and host_pool is None and config.host_states:
        raise ConfigError(f"host_states: expected 0 without a host pool, got {config.host_states}")
    if specs and host_pool is not None and config.trailing_pools and config.host_states < 1:
        raise ConfigError(
            f"host_states: a TRAILING_PAGES side pool with a host pool needs an int >= 1, "
            f"got {config.host_states}"
        )


def _check_storage(
    config: RadixCacheConfig, host_pool: KVPool, storage: StorageBackend, hybrid: bool
) -> None:
    if not isinstance(host_pool, HostKVPool):
        raise ConfigError("an L3 storage backend needs a HostKVPool as the host pool")
    if storage.keyspace.model.page_size != config.page_size:
        raise ConfigError(
            f"the storage key space's page size ({storage.keyspace.model.page_size}) "
            f"differs from the cache's page_size ({config.page_size})"
        )
    if not config.page_hashes:
        raise ConfigError("an L3 storage backend needs page_hashes=True (its keys)")
    if hybrid:  # refuse a layer_first pool before building anything
        check_attachable(host_pool, "HierarchicalRadixCache.build")
    else:
        storage.attach(host_pool)


def build_cache(
    cls: Callable[..., C],
    config: RadixCacheConfig,
    device_pool: KVPool,
    host_pool: KVPool | None = None,
    executor: Executor | None = None,
    *,
    storage: StorageBackend | None = None,
    storage_config: StorageConfig | None = None,
    storage_executor: Executor | Lanes | None = None,
    side_specs: Sequence[SideSpec] = (),
    tp_group: TpGroup | None = None,
) -> C:
    """A cache over real pools (in TP group ``tp_group`` if given: ``agree_with``): copies run on
    ``executor`` (a worker thread by default). With a
    ``storage`` backend (which needs a page-first host pool) L2 is backed up to L3 and prefetched
    from it; store I/O runs on ``storage_executor`` (a worker thread by default).

    Side pools: ``side_specs`` gives the shapes of ``config.side_pools`` (one spec per pool, in the
    same order). Their buffers sit next to each KV pool: an ``ALL_PAGES`` buffer of one entry per
    KV page, a ``TRAILING_PAGES`` one of ``device_states`` / ``host_states`` slots
    (``device_group`` / ``host_group``). Every L1 <-> L2 copy moves the indexer entries of its
    pages and the state slots it carries in the same batch; with a ``storage`` backend the L3 tier
    drives a :class:`~kvstrata.impl.storage.hybrid.HybridStorage` over the host side buffers."""
    cache = _build(
        cls,
        config,
        device_pool,
        host_pool,
        executor,
        storage,
        storage_config,
        storage_executor,
        tuple(side_specs),
    )
    if tp_group is not None:
        cache.agree_with(tp_group)
    return cache


def _build(  # noqa: PLR0917
    cls: Callable[..., C],
    config: RadixCacheConfig,
    device_pool: KVPool,
    host_pool: KVPool | None,
    executor: Executor | None,
    storage: StorageBackend | None,
    storage_config: StorageConfig | None,
    storage_executor: Executor | Lanes | None,
    specs: tuple[SideSpec, ...],
) -> C:
    _check(config, device_pool, host_pool, specs)
    device_group = _side_group(specs, device_pool, config.device_states, host=False)
    if host_pool is None:
        if storage is not None:
            raise ConfigError("an L3 storage backend needs a host pool (L2) to stage pages")
        alone = cls(
            config,
            device_pool.allocator,
            device_states=_state_allocator(device_group) if config.trailing_pools else None,
            page_nbytes=device_pool.shape.bytes_per_page,
        )
        alone.device_group = device_group if specs else None
        return alone
    if storage is not None:
        _check_storage(config, host_pool, storage, bool(specs))
    if specs:
        cache = _build_hybrid(cls, config, device_group, host_pool, executor)
        if storage is not None:  # KV pages with their side objects (attached here)
            assert cache.host_group is not None and isinstance(host_pool, HostKVPool)
            hybrid = HybridStorage(storage, list(cache.host_group.side.values()))
            hybrid.attach(host_pool)
            _attach_l3(cache, hybrid, storage_config, storage_executor, host_pool)
        return cache

    cache = _build_plain(cls, config, device_pool, host_pool, executor)
    if storage is not None:
        _attach_l3(cache, storage, storage_config, storage_executor, host_pool)
    return cache


def _build_plain(
    cls: Callable[..., C],
    config: RadixCacheConfig,
    device_pool: KVPool,
    host_pool: KVPool,
    executor: Executor | None,
) -> C:
    """``build`` with an L2 and no side pools: KV page copies between the two pools."""

    def copy(direction: Direction, src: Pages, dst: Pages) -> int:
        if direction is Direction.WRITE:
            return copy_pages(device_pool, src, host_pool, dst)
        return copy_pages(host_pool, src, device_pool, dst)

    transfer = TransferController(copy, executor)
    return cls(
        config,
        device_pool.allocator,
        host_pool.allocator,
        transfer,
        copy,
        page_nbytes=device_pool.shape.bytes_per_page,
    )


def _attach_l3(
    cache: BuildTarget,
    backend: StorageBackend | HybridStorage,
    config: StorageConfig | None,
    executor: Executor | Lanes | None,
    host_pool: KVPool,
) -> None:
    cache.attach_l3(
        L3Tier(
            cache.port,
            backend,
            config or StorageConfig(),
            executor,
            page_nbytes=host_pool.shape.bytes_per_page,
        )
    )


def _side_group(specs: tuple[SideSpec, ...], pool: KVPool, states: int, *, host: bool) -> PoolGroup:
    """``pool`` with a buffer per side spec: one entry per KV page (``ALL_PAGES``) or
    ``states`` slots (``TRAILING_PAGES``)."""
    buffers = [
        SideBuffer(
            spec,
            pool.num_pages if spec.policy is HitPolicy.ALL_PAGES else states,
            host=host,
            device=None if host else pool.device,
            pin_memory=None if host else False,
        )
        for spec in specs
    ]
    return PoolGroup(pool, buffers)


def _build_hybrid(
    cls: Callable[..., C],
    config: RadixCacheConfig,
    device_group: PoolGroup,
    host_pool: KVPool,
    executor: Executor | None,
) -> C:
    """``build`` with side pools and an L2: KV copies carry the ``ALL_PAGES`` entries of their
    pages (:func:`copy_between`), state slots travel as :class:`PoolTransfer` s."""
    specs = tuple(buffer.spec for buffer in device_group.side.values())
    host_group = _side_group(specs, host_pool, config.host_states, host=True)

    def copy(direction: Direction, src: Pages, dst: Pages) -> int:
        if direction is Direction.WRITE:
            return copy_between(device_group, host_group, src, dst)
        return copy_between(host_group, device_group, src, dst)

    def side_copy(direction: Direction, transfer: PoolTransfer) -> int:
        source, target = (
            (device_group, host_group)
            if direction is Direction.WRITE
            else (host_group, device_group)
        )
        buffer = source.side[transfer.pool]
        copy_entries(buffer, transfer.src, target.side[transfer.pool], transfer.dst)
        return buffer.spec.bytes_per_entry * len(transfer.src)

    transfer = TransferController(copy, executor, side_copy)
    trailing = bool(config.trailing_pools)
    cache = cls(
        config,
        device_group.kv.allocator,
        host_pool.allocator,
        transfer,
        copy,
        device_states=_state_allocator(device_group) if trailing else None,
        host_states=_state_allocator(host_group) if trailing else None,
        side_copy_now=side_copy,
        page_nbytes=device_group.kv.shape.bytes_per_page,
    )
    cache.device_group = device_group
    cache.host_group = host_group
    return cache


class Buildable:
    """Mixed into the cache class: :meth:`build`, its constructor over real pools."""

    @classmethod
    def build(
        cls,
        config: RadixCacheConfig,
        device_pool: KVPool,
        host_pool: KVPool | None = None,
        executor: Executor | None = None,
        *,
        storage: StorageBackend | None = None,
        storage_config: StorageConfig | None = None,
        storage_executor: Executor | Lanes | None = None,
        side_specs: Sequence[SideSpec] = (),
        tp_group: TpGroup | None = None,
    ) -> Self:
        """A cache over real pools, with side pools, an L3 store and a TP group if given
        (:func:`build_cache` says what it builds)."""
        target = cast("Callable[..., Any]", cls)
        built = build_cache(
            target,
            config,
            device_pool,
            host_pool,
            executor,
            storage=storage,
            storage_config=storage_config,
            storage_executor=storage_executor,
            side_specs=side_specs,
            tp_group=tp_group,
        )
        return cast("Self", built)
