"""Unit tests of the embedding cache on the in-memory store: round trips, re-push of local hits,
pins, failed I/O (whole batches and single items of a batch), the background thread, the mapping of
Mooncake's per-key codes, and bad input (a typed error, nothing changed)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pytest
import torch

import kvstrata
from kvstrata.impl.embedding import (
    EmbeddingCache,
    EmbeddingPool,
    ExtentStatus,
    MemoryEmbeddingStore,
    PoolShape,
)
from kvstrata.impl.embedding.entries import Entry
from kvstrata.impl.embedding.store import status_of_get, status_of_put
from kvstrata.impl.errors import CapacityError, ConfigError, MisuseError
from kvstrata.impl.storage.memory import MemoryStore
from kvstrata.impl.transfer import InlineExecutor, ManualExecutor
from kvstrata.model.keys import (
    KeySpace,
    KVKind,
    ModelIdentity,
    PageHash,
    RenderedKeys,
    Shard,
    StoreKey,
    content_hash,
)
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


def test_each_unit_is_one_object_of_exactly_its_rows_under_its_own_key() -> None:
    """A batch of one-unit and several-unit embeddings (units of 4 rows): every unit is one object
    under ``object_keys``' key for it, holding exactly the rows it holds (a partly filled unit is
    not stored whole), whatever the other items of the batch take."""
    store = MemoryEmbeddingStore()
    a, io_a = node(store)
    assert io_a is not None
    sizes = {A: 3, B: 9, C: 4}  # one unit partly filled, three units (4 + 4 + 1 rows), one full
    a.insert_batch(list(sizes), [embedding(m, n) for m, n in sizes.items()])
    io_a.run_all()
    assert a.poll() == 1 and a.counters.pushed == 3
    row = DIM * torch.bfloat16.itemsize
    for media, tokens in sizes.items():
        keys = a.object_keys(media, tokens)
        assert len(keys) == -(-tokens // 4)
        objects = store.objects.read(list(keys))
        want = embedding(media, tokens).view(torch.int16).numpy().tobytes()
        assert [len(o or b"") for o in objects] == [
            min(4, tokens - 4 * i) * row for i in range(len(keys))
        ]
        assert b"".join(o or b"" for o in objects) == want
    assert len(store.objects.visible_keys()) == 1 + 3 + 1


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


def test_a_partially_failed_put_completes_item_by_item() -> None:
    store = MemoryEmbeddingStore()
    a, io_a = node(store)
    assert io_a is not None
    a.insert_batch([A, B, C], [embedding(A, 5), embedding(B, 3), embedding(C, 2)])
    store.fail_keys = {a.object_keys(A, 5)[1]}  # one of A's two objects fails: A failed
    io_a.run_all()
    store.fail_keys = set()
    assert a.poll() == 1
    assert [e.state for e in a.entries()] == [EntryState.READY] * 3
    assert a.exists([A, B, C], [5, 3, 2]) == (False, True, True)
    assert store.exists(a.object_keys(A, 5)) == [True, False]  # half of A: still a miss
    assert (a.counters.pushed, a.counters.failed, a.counters.store_full) == (2, 1, 0)
    assert same(a.get([A])[0], embedding(A, 5))  # the local copy is intact and readable
    again = a.insert_batch([A, B, C], [embedding(A, 5), embedding(B, 3), embedding(C, 2)])
    assert (again.re_pushed, again.stored, again.store_skipped) == (3, 1, 2)  # A again
    io_a.run_all()
    a.poll()
    assert a.exists([A], [5]) == (True,)


def test_a_partially_failed_get_frees_only_its_failed_items() -> None:
    store = MemoryEmbeddingStore()
    b_store = MemoryEmbeddingStore(store.objects)  # another client of the same objects
    a, io_a = node(store)
    b, io_b = node(b_store)
    assert io_a is not None and io_b is not None
    a.insert_batch([A, B], [embedding(A, 5), embedding(B, 3)])
    io_a.run_all()
    a.poll()
    b.prefetch("r", [A, B], [5, 3])
    b_store.fail_keys = {b.object_keys(A, 5)[0]}  # one of A's two objects cannot be read
    io_b.run_all()
    assert b.is_ready("r")
    assert b.entry(A) is None and b.used_units == 1  # A failed: freed and forgotten
    got = b.get([A, B])
    assert got[0] is None and same(got[1], embedding(B, 3))
    assert (b.counters.loaded, b.counters.failed) == (1, 1)


def test_a_store_full_for_some_objects_stores_the_others() -> None:
    objects = MemoryStore(capacity_bytes=2 * 4 * DIM * 2)  # two full units of bfloat16
    store = MemoryEmbeddingStore(objects)
    a, io_a = node(store)
    assert io_a is not None
    a.insert_batch([A, B, C], [embedding(A, 4), embedding(B, 4), embedding(C, 4)])
    io_a.run_all()
    a.poll()
    assert a.exists([A, B, C], [4, 4, 4]) == (True, True, False)  # C did not fit
    assert (a.counters.pushed, a.counters.failed, a.counters.store_full) == (2, 1, 1)
    assert a.entry(C) is not None and a.entry(C).state is EntryState.READY  # type: ignore[union-attr]


def test_mooncake_codes_map_per_key() -> None:
    assert [status_of_put(code) for code in (0, -200, -600, -900, -703)] == [
        ExtentStatus.DONE,
        ExtentStatus.FULL,
        ExtentStatus.FAILED,
        ExtentStatus.FAILED,
        ExtentStatus.FAILED,
    ]
    assert [status_of_get(code, 64) for code in (64, 32, 0, -704, -600, -707, -800, -900)] == [
        ExtentStatus.DONE,
        ExtentStatus.FAILED,  # a short read is not the object
        ExtentStatus.FAILED,
        ExtentStatus.MISSING,
        ExtentStatus.FAILED,
        ExtentStatus.FAILED,
        ExtentStatus.FAILED,
        ExtentStatus.FAILED,
    ]


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
        ([A], None, MisuseError),  # not iterable at all: typed too, never a bare TypeError
        (None, [embedding(A, 2)], MisuseError),
        (5, [embedding(A, 2)], MisuseError),
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


def test_arguments_that_are_not_iterable_raise_typed_errors() -> None:
    a, _io = node(MemoryEmbeddingStore())
    calls = [
        lambda: a.get(None),  # type: ignore[arg-type]
        lambda: a.borrow(7),  # type: ignore[arg-type]
        lambda: a.exists([A], None),  # type: ignore[arg-type]
        lambda: a.prefetch("r", [A], 3),  # type: ignore[arg-type]
        lambda: a.reserve([A], None),  # type: ignore[arg-type]
    ]
    for call in calls:
        with pytest.raises(MisuseError, match="iterable"):
            call()
    assert a.entries() == () and a.pending_ops() == ()
    a.prefetch("r", [A], [3])  # the refused prefetch did not take the request id


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


def test_a_closed_embedding_cache_refuses_every_verb() -> None:
    """Issue 17: a closed EmbeddingCache used to accept calls (a prefetch never became ready)."""
    from kvstrata.impl.errors import CacheClosed  # noqa: PLC0415

    cache, _executor = node(MemoryEmbeddingStore())
    cache.close()
    cache.close()  # idempotent
    for verb in (
        "insert_batch",
        "prefetch",
        "release",
        "get",
        "evict",
        "flush",
        "poll",
        "is_ready",
        "wait",
    ):
        with pytest.raises(CacheClosed, match=verb):
            getattr(cache, verb)()


def test_reserve_write_in_place_then_commit_pushes_the_written_bytes() -> None:
    store = MemoryEmbeddingStore()
    a, io = node(store)
    b, io_b = node(store)
    assert io is not None and io_b is not None
    reservation = a.reserve([A, B, A], [5, 3, 5])
    assert reservation.new == (A, B) and a.get([A, B]) == (None, None)
    assert [e.state for e in a.entries()] == [EntryState.FILLING] * 2
    assert a.evict(6) == 0  # filling entries are held by the reservation
    view = reservation.views[A]
    assert view is not None and view.shape == (5, DIM)
    view.copy_(embedding(A, 5))
    reservation.write(B, embedding(B, 3))
    with pytest.raises(MisuseError, match="want a"):
        reservation.write(B, embedding(B, 4))
    with pytest.raises(MisuseError, match="not a new entry"):
        reservation.write(C, embedding(C, 3))
    report = a.commit(reservation)
    assert (report.new, report.stored, report.op) == (2, 2, 0)
    with pytest.raises(MisuseError, match="no open reservation"):
        a.commit(reservation)
    with pytest.raises(MisuseError, match="not a new entry"):
        reservation.write(B, embedding(B, 3))  # nothing may be written after the commit
    io.run_all()
    a.poll()
    assert b.prefetch("r", [A, B], [5, 3], probe=False).loading == 2
    io_b.run_all()
    got_a, got_b = b.get([A, B])
    assert same(got_a, embedding(A, 5)) and same(got_b, embedding(B, 3))


def test_abort_frees_a_reservation_and_nothing_reaches_the_store() -> None:
    store = MemoryEmbeddingStore()
    a, _io = node(store)
    reservation = a.reserve([A], [4])
    assert a.used_units == 1 and a.abort(reservation) == 1
    assert a.used_units == 0 and a.entry(A) is None and a.open_holds() == ()
    with pytest.raises(MisuseError):
        a.abort(reservation)
    assert a.exists([A], [4]) == (False,)


def test_a_loan_reads_in_place_and_keeps_its_entries_until_given_back() -> None:
    store = MemoryEmbeddingStore()
    a, io = node(store, units=2)
    assert io is not None
    a.insert_batch([A, B], [embedding(A, 4), embedding(B, 4)])
    io.run_all()
    a.poll()
    loan = a.borrow([A, C, A])
    got_a, miss, again = loan.tensors
    assert miss is None and got_a is not None and again is not None
    assert got_a.data_ptr() == a.pool.unit_ptr(a.entries()[0].units[0]) or same(
        got_a, embedding(A, 4)
    )
    assert same(got_a, embedding(A, 4)) and a.entry(A).readers == 1  # type: ignore[union-attr]
    assert a.evict(2) == 1  # B went; A is lent
    report = a.insert_batch([C], [embedding(C, 4)])  # room comes from the free unit, not A
    assert report.new == 1 and same(got_a, embedding(A, 4))
    assert a.insert_batch([B], [embedding(B, 4)]).skipped_no_space == 1  # A lent, C pushing
    assert a.give_back(loan) == 1 and a.entry(A).readers == 0  # type: ignore[union-attr]
    with pytest.raises(MisuseError, match="no open loan"):
        a.give_back(loan)


def test_a_scattered_entry_is_written_through_write_and_lent_as_a_copy() -> None:
    store = MemoryEmbeddingStore()
    a, io = node(store, units=3)
    assert io is not None
    a.insert_batch([A, B, C], [embedding(A, 4), embedding(B, 4), embedding(C, 4)])
    io.run_all()
    a.poll()
    a.get([B])  # A and C are the LRU entries: units 0 and 2 become free, 1 stays taken
    assert a.evict(2) == 2 and a.entry(B) is not None
    big = content_hash(b"big")
    reservation = a.reserve([big], [8])
    assert reservation.views[big] is None  # units 0 and 2: no single view
    reservation.write(big, embedding(big, 8))
    a.commit(reservation)
    io.run_all()
    a.poll()
    with a.borrow([big]) as loan:
        (got,) = loan.tensors
        assert same(got, embedding(big, 8))  # gathered into a copy
    fresh, fresh_io = node(store)
    assert fresh_io is not None and fresh.prefetch("r", [big], [8]).loading == 1
    assert fresh_io.run_all() == 1  # the pushed object is the two scattered units, in order
    (fetched,) = fresh.get([big])
    assert same(fetched, embedding(big, 8))


def test_the_pool_gives_the_lowest_adjacent_run_else_the_lowest_free_units() -> None:
    pool = EmbeddingPool(PoolShape(6, 4, DIM, torch.bfloat16))
    assert pool.alloc(2) == (0, 1) and pool.alloc(1) == (2,) and pool.alloc(2) == (3, 4)
    pool.free((0, 1))
    pool.free((3, 4))
    assert pool.alloc(3) == (3, 4, 5)  # the lowest run of three
    assert pool.view((3, 4, 5), 10) is not None
    assert pool.alloc(2) == (0, 1) and pool.free_count == 0
    pool.free((0,))
    pool.free((4,))
    units = pool.alloc(2)  # no run of two: the lowest free units, apart
    assert units == (0, 4) and pool.view(units, 8) is None
    assert [p.shape[0] for p in pool.segments(units, 7)] == [4, 3]
    for bad in ((0, 0), (9,), (-1,)):
        with pytest.raises(MisuseError, match="not allocated"):
            pool.free(bad)
    with pytest.raises(MisuseError, match="units asked"):
        pool.alloc(1)
    assert pool.used_count == 6


class CallerRuns(ManualExecutor):
    """A joinable executor with no worker: its jobs run only when a waiter runs them."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[int] = []

    def run_queued(
        self, timeout: float | None = None, until: Callable[[], bool] | None = None
    ) -> int:
        ran = 0
        while self.jobs and not (until is not None and until()):
            self.threads.append(threading.get_ident())
            self.run_next()
            ran += 1
        return ran


