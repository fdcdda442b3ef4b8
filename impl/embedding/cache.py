"""One node's embedding cache over a shared object store (SPEC §6), the implementation of
:class:`~kvstrata.model.embedding.EmbeddingCacheModel`.

Theory of operation
-------------------
An encoder output (a ``[tokens, dim]`` tensor of the pool's dtype) is cached under the content
hash of its media item. Its entry takes ``ceil(tokens / unit_tokens)`` units of the
:class:`~kvstrata.impl.embedding.pool.EmbeddingPool`; in the store it is one object per unit,
keyed ``KeySpace.key(namespace, "emb", "u<i>of<n>", media)`` (the unit count is part of the key,
so a reader that expects another token count misses; a media item whose objects are not *all*
visible is a miss).

Every entry advances only through :data:`~kvstrata.model.lifecycles.EMBEDDING_ENTRY`, with the
model's rules: ``insert_batch`` fills new entries (FREE -> FILLING -> READY), touches every READY
entry of the batch and hands those the store lacks to *one* batch put (READY -> PUSHING);
``prefetch`` allocates LOADING entries for the items that are not local but visible in the store
and hands them to *one* batch get; LRU eviction takes READY entries only. The I/O runs on an
:class:`~kvstrata.impl.transfer.Executor` (a thread, or a
:class:`~kvstrata.impl.transfer.ManualExecutor` in tests); results are queued and applied only on
the caller's thread (:meth:`EmbeddingCache.poll`, called by every public operation). A result is
per store object (one status per key, as a real batch call answers), applied item by item as the
model's ``ack_push(op, failed)`` / ``ack_get(op, failed)``: an item whose *every* object is DONE
completes; an item with *any* failed object failed (a put item is READY again and is pushed again
by a later insert; a get item is freed and forgotten), whatever the other items of the batch did.

The facade validates and delegates to pieces that own their state, mirroring the model's file
names: :mod:`.entries` (the entry table, the only module that advances ``EMBEDDING_ENTRY``) and
:mod:`.ops` (the ops in flight, the requests, the executor and its results, the store keys).

Upheld here (the facade; checked by the differential machine against the model):
    * a call with bad input raises a typed error before it changes anything, and plans its room
      before it evicts;
    * a batch's own local hits are never its LRU victims, and their extents are captured only
      once they are pinned (PUSHING), so every extent handed to the store belongs to its entry's
      current generation;
    * only READY entries are read (``get``) or pushed (the model's guard sets); a failed get
      frees and forgets its entry (:mod:`.ops`, through :mod:`.entries`).

Deviation from the bare issue API, forced by the model: ``prefetch`` and ``exists`` take each
item's token count (the model's prefetch takes sizes: a reader must know how much room to
allocate), and ``insert_batch`` / ``prefetch`` ask the store which keys exist (one batch
``exists`` on the caller's thread) so that an entry the store already holds is not pinned.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs
import torch

from kvstrata.impl.embedding.entries import Entries, Entry
from kvstrata.impl.embedding.ops import Item, Ops
from kvstrata.impl.embedding.pool import EmbeddingPool
from kvstrata.impl.embedding.store import EmbeddingStore
from kvstrata.impl.errors import CapacityError, MisuseError
from kvstrata.impl.guard import Guard, guarded
from kvstrata.impl.transfer import Executor, ThreadExecutor
from kvstrata.model.embedding.entries import PUSHABLE, READABLE
from kvstrata.model.keys import DEFAULT_NAMESPACE, KeySpace, KVKind, Namespace, PageHash, StoreKey
from kvstrata.model.lifecycles import EntryEvent

__all__ = ["EmbeddingCache", "EmbeddingCounters", "Entry", "InsertResult", "PrefetchResult"]


@attrs.frozen
class InsertResult:
    """What one ``insert_batch`` did (the fields of the model's ``InsertResult``)."""

    op: int | None
    new: int
    re_pushed: int
    stored: int
    store_skipped: int
    busy: int
    skipped_no_space: int


@attrs.frozen
class PrefetchResult:
    """What one ``prefetch`` did (the fields of the model's ``PrefetchResult``)."""

    op: int | None
    loading: int
    local: int
    missing: int
    skipped_no_space: int


@attrs.frozen
class EmbeddingCounters:
    """Counters since construction, in items (media), not store objects.

    ``skipped_no_space``: items that found no room in the local pool (everything else was pinned);
    ``failed``: items whose put or get failed (an item fails when *any* of its objects did);
    ``store_full``: the failed put items the store refused for lack of room (also in ``failed``)."""

    new: int = 0
    re_pushed: int = 0
    skipped_no_space: int = 0
    failed: int = 0
    store_full: int = 0
    pushed: int = 0
    loaded: int = 0
    evicted: int = 0


@guarded("insert_batch", "prefetch", "release", "get", "evict", "flush", "poll", "is_ready", "wait")
class EmbeddingCache:
    """One node's embedding cache. See the module docstring for the rules. Its verbs run only on
    the owner thread and only while open (:mod:`kvstrata.impl.guard`)."""

    def __init__(
        self,
        pool: EmbeddingPool,
        store: EmbeddingStore,
        keyspace: KeySpace,
        *,
        namespace: Namespace = DEFAULT_NAMESPACE,
        executor: Executor | None = None,
    ) -> None:
        if not isinstance(pool, EmbeddingPool):
            raise MisuseError(f"EmbeddingCache takes an EmbeddingPool, got {pool!r}")
        if not isinstance(keyspace, KeySpace) or keyspace.model.kind is not KVKind.EMBEDDING:
            raise MisuseError(
                f"keyspace must be a KeySpace of an EMBEDDING model, got {keyspace!r}"
            )
        if keyspace.model.dim != pool.shape.dim:
            raise MisuseError(f"keyspace dim {keyspace.model.dim} != pool dim {pool.shape.dim}")
        self.pool = pool
        self.store = store
        self.keyspace = keyspace
        self.namespace = namespace
        self.executor: Executor = (
            executor if executor is not None else ThreadExecutor("kvstrata-embedding")
        )
        self._counted = EmbeddingCounters()  # what the facade counts; results are counted by ops
        self._entries = Entries(pool)
        self._ops = Ops(self._entries, store, keyspace, namespace, self.executor)
        self.store.register(pool.ptr, pool.nbytes)
        self._guard = Guard("EmbeddingCache")

    # ----------------------------------------------------------------------------- queries

    @property
    def counters(self) -> EmbeddingCounters:
        """Counters since construction (see :class:`EmbeddingCounters`)."""
        ops = self._ops
        return attrs.evolve(
            self._counted,
            failed=ops.failed,
            store_full=ops.store_full,
            pushed=ops.pushed,
            loaded=ops.loaded,
        )

    @property
    def used_units(self) -> int:
        return self.pool.used_count

    def entry(self, media: PageHash) -> Entry | None:
        return self._entries.get(media)

    def entries(self) -> tuple[Entry, ...]:
        return self._entries.sorted()

    def pending_ops(self) -> tuple[int, ...]:
        return self._ops.handles()

    def object_keys(self, media: PageHash, tokens: int) -> tuple[StoreKey, ...]:
        """The store keys of the embedding of ``media`` with ``tokens`` rows, unit by unit."""
        return self._ops.object_keys(media, tokens)

    def exists(self, hashes: Iterable[PageHash], tokens: Iterable[int]) -> tuple[bool, ...]:
        """Whether each embedding is visible, every unit of it, in the (shared) store."""
        batch = self._check_sizes(hashes, tokens, merge=False)
        return tuple(self._ops.visible(batch))

    def is_ready(self, request_id: str) -> bool:
        """Whether the get that ``prefetch(request_id, ...)`` started was applied (or was empty)."""
        self.poll()
        return not self._ops.is_pending(self._ops.request(request_id))

    def wait(self, request_id: str, timeout: float | None = None) -> bool:
        """Block until :meth:`is_ready` (the I/O must be running: not for a ManualExecutor);
        ``False`` if ``timeout`` seconds passed first."""
        return self._ops.wait(self._ops.request(request_id), timeout)

    # ----------------------------------------------------------------------------- operations

    def insert_batch(
        self, hashes: Iterable[PageHash], tensors: Iterable[torch.Tensor]
    ) -> InsertResult:
        """Insert freshly computed embeddings; push every READY one the store lacks (local hits
        included) in one batch put."""
        self.poll()
        batch, first = self._check_insert(hashes, tensors)
        protect = frozenset(media for media, _tokens in batch)
        hits = {media: self._entries[media] for media, _tokens in batch if media in self._entries}
        misses = [(media, tokens) for media, tokens in batch if media not in hits]
        victims, fits, no_space = self._entries.plan_room(misses, protect)
        ready = [(m, t) for m, t in batch if m in hits and hits[m].state in PUSHABLE]
        seen = self._ops.visible(ready + fits)
        visible = dict(zip([m for m, _ in ready + fits], seen, strict=True))
        # Nothing has changed so far; every step below is legal by construction.
        self._evict(victims)
        fresh = {media: self._entries.fill(media, first[media]) for media, _tokens in fits}
        items: list[Item] = []
        re_pushed = skipped = busy = 0
        for media, _tokens in batch:
            entry = fresh.get(media) or hits.get(media)
            if entry is None:
                continue
            if entry.state not in PUSHABLE:
                busy += 1
                continue
            re_pushed += media in hits
            entry = self._entries.stamp(entry)
            if visible[media]:
                skipped += 1
            else:
                entry = self._entries.step(entry, EntryEvent.PUSH)
                items.append(self._ops.item(entry))
            self._entries.put(entry)
        op = self._ops.submit(True, items)
        self._count(new=len(fresh), re_pushed=re_pushed, skipped_no_space=no_space)
        return InsertResult(op, len(fresh), re_pushed, len(items), skipped, busy, no_space)

    def prefetch(
        self, request_id: str, hashes: Iterable[PageHash], tokens: Iterable[int]
    ) -> PrefetchResult:
        """Start one batch get for the items that are not local but visible in the store; their
        entries are LOADING (pinned) until the result is applied."""
        self.poll()
        self._ops.check_new_request(request_id)
        batch = self._check_sizes(hashes, tokens, merge=True)
        local = [media for media, _tokens in batch if media in self._entries]
        others = [(media, count) for media, count in batch if media not in self._entries]
        remote = [
            item for item, seen in zip(others, self._ops.visible(others), strict=True) if seen
        ]
        protect = frozenset(media for media, _tokens in batch)
        victims, fits, no_space = self._entries.plan_room(remote, protect)
        # Nothing has changed so far; every step below is legal by construction.
        self._evict(victims)
        for media in local:
            self._entries.touch(media)
        items = [self._ops.item(self._entries.load(media, count)) for media, count in fits]
        op = self._ops.submit(False, items)
        self._ops.start_request(request_id, op)
        self._count(skipped_no_space=no_space)
        return PrefetchResult(
            op, len(items), len(local), len(batch) - len(local) - len(remote), no_space
        )

    def release(self, request_id: str) -> None:
        """Forget a request (its get, if still pending, completes on its own)."""
        self._ops.release(request_id)

    def get(self, hashes: Iterable[PageHash]) -> tuple[torch.Tensor | None, ...]:
        """A copy of each READY entry's embedding (touched for LRU); ``None`` for anything else."""
        self.poll()
        out: list[torch.Tensor | None] = []
        for media in _check_hashes(hashes):
            entry = self._entries.get(media)
            if entry is None or entry.state not in READABLE:
                out.append(None)
                continue
            out.append(self._entries.read(entry))
            self._entries.touch(media)
        return tuple(out)

    def evict(self, n_units: int) -> int:
        """Evict READY entries in LRU order until ``n_units`` units were freed; the units freed."""
        if isinstance(n_units, bool) or not isinstance(n_units, int) or n_units < 0:
            raise MisuseError(f"evict takes an int >= 0, got {n_units!r}")
        self.poll()
        freed = 0
        for victim in self._entries.lru(frozenset()):
            if freed >= n_units:
                break
            self._evict([victim])
            freed += len(victim.units)
        return freed

    def flush(self, timeout: float | None = None) -> bool:
        """Block until every pending op was applied (the I/O must be running: not for a
        ManualExecutor); ``False`` if ``timeout`` seconds passed first."""
        return self._ops.flush(timeout)

    def poll(self) -> int:
        """Apply every I/O result queued so far (on this thread); how many ops completed."""
        return self._ops.poll()

    def close(self) -> None:
        """Finish the pending I/O, apply it and unregister the pool from the store. Idempotent;
        every verb afterwards raises :class:`~kvstrata.impl.errors.CacheClosed`."""
        if self._guard.closed:
            return
        self.executor.close()
        self._ops.poll()  # not the guarded verb: close may come from any thread
        self._guard.closed = True
        self.store.unregister(self.pool.ptr)

    # ----------------------------------------------------------------------------- helpers

    def _evict(self, victims: Iterable[Entry]) -> None:
        for victim in victims:
            self._entries.forget(victim, EntryEvent.EVICT)
            self._count(evicted=1)

    def _count(self, **deltas: int) -> None:
        counted = self._counted
        changes = {name: getattr(counted, name) + delta for name, delta in deltas.items()}
        self._counted = attrs.evolve(counted, **changes)

    def _check_insert(
        self, hashes: Iterable[PageHash], tensors: Iterable[torch.Tensor]
    ) -> tuple[list[tuple[PageHash, int]], dict[PageHash, torch.Tensor]]:
        """The batch as (media, tokens) pairs, duplicates merged, and each item's first tensor;
        raises on misuse."""
        hashes, tensors = _check_hashes(hashes), tuple(tensors)
        if len(hashes) != len(tensors):
            raise MisuseError(f"insert_batch: {len(hashes)} hashes but {len(tensors)} tensors")
        for tensor in tensors:
            self._check_tensor(tensor)
        batch = self._check_sizes(hashes, [int(t.shape[0]) for t in tensors], merge=True)
        return batch, {media: tensors[hashes.index(media)] for media, _tokens in batch}

    def _check_tensor(self, tensor: object) -> None:
        shape = self.pool.shape
        if not isinstance(tensor, torch.Tensor):
            raise MisuseError(
                f"insert_batch: an embedding is a torch.Tensor, got {type(tensor).__name__}"
            )
        if tensor.dtype != shape.dtype:
            raise MisuseError(f"insert_batch: dtype {tensor.dtype}, the pool holds {shape.dtype}")
        if tensor.dim() != 2 or tensor.shape[1] != shape.dim:
            raise MisuseError(
                f"insert_batch: shape {tuple(tensor.shape)}, want [tokens, {shape.dim}]"
            )

    def _check_sizes(
        self, hashes: Iterable[PageHash], tokens: Iterable[int], *, merge: bool
    ) -> list[tuple[PageHash, int]]:
        """(media, tokens) pairs (duplicates merged when ``merge``); raises on misuse."""
        hashes, counts = _check_hashes(hashes), tuple(tokens)
        if len(hashes) != len(counts):
            raise MisuseError(f"{len(hashes)} hashes but {len(counts)} token counts")
        batch: dict[PageHash, int] = {}
        pairs = []
        for media, count in zip(hashes, counts, strict=True):
            if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
                raise MisuseError(f"a token count is an int > 0, got {count!r}")
            units = self.pool.shape.units_for(count)
            if units > self.pool.shape.units:
                raise CapacityError(
                    f"{count} tokens take {units} units, the pool has {self.pool.shape.units}"
                )
            entry = self._entries.get(media)
            known = batch.get(media, entry.tokens if entry is not None and merge else count)
            if known != count:
                raise MisuseError(f"{media} has {known} tokens, not {count}")
            batch[media] = count
            pairs.append((media, count))
        return list(batch.items()) if merge else pairs


def _check_hashes(hashes: Iterable[PageHash]) -> tuple[PageHash, ...]:
    if isinstance(hashes, PageHash | str | bytes):
        raise MisuseError(f"expected an iterable of PageHash, got {type(hashes).__name__}")
    out = tuple(hashes)
    for media in out:
        if not isinstance(media, PageHash):
            raise MisuseError(f"a media hash is a PageHash, got {type(media).__name__}")
    return out
