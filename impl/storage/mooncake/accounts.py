"""What one Mooncake backend's calls came to, counted: :class:`CallAccounts` (issue 20).

The native codes of a call become per-page statuses here, and every error among them is counted
by kind (:class:`~kvstrata.impl.storage.mooncake.counters.ErrorCounters`, one per failed object)
and as the backend's ``io_errors`` (:class:`~kvstrata.impl.storage.counters.BackendCounters`). A
call with no error is a success of its operation (which ends an error burst's log).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata.impl.storage.base import GetStatus
from kvstrata.impl.storage.counters import BackendCounters
from kvstrata.impl.storage.mooncake.codes import ErrorKind, classify, describe
from kvstrata.impl.storage.mooncake.counters import ErrorCounters

__all__ = ["CallAccounts"]


class CallAccounts:
    """The error and page counters of one backend, and the rules that fill them from codes.

    Invariant: every negative code handed to :meth:`count_errors` or :meth:`settle_gets` is
    counted once, by kind, in ``errors`` and in ``counters.io_errors``."""

    __slots__ = ("counters", "errors")

    def __init__(self, errors: ErrorCounters, counters: BackendCounters) -> None:
        self.errors = errors
        self.counters = counters

    def count_errors(self, operation: str, codes: Sequence[int]) -> bool:
        """Count the negative ``codes`` by kind (and as ``io_errors``); whether there was any."""
        kinds: dict[ErrorKind, tuple[int, int]] = {}
        for code in codes:
            if code < 0:
                kind = classify(code)
                count, _ = kinds.get(kind, (0, code))
                kinds[kind] = (count + 1, code)
        for kind, (count, code) in kinds.items():
            self.error(operation, kind, count, describe(code))
        return bool(kinds)

    def error(self, operation: str, kind: ErrorKind, count: int, detail: str) -> None:
        self.errors.error(operation, kind, count, detail)
        self.counters.add(io_errors=count)

    def settle_gets(self, codes: Sequence[int], sizes: Sequence[int]) -> list[GetStatus]:
        """One status per page from the native codes of a ``batch_get_into`` of whole pages of
        ``len(sizes)`` objects each (page-major; object ``c`` of a page is ``sizes[c]`` bytes):
        LOADED only if every object returned exactly its size; a missing one is a plain MISSING,
        anything else FAILED (counted by kind)."""
        width = len(sizes)
        if len(set(sizes)) == 1 and codes.count(sizes[0]) == len(codes):  # all whole: one C pass
            self.errors.success("get")
            return [GetStatus.LOADED] * (len(codes) // width)
        statuses: list[GetStatus] = []
        errors: list[int] = []
        short = 0
        for page in range(len(codes) // width):
            missing = failed = False
            for code, size in zip(codes[page * width : (page + 1) * width], sizes, strict=True):
                if code == size:
                    continue
                if code >= 0:
                    failed = True
                    short += 1
                elif classify(code) is ErrorKind.MISSING:
                    missing = True  # a plain miss, not an error
                else:
                    failed = True
                    errors.append(code)
            statuses.append(
                GetStatus.MISSING if missing else GetStatus.FAILED if failed else GetStatus.LOADED
            )
        if short:
            self.error("get", ErrorKind.SHORT_READ, short, "objects not of their size")
        if not self.count_errors("get", errors) and not short:
            self.errors.success("get")
        return statuses
