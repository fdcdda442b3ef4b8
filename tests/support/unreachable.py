"""A memory backend that raises on every call while ``unreachable``: a store the link judges down
(each raised call is a fault), unlike ``MemoryBackend.down``, whose failures are plain misses. It
raises :class:`StoreUnavailable`, as a client that lost its master does."""

from __future__ import annotations

from typing import Any

from kvstrata.impl.errors import StoreUnavailable
from kvstrata.impl.storage.memory import MemoryBackend


class UnreachableBackend(MemoryBackend):
    """``put`` and ``exists`` raise :class:`StoreUnavailable` while ``unreachable`` is set."""

    unreachable = False

    def put(self, *args: Any, **kwargs: Any) -> Any:
        if self.unreachable:
            raise StoreUnavailable("store unreachable")
        return super().put(*args, **kwargs)

    def exists(self, *args: Any, **kwargs: Any) -> Any:
        if self.unreachable:
            raise StoreUnavailable("store unreachable")
        return super().exists(*args, **kwargs)