def test_flush_and_wait_run_the_queued_jobs_on_the_callers_thread() -> None:
    store = MemoryEmbeddingStore()
    pool = EmbeddingPool(PoolShape(4, 4, DIM, torch.bfloat16))
    io_a, io_b = CallerRuns(), CallerRuns()
    a = EmbeddingCache(pool, store, KEYSPACE, executor=io_a)
    b = EmbeddingCache(EmbeddingPool(pool.shape), store, KEYSPACE, executor=io_b)
    a.insert_batch([A], [embedding(A, 4)])
    assert io_a.jobs and a.flush(timeout=1)  # nothing else would have run the put
    assert io_a.threads == [threading.get_ident()] and a.counters.pushed == 1
    b.prefetch("r", [A], [4], probe=False)
    b.prefetch("later", [C], [4], probe=False)
    assert b.wait("r", timeout=1) and same(b.get([A])[0], embedding(A, 4))
    assert len(io_b.threads) == 1 and len(io_b.jobs) == 1  # the get behind it stays queued
    assert b.wait("r", timeout=1) and len(io_b.threads) == 1  # nothing pending: nothing run
    assert b.wait("later", timeout=1) and len(io_b.threads) == 2
    # an executor that is not joinable is left to its worker: here none, so the wait times out
    c, io_c = node(store)
    assert io_c is not None
    c.insert_batch([B], [embedding(B, 4)])
    assert not c.flush(timeout=0.01) and len(io_c.jobs) == 1


