"""Tests of the model's building blocks: SlotPool (I5, I7), StoreModel (I2) and Lifecycle tables."""

from __future__ import annotations

import enum

import pytest
from hypothesis import given
from hypothesis import strategies as st
from transitions import MachineError

from kvstrata.model.errors import (
    CapacityError,
    IllegalTransition,
    InvariantViolation,
    MisuseError,
)
from kvstrata.model.keys import (
    DEFAULT_NAMESPACE,
    KeySpace,
    KVKind,
    ModelIdentity,
    StoreKey,
    chain_page_hashes,
)
from kvstrata.model.lifecycles import (
    ALL_LIFECYCLES,
    DEVICE_VALID,
    HOST_VALID,
    L1_DROPPABLE,
    L1_WITH_L2,
    L2_DROPPABLE,
    PREFETCH_OP,
    STATE_RESIDENCY,
    WRITE_OP,
    OpEvent,
    OpState,
    PrefetchEvent,
    PrefetchState,
    Residency,
    StateEvent,
)
from kvstrata.model.slots import UNWRITTEN, SlotPool
from kvstrata.model.store import StoreModel
from kvstrata.model.table import Lifecycle

# ----------------------------------------------------------------------------------------------
# SlotPool


def _snapshot(pool: SlotPool) -> tuple[int, int, frozenset[int], dict[int, object]]:
    return (
        pool.free_count,
        pool.used_count,
        pool.allocated(),
        {slot: pool.peek(slot) for slot in range(pool.capacity)},
    )


def test_alloc_is_lowest_first_and_reuses_freed_slots_first() -> None:
    pool = SlotPool("host", 6)
    assert pool.alloc(3) == (0, 1, 2)
    pool.free([1])
    pool.free([0])
    assert pool.alloc(2) == (0, 1)
    assert pool.alloc(1) == (3,)
    pool.free([2, 0])
    assert pool.alloc(3) == (0, 2, 4)
    assert (pool.free_count, pool.used_count) == (1, 5)


def test_alloc_zero_and_negative() -> None:
    pool = SlotPool("host", 2)
    assert pool.alloc(0) == ()
    with pytest.raises(MisuseError):
        pool.alloc(-1)
    with pytest.raises(MisuseError):
        SlotPool("bad", -1)
    assert SlotPool("empty", 0).alloc(0) == ()


def test_capacity_error_changes_nothing() -> None:
    pool = SlotPool("dev", 4)
    pool.alloc(3)
    pool.free([1])
    before = _snapshot(pool)
    with pytest.raises(CapacityError):
        pool.alloc(3)
    assert _snapshot(pool) == before
    assert pool.alloc(2) == (1, 3)


@pytest.mark.parametrize(
    "to_free",
    [
        [2],  # never allocated
        [0, 0],  # the same slot twice in one call
        [0, 2],  # one good, one bad: nothing is freed
        [1, 99],  # out of range
    ],
)
def test_double_free_is_i5_and_changes_nothing(to_free: list[int]) -> None:
    pool = SlotPool("dev", 4)
    pool.alloc(2)
    pool.write(0, "a")
    before = _snapshot(pool)
    with pytest.raises(InvariantViolation) as info:
        pool.free(to_free)
    assert info.value.invariant == "I5"
    assert _snapshot(pool) == before


def test_free_after_free_is_i5() -> None:
    pool = SlotPool("dev", 2)
    (slot,) = pool.alloc(1)
    pool.free([slot])
    with pytest.raises(InvariantViolation, match="I5"):
        pool.free([slot])
    assert pool.free_count == 2


def test_read_before_write_is_i7() -> None:
    pool = SlotPool("dev", 2)
    (slot,) = pool.alloc(1)
    assert pool.peek(slot) is UNWRITTEN
    with pytest.raises(InvariantViolation) as info:
        pool.read(slot)
    assert info.value.invariant == "I7"
    pool.write(slot, ("page", 7))
    assert pool.read(slot) == ("page", 7)


