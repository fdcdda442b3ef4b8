"""Mooncake-format request traces (SPEC §11): reading them, with an error naming the line for anything
malformed, and synthesising the token ids of each request.

A trace is JSON lines, one request per line: ``timestamp`` (ms since the first request),
``input_length`` and ``output_length`` (tokens) and ``hash_ids``, one id per 512-token block of the
input; equal ids at equal positions mean equal prefixes. Blank lines are skipped.

Token synthesis. Token ``i`` of block ``h`` is ``((h * 512 + i) * 2654435761) mod 2**32``. The
multiplier is odd, so multiplication modulo ``2**32`` is a bijection, and ``h * 512 + i < 2**32``
for every id up to :data:`MAX_HASH_ID`: **different blocks never share a token at the same
position**. Equal token prefixes therefore mean equal hash-id prefixes, and a cache that matches tokens
finds exactly the reuse the trace describes. (A map reduced modulo a vocabulary size does not have this
property: ``% 50000`` makes block ``h`` and block ``h + 3125`` identical, which on the public
conversation trace collapses 182,790 block ids onto 3,125 block contents and inflates the unbounded
hit ratio from 0.374 to 0.524.) The map is fixed: the same trace gives the same tokens in every
process and Python run (no ``hash()``, no random seed).
"""

from __future__ import annotations

import json
import math
from collections.abc import Generator, Sequence
from pathlib import Path

import attrs
import numpy as np
import numpy.typing as npt

from kvstrata.impl.replay.errors import TraceError

__all__ = [
    "BLOCK_TOKENS",
    "MAX_HASH_ID",
    "Request",
    "block_tokens",
    "read_trace",
    "request_tokens",
    "synthesise",
]

BLOCK_TOKENS = 512
"""Tokens per hash id (the Mooncake trace's block size)."""
MAX_INPUT_TOKENS = 10_000_000
"""The most input tokens one replayed request may have (issue 17: a trace line of 2e9 tokens
allocated 14.9 GiB of token ids before failing); larger lines are refused as malformed."""
MAX_HASH_ID = (1 << 32) // BLOCK_TOKENS - 1
"""The largest hash id whose tokens stay distinct from every other block's (8,388,607)."""
_MULTIPLIER = np.uint64(
    2654435761
)  # odd: a bijection modulo 2**32 (Knuth's multiplicative constant)
_MASK = np.uint64(0xFFFFFFFF)
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


@attrs.frozen(slots=True)
class Request:
    """One request of a trace. Invariant (checked by :func:`read_trace`): ``hash_ids`` has at least
    :attr:`blocks` ids, each in ``[0, MAX_HASH_ID]``; lengths are ints >= 0."""

    timestamp: float  # ms
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def blocks(self) -> int:
        """Blocks the input covers (the last one possibly partial)."""
        return -(-self.input_length // BLOCK_TOKENS)


def _int(record: dict[str, object], field: str, where: str) -> int:
    value = record[field]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TraceError(f"{where}: {field} must be an int >= 0, got {value!r}")
    return value


def _parse(line: str, where: str) -> Request:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise TraceError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(record, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(record).__name__}")
    missing = [field for field in _FIELDS if field not in record]
    if missing:
        raise TraceError(f"{where}: missing field(s) {', '.join(missing)}")
    timestamp = record["timestamp"]
    if (
        isinstance(timestamp, bool)
        or not isinstance(timestamp, int | float)
        or not math.isfinite(timestamp)
        or timestamp < 0
    ):
        raise TraceError(f"{where}: timestamp must be a number of ms >= 0, got {timestamp!r}")
    input_length = _int(record, "input_length", where)
    if input_length > MAX_INPUT_TOKENS:
        raise TraceError(
            f"{where}: input_length {input_length} is over the {MAX_INPUT_TOKENS:,}-token cap of a "
            "replayed request (its token ids alone would take "
            f"{input_length * 4 / 2**30:.1f} GiB)"
        )
    output_length = _int(record, "output_length", where)
    ids = record["hash_ids"]
    if not isinstance(ids, list):
        raise TraceError(f"{where}: hash_ids must be a list of ints, got {type(ids).__name__}")
    for value in ids:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_HASH_ID:
            raise TraceError(
                f"{where}: hash_ids must hold ints in [0, {MAX_HASH_ID}], got {value!r}"
            )
    request = Request(timestamp, input_length, output_length, tuple(ids))
    if request.blocks > len(ids):
        raise TraceError(
            f"{where}: {input_length} input tokens need {request.blocks} hash ids "
            f"(one per {BLOCK_TOKENS} tokens), got {len(ids)}"
        )
    return request


def _lines(path: Path) -> Generator[tuple[int, str], None, None]:
    """``(line number, text)`` of every line; :class:`TraceError` naming the file (and the line that is
    not UTF-8) for anything that cannot be read."""
    try:
        handle = path.open("rb")
    except FileNotFoundError:
        raise TraceError(f"trace not found: {path}") from None
    except IsADirectoryError:
        raise TraceError(f"trace is a directory, not a file: {path}") from None
    except OSError as error:
        raise TraceError(f"cannot open trace {path}: {error.strerror or error}") from None
    with handle:
        try:
            for number, raw in enumerate(handle, 1):
                try:
                    yield number, raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise TraceError(f"{path}:{number}: not UTF-8 text") from None
        except OSError as error:
            raise TraceError(f"cannot read trace {path}: {error.strerror or error}") from None


def read_trace(path: str | Path, limit: int | None = None) -> list[Request]:
    """The first ``limit`` requests of the trace at ``path`` (all when ``None``).

    :class:`TraceError` naming the file (and the line, for a malformed one) when the file is missing or
    unreadable, a line is not a trace record, or the trace holds no request."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise TraceError(f"limit must be an int >= 1, got {limit!r}")
    path = Path(path)
    requests: list[Request] = []
    lines = _lines(path)
    try:
        for number, line in lines:
            if limit is not None and len(requests) >= limit:
                break
            if line.strip():
                requests.append(_parse(line, f"{path}:{number}"))
    finally:
        lines.close()  # closes the file now, also when stopping early
    if not requests:
        raise TraceError(f"{path}: the trace holds no request")
    return requests


def block_tokens(hash_ids: Sequence[int] | npt.NDArray[np.int64]) -> npt.NDArray[np.uint32]:
    """The 512 token ids of each block, shape ``(len(hash_ids), 512)`` (see the module docstring)."""
    ids: npt.NDArray[np.uint64] = np.asarray(hash_ids, dtype=np.uint64).reshape(-1, 1)
    offsets: npt.NDArray[np.uint64] = np.arange(BLOCK_TOKENS, dtype=np.uint64)
    positions: npt.NDArray[np.uint64] = ids * np.uint64(BLOCK_TOKENS) + offsets
    mixed: npt.NDArray[np.uint64] = np.bitwise_and(positions * _MULTIPLIER, _MASK)
    return mixed.astype(np.uint32)


def request_tokens(request: Request) -> npt.NDArray[np.uint32]:
    """The request's input token ids (uint32, contiguous), the last block cut to ``input_length``.
    Read-only and owning its memory: a prompt never changes, so a cache may read its pages after
    ``insert`` returns (the page-hashing thread) instead of copying them."""
    tokens = block_tokens(request.hash_ids[: request.blocks]).reshape(-1)[: request.input_length]
    owned = np.array(tokens, dtype=np.uint32, order="C", copy=True)
    owned.flags.writeable = False
    return owned


def synthesise(requests: Sequence[Request]) -> list[npt.NDArray[np.uint32]]:
    """:func:`request_tokens` of every request."""
    return [request_tokens(request) for request in requests]
