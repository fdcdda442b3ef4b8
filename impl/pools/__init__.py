"""KV page pools of kvstrata.impl (SPEC §2): shapes and host layouts, page allocators, the L1 device pool,
the L2 host pool, host-pool sizing and vectorised page copies between them.

Everything here is page-granular: an index is a page index (``page_size`` tokens), never a token index.
Every pool reads and writes pages in one canonical shape, ``[planes, L, n, page_size, H, D]``.
"""

from kvstrata.impl.pools.allocator import PageAllocator, PageIndices, as_page_array
from kvstrata.impl.pools.base import KVPool
from kvstrata.impl.pools.copy import copy_pages, gather_pages
from kvstrata.impl.pools.device import DeviceKVPool, default_device
from kvstrata.impl.pools.host import HostKVPool
from kvstrata.impl.pools.shape import HostLayout, KVShape
from kvstrata.impl.pools.sizes import (
    available_host_memory,
    check_host_fits,
    host_pages_for,
    parse_size,
)

__all__ = [
    "DeviceKVPool",
    "HostKVPool",
    "HostLayout",
    "KVPool",
    "KVShape",
    "PageAllocator",
    "PageIndices",
    "as_page_array",
    "available_host_memory",
    "check_host_fits",
    "copy_pages",
    "default_device",
    "gather_pages",
    "host_pages_for",
    "parse_size",
]
