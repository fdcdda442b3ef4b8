"""Mooncake's native return codes, what kind of failure each one is, and the typed error for it.

The native client answers every call with an int: ``>= 0`` is success (a count, a size, 1/0 for
existence) and a negative value is an ``ErrorCode`` from ``mooncake-store/include/types.h`` (the
measured meanings are in ``shared/MOONCAKE.md`` §3.3). kvstrata never lets those ints travel further
than the backend: :func:`classify` turns one into an :class:`ErrorKind` (what the cache does about it
and what the counters count), and :func:`error_for` into a typed exception from
:mod:`kvstrata.impl.errors` for the few calls that raise (setup, buffer registration).
"""

from __future__ import annotations

import enum
import logging
from array import array
from collections.abc import Callable
from typing import Any, Final

from kvstrata.impl.errors import (
    StoreError,
    StoreFull,
    StoreNotReady,
    StoreTimeout,
    StoreUnavailable,
)

__all__ = [
    "CODE_NAMES",
    "INTERNAL_ERROR",
    "ErrorKind",
    "classify",
    "describe",
    "error_for",
    "native_codes",
]

log = logging.getLogger("kvstrata.storage.mooncake")

INTERNAL_ERROR: Final = -1
"""The code a native call that raised or answered malformed counts as, per key."""

CODE_NAMES: dict[int, str] = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -101: "SEGMENT_NOT_FOUND",
    -103: "CLIENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS",
    -601: "ILLEGAL_CLIENT",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -710: "REPLICA_NOT_FOUND",
    -712: "REPLICA_IS_GONE",
    -714: "OBJECT_REPLICA_BUSY",
    -800: "TRANSFER_FAIL",
    -801: "CHECKSUM_MISMATCH",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
}
"""The codes kvstrata has seen or expects, by name (others are reported by number)."""


class ErrorKind(enum.Enum):
    """Why one object (or one call) did not succeed; the key of the error counters."""

    FULL = "full"
    """No room in the store (-200); also briefly right after a master restart."""
    MISSING = "missing"
    """The object is not in the store (-704, a replica gone)."""
    NOT_READY = "not_ready"
    """Another writer is mid-put or overwriting (-703, -714)."""
    NOT_VISIBLE = "not_visible"
    """A put returned 0 but the object could not be confirmed afterwards (MOONCAKE.md §3.4)."""
    LEASE = "lease"
    """A lease blocked the call or ran out during a read (-706, -707)."""
    TRANSFER = "transfer"
    """The bytes could not be moved (-800: the segment owner died; -801 checksum)."""
    SHORT_READ = "short_read"
    """A read returned fewer (or more) bytes than the object's slot."""
    UNAVAILABLE = "unavailable"
    """The master or the client is not reachable or not set up (-900, -1, -101, -103, closed)."""
    TIMEOUT = "timeout"
    """A call timed out (-901)."""
    INVALID = "invalid"
    """The store refused the arguments (-600 and friends): a kvstrata bug or a misconfiguration."""
    OTHER = "other"
    """Any other negative code."""


_KINDS: dict[int, ErrorKind] = {
    -1: ErrorKind.UNAVAILABLE,
    -101: ErrorKind.UNAVAILABLE,
    -103: ErrorKind.UNAVAILABLE,
    -200: ErrorKind.FULL,
    -10: ErrorKind.INVALID,
    -400: ErrorKind.INVALID,
    -600: ErrorKind.INVALID,
    -601: ErrorKind.INVALID,
    -700: ErrorKind.INVALID,
    -701: ErrorKind.INVALID,
    -702: ErrorKind.INVALID,
    -703: ErrorKind.NOT_READY,
    -714: ErrorKind.NOT_READY,
    -704: ErrorKind.MISSING,
    -710: ErrorKind.MISSING,
    -712: ErrorKind.MISSING,
    -706: ErrorKind.LEASE,
    -707: ErrorKind.LEASE,
    -800: ErrorKind.TRANSFER,
    -801: ErrorKind.TRANSFER,
    -900: ErrorKind.UNAVAILABLE,
    -901: ErrorKind.TIMEOUT,
}


def classify(code: int) -> ErrorKind:
    """The kind of a negative native code (``-1000`` to ``-1012``, the HA/etcd family, count as
    UNAVAILABLE). :class:`ValueError` for a non-negative code: success has no kind."""
    if code >= 0:
        raise ValueError(f"{code} is a success, not an error code")
    kind = _KINDS.get(code)
    if kind is not None:
        return kind
    if -1012 <= code <= -1000:
        return ErrorKind.UNAVAILABLE
    return ErrorKind.OTHER


def describe(code: int) -> str:
    """``"-200 NO_AVAILABLE_HANDLE"``-style text for logs and error messages."""
    name = CODE_NAMES.get(code)
    return f"{code} {name}" if name else str(code)


_ERRORS: dict[ErrorKind, type[StoreError]] = {
    ErrorKind.FULL: StoreFull,
    ErrorKind.NOT_READY: StoreNotReady,
    ErrorKind.UNAVAILABLE: StoreUnavailable,
    ErrorKind.TIMEOUT: StoreTimeout,
}


def error_for(code: int, what: str) -> StoreError:
    """The typed exception for a negative native code returned by the call ``what``."""
    kind = classify(code)
    return _ERRORS.get(kind, StoreError)(
        f"{what}: mooncake returned {describe(code)} ({kind.value})"
    )


def native_codes(what: str, count: int, call: Callable[[Any], object], native: Any) -> list[int]:
    """``call(native)``'s ``count`` codes: the native list itself (a plain ``list``, as the binding
    returns) once one C pass found every code an integer: anything with ``__index__``, as the
    binding's ints are (``bytes`` where all lie in 0..255, as presence and put codes do: 8 µs for
    2,048 keys; else a 64-bit ``array``: 22 µs; ``int()`` per code cost 57). A raise or any other
    answer (a float, a text, a wrong length) is logged and becomes :data:`INTERNAL_ERROR` per key."""
    try:
        result = call(native)
    except Exception as error:
        log.error("mooncake %s raised %r", what, error)
        return [INTERNAL_ERROR] * count
    if type(result) is list and len(result) == count:
        for check in (bytes, _int64s):
            try:
                check(result)
            except (TypeError, ValueError, OverflowError):
                continue
            return result
    log.error("mooncake %s returned %r for %d keys", what, result, count)
    return [INTERNAL_ERROR] * count


def _int64s(codes: list[object]) -> array[int]:
    return array("q", codes)  # type: ignore[arg-type]  # TypeError / OverflowError unless ints
