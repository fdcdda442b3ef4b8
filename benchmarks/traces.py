"""Mooncake-format request traces for the benchmarks (SPEC §11).

A trace is JSON lines with ``timestamp`` (ms), ``input_length``, ``output_length`` (tokens) and
``hash_ids``: one id per 512-token block of the input; equal ids at equal positions mean equal
prefixes. Reading and token synthesis live in the package (:mod:`kvstrata.impl.replay.trace`, shared
with ``kvstrata replay``): token ids come from a fixed, injective map of (block id, position), so the
same trace gives the same tokens in every process and different blocks never share tokens. This module
adds where the shared trace lives.

Imported as ``benchmarks.traces`` (the repository root on ``sys.path``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvstrata.impl.replay.trace import (
    BLOCK_TOKENS,
    Request,
    block_tokens,
    request_tokens,
    synthesise,
)
from kvstrata.impl.replay.trace import read_trace as load_trace

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


class TraceNotFound(FileNotFoundError):
    """The trace file does not exist (or is not a file)."""


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