def test_reallocated_slot_is_unwritten_again() -> None:
    pool = SlotPool("dev", 1)
    (slot,) = pool.alloc(1)
    pool.write(slot, "old")
    pool.free([slot])
    assert pool.alloc(1) == (slot,)
    with pytest.raises(InvariantViolation, match="I7"):
        pool.read(slot)  # stale content must not leak into a new allocation


def test_read_or_write_of_freed_slot_is_i5() -> None:
    pool = SlotPool("dev", 2)
    (slot,) = pool.alloc(1)
    pool.write(slot, "x")
    pool.free([slot])
    with pytest.raises(InvariantViolation) as read_info:
        pool.read(slot)
    with pytest.raises(InvariantViolation) as write_info:
        pool.write(slot, "y")
    assert read_info.value.invariant == write_info.value.invariant == "I5"
    assert pool.peek(slot) is None
    assert not pool.is_allocated(slot)
    with pytest.raises(InvariantViolation, match="I5"):
        pool.read(5)  # never a slot at all


@given(
    capacity=st.integers(0, 6),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 7)), max_size=30),
)
def test_slot_pool_against_a_set(capacity: int, ops: list[tuple[bool, int]]) -> None:
    pool = SlotPool("p", capacity)
    allocated: set[int] = set()
    for is_alloc, number in ops:
        free = sorted(set(range(capacity)) - allocated)
        if is_alloc:
            if number > len(free):
                with pytest.raises(CapacityError):
                    pool.alloc(number)
            else:
                assert pool.alloc(number) == tuple(free[:number])
                allocated.update(free[:number])
        elif number in allocated:
            pool.free([number])
            allocated.discard(number)
        else:
            with pytest.raises(InvariantViolation):
                pool.free([number])
        assert pool.allocated() == allocated
        assert pool.free_count + pool.used_count == capacity


# ----------------------------------------------------------------------------------------------
# StoreModel

SPACE = KeySpace(ModelIdentity(name="m", dtype="bf16", kind=KVKind.MHA, page_size=2))
HASHES = chain_page_hashes(list(range(8)), 2)
PAGES = [SPACE.page_keys(DEFAULT_NAMESPACE, h) for h in HASHES]
KEY = PAGES[0][0]


def _put(store: StoreModel, key: StoreKey, content: object = "bytes") -> None:
    assert store.begin_put(key)
    store.end_put(key, content)  # type: ignore[arg-type,unused-ignore]


def test_two_phase_put_is_invisible_until_end() -> None:
    store = StoreModel()
    assert store.begin_put(KEY)
    assert not store.contains(KEY)
    assert store.get(KEY) is None
    assert len(store) == 0
    assert store.writing_keys() == {KEY}
    assert store.exists_pages([[KEY]]) == 0
    store.end_put(KEY, "content")
    assert store.contains(KEY)
    assert store.get(KEY) == "content"
    assert store.writing_keys() == frozenset()
    assert store.exists_pages([[KEY]]) == 1
    assert store.visible_items() == ((KEY, "content"),)


def test_begin_put_on_visible_or_writing_key_returns_false() -> None:
    store = StoreModel()
    assert store.begin_put(KEY)
    assert not store.begin_put(KEY)  # already being written
    store.end_put(KEY, "first")
    assert not store.begin_put(KEY)  # already visible: content-addressed, nothing to write
    assert store.get(KEY) == "first"
    assert store.writing_keys() == frozenset()


def test_abort_put_forgets_the_write() -> None:
    store = StoreModel()
    assert store.begin_put(KEY)
    store.abort_put(KEY)
    assert not store.contains(KEY)
    assert store.writing_keys() == frozenset()
    assert store.begin_put(KEY)  # may be written again


def test_end_or_abort_without_begin_is_i2() -> None:
    store = StoreModel()
    for method, args in ((store.end_put, (KEY, "x")), (store.abort_put, (KEY,))):
        with pytest.raises(InvariantViolation) as info:
            method(*args)
        assert info.value.invariant == "I2"
    _put(store, KEY)
    with pytest.raises(InvariantViolation, match="I2"):
        store.end_put(KEY, "again")
    with pytest.raises(InvariantViolation, match="I2"):
        store.abort_put(KEY)
    assert store.get(KEY) == "bytes"