def test_an_inline_executor_completes_the_put_before_commit_returns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = MemoryEmbeddingStore()
    pool = EmbeddingPool(PoolShape(4, 4, DIM, torch.bfloat16))
    a = EmbeddingCache(pool, store, KEYSPACE, executor=InlineExecutor())
    report = a.insert_batch([A], [embedding(A, 4)])
    assert report.op == 0 and a.exists([A], [4]) == (True,)  # stored already
    assert a.pending_ops() == (0,) and a.poll() == 1 and a.counters.pushed == 1
    InlineExecutor().submit(lambda: 1 / 0)  # a raising job is logged, never raised
    assert "inline job raised" in caplog.text
    a.close()


def test_the_documented_flow_runs_through_the_public_face() -> None:
    """docs/scheduler.md §8 with the names it imports from ``kvstrata`` (an in-memory store)."""
    identity = kvstrata.ModelIdentity(
        name="siglip", dtype="bf16", kind=kvstrata.KVKind.EMBEDDING, dim=DIM
    )
    keyspace = kvstrata.KeySpace(identity, shard=kvstrata.Shard.replicated())
    store = kvstrata.MemoryEmbeddingStore()
    shape = kvstrata.PoolShape(units=8, unit_tokens=4, dim=DIM, dtype=torch.bfloat16)
    encoder = kvstrata.EmbeddingCache(kvstrata.EmbeddingPool(shape), store, keyspace)
    prefill = kvstrata.EmbeddingCache(kvstrata.EmbeddingPool(shape), store, keyspace)
    reservation = encoder.reserve([A, B], [4, 7])
    for media, tokens in zip(reservation.new, [4, 7], strict=True):
        view = reservation.views[media]
        assert view is not None
        view.copy_(embedding(media, tokens))
    assert encoder.commit(reservation).stored == 2 and encoder.flush(10)
    assert prefill.exists([A, B, C], [4, 7, 4]) == (True, True, False)
    prefill.prefetch("req-7", [A, B], [4, 7], probe=False)
    assert prefill.wait("req-7", 10)
    with prefill.borrow([A, B, C]) as loan:
        got_a, got_b, miss = loan.tensors
        assert same(got_a, embedding(A, 4)) and same(got_b, embedding(B, 7)) and miss is None
    prefill.release("req-7")
    encoder.close()
    prefill.close()


