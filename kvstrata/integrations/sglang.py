"""kvstrata as sglang's L3 storage backend: :class:`KvstrataHiCacheStorage` (sglang 0.5.23).

Turn it on with::

    --enable-hierarchical-cache --hicache-mem-layout page_first_direct \\
    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
    '{"backend_name":"kvstrata","module_path":"kvstrata.integrations.sglang",
      "class_name":"KvstrataHiCacheStorage","interface_v1":1,"master":"10.0.0.5:50051"}'

sglang keeps its own L1 and L2; kvstrata stores and finds the L2 pages in its L3 (Mooncake by
default). This module only converts sglang's types: :class:`~kvstrata.integrations.hicache.HiCachePages`
holds the behaviour, :mod:`kvstrata.model.engines` the sharing rule, :mod:`kvstrata.integrations.store`
the options (docs/engines.md lists them).

Construction (``cls(storage_config, kwargs)``, as sglang's factory calls it) parses the extra config
and refuses what kvstrata cannot key correctly (context-parallel or decode-context-parallel shards,
split heads), naming the key; the store is opened when sglang registers its host pool, which is
wrapped, not copied.

KV formats (issue 20, part 19): sglang keeps fp8 KV of every variant in ``uint8`` pools, so the
pool's dtype does not say what the bytes are. For such a pool the key names the KV cache dtype: the
extra config's ``kv_dtype`` (sglang's ``--kv-cache-dtype`` value or a torch dtype name), else the
server's ``--kv-cache-dtype`` when sglang published it and it is not ``auto``; neither, or the two
disagreeing, is a :class:`ConfigError` (never a key shared by every fp8 variant). A KV scales file
(``--quantization-param-path``) is part of the format, and the server's ``--revision`` and
``--quantization`` of the model's weights (``EngineShard.weights``). A host pool that keeps per-token
bytes outside its KV buffer (sglang's MXFP8 pool keeps its block scales apart) is refused: its pages
would reach L3 without them.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolTransfer,
    PoolTransferResult,
)

from kvstrata.impl.errors import ConfigError, MisuseError
from kvstrata.impl.pools.host import HostKVPool
from kvstrata.impl.pools.shape import HostLayout
from kvstrata.integrations.hicache import HiCachePages, HostGeometry, PoolAsk, side_detail
from kvstrata.integrations.legacy import FlatPages
from kvstrata.integrations.store import StoreOptions
from kvstrata.model.engines import (
    EngineShard,
    HashScheme,
    engine_kv_format,
    engine_weights,
    holds_bytes,
)
from kvstrata.model.hybrid import HitPolicy

__all__ = ["KvstrataHiCacheStorage"]

log = logging.getLogger("kvstrata.integrations.sglang")

_POLICIES = {
    PoolHitPolicy.ALL_PAGES: HitPolicy.ALL_PAGES,
    PoolHitPolicy.TRAILING_PAGES: HitPolicy.TRAILING_PAGES,
}
_KV = "kv"
_OWN = frozenset({"kv_dtype"})
"""The extra config's keys this adapter reads itself (the rest are :class:`StoreOptions`)."""


class KvstrataHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """sglang's ``HiCacheStorage`` on kvstrata's keys and stores."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None):
        where = "kvstrata sglang backend"
        if storage_config.attn_cp_size > 1:
            raise ConfigError(
                f"{where}: attn_cp_size > 1 is not supported (pages are split per rank)"
            )
        if storage_config.dcp_size > 1:
            raise ConfigError(f"{where}: dcp_size > 1 is not supported")
        if storage_config.should_split_heads:
            raise ConfigError(f"{where}: tp_lcm_size with split heads is not supported")
        if not storage_config.model_name:
            raise ConfigError(f"{where}: the storage config names no model (model_name)")
        self.config = storage_config
        self.options = StoreOptions.parse(storage_config.extra_config, where=where, own=_OWN)
        kv_dtype = (storage_config.extra_config or {}).get("kv_dtype")
        if kv_dtype is not None and (not isinstance(kv_dtype, str) or not kv_dtype.strip()):
            raise ConfigError(f"{where}: key 'kv_dtype' expects a dtype name, got {kv_dtype!r}")
        self.kv_dtype: str | None = kv_dtype
        self.pages: HiCachePages | None = None
        self.flat: FlatPages | None = None
        self._pending_side: list[tuple[Any, str]] = []

    # ------------------------------------------------------------------------------ attach
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        pool = mem_pool_host
        mla = bool(self.config.is_mla_model)
        if not mla and getattr(pool, "v_head_dim", pool.head_dim) != pool.head_dim:
            raise ConfigError("kvstrata sglang backend: K and V head dims differ")
        geometry = HostGeometry(
            layout=pool.layout,
            page_size=pool.page_size,
            dtype=pool.dtype,
            layers=pool.layer_num,
            heads=1 if mla else pool.head_num,
            head_dim=pool.kv_cache_dim if mla else pool.head_dim,
            mla=mla,
        )
        shape = geometry.shape()
        args = _server_args()
        per_token = getattr(pool, "size_per_token", None)
        if isinstance(per_token, int) and per_token != shape.bytes_per_token:
            raise ConfigError(
                f"kvstrata sglang backend: sglang's {type(pool).__name__} holds {per_token} bytes "
                f"a token, its KV buffer {shape.bytes_per_token}; the rest (block scales, an "
                "index) would not reach L3 and pages restored without it would be wrong"
            )
        host = HostKVPool.wrap(pool.kv_buffer, shape, geometry.layout)
        shard = EngineShard(
            HashScheme.SGLANG,
            model_name=str(self.config.model_name),
            dtype=str(pool.dtype),
            mla=mla,
            page_size=pool.page_size,
            tp_rank=self.config.tp_rank,
            tp_size=self.config.tp_size,
            pp_rank=self.config.pp_rank,
            pp_size=self.config.pp_size,
            writer_rank=self.config.dcp_rank if mla else 0,
            tag=self.options.tag,
            tenant=self.options.tenant,
            key_schema=self.options.key_schema,
            kv_format=_kv_format(pool.dtype, self.kv_dtype, args),
            weights=_weights(args),
        )
        if self.pages is not None:
            self.pages.close()
        self.pages = HiCachePages(shard, self.options, host)
        self.flat = FlatPages(shard, self.options, shape, HostLayout.parse(geometry.layout))
        for side_pool, name in self._pending_side:
            self._attach_side(side_pool, name)
        self._pending_side.clear()

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if self.pages is None:
            self._pending_side.append((host_pool, str(host_pool_name)))
        else:
            self._attach_side(host_pool, str(host_pool_name))

    def _attach_side(self, host_pool: Any, name: str) -> None:
        if name == _KV:
            return  # the anchor: the KV host pool itself
        assert self.pages is not None
        dummy = host_pool.get_dummy_flat_data_page()
        self.pages.attach_side(
            name,
            dummy.numel() * dummy.element_size(),
            read=lambda index: host_pool.get_data_page(index, flat=True),
            write=host_pool.set_from_flat_data_page,
            detail=side_detail(host_pool, dummy),
        )

    def _attached(self) -> HiCachePages:
        if self.pages is None:
            raise MisuseError("kvstrata sglang backend: register_mem_pool_host was not called")
        return self.pages

    # ------------------------------------------------------------------------------ v1 (zero-copy)
    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        return self._attached().exists(keys)

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        return self._attached().get(keys, host_indices)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        return self._attached().set(keys, host_indices)

    # ------------------------------------------------------------------------------ v2 (hybrid)
    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        asks = []
        for transfer in pool_transfers or []:
            if str(transfer.name) == _KV:
                continue
            policy = _POLICIES.get(transfer.hit_policy)
            if policy is None:
                raise MisuseError(
                    f"kvstrata sglang backend: hit policy {transfer.hit_policy} is not supported"
                )
            asks.append(PoolAsk(str(transfer.name), policy, len(transfer.keys or []) or 1))
        hit = self._attached().exists_v2(keys, asks)
        return PoolTransferResult(hit.kv_hit, dict(hit.pool_hits), hit.restorable)

    def _v2(self, transfers: list[PoolTransfer], write: bool) -> dict[str, list[bool]]:
        pages = self._attached()
        results: dict[str, list[bool]] = {}
        for transfer in transfers:
            name, keys = str(transfer.name), list(transfer.keys or [])
            if name == _KV:
                op = pages.set if write else pages.get
                results[name] = op(keys, transfer.host_indices)
                continue
            host_pool = self.registered_pools[transfer.name]
            step = getattr(host_pool, "page_size", 1) or 1
            entries = pages.slots(transfer.host_indices, len(keys), step)
            side_op = pages.set_side if write else pages.get_side
            results[name] = side_op(name, keys, entries)
        return results

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._v2(transfers, write=False)

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._v2(transfers, write=True)

    # ------------------------------------------------------------------------------ legacy (copying)
    def _flat(self) -> FlatPages:
        if self.flat is None:
            raise MisuseError("kvstrata sglang backend: register_mem_pool_host was not called")
        return self.flat

    def exists(self, key: str) -> bool:
        return self._attached().exists([key]) == 1

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return None if self.batch_get([key], [target_location])[0] is None else target_location

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        targets = list(target_locations or [])
        loaded = self._flat().get(self._attached().pages(keys), targets)
        return [target if ok else None for target, ok in zip(targets, loaded, strict=True)]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        return all(self._flat().set(self._attached().pages(keys), list(values or [])))

    # ------------------------------------------------------------------------------ the rest
    def get_stats(self) -> Any:
        from sglang.srt.observability.metrics_collector import StorageMetrics  # noqa: PLC0415

        metrics = StorageMetrics()
        if self.pages is not None:
            stats = self.pages.drain_stats()
            metrics.prefetch_pgs.extend(stats.prefetch_pages)
            metrics.backup_pgs.extend(stats.backup_pages)
            metrics.prefetch_bandwidth.extend(stats.prefetch_gbps)
            metrics.backup_bandwidth.extend(stats.backup_gbps)
        return metrics

    def clear(self) -> None:
        """Nothing: the store is shared, and other instances' pages are not this one's to drop."""

    def close(self) -> None:
        if self.pages is not None:
            self.pages.close()
        if self.flat is not None:
            self.flat.close()


def _server_args() -> Any | None:
    """sglang's server arguments as the operator gave them, when this process published them (a
    server's scheduler processes do; a backend built outside a server sees none)."""
    try:
        from sglang.srt.runtime_context import get_server_args  # noqa: PLC0415

        return get_server_args()
    except (ImportError, ValueError, AttributeError, RuntimeError):
        return None


