"""Argument checks of :class:`~kvstrata.impl.embedding.cache.EmbeddingCache`: each raises a typed
error (:class:`MisuseError`, :class:`CapacityError`) before the cache changes anything, and
returns the batch in the form the cache plans with."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

from kvstrata.impl.embedding.entries import Entries
from kvstrata.impl.embedding.pool import PoolShape
from kvstrata.impl.errors import CapacityError, MisuseError
from kvstrata.model.errors import whole_count
from kvstrata.model.keys import PageHash

__all__ = ["check_hashes", "check_insert", "check_sizes", "check_wait"]

T = TypeVar("T")


def _listed(values: Iterable[T], what: str) -> tuple[T, ...]:
    """``values`` as a tuple; :class:`MisuseError` when it is not iterable at all (an error the
    caller's own iterator raises while it runs is theirs, and propagates as it is)."""
    try:
        iterator = iter(values)
    except TypeError:
        raise MisuseError(f"{what} are an iterable, got {type(values).__name__}") from None
    return tuple(iterator)


def check_hashes(hashes: Iterable[PageHash]) -> tuple[PageHash, ...]:
    if isinstance(hashes, PageHash | str | bytes):
        raise MisuseError(f"expected an iterable of PageHash, got {type(hashes).__name__}")
    out = _listed(hashes, "media hashes")
    for media in out:
        if not isinstance(media, PageHash):
            raise MisuseError(f"a media hash is a PageHash, got {type(media).__name__}")
    return out


def check_insert(
    entries: Entries, hashes: Iterable[PageHash], tensors: Iterable[torch.Tensor]
) -> tuple[list[tuple[PageHash, int]], dict[PageHash, torch.Tensor]]:
    """The batch as (media, tokens) pairs, duplicates merged, and each item's first tensor."""
    hashes, tensors = check_hashes(hashes), _listed(tensors, "embeddings")
    if len(hashes) != len(tensors):
        raise MisuseError(f"insert_batch: {len(hashes)} hashes but {len(tensors)} tensors")
    shape = entries.pool.shape
    for tensor in tensors:
        _check_tensor(shape, tensor)
    batch = check_sizes(entries, hashes, [int(t.shape[0]) for t in tensors], merge=True)
    first: dict[PageHash, torch.Tensor] = {}
    for media, tensor in zip(hashes, tensors, strict=True):
        first.setdefault(media, tensor)
    return batch, first


def _check_tensor(shape: PoolShape, tensor: object) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise MisuseError(
            f"insert_batch: an embedding is a torch.Tensor, got {type(tensor).__name__}"
        )
    if tensor.dtype != shape.dtype:
        raise MisuseError(f"insert_batch: dtype {tensor.dtype}, the pool holds {shape.dtype}")
    if tensor.dim() != 2 or tensor.shape[1] != shape.dim:
        raise MisuseError(f"insert_batch: shape {tuple(tensor.shape)}, want [tokens, {shape.dim}]")


def check_sizes(
    entries: Entries, hashes: Iterable[PageHash], tokens: Iterable[int], *, merge: bool
) -> list[tuple[PageHash, int]]:
    """(media, tokens) pairs (duplicates merged when ``merge``); a local entry's token count must
    match when ``merge``."""
    hashes, counts = check_hashes(hashes), _listed(tokens, "token counts")
    if len(hashes) != len(counts):
        raise MisuseError(f"{len(hashes)} hashes but {len(counts)} token counts")
    shape = entries.pool.shape
    most = shape.units * shape.unit_tokens  # the most tokens an entry may have (the whole pool)
    batch: dict[PageHash, int] = {}
    pairs = []
    for media, given in zip(hashes, counts, strict=True):
        # whole_count's rule, its common case inline (this runs once per item of every call)
        count = (
            given
            if type(given) is int and given >= 1
            else whole_count(given, "a token count", least=1)
        )
        if count > most:
            units = shape.units_for(count)
            raise CapacityError(f"{count} tokens take {units} units, the pool has {shape.units}")
        entry = entries.get(media)
        known = batch.get(media, entry.tokens if entry is not None and merge else count)
        if known != count:
            raise MisuseError(f"{media} has {known} tokens, not {count}")
        batch[media] = count
        pairs.append((media, count))
    return list(batch.items()) if merge else pairs


def check_wait(wait: object, refused: Callable[[], str | None]) -> None:
    """A verb's ``wait`` flag: a bool, and ``True`` only where ``refused()`` (why the verb may
    not wait here and now, or ``None``) allows it."""
    if not isinstance(wait, bool):
        raise MisuseError(f"wait is a bool, got {wait!r}")
    if wait and (why := refused()) is not None:
        raise MisuseError(why)
