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

Invariants (checked by the differential machine against the model)
    * an entry is PUSHING (LOADING) exactly while one pending put (get) holds its extents, and
      those extents are the units of the entry's *current* generation: pinned entries are never
      evicted, and their units never reused, until the result is applied;
    * only READY entries are read (``get``) or pushed; a failed get frees and forgets its entry;
    * the pool's allocated units are exactly the units of the live entries;
    * a call with bad input raises a typed error before it changes anything.

Deviation from the bare issue API, forced by the model: ``prefetch`` and ``exists`` take each
item's token count (the model's prefetch takes sizes: a reader must know how much room to
allocate), and ``insert_batch`` / ``prefetch`` ask the store which keys exist (one batch
``exists`` on the caller's thread) so that an entry the store already holds is not pinned.
"""

from __future__ import annotations

import queue
from collections.abc import Iterable, Sequence

import attrs
import torch

from kvstrata.impl.embedding.pool import EmbeddingPool
from kvstrata.impl.embedding.store import EmbeddingStore, Extent, ExtentStatus
from kvstrata.impl.errors import CapacityError, InvariantViolation, MisuseError
from kvstrata.impl.transfer import Executor, ThreadExecutor
from kvstrata.model.keys import DEFAULT_NAMESPACE, KeySpace, KVKind, Namespace, PageHash, StoreKey
from kvstrata.model.lifecycles import EMBEDDING_ENTRY, EntryEvent, EntryState

__all__ = ["EmbeddingCache", "EmbeddingCounters", "Entry", "InsertResult", "PrefetchResult"]

POOL = "emb"


@attrs.frozen
class Entry:
    """One cached media item; ``generation`` is new for every allocation, ``stamp`` orders LRU."""

    media: PageHash
    tokens: int
    units: tuple[int, ...]
    state: EntryState
    generation: int
    stamp: int


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


@attrs.frozen
class _Item:
    """One entry of a pending op, as it was when the op started (its generation and units)."""

    media: PageHash
    generation: int
    extents: tuple[Extent, ...]


@attrs.frozen
class _Op:
    op_id: int
    push: bool
    items: tuple[_Item, ...]


class EmbeddingCache:
    """One node's embedding cache. See the module docstring for the rules."""

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
        self.counters = EmbeddingCounters()
        self._entries: dict[PageHash, Entry] = {}
        self._ops: dict[int, _Op] = {}
        self._requests: dict[str, int | None] = {}
        self._results: queue.SimpleQueue[tuple[int, list[ExtentStatus]]] = queue.SimpleQueue()
        self._clock = 0
        self._generation = 0
        self._next_op = 0
        self.store.register(pool.ptr, pool.nbytes)

    # ----------------------------------------------------------------------------- queries

    @property
    def used_units(self) -> int:
        return self.pool.used_count

    def entry(self, media: PageHash) -> Entry | None:
        return self._entries.get(media)

    def entries(self) -> tuple[Entry, ...]:
        return tuple(sorted(self._entries.values(), key=lambda entry: entry.media.digest))

    def pending_ops(self) -> tuple[int, ...]:
        return tuple(sorted(self._ops))

    def object_keys(self, media: PageHash, tokens: int) -> tuple[StoreKey, ...]:
        """The store keys of the embedding of ``media`` with ``tokens`` rows, unit by unit."""
        count = self.pool.shape.units_for(tokens)
        return tuple(
            self.keyspace.key(self.namespace, POOL, f"u{i}of{count}", media) for i in range(count)
        )

    def exists(self, hashes: Iterable[PageHash], tokens: Iterable[int]) -> tuple[bool, ...]:
        """Whether each embedding is visible, every unit of it, in the (shared) store."""
        batch = self._check_sizes(hashes, tokens, merge=False)
        return tuple(self._visible(batch))

    def is_ready(self, request_id: str) -> bool:
        """Whether the get that ``prefetch(request_id, ...)`` started was applied (or was empty)."""
        self.poll()
        return self._request(request_id) not in self._ops

    def wait(self, request_id: str, timeout: float | None = None) -> bool:
        """Block until :meth:`is_ready` (the I/O must be running: not for a ManualExecutor);
        ``False`` if ``timeout`` seconds passed first."""
        op = self._request(request_id)
        while op in self._ops:
            try:
                result = self._results.get(timeout=timeout)
            except queue.Empty:
                return False
            self._apply(*result)
        return True

    # ----------------------------------------------------------------------------- operations

    def insert_batch(
        self, hashes: Iterable[PageHash], tensors: Iterable[torch.Tensor]
    ) -> InsertResult:
        """Insert freshly computed embeddings; push every READY one the store lacks (local hits
        included) in one batch put."""
        self.poll()
        hashes, tensors = _check_hashes(hashes), tuple(tensors)
        if len(hashes) != len(tensors):
            raise MisuseError(f"insert_batch: {len(hashes)} hashes but {len(tensors)} tensors")
        for tensor in tensors:
            self._check_tensor(tensor)
        batch = self._check_sizes(hashes, [int(t.shape[0]) for t in tensors], merge=True)
        first = {media: tensors[hashes.index(media)] for media, _tokens in batch}
        protect = frozenset(media for media, _tokens in batch)
        hits = {media: self._entries[media] for media, _tokens in batch if media in self._entries}
        misses = [(media, tokens) for media, tokens in batch if media not in hits]
        victims, fits, no_space = self._plan_room(misses, protect)
        ready = [(m, t) for m, t in batch if m in hits and hits[m].state is EntryState.READY]
        visible = dict(zip([m for m, _ in ready + fits], self._visible(ready + fits), strict=True))
        # Nothing has changed so far; every step below is legal by construction.
        for victim in victims:
            self._forget(victim, EntryEvent.EVICT)
        fresh = {media: self._fill(media, first[media]) for media, _tokens in fits}
        items: list[_Item] = []
        re_pushed = skipped = busy = 0
        for media, _tokens in batch:
            entry = fresh.get(media) or hits.get(media)
            if entry is None:
                continue
            if entry.state is not EntryState.READY:
                busy += 1
                continue
            re_pushed += media in hits
            entry = attrs.evolve(entry, stamp=self._tick())
            if visible[media]:
                skipped += 1
            else:
                entry = attrs.evolve(
                    entry, state=EMBEDDING_ENTRY.next(entry.state, EntryEvent.PUSH)
                )
                items.append(self._item(entry))
            self._entries[media] = entry
        op = self._submit(True, items)
        self.counters = attrs.evolve(
            self.counters,
            new=self.counters.new + len(fresh),
            re_pushed=self.counters.re_pushed + re_pushed,
            skipped_no_space=self.counters.skipped_no_space + no_space,
        )
        return InsertResult(op, len(fresh), re_pushed, len(items), skipped, busy, no_space)

    def prefetch(
        self, request_id: str, hashes: Iterable[PageHash], tokens: Iterable[int]
    ) -> PrefetchResult:
        """Start one batch get for the items that are not local but visible in the store; their
        entries are LOADING (pinned) until the result is applied."""
        self.poll()
        if not isinstance(request_id, str) or request_id in self._requests:
            raise MisuseError(f"prefetch: request id must be a new string, got {request_id!r}")
        batch = self._check_sizes(hashes, tokens, merge=True)
        local = [media for media, _tokens in batch if media in self._entries]
        others = [(media, count) for media, count in batch if media not in self._entries]
        remote = [item for item, seen in zip(others, self._visible(others), strict=True) if seen]
        victims, fits, no_space = self._plan_room(remote, frozenset(m for m, _ in batch))
        # Nothing has changed so far; every step below is legal by construction.
        for victim in victims:
            self._forget(victim, EntryEvent.EVICT)
        for media in local:
            self._entries[media] = attrs.evolve(self._entries[media], stamp=self._tick())
        items: list[_Item] = []
        for media, count in fits:
            entry = Entry(
                media=media,
                tokens=count,
                units=self.pool.alloc(self.pool.shape.units_for(count)),
                state=EMBEDDING_ENTRY.next(EMBEDDING_ENTRY.initial, EntryEvent.LOAD),
                generation=self._new_generation(),
                stamp=self._tick(),
            )
            self._entries[media] = entry
            items.append(self._item(entry))
        op = self._submit(False, items)
        self._requests[request_id] = op
        self.counters = attrs.evolve(
            self.counters, skipped_no_space=self.counters.skipped_no_space + no_space
        )
        return PrefetchResult(
            op, len(items), len(local), len(batch) - len(local) - len(remote), no_space
        )

    def release(self, request_id: str) -> None:
        """Forget a request (its get, if still pending, completes on its own)."""
        self._request(request_id)
        del self._requests[request_id]

    def get(self, hashes: Iterable[PageHash]) -> tuple[torch.Tensor | None, ...]:
        """A copy of each READY entry's embedding (touched for LRU); ``None`` for anything else."""
        self.poll()
        out: list[torch.Tensor | None] = []
        for media in _check_hashes(hashes):
            entry = self._entries.get(media)
            if entry is None or entry.state is not EntryState.READY:
                out.append(None)
                continue
            out.append(self.pool.read(entry.units, entry.tokens))
            self._entries[media] = attrs.evolve(entry, stamp=self._tick())
        return tuple(out)

    def evict(self, n_units: int) -> int:
        """Evict READY entries in LRU order until ``n_units`` units were freed; the units freed."""
        if isinstance(n_units, bool) or not isinstance(n_units, int) or n_units < 0:
            raise MisuseError(f"evict takes an int >= 0, got {n_units!r}")
        self.poll()
        freed = 0
        for victim in self._lru(frozenset()):
            if freed >= n_units:
                break
            self._forget(victim, EntryEvent.EVICT)
            freed += len(victim.units)
        return freed

    def flush(self, timeout: float | None = None) -> bool:
        """Block until every pending op was applied (the I/O must be running: not for a
        ManualExecutor); ``False`` if ``timeout`` seconds passed first."""
        while self._ops:
            try:
                result = self._results.get(timeout=timeout)
            except queue.Empty:
                return False
            self._apply(*result)
        return True

    def poll(self) -> int:
        """Apply every I/O result queued so far (on this thread); how many ops completed."""
        count = 0
        while True:
            try:
                result = self._results.get_nowait()
            except queue.Empty:
                return count
            self._apply(*result)
            count += 1

    def close(self) -> None:
        """Finish the pending I/O, apply it and unregister the pool from the store."""
        self.executor.close()
        self.poll()
        self.store.unregister(self.pool.ptr)

    # ----------------------------------------------------------------------------- I/O

    def _item(self, entry: Entry) -> _Item:
        """The extents of ``entry``'s current generation (it is pinned by the caller)."""
        shape = self.pool.shape
        keys = self.object_keys(entry.media, entry.tokens)
        extents = tuple(
            Extent(
                key,
                self.pool.unit_ptr(unit),
                shape.rows(entry.tokens, i) * shape.dim * shape.itemsize,
            )
            for i, (key, unit) in enumerate(zip(keys, entry.units, strict=True))
        )
        return _Item(entry.media, entry.generation, extents)

    def _submit(self, push: bool, items: Sequence[_Item]) -> int | None:
        if not items:
            return None
        op = _Op(self._next_op, push, tuple(items))
        self._next_op += 1
        self._ops[op.op_id] = op
        extents = [extent for item in items for extent in item.extents]
        call = self.store.put if push else self.store.get

        def job() -> None:
            try:
                done = call(extents)
            except Exception:  # a job never raises into the executor: the op failed
                done = [ExtentStatus.FAILED] * len(extents)
            self._results.put((op.op_id, done))

        self.executor.submit(job)
        return op.op_id

    def _apply(self, op_id: int, done: list[ExtentStatus]) -> None:
        """Apply one op's per-extent results, item by item: an item whose every extent is DONE
        completes (``PUSH_ACK`` / ``LOADED``); any other item failed (a put item is READY again,
        a get item is freed and forgotten). A result list of the wrong length fails what it does
        not cover."""
        op = self._ops.pop(op_id)
        statuses = iter(done)
        ok = failed = full = 0
        for item in op.items:
            entry = self._entries.get(item.media)
            if entry is None or entry.generation != item.generation:
                raise InvariantViolation("I5", f"op {op_id}: stale offset for {item.media}")
            mine = [next(statuses, ExtentStatus.FAILED) for _ in item.extents]
            good = all(status is ExtentStatus.DONE for status in mine)
            ok += good
            failed += not good
            if op.push:
                full += ExtentStatus.FULL in mine
                event = EntryEvent.PUSH_ACK if good else EntryEvent.PUSH_FAILED
                self._entries[item.media] = attrs.evolve(
                    entry, state=EMBEDDING_ENTRY.next(entry.state, event)
                )
            elif good:
                self._entries[item.media] = attrs.evolve(
                    entry, state=EMBEDDING_ENTRY.next(entry.state, EntryEvent.LOADED)
                )
            else:
                self._forget(entry, EntryEvent.LOAD_FAILED)
        self.counters = attrs.evolve(
            self.counters,
            failed=self.counters.failed + failed,
            store_full=self.counters.store_full + full,
            pushed=self.counters.pushed + (ok if op.push else 0),
            loaded=self.counters.loaded + (0 if op.push else ok),
        )

    def _visible(self, batch: Sequence[tuple[PageHash, int]]) -> list[bool]:
        """Per item: all its unit objects are visible in the store (one batch exists call)."""
        keys = [self.object_keys(media, tokens) for media, tokens in batch]
        flat = self.store.exists([key for group in keys for key in group]) if batch else []
        out, at = [], 0
        for group in keys:
            out.append(all(flat[at : at + len(group)]))
            at += len(group)
        return out

    # ----------------------------------------------------------------------------- helpers

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

    def _lru(self, protect: frozenset[PageHash]) -> list[Entry]:
        return sorted(
            (
                e
                for e in self._entries.values()
                if e.state is EntryState.READY and e.media not in protect
            ),
            key=lambda entry: entry.stamp,
        )

    def _plan_room(
        self, needs: Sequence[tuple[PageHash, int]], protect: frozenset[PageHash]
    ) -> tuple[list[Entry], list[tuple[PageHash, int]], int]:
        """The victims (LRU first), the needs that fit (in order) and how many did not; changes
        nothing."""
        candidates = self._lru(protect)
        spare = sum(len(entry.units) for entry in candidates)
        free = self.pool.free_count
        victims: list[Entry] = []
        fits: list[tuple[PageHash, int]] = []
        for media, tokens in needs:
            size = self.pool.shape.units_for(tokens)
            if size > free + spare:
                continue
            while free < size:
                victim = candidates[len(victims)]
                victims.append(victim)
                free += len(victim.units)
                spare -= len(victim.units)
            free -= size
            fits.append((media, tokens))
        return victims, fits, len(needs) - len(fits)

    def _fill(self, media: PageHash, tensor: torch.Tensor) -> Entry:
        filling = EMBEDDING_ENTRY.next(EMBEDDING_ENTRY.initial, EntryEvent.FILL)
        units = self.pool.alloc(self.pool.shape.units_for(int(tensor.shape[0])))
        self.pool.write(units, tensor)
        entry = Entry(
            media=media,
            tokens=int(tensor.shape[0]),
            units=units,
            state=EMBEDDING_ENTRY.next(filling, EntryEvent.FILLED),
            generation=self._new_generation(),
            stamp=self._tick(),
        )
        self._entries[media] = entry
        return entry

    def _forget(self, entry: Entry, event: EntryEvent) -> None:
        """Take ``entry`` to FREE through ``event``: forgotten, its units freed."""
        if EMBEDDING_ENTRY.next(entry.state, event) is not EntryState.FREE:
            raise InvariantViolation("I5", f"{event} does not free {entry!r}")
        del self._entries[entry.media]
        self.pool.free(entry.units)
        if event is EntryEvent.EVICT:
            self.counters = attrs.evolve(self.counters, evicted=self.counters.evicted + 1)

    def _request(self, request_id: str) -> int | None:
        if not isinstance(request_id, str) or request_id not in self._requests:
            raise MisuseError(f"unknown request {request_id!r}")
        return self._requests[request_id]

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _new_generation(self) -> int:
        self._generation += 1
        return self._generation


def _check_hashes(hashes: Iterable[PageHash]) -> tuple[PageHash, ...]:
    if isinstance(hashes, PageHash | str | bytes):
        raise MisuseError(f"expected an iterable of PageHash, got {type(hashes).__name__}")
    out = tuple(hashes)
    for media in out:
        if not isinstance(media, PageHash):
            raise MisuseError(f"a media hash is a PageHash, got {type(media).__name__}")
    return out