def _logical(name: str) -> str:
    """The type sglang stores for a KV cache dtype name on this platform: its ``fp8_dtype`` for
    e4m3 names (e4m3fnuz on ROCm's MI300), and for ``fp8_e5m2`` too on ROCm (sglang's
    ``configure_kv_cache_dtype``); :func:`~kvstrata.model.engines.engine_kv_format`."""
    from sglang.kernels.ops.quantization.fp8_kernel import fp8_dtype  # noqa: PLC0415

    e4m3 = str(fp8_dtype)
    return engine_kv_format(name, e4m3, e4m3 if torch.version.hip is not None else "float8_e5m2")


def _kv_format(dtype: torch.dtype, configured: str | None, args: Any | None) -> str:
    """The logical element type of a KV sglang keeps as bytes (``""`` when ``dtype`` is the
    element type): ``configured`` (the extra config's ``kv_dtype``), else the server's
    ``--kv-cache-dtype``; they must agree when both are known. A KV scales file
    (``--quantization-param-path``: the numbers the fp8 bytes are multiplied by) adds the digest
    of its content."""
    if not holds_bytes(dtype):
        return ""
    published = getattr(args, "kv_cache_dtype", None)
    published = str(published) if published and published != "auto" else None
    name = configured or published
    if name is None:
        raise ConfigError(
            f"kvstrata sglang backend: sglang keeps this KV as {dtype}, as it keeps every fp8 "
            "variant, and its KV cache dtype is not known here: set 'kv_dtype' in the extra "
            "config (sglang's --kv-cache-dtype, e.g. fp8_e4m3, or a torch dtype name)"
        )
    logical = _logical(name)
    if published is not None and _logical(published) != logical:
        raise ConfigError(
            f"kvstrata sglang backend: key 'kv_dtype' {configured!r} is not the server's "
            f"--kv-cache-dtype {published!r}"
        )
    scales = getattr(args, "quantization_param_path", None)
    if scales:
        try:
            with open(scales, "rb") as file:
                digest = hashlib.sha256(file.read()).hexdigest()[:16]
        except OSError as error:
            raise ConfigError(
                f"kvstrata sglang backend: cannot read the KV scales {scales!r}: {error}"
            ) from error
        logical = f"{logical}.scales_{digest}"
    return logical


def _weights(args: Any | None) -> str:
    """The revision and online weight quantization the operator gave sglang, each when set (a
    quantized checkpoint's own method is named by its path and served name)."""
    return engine_weights(getattr(args, "revision", None), getattr(args, "quantization", None))
