"""Memory backends that fail on cue, for the engine connector's tests."""

from __future__ import annotations

import collections
from collections.abc import Sequence

from kvstrata.impl.storage.base import PutStatus
from kvstrata.impl.storage.memory import MemoryBackend, MemoryStore
from kvstrata.model.keys import KeySpace, Namespace, PageHash


class FlakyBackend(MemoryBackend):
    """A memory backend whose next ``fail_next`` puts fail (a store that timed out), besides
    ``down``; ``failures`` counts each page's failed puts (a test may reset a page's count)."""

    def __init__(self, keys: KeySpace, store: MemoryStore, fail_next: int = 0) -> None:
        super().__init__(keys, store=store)
        self.fail_next = fail_next
        self.failures: collections.Counter[PageHash] = collections.Counter()

    def put(
        self, namespace: Namespace, pages: Sequence[PageHash], host_indices: Sequence[int]
    ) -> list[PutStatus]:
        statuses = [PutStatus.FAILED] * len(pages)
        try:
            if self.fail_next:
                self.fail_next -= 1
            else:
                statuses = super().put(namespace, pages, host_indices)  # raises while down
        finally:
            self.failures.update(
                page for page, status in zip(pages, statuses, strict=True) if not status.ok
            )
        return statuses
