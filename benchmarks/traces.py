"""Mooncake-format request traces for the benchmarks (SPEC §11).

A trace is JSON lines with ``timestamp`` (ms), ``input_length``, ``output_length`` (tokens) and
``hash_ids``: one id per 512-token block of the input; equal ids at equal positions mean equal
prefixes. Token ids are synthesised per block from its id with a fixed map, so the same trace gives
the same tokens in every process and Python run (no ``hash()``, no random seed).

Imported as ``benchmarks.traces`` (the repository root on ``sys.path``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

__all__ = [
    "BLOCK_TOKENS",
    "DEFAULT_TRACE",
    "Request",
    "TraceNotFound",
    "block_tokens",
    "load_trace",
    "request_tokens",
    "resolve_trace",
    "resolve_trace_or_exit",
    "synthesise",
]

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "conversation_trace.jsonl"
BLOCK_TOKENS = 512
_MULTIPLIER = 2654435761  # Knuth's multiplicative constant
_VOCAB = 50_000


class TraceNotFound(FileNotFoundError):
    """The trace file does not exist (or is not a file)."""


@dataclass(frozen=True, slots=True)
class Request:
    timestamp: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def resolve_trace(path: str | Path | None = None) -> Path:
    """``path``, or the shared conversation trace next to the repository when ``None``.

    :class:`TraceNotFound` with a message naming the path (and how to pass another) if it is absent.
    """
    candidate = DEFAULT_TRACE if path is None else Path(path).expanduser()
    if not candidate.is_file():
        hint = (
            "the default trace lives at ../shared/traces/conversation_trace.jsonl relative to the "
            "repository; pass --trace PATH to use another Mooncake-format JSONL trace"
        )
        raise TraceNotFound(f"trace not found: {candidate} ({hint})")
    return candidate


def resolve_trace_or_exit(path: str | Path | None = None) -> Path:
    """:func:`resolve_trace` for command-line tools: prints the message and exits with status 2."""
    try:
        return resolve_trace(path)
    except TraceNotFound as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def load_trace(path: Path, limit: int | None = None) -> list[Request]:
    """The first ``limit`` requests of the trace at ``path`` (all when ``None``). Blank lines are
    skipped; a malformed line raises :class:`ValueError` naming its line number."""
    requests: list[Request] = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                request = Request(
                    int(record["timestamp"]),
                    int(record["input_length"]),
                    int(record["output_length"]),
                    tuple(int(h) for h in record["hash_ids"]),
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a Mooncake trace record: {exc}") from exc
            if -(-request.input_length // BLOCK_TOKENS) > len(request.hash_ids):
                raise ValueError(
                    f"{path}:{number}: {request.input_length} input tokens need "
                    f"{-(-request.input_length // BLOCK_TOKENS)} hash ids, got {len(request.hash_ids)}"
                )
            requests.append(request)
    return requests


def block_tokens(hash_ids: Sequence[int] | npt.NDArray[np.int64]) -> npt.NDArray[np.uint32]:
    """The 512 token ids of each block, ``(len(hash_ids), 512)``: token ``i`` of block ``h`` is
    ``(h * 512 + i) * 2654435761 % 50000 + 1`` (ids in ``[1, 50000]``)."""
    ids = np.asarray(hash_ids, dtype=np.int64).reshape(-1, 1)
    positions = ids * BLOCK_TOKENS + np.arange(BLOCK_TOKENS, dtype=np.int64)
    # (a * b) % m == ((a % m) * (b % m)) % m, and (m - 1) ** 2 < 2**63: exact for any id
    return ((positions % _VOCAB) * (_MULTIPLIER % _VOCAB) % _VOCAB + 1).astype(np.uint32)


def request_tokens(request: Request) -> npt.NDArray[np.uint32]:
    """The request's input token ids (uint32, contiguous), the last block truncated to length."""
    blocks = -(-request.input_length // BLOCK_TOKENS)
    tokens = block_tokens(request.hash_ids[:blocks]).reshape(-1)[: request.input_length]
    return np.ascontiguousarray(tokens)


def synthesise(requests: Sequence[Request]) -> list[npt.NDArray[np.uint32]]:
    """:func:`request_tokens` of every request (precompute before timing anything)."""
    return [request_tokens(request) for request in requests]
