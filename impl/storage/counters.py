"""Plain counters of what one L3 backend did, the same shape for every backend.

They are monotonic totals since the backend was built, kept by the backend itself (so they count what
the store answered, not what the caller made of it). Metrics exporters and tests read them through
:meth:`BackendCounters.snapshot`, a consistent copy taken under the counters' own lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from kvstrata.impl.storage.base import GetStatus, PutStatus

__all__ = ["BackendCounters"]

_PUT_FIELD = {
    PutStatus.STORED: "puts_stored",
    PutStatus.EXISTED: "puts_existed",
    PutStatus.SKIPPED: "puts_skipped",
    PutStatus.FULL: "puts_full",
    PutStatus.FAILED: "puts_failed",
}
_GET_FIELD = {
    GetStatus.LOADED: "gets_loaded",
    GetStatus.MISSING: "gets_missing",
    GetStatus.FAILED: "gets_failed",
}


@attrs.define(eq=False)
class BackendCounters:
    """Totals since construction.

    Invariants: every page a ``put`` returned is counted once in exactly one ``puts_*`` field (by its
    :class:`PutStatus`) and every page a ``get`` returned once in exactly one ``gets_*`` field;
    ``bytes_written`` / ``bytes_read`` count object payload bytes that reached the store / a host slot
    (not file headers); ``objects_evicted`` counts objects this backend removed to stay under its
    capacity, ``objects_discarded`` objects it removed because they were corrupt, truncated or foreign,
    ``puts_unconfirmed`` pages whose write the store accepted but whose objects a reader could not
    see right after (answered ``FAILED``, retried), and ``io_errors`` every store I/O error it turned
    into a status.

    Equality compares the numbers only, so a test can write ``snapshot() == BackendCounters(...)``.
    """

    puts_stored: int = 0
    puts_existed: int = 0
    puts_skipped: int = 0
    puts_full: int = 0
    puts_failed: int = 0
    gets_loaded: int = 0
    gets_missing: int = 0
    gets_failed: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    objects_evicted: int = 0
    objects_discarded: int = 0
    io_errors: int = 0
    puts_unconfirmed: int = 0
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)

    def record_puts(self, statuses: Iterable[PutStatus], nbytes: int = 0) -> None:
        """Count one page per status, plus ``nbytes`` payload bytes written."""
        self._record(_PUT_FIELD, list(statuses), "bytes_written", nbytes)

    def record_gets(self, statuses: Iterable[GetStatus], nbytes: int = 0) -> None:
        """Count one page per status, plus ``nbytes`` payload bytes read into host slots."""
        self._record(_GET_FIELD, list(statuses), "bytes_read", nbytes)

    def _record(
        self, fields: Mapping[Any, str], statuses: list[Any], payload: str, nbytes: int
    ) -> None:
        """One ``list.count`` per status kind (identity checks in C: a batch is usually one kind;
        an enum's own hash is Python code), then the payload bytes. A status of no kind is a
        KeyError, with nothing counted."""
        counts = [(name, statuses.count(status)) for status, name in fields.items()]
        if sum(n for _, n in counts) != len(statuses):
            raise KeyError(next(status for status in statuses if status not in fields))
        with self._lock:
            for name, n in counts:
                if n:
                    setattr(self, name, getattr(self, name) + n)
            setattr(self, payload, getattr(self, payload) + nbytes)

    def add(
        self,
        *,
        objects_evicted: int = 0,
        objects_discarded: int = 0,
        io_errors: int = 0,
        puts_unconfirmed: int = 0,
    ) -> None:
        """Add to the object-level counters."""
        with self._lock:
            self.objects_evicted += objects_evicted
            self.objects_discarded += objects_discarded
            self.io_errors += io_errors
            self.puts_unconfirmed += puts_unconfirmed

    def as_dict(self) -> dict[str, int]:
        """The numbers by field name (a consistent copy)."""
        with self._lock:
            return {
                field.name: getattr(self, field.name)
                for field in attrs.fields(BackendCounters)
                if field.init
            }

    def snapshot(self) -> BackendCounters:
        """A consistent copy that later counting does not change."""
        return BackendCounters(**self.as_dict())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BackendCounters):
            return NotImplemented
        return self.as_dict() == other.as_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable: equal counters need not stay equal
