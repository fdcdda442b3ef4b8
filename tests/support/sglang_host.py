"""sglang's host pools and storage config, built as sglang's own storage tests build them. Import
only from tests/engines/sglang (its conftest installs what sglang needs on a CPU first)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

LAYERS, HEADS, HEAD_DIM, PAGE = 2, 2, 8, 4
DTYPE = torch.bfloat16
BACKEND = {
    "backend_name": "kvstrata",
    "module_path": "kvstrata.integrations.sglang",
    "class_name": "KvstrataHiCacheStorage",
    "interface_v1": 1,
}


def mha_pool(
    layout: str,
    pages: int = 8,
    *,
    heads: int = HEADS,
    dtype: torch.dtype = DTYPE,
    cls: type[MHATokenToKVPoolHost] = MHATokenToKVPoolHost,
    ready: Callable[[Any], None] | None = None,
) -> MHATokenToKVPoolHost:
    """sglang's MHA host pool, built as sglang's own storage tests build it (no device pool):
    ``object.__new__`` and the attributes its storage paths read, with ``kv_buffer`` in
    ``init_kv_buffer``'s shape for ``layout``; ``size_per_token`` as ``HostKVCache`` sets it, from
    the class's own ``get_size_per_token`` (``ready`` sets what a subclass's needs first).
    ``dtype`` is the pool's storage dtype (sglang keeps fp8 KV as ``uint8``)."""
    pool = object.__new__(cls)
    size = pages * PAGE
    pool.layout, pool.page_size, pool.dtype = layout, PAGE, dtype
    pool.layer_num, pool.head_num, pool.head_dim, pool.v_head_dim = (
        LAYERS,
        heads,
        HEAD_DIM,
        HEAD_DIM,
    )
    pool.size, pool.page_num, pool.device, pool.pin_memory = size, pages, "cpu", False
    dims = {
        "layer_first": (2, LAYERS, size, heads, HEAD_DIM),
        "page_first": (2, size, LAYERS, heads, HEAD_DIM),
        "page_first_direct": (2, pages, LAYERS, PAGE, heads, HEAD_DIM),
        "page_head": (2, pages, heads, PAGE, LAYERS, HEAD_DIM),
    }[layout]
    pool.kv_buffer = torch.zeros(dims, dtype=dtype)
    if ready is not None:
        ready(pool)
    pool.size_per_token = pool.get_size_per_token()
    return pool


def mla_pool(layout: str, pages: int = 8, dim: int = 24) -> MLATokenToKVPoolHost:
    """sglang's MLA host pool (one latent of ``kv_cache_dim`` per token, no plane dimension)."""
    pool = object.__new__(MLATokenToKVPoolHost)
    size = pages * PAGE
    pool.layout, pool.page_size, pool.dtype = layout, PAGE, DTYPE
    pool.layer_num, pool.kv_cache_dim = LAYERS, dim
    pool.size, pool.page_num, pool.device, pool.pin_memory = size, pages, "cpu", False
    dims = {
        "layer_first": (LAYERS, size, 1, dim),
        "page_first": (size, LAYERS, 1, dim),
        "page_first_direct": (pages, LAYERS, PAGE, 1, dim),
    }[layout]
    pool.kv_buffer = torch.zeros(dims, dtype=DTYPE)
    pool._size_per_token = dim * DTYPE.itemsize * LAYERS  # as MLATokenToKVPoolHost.__init__
    pool.size_per_token = pool.get_size_per_token()
    return pool


def storage_config(
    extra: dict[str, Any],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    mla: bool = False,
    model: str = "tiny-org/tiny-llama",
    layout: str = "page_first_direct",
) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=True,
        is_page_first_layout=layout == "page_first",
        model_name=model,
        extra_config={**BACKEND, **extra},
    )