def test_evict() -> None:
    store = StoreModel()
    assert not store.evict(KEY)
    _put(store, KEY)
    assert store.evict(KEY)
    assert not store.contains(KEY)
    assert not store.evict(KEY)
    assert store.begin_put(KEY)
    assert not store.evict(KEY)  # an in-flight write is not visible, so not evictable
    assert store.writing_keys() == {KEY}


def test_evict_reports_removal_of_none_content() -> None:
    store = StoreModel()
    _put(store, KEY, None)
    assert store.contains(KEY)
    assert store.evict(KEY)


def test_exists_pages_counts_consecutive_complete_pages() -> None:
    store = StoreModel()
    assert store.exists_pages(PAGES) == 0
    assert store.exists_pages([]) == 0
    for key in PAGES[0] + PAGES[1] + PAGES[3]:
        _put(store, key)
    assert store.exists_pages(PAGES) == 2  # page 2 missing: page 3 does not count
    _put(store, PAGES[2][0])  # only K of page 2
    assert store.exists_pages(PAGES) == 2
    assert store.begin_put(PAGES[2][1])  # V of page 2 in flight: still a miss (I2)
    assert store.exists_pages(PAGES) == 2
    store.end_put(PAGES[2][1], "v")
    assert store.exists_pages(PAGES) == 4
    store.evict(PAGES[0][1])
    assert store.exists_pages(PAGES) == 0
    assert store.exists_pages([()]) == 0  # a page with no components is not a hit


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.contains("kvs1/x"),
        lambda s: s.get("kvs1/x"),
        lambda s: s.begin_put("kvs1/x"),
        lambda s: s.evict("kvs1/x"),
        lambda s: s.exists_pages([["kvs1/x"]]),
        lambda s: s.begin_put(HASHES[0]),
    ],
    ids=["contains", "get", "begin_put", "evict", "exists_pages", "begin_put-page-hash"],
)
def test_non_store_keys_are_misuse(call: object) -> None:
    store = StoreModel()
    _put(store, KEY)
    with pytest.raises(MisuseError):
        call(store)  # type: ignore[operator]
    assert store.visible_items() == ((KEY, "bytes"),)
    assert store.writing_keys() == frozenset()


@pytest.mark.parametrize("method", ["end_put", "abort_put"])
def test_non_store_keys_are_misuse_in_end_and_abort(method: str) -> None:
    store = StoreModel()
    args = ("kvs1/x", "c") if method == "end_put" else ("kvs1/x",)
    with pytest.raises(MisuseError):
        getattr(store, method)(*args)


def test_visible_items_are_sorted() -> None:
    store = StoreModel()
    keys = [key for page in PAGES for key in page]
    for key in reversed(keys):
        _put(store, key, key.text)
    assert [key for key, _ in store.visible_items()] == sorted(keys, key=lambda k: k.text)
    assert len(store) == len(keys)


# ----------------------------------------------------------------------------------------------
# Lifecycles


class _Holder:
    """A plain object carrying a state (transitions cannot decorate slotted attrs classes)."""

    def __init__(self, state: object = None) -> None:
        self.state = state


def test_illegal_event_raises_and_changes_nothing() -> None:
    holder = _Holder(PrefetchState.COMPLETE)

    def advance(event: PrefetchEvent) -> None:
        # The discipline every caller follows: compute the next state first, then mutate.
        holder.state = PREFETCH_OP.next(holder.state, event)  # type: ignore[arg-type]

    with pytest.raises(IllegalTransition) as info:
        advance(PrefetchEvent.ARRIVE)
    assert holder.state is PrefetchState.COMPLETE
    assert info.value.machine == PREFETCH_OP.name
    assert info.value.state is PrefetchState.COMPLETE
    assert info.value.event is PrefetchEvent.ARRIVE
    assert not PREFETCH_OP.allows(PrefetchState.COMPLETE, PrefetchEvent.ARRIVE)
    advance(PrefetchEvent.COMMIT)
    assert holder.state == PrefetchState.DONE  # type: ignore[comparison-overlap]
    for event in PrefetchEvent:  # a final state takes no event at all
        with pytest.raises(IllegalTransition):
            advance(event)
        assert holder.state is PrefetchState.DONE


