"""A memory backend that raises on every call while ``unreachable``: a store the link judges down
(each raised call is a fault), unlike ``MemoryBackend.down``, whose failures are plain misses."""

from __future__ import annotations

from typing import Any

from kvstrata.impl.storage.memory import MemoryBackend


class UnreachableBackend(MemoryBackend):
    """``put`` and ``exists`` raise ``ConnectionError`` while ``unreachable`` is set."""

    unreachable = False

    def put(self, *args: Any, **kwargs: Any) -> Any:
        if self.unreachable:
            raise ConnectionError("store unreachable")
        return super().put(*args, **kwargs)

    def exists(self, *args: Any, **kwargs: Any) -> Any:
        if self.unreachable:
            raise ConnectionError("store unreachable")
        return super().exists(*args, **kwargs)
