"""Unit tests of kvstrata.model.embedding: the multimodal embedding cache model (SPEC §6).

Expected contents are spelled out here (``Unit(media, i)`` for ``i < size``), not taken from the
model.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TypeVar

import attrs
import pytest

from kvstrata.model.embedding import (
    EmbeddingCacheModel,
    OpHandle,
    OpKind,
    Unit,
)
from kvstrata.model.errors import CapacityError, InvariantViolation, MisuseError, ModelError
from kvstrata.model.keys import KeySpace, KVKind, ModelIdentity, PageHash, Shard, content_hash
from kvstrata.model.lifecycles import EntryState
from kvstrata.model.slots import UNWRITTEN
from kvstrata.model.store import StoreModel

T = TypeVar("T")

VIT = ModelIdentity(name="vit-l", dtype="bf16", kind=KVKind.EMBEDDING, dim=16)
KEYSPACE = KeySpace(VIT, shard=Shard.replicated())
A, B, C, D = (content_hash(f"image-{i}".encode()) for i in range(4))


def frozen_copy(value: T) -> T:
    """A deep copy for 'changes nothing' checks (the ``UNWRITTEN`` sentinel is kept as is)."""
    return copy.deepcopy(value, {id(UNWRITTEN): UNWRITTEN})


def units(media: PageHash, size: int) -> tuple[Unit, ...]:
    return tuple(Unit(media=media, index=i) for i in range(size))


def node(
    name: str = "n0", capacity: int = 4, store: StoreModel | None = None
) -> EmbeddingCacheModel:
    return EmbeddingCacheModel(
        name, capacity, KEYSPACE, store if store is not None else StoreModel()
    )


def state(cache: EmbeddingCacheModel, media: PageHash) -> EntryState | None:
    entry = cache.entry(media)
    return None if entry is None else entry.state


def pushed(cache: EmbeddingCacheModel, hashes: list[PageHash], sizes: list[int]) -> None:
    """Insert and ack the push: the items are READY here and visible in the store."""
    report = cache.insert_batch(hashes, sizes)
    if report.op is not None:
        cache.ack_push(report.op)


# ------------------------------------------------------------------------------ lifecycle


def test_insert_fills_pushes_and_ack_makes_visible() -> None:
    cache = node()
    report = cache.insert_batch([A, B], [2, 1])
    assert (report.new, report.re_pushed, report.stored, report.skipped_no_space) == (2, 0, 2, 0)
    assert report.op is not None and report.op.kind is OpKind.PUSH
    assert state(cache, A) is state(cache, B) is EntryState.PUSHING
    assert cache.exists([A, B]) == (False, False)  # I2: not visible before the ack
    assert cache.get([A, B]) == (None, None)  # only READY entries are read
    assert cache.ack_push(report.op) == 2
    assert state(cache, A) is state(cache, B) is EntryState.READY
    assert cache.exists([A, B, C]) == (True, True, False)
    assert cache.store.get(cache.key(A)) == units(A, 2)
    assert cache.get([A, B, C]) == (units(A, 2), units(B, 1), None)
    assert cache.used_units == 3 and cache.free_units == 1


def test_duplicates_in_a_batch_are_one_item() -> None:
    cache = node()
    report = cache.insert_batch([A, A, B], [2, 2, 1])
    assert (report.new, report.stored) == (2, 2)
    assert report.op is not None and cache.op_media(report.op) == (A, B)


def test_local_hit_is_pushed_again_and_the_store_skips_what_it_has() -> None:
    cache = node()
    pushed(cache, [A], [2])
    report = cache.insert_batch([A], [2])
    assert (report.new, report.re_pushed, report.stored, report.store_skipped) == (0, 1, 0, 1)
    assert report.op is None and state(cache, A) is EntryState.READY


def test_local_hit_is_pushed_again_after_the_store_lost_it() -> None:
    cache = node()
    pushed(cache, [A], [2])
    assert cache.store.evict(cache.key(A))
    report = cache.insert_batch([A, B], [2, 1])  # local presence is not global presence
    assert (report.new, report.re_pushed, report.stored) == (1, 1, 2)
    assert state(cache, A) is EntryState.PUSHING
    assert report.op is not None
    cache.ack_push(report.op)
    assert cache.store.get(cache.key(A)) == units(A, 2)
    assert cache.stats.re_pushed == 1


def test_entries_being_pushed_or_loaded_are_busy() -> None:
    cache = node()
    first = cache.insert_batch([A], [1])
    again = cache.insert_batch([A], [1])
    assert (again.busy, again.re_pushed, again.stored, again.op) == (1, 0, 0, None)
    assert first.op is not None and cache.pending_ops() == (first.op,)


def test_failed_push_leaves_entries_ready_and_nothing_in_the_store() -> None:
    cache = node()
    report = cache.insert_batch([A, B], [1, 1])
    assert report.op is not None
    assert cache.fail_push(report.op) == 2
    assert state(cache, A) is state(cache, B) is EntryState.READY
    assert cache.exists([A, B]) == (False, False)
    assert cache.store.writing_keys() == frozenset()
    assert cache.stats.push_failed == 2
    retry = cache.insert_batch([A, B], [1, 1])  # the next insert pushes them again
    assert (retry.re_pushed, retry.stored) == (2, 2)


def test_a_partially_failed_push_completes_item_by_item() -> None:
    cache = node()
    report = cache.insert_batch([A, B, C], [1, 1, 1])
    assert report.op is not None
    assert cache.ack_push(report.op, failed=[B]) == 2  # the store refused B (e.g. -200)
    assert state(cache, A) is state(cache, B) is state(cache, C) is EntryState.READY
    assert cache.exists([A, B, C]) == (True, False, True)
    assert cache.store.writing_keys() == frozenset()
    assert (cache.stats.pushed, cache.stats.push_failed) == (2, 1)
    assert cache.get([B]) == (units(B, 1),)  # a failed push leaves the local copy readable
    retry = cache.insert_batch([A, B, C], [1, 1, 1])  # only B is pushed again
    assert (retry.re_pushed, retry.stored, retry.store_skipped) == (3, 1, 2)


# ------------------------------------------------------------------------------ prefetch / GET


def test_two_nodes_sharing_a_store_see_each_others_pushes() -> None:
    store = StoreModel()
    first, second = node("a", store=store), node("b", store=store)
    pushed(first, [A, B], [2, 1])
    assert second.exists([A, B, C]) == (True, True, False)
    report = second.prefetch("r1", [A, B, C], [2, 1, 3])
    assert (report.loading, report.local, report.missing, report.skipped_no_space) == (2, 0, 1, 0)
    assert not second.is_ready("r1")
    assert state(second, A) is EntryState.LOADING
    assert second.get([A]) == (None,)
    assert report.op is not None and second.ack_get(report.op) == 2
    assert second.is_ready("r1")
    assert second.get([A, B]) == (units(A, 2), units(B, 1))


def test_a_write_in_flight_on_another_node_is_invisible_and_not_written_twice() -> None:
    store = StoreModel()
    first, second = node("a", store=store), node("b", store=store)
    report = first.insert_batch([A], [2])
    assert second.prefetch("r1", [A], [2]).missing == 1  # I2: not visible yet
    other = second.insert_batch([A], [2])  # a new entry is pushed unasked; it begins nothing
    assert (other.new, other.stored, other.store_skipped) == (1, 1, 0)
    assert report.op is not None and other.op is not None
    assert second.ack_push(other.op) == 1 and second.exists([A]) == (False,)  # nothing written
    assert state(second, A) is EntryState.READY
    first.ack_push(report.op)
    assert second.exists([A]) == (True,)


def test_a_new_entry_the_store_holds_is_pushed_unasked_and_writes_nothing() -> None:
    store = StoreModel()
    first, second = node("a", store=store), node("b", store=store)
    pushed(first, [A], [2])
    report = second.insert_batch([A, B], [2, 1])
    assert (report.new, report.stored, report.store_skipped) == (2, 2, 0)
    assert report.op is not None and state(second, A) is EntryState.PUSHING  # pinned until the ack
    assert store.writing_keys() == frozenset({second.key(B)})  # only B began a write
    assert (
        second.ack_push(report.op, failed=[A]) == 1
    )  # a failure of the skipped key aborts nothing
    assert second.exists([A, B]) == (True, True) and store.writing_keys() == frozenset()
    assert state(second, A) is state(second, B) is EntryState.READY


def test_prefetch_without_a_probe_fetches_every_item_that_is_not_local() -> None:
    store = StoreModel()
    first, second = node("a", store=store), node("b", store=store)
    pushed(first, [A], [2])
    with pytest.raises(MisuseError, match="probe"):
        second.prefetch("r0", [A], [2], probe=1)  # type: ignore[arg-type]
    report = second.prefetch("r1", [A, B], [2, 1], probe=False)
    assert (report.loading, report.local, report.missing) == (2, 0, 0)
    assert report.op is not None and second.ack_get(report.op) == 1  # B is not in the store
    assert state(second, A) is EntryState.READY and second.entry(B) is None
    assert (second.stats.loaded, second.stats.load_failed, second.used_units) == (1, 1, 2)


def test_other_key_spaces_do_not_share() -> None:
    store = StoreModel()
    other_model = attrs.evolve(VIT, dim=32)
    first = node("a", store=store)
    second = EmbeddingCacheModel("b", 4, KeySpace(other_model, shard=Shard.replicated()), store)
    pushed(first, [A], [1])
    assert second.exists([A]) == (False,)


def test_prefetch_skips_local_items() -> None:
    cache = node()
    pushed(cache, [A], [1])
    report = cache.prefetch("r1", [A], [1])
    assert (report.op, report.local, report.loading) == (None, 1, 0)
    assert cache.is_ready("r1")
    cache.release("r1")
    with pytest.raises(MisuseError):
        cache.is_ready("r1")


def test_failed_get_frees_and_forgets_its_entry() -> None:
    store = StoreModel()
    first, second = node("a", store=store), node("b", store=store)
    pushed(first, [A, B], [2, 1])
    report = second.prefetch("r1", [A, B], [2, 1])
    assert second.used_units == 3
    store.evict(first.key(A))  # the store drops A before the GET reads it
    assert report.op is not None and second.ack_get(report.op) == 1
    assert second.entry(A) is None and state(second, B) is EntryState.READY
    assert second.used_units == 1 and second.stats.load_failed == 1
    assert second.get([A, B]) == (None, units(B, 1))
    assert second.is_ready("r1")


def test_failed_get_batch_frees_everything() -> None:
    store = StoreModel()
    first, second = node("a", store=store), node("b", store=store)
    pushed(first, [A, B], [2, 1])
    report = second.prefetch("r1", [A, B], [2, 1])
    assert report.op is not None and second.fail_get(report.op) == 2
    assert second.entries() == () and second.used_units == 0


def test_a_partially_failed_get_frees_only_its_failed_items() -> None:
    store = StoreModel()
    first, second = node("a", store=store), node("b", store=store)
    pushed(first, [A, B], [2, 1])
    report = second.prefetch("r1", [A, B], [2, 1])
    assert report.op is not None and second.ack_get(report.op, failed=[A]) == 1
    assert second.entry(A) is None and state(second, B) is EntryState.READY
    assert second.used_units == 1 and (second.stats.loaded, second.stats.load_failed) == (1, 1)
    assert second.get([A, B]) == (None, units(B, 1))
    assert second.exists([A]) == (True,)  # a failed read changes nothing in the store
    assert second.is_ready("r1")


def test_failed_items_must_belong_to_the_op() -> None:
    cache = node()
    report = cache.insert_batch([A], [1])
    assert report.op is not None
    before = frozen_copy(cache)
    for bad in ([B], [A, B], [b"x" * 32], A):
        with pytest.raises(MisuseError):
            cache.ack_push(report.op, failed=bad)  # type: ignore[arg-type]
    assert cache == before


def test_a_get_of_the_wrong_size_is_a_miss() -> None:
    store = StoreModel()
    first, second = node("a", store=store), node("b", store=store)
    pushed(first, [A], [2])
    report = second.prefetch("r1", [A], [3])  # the caller believes A is 3 units
    assert report.op is not None and second.ack_get(report.op) == 0
    assert second.entry(A) is None and second.used_units == 0


# ------------------------------------------------------------------------------ eviction


def test_eviction_never_takes_pinned_entries() -> None:
    store = StoreModel()
    first, second = node("a", store=store), node("b", capacity=4, store=store)
    pushed(first, [C], [2])
    push = second.insert_batch([A, B], [1, 1])  # PUSHING: pinned
    get = second.prefetch("r1", [C], [2])  # LOADING: pinned
    assert second.free_units == 0
    assert second.evict(4) == 0
    report = second.insert_batch([D], [1])
    assert (report.new, report.skipped_no_space) == (0, 1)
    assert second.prefetch("r2", [D], [1]).missing == 1
    assert push.op is not None and get.op is not None
    second.ack_push(push.op)
    second.ack_get(get.op)
    assert second.evict(1) == 1  # the least recently used READY entry: A
    assert second.entry(A) is None


def test_lru_evicts_the_least_recently_used_ready_entry() -> None:
    cache = node(capacity=3)
    pushed(cache, [A], [1])
    pushed(cache, [B], [1])
    pushed(cache, [C], [1])
    cache.get([A])  # A is now the most recently used
    report = cache.insert_batch([D], [1])
    assert report.new == 1
    assert cache.entry(B) is None
    assert cache.entry(A) is not None and cache.entry(C) is not None


def test_a_batch_never_evicts_its_own_hits() -> None:
    """The stale-offset trap: making room for a new item of a batch must not evict a local hit of
    the same batch whose offset the batch PUT is about to take."""
    cache = node(capacity=3)
    pushed(cache, [A], [2])
    cache.store.evict(cache.key(A))
    report = cache.insert_batch([A, B], [2, 2])
    assert (report.new, report.re_pushed, report.skipped_no_space) == (0, 1, 1)
    assert state(cache, A) is EntryState.PUSHING
    assert report.op is not None
    cache.ack_push(report.op)
    assert cache.store.get(cache.key(A)) == units(A, 2)


def test_evict_frees_at_least_what_was_asked_in_lru_order() -> None:
    cache = node(capacity=4)
    pushed(cache, [A, B, C], [2, 1, 1])
    assert cache.evict(0) == 0
    assert cache.evict(1) == 2  # A is the oldest and is 2 units
    assert cache.evict(10) == 2
    assert cache.entries() == () and cache.stats.evicted == 3


def test_generation_changes_when_slots_are_reused() -> None:
    cache = node(capacity=2)
    pushed(cache, [A], [2])
    old = cache.entry(A)
    assert old is not None and old.slots == (0, 1)
    report = cache.insert_batch([B], [2])  # evicts A, reuses its slots
    new = cache.entry(B)
    assert report.new == 1 and cache.entry(A) is None
    assert new is not None and new.slots == old.slots and new.generation != old.generation
    assert report.op is not None
    cache.ack_push(report.op)
    pushed(cache, [A], [2])  # A again: a new generation, never the old one
    again = cache.entry(A)
    assert again is not None and again.generation not in {old.generation, new.generation}


# ------------------------------------------------------------------------------ misuse


def _misuse_cases() -> list[tuple[str, Callable[[EmbeddingCacheModel], object], type[Exception]]]:
    ghost = OpHandle("n0", OpKind.PUSH, 99)
    return [
        ("length mismatch", lambda c: c.insert_batch([A, B], [1]), MisuseError),
        ("size zero", lambda c: c.insert_batch([C], [0]), MisuseError),
        ("size negative", lambda c: c.insert_batch([C], [-1]), MisuseError),
        ("size bool", lambda c: c.insert_batch([C], [True]), MisuseError),
        ("size too large", lambda c: c.insert_batch([C, D], [1, 5]), CapacityError),
        ("not a hash", lambda c: c.insert_batch([b"x" * 32], [1]), MisuseError),  # type: ignore[list-item]
        ("a bare hash", lambda c: c.get(A), MisuseError),  # type: ignore[arg-type]
        ("conflicting sizes", lambda c: c.insert_batch([C, C], [1, 2]), MisuseError),
        ("size of a local entry", lambda c: c.insert_batch([C, A], [1, 1]), MisuseError),
        ("prefetch size", lambda c: c.prefetch("r9", [D], [0]), MisuseError),
        ("request id reused", lambda c: c.prefetch("r1", [D], [1]), MisuseError),
        ("unknown handle", lambda c: c.ack_push(ghost), MisuseError),
        ("not a handle", lambda c: c.ack_get("op"), MisuseError),  # type: ignore[arg-type]
        ("push acked as get", lambda c: c.ack_get(c.pending_ops()[0]), MisuseError),
        ("get failed as push", lambda c: c.fail_push(c.pending_ops()[1]), MisuseError),
        ("evict negative", lambda c: c.evict(-1), MisuseError),
        ("unknown request", lambda c: c.is_ready("nope"), MisuseError),
        ("release unknown", lambda c: c.release("nope"), MisuseError),
    ]


@pytest.mark.parametrize(
    ("call", "error"), [case[1:] for case in _misuse_cases()], ids=[c[0] for c in _misuse_cases()]
)
def test_bad_calls_raise_and_change_nothing(
    call: Callable[[EmbeddingCacheModel], object], error: type[Exception]
) -> None:
    store = StoreModel()
    peer = node("peer", store=store)
    pushed(peer, [B], [1])
    cache = node(store=store)
    pushed(cache, [A], [2])
    cache.insert_batch([C], [1])  # a pending PUSH: pending_ops()[0]
    cache.prefetch("r1", [B], [1])  # a pending GET: pending_ops()[1]
    before = frozen_copy((cache, peer))
    with pytest.raises(error):
        call(cache)
    assert (cache, peer) == before


def test_acking_an_op_twice_is_misuse_and_changes_nothing() -> None:
    cache = node()
    report = cache.insert_batch([A], [1])
    assert report.op is not None
    cache.ack_push(report.op)
    before = frozen_copy(cache)
    for complete in (cache.ack_push, cache.fail_push):
        with pytest.raises(MisuseError):
            complete(report.op)
    assert cache == before


def test_a_handle_of_another_node_is_unknown() -> None:
    store = StoreModel()
    first, second = node("a", store=store), node("b", store=store)
    report = first.insert_batch([A], [1])
    assert report.op is not None
    with pytest.raises(MisuseError):
        second.ack_push(report.op)


@pytest.mark.parametrize(
    "make",
    [
        lambda: EmbeddingCacheModel("n", 0, KEYSPACE, StoreModel()),
        lambda: EmbeddingCacheModel("", 4, KEYSPACE, StoreModel()),
        lambda: EmbeddingCacheModel(
            "n", 4, KeySpace(ModelIdentity("m", "bf16", KVKind.MHA, page_size=4)), StoreModel()
        ),
    ],
    ids=["capacity", "name", "not an embedding model"],
)
def test_bad_configuration_is_rejected(make: Callable[[], object]) -> None:
    with pytest.raises(MisuseError):
        make()


# ------------------------------------------------------------------------------ invariants


def test_a_poisoned_store_object_is_an_invariant_violation() -> None:
    cache = node()
    key = cache.key(A)
    cache.store.begin_put(key)
    cache.store.end_put(key, units(B, 2))  # the bytes of B under A's key: a stale offset's mark
    with pytest.raises(InvariantViolation) as info:
        cache.check_invariants()
    assert info.value.invariant == "I2"


def test_every_error_is_a_model_error() -> None:
    assert issubclass(MisuseError, ModelError) and issubclass(CapacityError, ModelError)


def test_counts_take_numpy_style_integers_and_refuse_bools() -> None:
    """Sizes and ``evict``'s unit count follow ``whole_count``: any integer with ``__index__`` (a
    numpy integer, as schedulers compute with) is a count; a bool or a float is ``MisuseError``,
    and nothing changed."""

    class Index:  # an integer type that is not an int, as numpy's are
        def __init__(self, value: int) -> None:
            self.value = value

        def __index__(self) -> int:
            return self.value

    a = node(capacity=4)
    pushed(a, [content_hash(b"x")], [Index(2)])  # type: ignore[list-item]
    assert state(a, content_hash(b"x")) is EntryState.READY
    for bad in (True, 2.0, "2", Index(-1)):
        before = frozen_copy(a.entries())
        with pytest.raises(MisuseError):
            a.evict(bad)  # type: ignore[arg-type]
        with pytest.raises(MisuseError):
            a.insert_batch([content_hash(b"y")], [bad])  # type: ignore[list-item]
        assert a.entries() == before
    assert a.evict(Index(2)) == 2  # type: ignore[arg-type]