def test_room_is_planned_from_the_lru_end_without_walking_the_pool() -> None:
    """In a full pool a new item evicts the least recently used entry (a touched one moved to the
    back), and planning its room looks at no more candidates than it takes: the cost of an insert
    does not grow with the pool (issue 20; the pool here holds 64 entries)."""
    store = MemoryEmbeddingStore()
    units = 64
    cache = EmbeddingCache(
        EmbeddingPool(PoolShape(units, 4, DIM, torch.bfloat16)),
        store,
        KEYSPACE,
        executor=InlineExecutor(),
    )
    media = [content_hash(f"pool-{i}".encode()) for i in range(units)]
    for item in media:
        cache.insert_batch([item], [embedding(item, 4)])
    cache.flush()
    assert cache.used_units == units
    assert cache.get([media[0]])[0] is not None  # touched: now the most recently used
    entries = cache._entries
    walk = entries._evictable
    seen: list[PageHash] = []

    def counted(protect: frozenset[PageHash]) -> Iterator[Entry]:
        for entry in walk(protect):
            seen.append(entry.media)
            yield entry

    entries._evictable = counted  # type: ignore[method-assign]  # counts what planning looks at
    new = content_hash(b"pool-new")
    report = cache.insert_batch([new], [embedding(new, 4)])
    assert report.new == 1
    assert seen == [media[1]], "the LRU victim, and nothing past it"
    assert cache.entry(media[1]) is None and cache.entry(media[0]) is not None