def test_next_follows_the_table() -> None:
    assert WRITE_OP.next(OpState.PENDING, OpEvent.ACK) is OpState.DONE
    with pytest.raises(IllegalTransition):
        WRITE_OP.next(OpState.DONE, OpEvent.ACK)


@pytest.mark.parametrize("lifecycle", ALL_LIFECYCLES, ids=lambda lc: lc.name.replace(" ", "-"))
def test_next_is_the_table_for_every_state_and_event(lifecycle: Lifecycle) -> None:  # type: ignore[type-arg]
    """``next`` (a lookup by member identity, for speed) answers exactly what ``table`` says for
    every pair of the lifecycle's enums, and refuses members of other enums that share a name
    or a value with the ones it knows."""
    events = type(next(iter(lifecycle.table))[1])
    for state in type(lifecycle.initial):
        for event in events:
            want = lifecycle.table.get((state, event))
            if want is None:
                with pytest.raises(IllegalTransition):
                    lifecycle.next(state, event)
            else:
                assert lifecycle.next(state, event) is want
    for (state, event), _target in lifecycle.table.items():
        twin_state = enum.Enum("Twin", [(state.name, state.value)])[state.name]
        twin_event = enum.Enum("TwinEvent", [(event.name, event.value)])[event.name]
        for pair in ((twin_state, event), (state, twin_event), (state.name, event.name)):
            with pytest.raises(IllegalTransition):
                lifecycle.next(*pair)


def _ids(lifecycle: Lifecycle) -> str:  # type: ignore[type-arg]
    return lifecycle.name.replace(" ", "-")


LIFECYCLES = pytest.mark.parametrize("lifecycle", ALL_LIFECYCLES, ids=_ids)


def _event_enum(lifecycle: Lifecycle) -> type[enum.Enum]:  # type: ignore[type-arg]
    return type(next(iter(lifecycle.table))[1])


@LIFECYCLES
def test_machine_follows_every_row(lifecycle: Lifecycle) -> None:  # type: ignore[type-arg]
    for state, event, target in lifecycle.rows():
        holder = _Holder()
        machine = lifecycle.build_machine(holder)
        assert holder.state == lifecycle.initial.name
        machine.set_state(state.name, model=holder)
        holder.trigger(event.name)  # type: ignore[attr-defined]
        assert holder.state == target.name
        assert lifecycle.next(state, event) is target


@LIFECYCLES
def test_machine_refuses_what_the_table_refuses(lifecycle: Lifecycle) -> None:  # type: ignore[type-arg]
    known_events = set(lifecycle.events)
    for state in lifecycle.states:
        for event in _event_enum(lifecycle):
            if lifecycle.allows(state, event):
                continue
            holder = _Holder()
            machine = lifecycle.build_machine(holder)
            machine.set_state(state.name, model=holder)
            expected = MachineError if event in known_events else AttributeError
            with pytest.raises(expected):
                holder.trigger(event.name)  # type: ignore[attr-defined]
            assert holder.state == state.name
            with pytest.raises(IllegalTransition):
                lifecycle.next(state, event)


@LIFECYCLES
def test_machine_without_a_model(lifecycle: Lifecycle) -> None:  # type: ignore[type-arg]
    machine = lifecycle.build_machine()
    assert machine.state == lifecycle.initial.name
    state, event, target = next(iter(lifecycle.rows()))
    machine.set_state(state.name)
    machine.trigger(event.name)
    assert machine.state == target.name


#: States deliberately unreachable from a lifecycle's initial state (none today).
INTENTIONALLY_UNREACHABLE: dict[str, frozenset[enum.Enum]] = {}


@LIFECYCLES
def test_every_state_is_reachable(lifecycle: Lifecycle) -> None:  # type: ignore[type-arg]
    expected = set(lifecycle.states) - INTENTIONALLY_UNREACHABLE.get(lifecycle.name, frozenset())
    assert lifecycle.reachable() == expected


