"""Small Mooncake-format traces for the replay tests, and the trace's reuse computed the naive way.

:func:`conversations` makes multi-turn chats: every request starts with a shared system block (id 0),
each session's turns extend its own history, and sessions interleave, so a cache sees reuse at several
depths. :func:`naive_max_hit_tokens` is the test's own oracle for the theoretical maximum: a set of
(hash-id prefix, page index) keys, one per page, deliberately written differently from
``kvstrata.impl.replay.maximum``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["conversations", "naive_max_hit_tokens", "write_trace"]

BLOCK = 512


def conversations(
    sessions: int = 5, turns: int = 5, blocks_per_turn: int = 3, cut: int = 100
) -> list[dict[str, Any]]:
    """``sessions * turns`` requests; turn ``t`` of a session holds ``1 + blocks_per_turn * (t + 1)``
    blocks, its last one cut short by ``cut`` tokens."""
    next_id = 1
    history: list[list[int]] = [[0] for _ in range(sessions)]
    records: list[dict[str, Any]] = []
    for turn in range(turns):
        for session in range(sessions):
            blocks = history[session]
            for _ in range(blocks_per_turn):
                blocks.append(next_id)
                next_id += 1
            records.append(
                {
                    "timestamp": 100 * len(records),
                    "input_length": len(blocks) * BLOCK - cut,
                    "output_length": 10 + turn,
                    "hash_ids": list(blocks),
                }
            )
    return records


def write_trace(path: Path, records: Sequence[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def naive_max_hit_tokens(records: Sequence[dict[str, Any]], page_size: int) -> int:
    """Tokens an unbounded, page-aligned prefix cache serves over the whole trace."""
    seen: set[tuple[tuple[int, ...], int]] = set()
    hits = 0
    for record in records:
        pages = record["input_length"] // page_size
        keys = [
            (tuple(record["hash_ids"][: -(-((page + 1) * page_size) // BLOCK)]), page)
            for page in range(pages)
        ]
        for key in keys:
            if key not in seen:
                break
            hits += page_size
        seen.update(keys)
    return hits