def test_a_closed_reservation_hands_out_no_views() -> None:
    """After ``commit`` (or ``abort``) a view written would change a READY entry, or bytes the
    store is being sent: the views are gone, as ``write`` is."""
    for close in ("commit", "abort"):
        a, _io = node(MemoryEmbeddingStore())
        reservation = a.reserve([A], [3])
        assert reservation.views[A] is not None
        getattr(a, close)(reservation)
        with pytest.raises(MisuseError, match="closed"):
            _ = reservation.views
        with pytest.raises(MisuseError):
            reservation.write(A, embedding(A, 3))


def test_token_counts_and_unit_counts_take_numpy_integers() -> None:
    """Token counts and ``evict``'s unit count follow ``whole_count``: a numpy integer (what a
    scheduler computes with) is a count; a bool, a float or a count below the least is
    ``MisuseError``, and nothing changed."""
    store = MemoryEmbeddingStore()
    a, _io = node(store, manual=False)
    b, _ = node(store, manual=False)
    a.insert_batch([A], [embedding(A, 7)])
    a.close()
    assert b.exists([A], [np.int64(7)]) == (True,)
    b.prefetch("r", [A], [np.int32(7)])
    assert b.wait("r")
    assert same(b.get([A])[0], embedding(A, 7))
    for bad in (True, 7.0, np.int64(0)):
        with pytest.raises(MisuseError, match="token count"):
            b.exists([A], [bad])
    for bad_units in (True, 1.0, np.int64(-1)):
        with pytest.raises(MisuseError, match="n_units"):
            b.evict(bad_units)  # type: ignore[arg-type]
    assert b.entries() and b.evict(np.int64(10**6)) > 0
    b.close()