@LIFECYCLES
def test_only_final_states_are_dead_ends(lifecycle: Lifecycle) -> None:  # type: ignore[type-arg]
    with_exits = {state for state, _event, _target in lifecycle.rows()}
    for state in lifecycle.states:
        assert (state in lifecycle.final) == (state not in with_exits), state


@LIFECYCLES
def test_every_event_is_used(lifecycle: Lifecycle) -> None:  # type: ignore[type-arg]
    assert set(lifecycle.events) == set(_event_enum(lifecycle))


@LIFECYCLES
def test_markdown_contains_every_row(lifecycle: Lifecycle) -> None:  # type: ignore[type-arg]
    text = lifecycle.markdown()
    lines = text.splitlines()
    assert lifecycle.name in lines[0]
    assert f"`{lifecycle.initial.name}`" in lines[0]
    rows = [line for line in lines if line.startswith("| `")]
    assert len(rows) == len(lifecycle.table)
    for state, event, target in lifecycle.rows():
        assert f"| `{state.name}` | `{event.name}` | `{target.name}` |" in rows


def test_all_lifecycles_have_distinct_names() -> None:
    names = [lifecycle.name for lifecycle in ALL_LIFECYCLES]
    assert len(set(names)) == len(names)


class _S(enum.Enum):
    A = "a"
    B = "b"


class _E(enum.Enum):
    GO = "go"


class _Other(enum.Enum):
    X = "x"


def test_final_state_with_an_exit_is_rejected() -> None:
    with pytest.raises(ValueError, match="final"):
        Lifecycle(name="bad", initial=_S.A, table={(_S.B, _E.GO): _S.A}, final=frozenset({_S.B}))  # type: ignore[arg-type]


def test_target_of_another_enum_is_rejected() -> None:
    with pytest.raises(TypeError):
        Lifecycle(name="bad", initial=_S.A, table={(_S.A, _E.GO): _Other.X})


def test_lifecycle_table_is_immutable() -> None:
    lifecycle: Lifecycle[_S, _E] = Lifecycle(
        name="t",
        initial=_S.A,
        table={(_S.A, _E.GO): _S.B},
        final=frozenset({_S.B}),  # type: ignore[arg-type]
    )
    with pytest.raises(TypeError):
        lifecycle.table[(_S.B, _E.GO)] = _S.A  # type: ignore[index]
    assert not lifecycle.allows(_S.B, _E.GO)


# ----------------------------------------------------------------------------------------------
# Guard sets are derived from the tables (issue 15): both sides import them, nobody spells them out
def test_sources_are_the_states_where_an_event_is_legal() -> None:
    assert PREFETCH_OP.sources(PrefetchEvent.COMMIT) == {
        PrefetchState.LOADING,
        PrefetchState.COMPLETE,
    }
    assert PREFETCH_OP.sources(PrefetchEvent.DRAIN) == {PrefetchState.CANCELLING}
    assert WRITE_OP.sources() == frozenset()


def test_state_guard_sets_follow_the_state_table() -> None:
    for state in Residency:
        drop_l1 = STATE_RESIDENCY.allows(state, StateEvent.DEMOTE) or (
            STATE_RESIDENCY.allows(state, StateEvent.DELETE) and state in DEVICE_VALID
        )
        drop_l2 = STATE_RESIDENCY.allows(state, StateEvent.DROP_HOST) or (
            STATE_RESIDENCY.allows(state, StateEvent.DELETE) and state in HOST_VALID
        )
        assert (state in L1_DROPPABLE) == drop_l1, state
        assert (state in L2_DROPPABLE) == drop_l2, state
    assert {Residency.DEVICE, Residency.BOTH} == L1_DROPPABLE
    assert {Residency.BOTH, Residency.HOST} == L2_DROPPABLE
    assert {Residency.WRITING, Residency.BOTH} == L1_WITH_L2
    assert Residency.LOADING in HOST_VALID  # a page being loaded back is still valid on L2
