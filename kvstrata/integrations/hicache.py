"""sglang's HiCache L3 contract on a kvstrata backend, without sglang: :class:`HiCachePages`.

:mod:`kvstrata.integrations.sglang` is the thin subclass of sglang's ``HiCacheStorage`` that
converts sglang's types and delegates here; everything that decides which bytes go where lives in
this module, so the main test suite checks it without an engine installed.

The contract kept (sglang 0.5.23, ``mem_cache/hicache_storage.py``):

- **keys** are sglang page hashes, 64 hex digits each (:func:`~kvstrata.model.engines.engine_page_hash`);
  each becomes store keys once, through the instance's :class:`~kvstrata.model.keys.KeySpace`
  (:mod:`kvstrata.model.engines` decides the key space from sglang's storage config);
- **host indices** are token slots of sglang's host pool, ``page_size`` per key, each run one whole,
  aligned page (anything else is a :class:`MisuseError`: a misaligned run would read or write the
  wrong page's bytes, the stale-offset bug class);
- :meth:`HiCachePages.exists` is the number of consecutive pages present from the first;
  :meth:`HiCachePages.get` reports a page loaded only if every byte arrived and every page before it
  was loaded too (sglang stops at the first ``False``); :meth:`HiCachePages.set` reports each page;
- hybrid side pools (``*_v2``): a side pool's entry is the engine's flat page of that pool
  (``get_data_page`` / ``set_from_flat_data_page``), moved through a staging buffer and stored
  under :func:`~kvstrata.model.hybrid.side_page_keys` of the KV page hash it belongs to;
  :meth:`HiCachePages.exists_v2` applies the per-pool hit policies with the model's code;
- the store never raises into the engine: an unreachable store is no L3 (every lookup misses);
  misuse raises, typed.

Threads: sglang calls a backend from its prefetch and backup threads at once; one lock serializes
the calls (a kvstrata backend is driven by one thread at a time).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import attrs
import torch

from kvstrata.impl.errors import ConfigError, MisuseError
from kvstrata.impl.pools.host import HostKVPool
from kvstrata.impl.pools.shape import HostLayout, KVShape
from kvstrata.impl.pools.side import SideBuffer, SideSpec
from kvstrata.impl.storage.base import GetStatus, StorageBackend
from kvstrata.impl.storage.side import EntryKeys, SideIO, side_io
from kvstrata.integrations.store import StoreOptions, open_backend
from kvstrata.model.engines import EngineShard, HashScheme, engine_page_hash
from kvstrata.model.hybrid import HitPolicy, SidePool, is_usable, side_page_keys
from kvstrata.model.keys import KVKind, PageHash

__all__ = ["HiCachePages", "HostGeometry", "PoolAsk", "Stats", "V2Hit"]

STAGING_ENTRIES = 128
"""Side-pool entries moved per staging round (sglang's ``STORAGE_BATCH_SIZE``)."""


@attrs.frozen
class HostGeometry:
    """What an engine's host pool says of itself (sglang: ``layout``, ``page_size``, ``dtype``,
    ``layer_num``, ``head_num``, ``head_dim``; MLA: one head of ``kv_cache_dim``)."""

    layout: str
    page_size: int
    dtype: torch.dtype
    layers: int
    heads: int
    head_dim: int
    mla: bool

    def shape(self) -> KVShape:
        try:
            HostLayout.parse(self.layout)
        except ConfigError as error:
            raise ConfigError(
                f"kvstrata: sglang host layout {self.layout!r} is not supported "
                "(use layer_first, page_first or page_first_direct; L3 needs a page-first one)"
            ) from error
        return KVShape(
            KVKind.MLA if self.mla else KVKind.MHA,
            layers=self.layers,
            heads=self.heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            page_size=self.page_size,
        )


@attrs.frozen
class PoolAsk:
    """One side pool in a hybrid exists: its name, hit policy and (``TRAILING_PAGES``) how many
    trailing pages must hold an entry."""

    name: str
    policy: HitPolicy
    window: int = 1


@attrs.frozen
class V2Hit:
    """A hybrid exists: the usable KV prefix, each pool's own boundary, and every prefix length
    (1..) usable in every pool (sglang intersects these across ranks)."""

    kv_hit: int
    pool_hits: dict[str, int]
    restorable: list[int]


@attrs.define
class Stats:
    """Per batch since the last :meth:`HiCachePages.drain_stats`: pages loaded and stored, and
    each batch's bandwidth in GB/s."""

    prefetch_pages: list[int] = attrs.Factory(list)
    backup_pages: list[int] = attrs.Factory(list)
    prefetch_gbps: list[float] = attrs.Factory(list)
    backup_gbps: list[float] = attrs.Factory(list)


@attrs.define(eq=False)
class _Side:
    """A registered side pool: its staging buffer and I/O, and the engine's flat-page accessors."""

    pool: SidePool
    staging: SideBuffer
    io: SideIO
    read: Callable[[int], torch.Tensor]
    write: Callable[[int, torch.Tensor], None]


class HiCachePages:
    """The L3 pages of one sglang rank: ``shard`` names them, ``host`` is sglang's host buffer
    (wrapped, never copied), ``options`` chooses the store."""

    def __init__(self, shard: EngineShard, options: StoreOptions, host: HostKVPool) -> None:
        if shard.scheme is not HashScheme.SGLANG:
            raise MisuseError("HiCachePages: expected an sglang shard")
        self.shard = shard
        self.keyspace = shard.keyspace()
        self.namespace = shard.namespace()
        self.host = host
        self.page_size = host.shape.page_size
        self.backend: StorageBackend | None = open_backend(
            options, self.keyspace, writer=shard.writer
        )
        if self.backend is not None:
            try:
                self.backend.attach(host)  # ConfigError for a layer_first pool: not page-contiguous
            except Exception:
                self.backend.close()
                raise
        self._side: dict[str, _Side] = {}
        self._lock = threading.Lock()
        self._stats = Stats()

    # ------------------------------------------------------------------------------ arguments
    def pages(self, keys: Sequence[str]) -> list[PageHash]:
        if isinstance(keys, str) or not isinstance(keys, Sequence):
            raise MisuseError(f"kvstrata: keys must be a list of page hashes, got {keys!r}")
        return [engine_page_hash(key, HashScheme.SGLANG) for key in keys]

    def slots(self, host_indices: object, count: int, page_size: int) -> list[int]:
        """The first slot of each of ``count`` runs of ``page_size`` token slots, checked: an
        integer tensor of exactly ``count * page_size`` slots, each run one aligned page."""
        if not isinstance(host_indices, torch.Tensor) or host_indices.dtype.is_floating_point:
            raise MisuseError(
                f"kvstrata: host_indices must be an integer tensor, got {host_indices!r}"
            )
        if host_indices.numel() != count * page_size:
            raise MisuseError(
                f"kvstrata: {count} keys need {count * page_size} host slots, "
                f"got {host_indices.numel()}"
            )
        runs = host_indices.reshape(count, page_size).to("cpu", torch.int64)
        first = runs[:, 0]
        steps = torch.arange(page_size, dtype=torch.int64)
        if count and (
            bool((first % page_size).any())
            or not torch.equal(runs - first[:, None], steps.expand_as(runs))
        ):
            raise MisuseError(
                "kvstrata: host_indices must be whole, aligned pages of consecutive slots"
            )
        return [int(slot) for slot in first]

    # ------------------------------------------------------------------------------ KV pages
    def exists(self, keys: Sequence[str]) -> int:
        pages = self.pages(keys)
        if self.backend is None or not pages:
            return 0
        with self._lock:
            return self.backend.exists(self.namespace, pages)

    def get(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        pages = self.pages(keys)
        slots = [
            slot // self.page_size for slot in self.slots(host_indices, len(pages), self.page_size)
        ]
        if self.backend is None or not pages:
            return [False] * len(pages)
        start = time.perf_counter()
        with self._lock:
            statuses = self.backend.get(self.namespace, pages, slots)
        loaded = _prefix([status is GetStatus.LOADED for status in statuses])
        self._record(self._stats.prefetch_pages, self._stats.prefetch_gbps, sum(loaded), start)
        return loaded

    def set(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        pages = self.pages(keys)
        slots = [
            slot // self.page_size for slot in self.slots(host_indices, len(pages), self.page_size)
        ]
        if self.backend is None or not pages:
            return [False] * len(pages)
        start = time.perf_counter()
        with self._lock:
            statuses = self.backend.put(self.namespace, pages, slots)
        stored = [status.ok for status in statuses]
        self._record(self._stats.backup_pages, self._stats.backup_gbps, sum(stored), start)
        return stored

    def _record(self, pages: list[int], gbps: list[float], count: int, start: float) -> None:
        seconds = max(time.perf_counter() - start, 1e-9)
        with self._lock:
            pages.append(count)
            gbps.append(count * self.host.shape.nbytes(1) / seconds / 1e9)

    def drain_stats(self) -> Stats:
        """What happened since the last call (then forgotten, as sglang's collectors expect)."""
        with self._lock:
            stats, self._stats = self._stats, Stats()
        return stats

    # ------------------------------------------------------------------------------ side pools
    def attach_side(
        self,
        name: str,
        entry_nbytes: int,
        read: Callable[[int], torch.Tensor],
        write: Callable[[int, torch.Tensor], None],
        detail: str = "",
    ) -> None:
        """Register a side pool whose entry is ``entry_nbytes`` flat bytes (``read(index)`` gives
        them, ``write(index, bytes)`` puts them back). ``detail`` says what else those bytes
        depend on (the engine pool's dtypes): with the size it makes the pool's layout token, so
        engines that lay an entry out differently never share its objects. Registering a name
        again is a no-op when its size and detail are the same, a :class:`MisuseError` when not."""
        if self.backend is None:
            return
        # the policy below only sizes the staging buffer's bookkeeping; keys do not depend on it
        # and every exists names its own policy per pool
        spec = SideSpec(
            SidePool(name, HitPolicy.ALL_PAGES, ("data",)),
            [(entry_nbytes,)],
            torch.uint8,
            detail=detail,
        )
        if name in self._side:
            if self._side[name].pool != spec.pool:
                raise MisuseError(f"kvstrata: side pool {name!r} is registered with another layout")
            return
        staging = SideBuffer(spec, STAGING_ENTRIES, host=True)
        self._side[name] = _Side(
            spec.pool, staging, side_io(self.backend, staging, self.keyspace), read, write
        )

    def side(self, name: str) -> _Side:
        try:
            return self._side[name]
        except KeyError:
            raise MisuseError(f"kvstrata: side pool {name!r} is not registered") from None

    def exists_v2(self, keys: Sequence[str], asks: Sequence[PoolAsk]) -> V2Hit:
        """The KV hit, then each side pool's presence for the pages below it (never beyond), and
        the prefixes usable in every pool under the model's hit rules."""
        kv_hit = self.exists(keys)
        pages = self.pages(keys)[:kv_hit]
        usable = set(range(1, kv_hit + 1))
        pool_hits: dict[str, int] = {"kv": kv_hit} if kv_hit else {}
        for ask in asks:
            if not usable:
                break
            side = self.side(ask.name)
            with self._lock:
                present = side.io.present(self._side_keys(side, pages)) if pages else []
            probe = present.__getitem__
            window = max(1, ask.window) if ask.policy is HitPolicy.TRAILING_PAGES else 1
            pool_usable = {
                prefix
                for prefix in usable
                if all(
                    is_usable(ask.policy, probe, end)
                    for end in range(max(1, prefix - window + 1), prefix + 1)
                )
            }
            if pool_usable:
                pool_hits[ask.name] = max(pool_usable)
            usable &= pool_usable
        restorable = sorted(usable)
        return V2Hit(restorable[-1] if restorable else 0, pool_hits, restorable)

    def _side_keys(self, side: _Side, pages: Sequence[PageHash]) -> list[EntryKeys]:
        return [side_page_keys(self.keyspace, self.namespace, side.pool, page) for page in pages]

    def _no_store(self, name: str, keys: Sequence[str], entries: Sequence[int]) -> bool:
        """Whether there is no store (unreachable at attach: no L3, never an error to the
        engine, for side pools as for KV); the arguments are checked all the same."""
        pages = self.pages(keys)  # malformed keys are refused with or without a store
        if len(entries) != len(pages):
            raise MisuseError(
                f"kvstrata: {len(pages)} keys but {len(entries)} entries for {name!r}"
            )
        return self.backend is None

    def set_side(self, name: str, keys: Sequence[str], entries: Sequence[int]) -> list[bool]:
        """Store each engine entry of pool ``name`` under its key's side keys (without a store:
        nothing stored)."""
        if self._no_store(name, keys, entries):
            return [False] * len(keys)
        side, pages = self.side(name), self.pages(keys)
        out: list[bool] = []
        for start in range(0, len(pages), STAGING_ENTRIES):
            chunk = list(range(min(STAGING_ENTRIES, len(pages) - start)))
            with self._lock:
                for slot in chunk:
                    side.staging.tensors[0][slot].copy_(
                        _flat_bytes(side.read(entries[start + slot]))
                    )
                statuses = side.io.put(
                    self._side_keys(side, pages[start : start + len(chunk)]), chunk
                )
            out += [status.ok for status in statuses]
        return out

    def get_side(self, name: str, keys: Sequence[str], entries: Sequence[int]) -> list[bool]:
        """Load each entry of pool ``name``; an entry is written back to the engine only if it
        arrived whole, and the answer stops at the first miss (without a store: nothing)."""
        if self._no_store(name, keys, entries):
            return [False] * len(keys)
        side, pages = self.side(name), self.pages(keys)
        out: list[bool] = []
        for start in range(0, len(pages), STAGING_ENTRIES):
            chunk = list(range(min(STAGING_ENTRIES, len(pages) - start)))
            with self._lock:
                statuses = side.io.get(
                    self._side_keys(side, pages[start : start + len(chunk)]), chunk
                )
                loaded = _prefix([status is GetStatus.LOADED for status in statuses])
                for slot, ok in zip(chunk, loaded, strict=True):
                    if ok:
                        side.write(entries[start + slot], side.staging.tensors[0][slot])
            out += loaded
            if not all(loaded):
                out += [False] * (len(pages) - len(out))
                break
        return _prefix(out)

    def close(self) -> None:
        for side in self._side.values():
            side.io.release()
        self._side.clear()
        if self.backend is not None:
            self.backend.close()


def _prefix(flags: list[bool]) -> list[bool]:
    """``flags`` with everything after the first ``False`` turned ``False``."""
    cut = flags.index(False) if False in flags else len(flags)
    return [True] * cut + [False] * (len(flags) - cut)


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


#: Attributes of an engine's side host pool that its flat entry bytes depend on besides their count:
#: element types (sglang's ``MambaPoolHost``: ``conv_dtype``, ``temporal_dtype``; other pools
#: ``dtype``), the order of the flat page (``layout``: ``get_data_page`` of a KV-shaped pool such as
#: SWA's flattens ``layer_first`` and ``page_first`` pages in different orders) and state shapes.
_DETAIL_ATTRIBUTES = (
    "dtype",
    "conv_dtype",
    "temporal_dtype",
    "layout",
    "conv_state_shapes",
    "temporal_state_shape",
)


def _detail_value(value: object) -> str | None:
    """A canonical text of one attribute, or None for a kind of value that is not a layout fact."""
    if isinstance(value, torch.dtype | str | int):
        return str(value)
    if isinstance(value, list | tuple):  # torch.Size is a tuple
        parts = [_detail_value(item) for item in value]
        return None if None in parts else "(" + ",".join(str(p) for p in parts) + ")"
    return None


def side_detail(host_pool: object, flat_page: torch.Tensor) -> str:
    """What an engine side pool's flat entry bytes depend on besides their count: the pool's class,
    the flat page's dtype and every attribute of :data:`_DETAIL_ATTRIBUTES` the pool has (as
    canonical text). Folded into the pool's layout token (``attach_side(detail=...)``), so two
    deployments whose entries have the same size but another SSM dtype (sglang's
    ``--mamba-ssm-dtype``) or another host layout never read each other's side objects. The class
    name only costs misses if the engine renames it."""
    found = []
    for name in _DETAIL_ATTRIBUTES:
        value = _detail_value(getattr(host_pool, name, None))
        if value is not None:
            found.append(f"{name}={value}")
    return ";".join([type(host_pool).__name__, f"flat={flat_page.dtype}", *found])
