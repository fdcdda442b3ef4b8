"""The embedding cache implementation driven side by side with its model (SPEC §6, §7).

One :class:`EmbeddingCacheModel` over a :class:`StoreModel` and one :class:`EmbeddingCache` over a
:class:`MemoryEmbeddingStore`, both stores warm with the same objects. I/O runs on a
:class:`ManualExecutor`: ``complete_io`` / ``fail_io`` finish the oldest pending op on both sides
(the implementation's executor is FIFO). Rules: insert / re-insert, prefetch, complete-io, fail-io,
the store dropping an object, local eviction, get, exists and bad input.

After every step: the same media are cached in the same states with the same used units, the same
ops pend, and every request is ready on both sides or neither. Every ``get`` checks bytes: a hit
on either side must be a hit on the other, and the tensor must equal, bit for bit, the embedding
its media hash names. A push the model's store skipped (the key was visible) is an op on the
implementation's side only if other keys of the batch were stored; the differential completes it
with the model's op, and a batch made only of skipped keys is no op on either side.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import event, note
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstrata.impl.embedding import EmbeddingCache, EmbeddingPool, MemoryEmbeddingStore, PoolShape
from kvstrata.impl.errors import CapacityError, MisuseError
from kvstrata.impl.transfer import ManualExecutor
from kvstrata.model.embedding import EmbeddingCacheModel, OpHandle, OpKind, Unit
from kvstrata.model.keys import (
    KeySpace,
    KVKind,
    ModelIdentity,
    PageHash,
    Shard,
    StoreKey,
    content_hash,
)
from kvstrata.model.store import StoreModel

DIM = 4
UNIT_TOKENS = 2
KEYSPACE = KeySpace(
    ModelIdentity(name="clip", dtype="fp16", kind=KVKind.EMBEDDING, dim=DIM),
    shard=Shard.replicated(),
)
MEDIA = tuple(content_hash(f"media-{i}".encode()) for i in range(5))

picks = st.lists(st.integers(0, len(MEDIA) - 1), min_size=1, max_size=3)


def embedding(media: PageHash, tokens: int) -> torch.Tensor:
    """The tensor every test puts under ``media``: a pure function of the hash."""
    gen = torch.Generator().manual_seed(int.from_bytes(media.digest[:8], "little"))
    return torch.randn((tokens, DIM), generator=gen).to(torch.float16)


class EmbeddingDifferential(RuleBasedStateMachine):
    @initialize(
        sizes=st.lists(st.integers(1, 3), min_size=len(MEDIA), max_size=len(MEDIA)),
        odd=st.lists(st.booleans(), min_size=len(MEDIA), max_size=len(MEDIA)),
        capacity=st.integers(4, 6),
        warm=st.lists(st.booleans(), min_size=len(MEDIA), max_size=len(MEDIA)),
    )
    def setup(self, sizes: list[int], odd: list[bool], capacity: int, warm: list[bool]) -> None:
        self.size = dict(zip(MEDIA, sizes, strict=True))
        # the last unit of an odd item is half full: object sizes differ from unit sizes
        self.tokens = {m: UNIT_TOKENS * s - o for m, s, o in zip(MEDIA, sizes, odd, strict=True)}
        self.model = EmbeddingCacheModel("a", capacity, KEYSPACE, StoreModel())
        self.store = MemoryEmbeddingStore()
        self.executor = ManualExecutor()
        pool = EmbeddingPool(PoolShape(capacity, UNIT_TOKENS, DIM, torch.float16))
        self.impl = EmbeddingCache(pool, self.store, KEYSPACE, executor=self.executor)
        seeder = EmbeddingCache(
            EmbeddingPool(PoolShape(3, UNIT_TOKENS, DIM, torch.float16)),
            self.store,
            KEYSPACE,
            executor=ManualExecutor(),
        )
        for media, present in zip(MEDIA, warm, strict=True):
            if present:  # pushed by a node that is gone
                key = self.model.key(media)
                self.model.store.begin_put(key)
                self.model.store.end_put(
                    key, tuple(Unit(media, i) for i in range(self.size[media]))
                )
                seeder.insert_batch([media], [embedding(media, self.tokens[media])])
                seeder.close()
                seeder.evict(3)
        self.pending: list[tuple[OpHandle, int]] = []
        self.requests: list[str] = []

    def batch(self, chosen: list[int]) -> list[PageHash]:
        return [MEDIA[i] for i in chosen]

    def track(self, handle: OpHandle | None, op: int | None) -> None:
        assert (handle is None) == (op is None), (handle, op)
        if handle is not None and op is not None:
            self.pending.append((handle, op))

    def impl_keys(self, media: PageHash) -> tuple[StoreKey, ...]:
        return self.impl.object_keys(media, self.tokens[media])

    # ------------------------------------------------------------------------------ rules

    @rule(chosen=picks)
    def insert_batch(self, chosen: list[int]) -> None:
        hashes = self.batch(chosen)
        want = self.model.insert_batch(hashes, [self.size[m] for m in hashes])
        got = self.impl.insert_batch(hashes, [embedding(m, self.tokens[m]) for m in hashes])
        note(f"insert {hashes}: {want} / {got}")
        assert (got.new, got.re_pushed, got.stored, got.store_skipped, got.busy) == (
            want.new,
            want.re_pushed,
            want.stored,
            want.store_skipped,
            want.busy,
        )
        assert got.skipped_no_space == want.skipped_no_space
        if want.re_pushed and want.stored > want.new:
            event("insert: local hit pushed again (store had lost it)")
        self.track(want.op, got.op)

    @rule(chosen=picks)
    def prefetch(self, chosen: list[int]) -> None:
        hashes = self.batch(chosen)
        request = f"r{len(self.requests)}"
        self.requests.append(request)
        want = self.model.prefetch(request, hashes, [self.size[m] for m in hashes])
        got = self.impl.prefetch(request, hashes, [self.tokens[m] for m in hashes])
        note(f"prefetch {hashes}: {want} / {got}")
        assert (got.loading, got.local, got.missing, got.skipped_no_space) == (
            want.loading,
            want.local,
            want.missing,
            want.skipped_no_space,
        )
        self.track(want.op, got.op)

    @precondition(lambda self: self.pending)
    @rule(fail=st.booleans())
    def finish_io(self, fail: bool) -> None:
        handle, _op = self.pending.pop(0)
        if fail:
            self.store.fail_next = 1
            event(f"io: {handle.kind.value} failed")
        assert self.executor.run_next()
        self.store.fail_next = 0
        assert self.impl.poll() == 1
        if handle.kind is OpKind.PUSH:
            (self.model.fail_push if fail else self.model.ack_push)(handle)
        else:
            (self.model.fail_get if fail else self.model.ack_get)(handle)

    @rule(index=st.integers(0, len(MEDIA) - 1))
    def store_drops(self, index: int) -> None:
        media = MEDIA[index]
        dropped = self.model.store.evict(self.model.key(media))
        assert (self.store.drop(self.impl_keys(media)) > 0) == dropped

    @rule(units=st.integers(0, 4))
    def evict(self, units: int) -> None:
        assert self.impl.evict(units) == self.model.evict(units)

    @rule(chosen=picks)
    def get(self, chosen: list[int]) -> None:
        hashes = self.batch(chosen)
        for media, want, got in zip(
            hashes, self.model.get(hashes), self.impl.get(hashes), strict=True
        ):
            assert (want is None) == (got is None), (media, want, got)
            if got is not None:
                assert torch.equal(
                    got.view(torch.int16), embedding(media, self.tokens[media]).view(torch.int16)
                ), f"wrong bytes for {media}"
                event("get: hit, bytes checked")

    @rule(chosen=picks)
    def exists(self, chosen: list[int]) -> None:
        hashes = self.batch(chosen)
        assert self.impl.exists(hashes, [self.tokens[m] for m in hashes]) == self.model.exists(
            hashes
        )

    @rule(
        index=st.integers(0, len(MEDIA) - 1),
        bad=st.sampled_from(["lengths", "dtype", "dim", "too_big", "rows"]),
    )
    def bad_input(self, index: int, bad: str) -> None:
        media = MEDIA[index]
        tensor = embedding(media, self.tokens[media])
        hashes: list[PageHash] = [media]
        tensors = [tensor]
        error: type[Exception] = MisuseError
        if bad == "lengths":
            tensors = [tensor, tensor]
        elif bad == "dtype":
            tensors = [tensor.to(torch.float32)]
        elif bad == "dim":
            tensors = [torch.zeros((2, DIM + 1), dtype=torch.float16)]
        elif bad == "too_big":
            tensors = [torch.zeros((UNIT_TOKENS * 7, DIM), dtype=torch.float16)]
            error = CapacityError
        else:
            tensors = [torch.zeros((0, DIM), dtype=torch.float16)]
        before = self.snapshot()
        with pytest.raises(error):
            self.impl.insert_batch(hashes, tensors)
        assert self.snapshot() == before

    # ------------------------------------------------------------------------------ oracles

    def snapshot(self) -> tuple[object, ...]:
        return (
            self.impl.entries(),
            self.impl.pending_ops(),
            self.impl.counters,
            self.store.objects.visible_keys(),
        )

    @invariant()
    def same_state(self) -> None:
        want = {e.media: (e.state, e.size) for e in self.model.entries()}
        got = {e.media: (e.state, len(e.units)) for e in self.impl.entries()}
        assert got == want
        assert self.impl.used_units == self.model.used_units
        assert len(self.impl.pending_ops()) == len(self.model.pending_ops()) == len(self.pending)
        for request in self.requests:
            assert self.impl.is_ready(request) == self.model.is_ready(request)

    @invariant()
    def same_store(self) -> None:
        for media in MEDIA:
            assert all(self.store.exists(self.impl_keys(media))) == self.model.store.contains(
                self.model.key(media)
            )


TestEmbeddingDifferential = EmbeddingDifferential.TestCase
