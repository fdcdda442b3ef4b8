"""Unit tests of the embedding cache on the in-memory store: round trips, re-push of local hits,
pins, failed I/O, the background thread, and bad input (a typed error, nothing changed)."""

from __future__ import annotations

import pytest
import torch

from kvstrata.impl.embedding import EmbeddingCache, EmbeddingPool, MemoryEmbeddingStore, PoolShape
from kvstrata.impl.errors import CapacityError, ConfigError, MisuseError
from kvstrata.impl.transfer import ManualExecutor
from kvstrata.model.keys import KeySpace, KVKind, ModelIdentity, PageHash, Shard, content_hash
from kvstrata.model.lifecycles import EntryState

DIM = 8
KEYSPACE = KeySpace(
    ModelIdentity(name="siglip", dtype="bf16", kind=KVKind.EMBEDDING, dim=DIM),
    shard=Shard.replicated(),
)
A, B, C = (content_hash(f"image-{i}".encode()) for i in range(3))


def embedding(media: PageHash, tokens: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(int.from_bytes(media.digest[:8], "little"))
    return torch.randn((tokens, DIM), generator=gen).to(torch.bfloat16)


def node(
    store: MemoryEmbeddingStore, units: int = 6, manual: bool = True
) -> tuple[EmbeddingCache, ManualExecutor | None]:
    executor = ManualExecutor() if manual else None
    pool = EmbeddingPool(PoolShape(units, 4, DIM, torch.bfloat16))
    return EmbeddingCache(pool, store, KEYSPACE, executor=executor), executor


def same(got: torch.Tensor | None, want: torch.Tensor) -> bool:
    return got is not None and torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_insert_then_another_node_prefetches_bit_for_bit() -> None:
    store = MemoryEmbeddingStore()
    a, io_a = node(store)
    b, io_b = node(store)
    assert io_a is not None and io_b is not None
    report = a.insert_batch([A, B], [embedding(A, 5), embedding(B, 3)])
    assert (report.new, report.stored, report.re_pushed) == (2, 2, 0)
    assert [e.state for e in a.entries()] == [EntryState.PUSHING] * 2
    assert a.get([A]) == (None,)  # pinned by the put: a miss until the ack
    assert b.exists([A, B], [5, 3]) == (False, False)
    io_a.run_all()
    assert a.poll() == 1 and a.counters.pushed == 2
    assert b.exists([A, B, C], [5, 3, 1]) == (True, True, False)
    assert b.exists([A], [9]) == (False,)  # another token count is another object
    fetched = b.prefetch("req", [A, B, C], [5, 3, 1])
    assert (fetched.loading, fetched.missing) == (2, 1)
    assert not b.is_ready("req") and b.get([A, B]) == (None, None)
    io_b.run_all()
    assert b.is_ready("req")
    got_a, got_b = b.get([A, B])
    assert same(got_a, embedding(A, 5)) and same(got_b, embedding(B, 3))


def test_local_hits_are_pushed_again_when_the_store_lost_them() -> None:
    store = MemoryEmbeddingStore()
    a, io = node(store)
    assert io is not None
    a.insert_batch([A], [embedding(A, 4)])
    io.run_all()
    again = a.insert_batch([A], [embedding(A, 4)])
    assert (again.re_pushed, again.stored, again.store_skipped, again.op) == (1, 0, 1, None)
    store.drop(a.object_keys(A, 4))
    again = a.insert_batch([A], [embedding(A, 4)])
    assert (again.re_pushed, again.stored) == (1, 1)
    io.run_all()
    a.poll()
    assert a.exists([A], [4]) == (True,)
    assert a.counters.re_pushed == 2 and a.counters.new == 1


def test_pinned_entries_are_never_evicted_and_no_space_is_counted() -> None:
    store = MemoryEmbeddingStore()
    a, io = node(store, units=2)
    assert io is not None
    a.insert_batch([A], [embedding(A, 8)])  # both units, pushing
    assert a.evict(2) == 0
    report = a.insert_batch([B], [embedding(B, 1)])
    assert report.skipped_no_space == 1 and a.counters.skipped_no_space == 1
    io.run_all()
    a.poll()
    assert a.insert_batch([B], [embedding(B, 1)]).new == 1  # A is READY now: LRU victim
    assert a.entry(A) is None and a.counters.evicted == 1


def test_failed_io_frees_loads_and_unpins_pushes() -> None:
    store = MemoryEmbeddingStore()
    a, io_a = node(store)
    b, io_b = node(store)
    assert io_a is not None and io_b is not None
    a.insert_batch([A], [embedding(A, 4)])
    store.fail_next = 1
    io_a.run_all()
    a.poll()
    assert a.entry(A) is not None and a.entry(A).state is EntryState.READY  # type: ignore[union-attr]
    assert a.counters.failed == 1 and b.exists([A], [4]) == (False,)
    a.insert_batch([A], [embedding(A, 4)])
    io_a.run_all()
    a.poll()
    b.prefetch("r", [A], [4])
    store.fail_next = 1
    io_b.run_all()
    assert b.is_ready("r") and b.entry(A) is None and b.used_units == 0
    assert b.counters.failed == 1


def test_wait_with_the_background_thread() -> None:
    store = MemoryEmbeddingStore()
    a, _ = node(store, manual=False)
    b, _ = node(store, manual=False)
    a.insert_batch([A, B], [embedding(A, 7), embedding(B, 2)])
    a.close()
    b.prefetch("r", [A, B], [7, 2])
    assert b.wait("r")
    got = b.get([A, B])
    assert same(got[0], embedding(A, 7)) and same(got[1], embedding(B, 2))
    b.close()


@pytest.mark.parametrize(
    ("hashes", "tensors", "error"),
    [
        ([A, B], [embedding(A, 2)], MisuseError),
        ([A], [embedding(A, 2).to(torch.float16)], MisuseError),
        ([A], [torch.zeros((2, DIM + 1), dtype=torch.bfloat16)], MisuseError),
        ([A], [torch.zeros((2, 2, DIM), dtype=torch.bfloat16)], MisuseError),
        ([A], [torch.zeros((0, DIM), dtype=torch.bfloat16)], MisuseError),
        ([A], [torch.zeros((25, DIM), dtype=torch.bfloat16)], CapacityError),
        ([A, A], [embedding(A, 2), embedding(A, 3)], MisuseError),
        (["not-a-hash"], [embedding(A, 2)], MisuseError),
        ([A], ["not-a-tensor"], MisuseError),
    ],
)
def test_bad_input_raises_typed_and_changes_nothing(
    hashes: list[object], tensors: list[object], error: type[Exception]
) -> None:
    store = MemoryEmbeddingStore()
    a, _io = node(store)
    a.insert_batch([B], [embedding(B, 3)])
    before = (a.entries(), a.pending_ops(), a.counters, store.objects.visible_keys(), a.used_units)
    with pytest.raises(error):
        a.insert_batch(hashes, tensors)  # type: ignore[arg-type]
    assert (
        a.entries(),
        a.pending_ops(),
        a.counters,
        store.objects.visible_keys(),
        a.used_units,
    ) == before


def test_bad_prefetch_and_config() -> None:
    a, _io = node(MemoryEmbeddingStore())
    with pytest.raises(MisuseError):
        a.prefetch("r", [A, B], [1])
    with pytest.raises(CapacityError):
        a.prefetch("r", [A], [100])
    a.prefetch("r", [A], [1])
    with pytest.raises(MisuseError):
        a.prefetch("r", [B], [1])  # request ids are not reused
    with pytest.raises(MisuseError):
        a.is_ready("unknown")
    with pytest.raises(ConfigError):
        PoolShape(0, 4, DIM, torch.bfloat16)
    with pytest.raises(ConfigError):
        PoolShape(1, 4, DIM, torch.int8)
    other = KeySpace(ModelIdentity(name="siglip", dtype="bf16", kind=KVKind.EMBEDDING, dim=DIM + 1))
    with pytest.raises(MisuseError):
        EmbeddingCache(
            EmbeddingPool(PoolShape(1, 4, DIM, torch.bfloat16)), MemoryEmbeddingStore(), other
        )
