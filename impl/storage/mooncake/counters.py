"""Store errors counted by kind, and logged once per burst: :class:`ErrorCounters`.

What a backend did (pages by status, bytes) is counted in the shared
:class:`~kvstrata.impl.storage.counters.BackendCounters`; this adds *why* Mooncake calls failed, by
:class:`~kvstrata.impl.storage.mooncake.codes.ErrorKind`, as plain ints that metrics exporters, tests
and operators read without a registry.

A *burst* of one error kind is every error of that kind between two successes of the same operation:
its first error is logged as a warning, the rest are only counted, and the next success logs (at info)
how many the burst held. So a master outage writes two log lines per operation, not one per page.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

from kvstrata.impl.storage.mooncake.codes import ErrorKind

__all__ = ["ErrorCounters"]

log = logging.getLogger("kvstrata.storage.mooncake")


class ErrorCounters:
    """Errors per (operation, :class:`ErrorKind`): one per failed object, or one per failed call
    that touched no object.

    Invariants: counts only grow; ``bursts`` holds, per (operation, kind), the errors since the last
    success of that operation (absent when there were none). Thread-safe.
    """

    __slots__ = ("_bursts", "_counts", "_lock")

    def __init__(self) -> None:
        self._counts: Counter[tuple[str, ErrorKind]] = Counter()
        self._bursts: dict[tuple[str, ErrorKind], int] = {}
        self._lock = threading.Lock()

    def error(self, operation: str, kind: ErrorKind, count: int = 1, detail: str = "") -> None:
        """Count ``count`` errors of ``kind``; log the first of a burst."""
        if count <= 0:
            return
        key = (operation, kind)
        with self._lock:
            self._counts[key] += count
            first = key not in self._bursts
            self._bursts[key] = self._bursts.get(key, 0) + count
        if first:
            log.warning(
                "mooncake %s: %s error%s%s (further ones are counted until it succeeds again)",
                operation,
                kind.value,
                f" x{count}" if count > 1 else "",
                f": {detail}" if detail else "",
            )

    def success(self, operation: str) -> None:
        """End the open bursts of ``operation`` (and log their size)."""
        if not self._bursts:  # the common case, read without the lock: a burst opened meanwhile
            return  # by another thread is ended by the next success, its log line one call late
        with self._lock:
            ended = {key: n for key, n in self._bursts.items() if key[0] == operation}
            for key in ended:
                del self._bursts[key]
        for (_, kind), count in ended.items():
            log.info("mooncake %s: recovered after %d %s error(s)", operation, count, kind.value)

    def count(self, kind: ErrorKind, operation: str | None = None) -> int:
        """Errors of ``kind`` (of ``operation``, or of every operation)."""
        with self._lock:
            return sum(
                n
                for (op, counted), n in self._counts.items()
                if counted is kind and operation in (None, op)
            )

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())

    def in_burst(self, operation: str) -> bool:
        """Whether ``operation`` has failed since it last succeeded."""
        with self._lock:
            return any(key[0] == operation for key in self._bursts)

    def as_dict(self) -> dict[str, int]:
        """Every non-zero count as ``"<operation>.<kind>"``."""
        with self._lock:
            items = sorted(self._counts.items(), key=lambda item: (item[0][0], item[0][1].value))
        return {f"{op}.{kind.value}": n for (op, kind), n in items}
