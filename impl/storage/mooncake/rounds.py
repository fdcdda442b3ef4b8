"""Batch gets that name a key more than once: :func:`in_rounds`.

The native ``batch_get_into`` (and ``batch_get_into_multi_buffers``) given one key twice reports
every occurrence read in full but fills only the buffer of its *last* occurrence; the others keep
their old bytes (measured on this project's pinned client, issue 20: two prefetches of a shared
prefix merged into one get). A success code over unfilled bytes would poison whatever reads them,
so :class:`~kvstrata.impl.storage.mooncake.client.MooncakeClient` makes such a batch in *rounds*:
round ``k`` holds the ``k``-th occurrence of each key, so no native call names a key twice, and
each position gets the code of the round that read it. A batch of distinct keys (the usual case)
is one call, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

__all__ = ["in_rounds", "rounds"]

T = TypeVar("T")


def rounds(texts: Sequence[str]) -> list[list[int]] | None:
    """``None`` when every key of ``texts`` is distinct; else the positions of ``texts`` in
    rounds, round ``k`` holding the ``k``-th occurrence of each key (in batch order). Every
    position is in exactly one round and no round holds a key twice."""
    if len(set(texts)) == len(texts):
        return None
    seen: dict[str, int] = {}
    out: list[list[int]] = []
    for position, text in enumerate(texts):
        occurrence = seen.get(text, 0)
        seen[text] = occurrence + 1
        if occurrence == len(out):
            out.append([])
        out[occurrence].append(position)
    return out


def in_rounds(
    call: Callable[[list[str], list[T], list[T]], list[int]],
    texts: list[str],
    ptrs: list[T],
    sizes: list[T],
) -> list[int]:
    """``call(texts, ptrs, sizes)`` made once per round of :func:`rounds` (once when the keys are
    distinct); one code per position, each from the round that read it."""
    split = rounds(texts)
    if split is None:
        return call(texts, ptrs, sizes)
    codes = [0] * len(texts)
    for positions in split:
        got = call(
            [texts[i] for i in positions],
            [ptrs[i] for i in positions],
            [sizes[i] for i in positions],
        )
        for position, code in zip(positions, got, strict=True):
            codes[position] = code
    return codes