def test_an_error_inside_the_callers_iterator_is_the_callers() -> None:
    """Only an argument that is not iterable at all becomes ``MisuseError``; a ``TypeError`` the
    caller's own generator raises while it runs propagates as it is (not "not an iterable")."""
    a, _io = node(MemoryEmbeddingStore())

    def broken() -> Iterator[PageHash]:
        yield A
        raise TypeError("the caller's own bug")

    with pytest.raises(TypeError, match="the caller's own bug"):
        a.get(broken())
    assert a.entries() == ()


def test_a_hold_of_another_cache_is_refused_and_changes_nothing() -> None:
    """Hold numbers start at 0 in every cache: a reservation or loan of one cache passed to
    another must be refused, not close that cache's own hold of the same number (the review's
    find of 2026-11-28: it pushed the other cache's unwritten entry to the shared store)."""
    store = MemoryEmbeddingStore()
    a, _ = node(store, manual=False)
    b, _ = node(store, manual=False)
    mine, theirs = a.reserve([A], [4]), b.reserve([B], [4])
    assert mine.hold == theirs.hold == 0
    with pytest.raises(MisuseError, match="of this cache"):
        a.commit(theirs)
    with pytest.raises(MisuseError, match="of this cache"):
        a.abort(theirs)
    assert a.entry(A).state is EntryState.FILLING and not mine.closed  # type: ignore[union-attr]
    assert a.exists([A], [4]) == (False,)  # nothing reached the store
    mine.views[A].copy_(embedding(A, 4))  # type: ignore[union-attr]
    theirs.views[B].copy_(embedding(B, 4))  # type: ignore[union-attr]
    assert a.commit(mine).stored == 1 and b.commit(theirs).stored == 1
    a.flush()
    b.flush()
    lent, other = a.borrow([A]), b.borrow([B])
    assert lent.hold == other.hold
    with pytest.raises(MisuseError, match="of this cache"):
        a.give_back(other)
    assert a.entry(A).readers == 1 and b.entry(B).readers == 1  # type: ignore[union-attr]
    assert a.give_back(lent) == 1 and b.give_back(other) == 1


def test_insert_batch_whose_copy_fails_frees_its_reservation() -> None:
    """A copy that raises inside insert_batch (its reservation is never handed out) must not
    leave the entries FILLING and their units allocated for good (the review's find)."""
    store = MemoryEmbeddingStore()
    a, _ = node(store, units=2, manual=False)
    meta = torch.empty((4, DIM), dtype=torch.bfloat16, device="meta")  # passes the checks
    with pytest.raises(Exception):  # noqa: B017 - torch's own error for a meta copy
        a.insert_batch([A, B], [embedding(A, 4), meta])
    assert a.used_units == 0 and a.open_holds() == () and a.entry(A) is None
    assert a.insert_batch([A, B], [embedding(A, 4), embedding(B, 4)]).stored == 2


def test_an_exists_answer_too_short_counts_what_it_misses_as_absent() -> None:
    """A store answering fewer keys than asked: the items it did not answer are pushed again,
    as a short put or get answer fails what it does not cover (the review's find: they counted
    as visible, so a local hit the store had lost was never pushed again)."""

    class ShortExists(MemoryEmbeddingStore):
        def exists(self, keys: Sequence[StoreKey] | RenderedKeys) -> list[bool]:
            return super().exists(keys)[:1]

    store = ShortExists()
    a, _ = node(store, manual=False)
    a.insert_batch([A, B], [embedding(A, 4), embedding(B, 4)])
    a.flush()
    store.drop([key for media in (A, B) for key in a.object_keys(media, 4)])  # the store lost both
    report = a.insert_batch([A, B], [embedding(A, 4), embedding(B, 4)])
    a.flush()
    assert (report.re_pushed, report.store_skipped) == (2, 0)
    keys = [key for media in (A, B) for key in a.object_keys(media, 4)]
    assert MemoryEmbeddingStore.exists(store, keys) == [True, True]
