"""sglang's legacy (copying) storage calls: whole pages as flat tensors, :class:`FlatPages`.

Without ``interface_v1`` sglang hands a backend each page as a flat tensor in its host layout's page
order (``get_data_page(index, flat=True)``) and expects reads into such tensors
(``get_dummy_flat_data_page()``). These calls move through a scratch host pool of
``page_first_direct`` pages with a store connection of its own (opened on first use), so the objects
are the same canonical ``[L, page, H, D]`` objects the zero-copy path writes: an instance on either
path reads the other's pages.

Flat page orders (sglang 0.5.23 ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``), planes
outermost (MLA has one plane and no plane dimension): ``layer_first`` ``[L, page, H, D]``,
``page_first`` ``[page, L, H, D]``, ``page_first_direct`` ``[L, page, H, D]``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from kvstrata.impl.errors import MisuseError
from kvstrata.impl.pools.host import HostKVPool
from kvstrata.impl.pools.shape import HostLayout, KVShape
from kvstrata.impl.storage.base import GetStatus, StorageBackend
from kvstrata.integrations.store import StoreOptions, open_backend
from kvstrata.model.engines import EngineShard
from kvstrata.model.keys import PageHash

__all__ = ["FlatPages"]

SCRATCH_PAGES = 16


class FlatPages:
    """Flat pages of ``layout`` for the pages of ``shard``, through a scratch pool."""

    def __init__(
        self, shard: EngineShard, options: StoreOptions, shape: KVShape, layout: HostLayout
    ) -> None:
        self.shard, self.options, self.shape, self.layout = shard, options, shape, layout
        self.scratch = HostKVPool(shape, SCRATCH_PAGES, HostLayout.PAGE_FIRST_DIRECT)
        self._backend: StorageBackend | None = None
        self._opened = False
        self._lock = threading.Lock()

    def _store(self) -> StorageBackend | None:
        if not self._opened:
            self._opened = True
            self._backend = open_backend(
                self.options, self.shard.keyspace(), writer=self.shard.writer
            )
            if self._backend is not None:
                self._backend.attach(self.scratch)
        return self._backend

    def _canonical(self, flat: torch.Tensor) -> torch.Tensor:
        """A flat page as ``[planes, L, page, H, D]``."""
        s = self.shape
        if not isinstance(flat, torch.Tensor) or flat.numel() != s.nbytes(1) // s.dtype.itemsize:
            raise MisuseError(f"kvstrata: a flat page holds {s.nbytes(1)} bytes of {s.dtype}")
        if self.layout is HostLayout.PAGE_FIRST:
            page = flat.reshape(s.planes, s.page_size, s.layers, s.heads, s.head_dim)
            return page.permute(0, 2, 1, 3, 4)
        return flat.reshape(s.planes, s.layers, s.page_size, s.heads, s.head_dim)

    def _flat_into(self, canonical: torch.Tensor, target: torch.Tensor) -> None:
        if self.layout is HostLayout.PAGE_FIRST:
            canonical = canonical.permute(0, 2, 1, 3, 4)
        target.copy_(canonical.reshape(-1).to(target.dtype))

    def set(self, namespace_pages: Sequence[PageHash], flats: Sequence[torch.Tensor]) -> list[bool]:
        if len(flats) != len(namespace_pages):
            raise MisuseError(f"kvstrata: {len(namespace_pages)} keys but {len(flats)} values")
        out: list[bool] = []
        with self._lock:
            store = self._store()
            for start in range(0, len(flats), SCRATCH_PAGES):
                chunk = range(min(SCRATCH_PAGES, len(flats) - start))
                if store is None:
                    out += [False] * len(chunk)
                    continue
                for slot in chunk:
                    self.scratch.buffer[:, slot].copy_(self._canonical(flats[start + slot]))
                pages = list(namespace_pages[start : start + len(chunk)])
                statuses = store.put(self.shard.namespace(), pages, list(chunk))
                out += [status.ok for status in statuses]
        return out

    def get(
        self, namespace_pages: Sequence[PageHash], targets: Sequence[torch.Tensor]
    ) -> list[bool]:
        if len(targets) != len(namespace_pages):
            raise MisuseError(f"kvstrata: {len(namespace_pages)} keys but {len(targets)} targets")
        out: list[bool] = []
        with self._lock:
            store = self._store()
            for start in range(0, len(targets), SCRATCH_PAGES):
                chunk = range(min(SCRATCH_PAGES, len(targets) - start))
                if store is None:
                    break
                pages = list(namespace_pages[start : start + len(chunk)])
                statuses = store.get(self.shard.namespace(), pages, list(chunk))
                for slot, status in zip(chunk, statuses, strict=True):
                    if status is not GetStatus.LOADED:
                        break
                    self._canonical(targets[start + slot])  # checks the target's size
                    self._flat_into(self.scratch.buffer[:, slot], targets[start + slot])
                    out.append(True)
                if len(out) < start + len(chunk):
                    break
        return out + [False] * (len(targets) - len(out))

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()
