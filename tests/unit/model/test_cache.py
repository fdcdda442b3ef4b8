"""Scenario tests of the cache model: each names one rule of SPEC §3/§4 and checks it directly."""

from __future__ import annotations

import attrs
import pytest

from kvstrata.model.cache import CacheConfig, CacheModel, InsertResult, WritePolicy
from kvstrata.model.errors import CapacityError, InvariantViolation, MisuseError
from kvstrata.model.hybrid import HitPolicy, SidePool, side_page_keys
from kvstrata.model.invariants import check_i1_keys
from kvstrata.model.keys import (
    DEFAULT_NAMESPACE,
    KeySpace,
    KVKind,
    ModelIdentity,
    Namespace,
    PageHash,
    chain_page_hashes,
    parse_store_key,
)
from kvstrata.model.l3.policy import PrefetchPolicy, PrefetchTimeout
from kvstrata.model.lifecycles import PrefetchState, Residency
from kvstrata.model.store import StoreModel

KEYS = KeySpace(ModelIdentity("tiny", "bf16", KVKind.MHA, page_size=1))
B, H, W, D = Residency.BOTH, Residency.HOST, Residency.WRITING, Residency.DEVICE


def make(store: StoreModel | None = None, **overrides: object) -> CacheModel:
    config: dict[str, object] = {
        "page_size": 1,
        "device_pages": 8,
        "host_pages": 8,
        "keys": KEYS,
        "prefetch_threshold": 1,
    }
    config.update(overrides)
    return CacheModel(CacheConfig(**config), StoreModel() if store is None else store)  # type: ignore[arg-type]


def request(cache: CacheModel, tokens: tuple[int, ...], ns: Namespace = DEFAULT_NAMESPACE) -> None:
    """The scheduler protocol: match, lock, allocate the rest, compute, insert, unlock."""
    result = cache.match_prefix(tokens, ns)
    pages = chain_page_hashes(tokens, cache.page_size, ns)
    fresh = cache.alloc_device(len(pages) - result.device_pages)
    for slot, page in zip(fresh, pages[result.device_pages :], strict=True):
        cache.write_device(slot, page)
    cache.insert(tokens, ns, result.device_slots + fresh)


def drain(cache: CacheModel) -> None:
    while cache.write_ops:
        cache.ack_write()
    while cache.backup_ops:
        cache.start_backup()
        cache.ack_backup()


def test_split_while_write_through_in_flight_keeps_coverage() -> None:
    """The lost-split scenario: the prefix of a node split during its write-through still reaches L2
    and L3 (I4)."""
    cache = make()
    request(cache, (1, 2, 3, 4))
    assert cache.residency((1, 2, 3, 4)) == (W, W, W, W)
    cache.match_prefix((1, 2, 9))  # splits the node after two pages while the copy is in flight
    assert len(cache.tree.nodes) == 3
    drain(cache)
    assert cache.residency((1, 2, 3, 4)) == (B, B, B, B)
    assert cache.l3_exists((1, 2, 3, 4)) == 4


def test_write_policies() -> None:
    through = make(write_policy=WritePolicy.WRITE_THROUGH)
    request(through, (1, 2))
    assert through.residency((1, 2)) == (W, W)

    selective = make(write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE, write_through_threshold=2)
    request(selective, (1, 2))
    assert selective.residency((1, 2)) == (D, D)
    selective.match_prefix((1, 2))
    selective.match_prefix((1, 2))
    assert selective.residency((1, 2)) == (W, W)

    back = make(write_policy=WritePolicy.WRITE_BACK, device_pages=2)
    request(back, (1, 2))
    assert back.residency((1, 2)) == (D, D)
    back.evict(2)
    assert back.residency((1, 2)) == (H, H)  # staged to L2 on eviction
    assert back.host_content([back.page_info[p].host_slot for p in chain_page_hashes((1, 2), 1)])  # type: ignore[misc]


def test_eviction_demotes_or_deletes_and_respects_locks() -> None:
    cache = make(host_pages=0)
    request(cache, (1, 2))
    node = cache.match_prefix((1, 2)).device_node
    cache.lock(node)
    assert cache.evict(8) == 0
    cache.unlock(node)
    assert cache.evict(1) == 2  # a whole leaf goes
    assert cache.residency((1, 2)) == ()
    with pytest.raises(MisuseError):
        cache.unlock(node)


def test_load_back_is_all_or_nothing_and_pinned_until_ack() -> None:
    cache = make(device_pages=4, load_back_quota=3)
    request(cache, (1, 2, 3, 4))
    drain(cache)
    cache.evict(4)
    assert cache.residency((1, 2, 3, 4)) == (H, H, H, H)
    host_node = cache.match_prefix((1, 2, 3, 4)).host_node
    assert cache.load_back(host_node) is None  # 4 pages > quota 3: nothing moves
    assert cache.residency((1, 2, 3, 4)) == (H, H, H, H)
    cache.match_prefix((1, 2, 3))  # split so that a chain of 3 fits the quota
    assert cache.load_back(cache.match_prefix((1, 2, 3)).host_node) is not None
    assert cache.evict_host(8) == 1  # only the unloaded last page can go
    cache.ack_load()
    assert cache.match_prefix((1, 2, 3)).device_pages == 3


def test_prefetch_from_another_instance_commit_and_drain() -> None:
    store = StoreModel()
    writer, reader = make(store=store), make(store=store)
    request(writer, (1, 2, 3, 4))
    drain(writer)
    op = reader.prefetch((1, 2, 3, 4))
    assert op is not None
    reader.prefetch_arrive(op, 2)
    assert reader.prefetch_commit(op) == 2  # best effort: what arrived
    assert reader.prefetch_ops[op].state is PrefetchState.CANCELLING  # pages 3-4 still in flight
    held = reader.host.used_count
    reader.prefetch_drain(op)
    assert reader.host.used_count == held - 2
    assert reader.residency((1, 2, 3, 4)) == (H, H)
    with pytest.raises(MisuseError):
        reader.prefetch_drain(op)


def test_a_committed_or_aborted_prefetch_is_gone_for_the_scheduler_until_its_drain() -> None:
    store = StoreModel()
    writer = make(store=store)
    request(writer, (1, 2, 3, 4))
    drain(writer)
    for first in ("commit", "abort"):
        reader = make(store=store)
        op = reader.prefetch((1, 2, 3, 4))
        assert op is not None
        reader.prefetch_arrive(op, 2)
        getattr(reader, f"prefetch_{first}")(op)
        assert reader.prefetch_ops[op].state is PrefetchState.CANCELLING
        before = attrs.evolve(reader.prefetch_ops[op]), reader.host.used_count, reader.clock
        for verb in (reader.prefetch_ready, reader.prefetch_commit, reader.prefetch_abort):
            with pytest.raises(MisuseError, match="no prefetch op"):
                verb(op)
        assert (reader.prefetch_ops[op], reader.host.used_count, reader.clock) == before
        reader.prefetch_drain(op)  # the I/O side still names it
        assert op not in reader.prefetch_ops


def test_prefetch_commit_waits_for_a_readable_parent_so_a_failed_write_keeps_i3() -> None:
    """Found by the fuzz run: a prefetch committed under a node whose write-through is still in
    flight, then that write fails. The commit gives its pages back instead of attaching a host-only
    leaf that the failure would leave under an L1-only node (I3); once the write landed it attaches."""
    store = StoreModel()
    writer = make(store=store)
    request(writer, (1, 2, 3))
    drain(writer)
    for landed in (False, True):
        reader = make(store=store)
        request(reader, (1,))
        assert reader.residency((1,)) == (W,)
        op = reader.prefetch((1, 2, 3))
        assert op is not None
        reader.prefetch_arrive(op, 2)
        if landed:
            reader.ack_write()
        free = reader.host.free_count
        assert reader.prefetch_commit(op) == (2 if landed else 0)
        assert reader.host.free_count == free + (0 if landed else 2)
        if not landed:
            reader.fail_write()  # checks every invariant on the way out
            assert reader.residency((1, 2, 3)) == (D,)
        else:
            assert reader.residency((1, 2, 3)) == (B, H, H)


def test_prefetch_policies_and_rate_limit() -> None:
    store = StoreModel()
    writer = make(store=store, device_pages=16, host_pages=16)
    request(writer, tuple(range(1, 9)))
    drain(writer)
    timeout = make(
        store=store,
        host_pages=8,
        prefetch_policy=PrefetchPolicy.TIMEOUT,
        prefetch_timeout=PrefetchTimeout(base=3, per_1k_tokens=0, cap=3),
    )
    assert timeout.prefetch(tuple(range(1, 9))) is None  # 8 pages > half of L2
    op = timeout.prefetch(tuple(range(1, 5)))
    assert op is not None and not timeout.prefetch_ready(op)
    timeout.tick(3)
    assert timeout.prefetch_ready(op)
    timeout.prefetch_abort(op)
    timeout.prefetch_drain(op)
    assert timeout.host.used_count == 0 and not timeout.prefetch_ops


def test_store_eviction_ends_a_prefetch_early() -> None:
    store = StoreModel()
    writer, reader = make(store=store), make(store=store)
    request(writer, (1, 2, 3))
    drain(writer)
    op = reader.prefetch((1, 2, 3))
    assert op is not None
    third = KEYS.page_keys(DEFAULT_NAMESPACE, chain_page_hashes((1, 2, 3), 1)[2])[1]
    reader.store_evict(third)
    assert reader.prefetch_arrive(op, 3) == 2
    assert reader.prefetch_ops[op].state is PrefetchState.COMPLETE
    assert reader.prefetch_commit(op) == 2


def test_backup_retries_when_another_writers_put_did_not_complete() -> None:
    store = StoreModel()
    a, b = make(store=store), make(store=store)
    request(a, (1,))
    request(b, (1,))
    a.ack_write()
    b.ack_write()
    a.start_backup()  # a begins the puts
    b.start_backup()  # b finds them in flight: nothing to write
    assert b.ack_backup() == 0  # not visible yet: b queues the page again
    a.fail_backup()  # a's puts are aborted
    b.start_backup()
    assert b.ack_backup() == 1
    assert b.l3_exists((1,)) == 1


def test_namespaces_never_share_pages_or_keys() -> None:
    cache = make()
    request(cache, (1, 2), Namespace(extra_key="tenant-a"))
    drain(cache)
    assert cache.match_prefix((1, 2)).device_pages == 0
    assert cache.l3_exists((1, 2)) == 0
    assert cache.l3_exists((1, 2), Namespace(extra_key="tenant-a")) == 2


def test_bad_input_is_rejected_without_change() -> None:
    cache = make(device_pages=2)
    request(cache, (1, 2))
    before = (repr(cache.page_info), cache.clock, cache.device.allocated())
    with pytest.raises(MisuseError):
        cache.insert((1, 2, 3), DEFAULT_NAMESPACE, (0,))  # wrong slot count
    with pytest.raises(MisuseError):
        cache.insert(["a"])  # type: ignore[list-item]
    with pytest.raises(MisuseError):
        cache.free_device((0,))  # the tree's slot, not the scheduler's
    with pytest.raises(MisuseError):
        cache.prefetch_drain(1)  # no such op
    assert (repr(cache.page_info), cache.clock, cache.device.allocated()) == before
    cache.lock(cache.match_prefix((1, 2)).device_node)
    with pytest.raises(CapacityError):
        cache.alloc_device(1)
    with pytest.raises(MisuseError):
        CacheConfig(page_size=0, device_pages=1)


# ----------------------------------------------------------------- hybrid side pools (SPEC §5)
INDEXER = SidePool("indexer", HitPolicy.ALL_PAGES, ("idx",))
MAMBA = SidePool("mamba", HitPolicy.TRAILING_PAGES, ("conv0", "temporal"))


def make_hybrid(store: StoreModel | None = None, **overrides: object) -> CacheModel:
    config: dict[str, object] = {
        "side_pools": (INDEXER, MAMBA),
        "device_states": 2,
        "host_states": 2,
    }
    config.update(overrides)
    return make(store, **config)


def hybrid_request(
    cache: CacheModel, tokens: tuple[int, ...], *, state: bool = True
) -> InsertResult:
    """The scheduler protocol with a trailing state computed at the end of the last page."""
    result = cache.match_prefix(tokens)
    pages = chain_page_hashes(tokens, cache.page_size, DEFAULT_NAMESPACE)
    fresh = cache.alloc_device(len(pages) - result.device_pages)
    for slot, page in zip(fresh, pages[result.device_pages :], strict=True):
        cache.write_device(slot, page)
    state_slot = None
    if state:
        state_slot = cache.alloc_device_state()
        cache.write_device_state(state_slot, cache.state_content(pages[-1]))
    return cache.insert(tokens, DEFAULT_NAMESPACE, result.device_slots + fresh, state_slot)


def hybrid_snapshot(cache: CacheModel) -> tuple[object, ...]:
    return (
        repr(cache.page_info),
        repr(cache.state_info),
        repr(cache.tree.nodes),
        cache.clock,
        cache.device_state.allocated(),
        cache.host_state.allocated(),
        cache.store.visible_items(),
    )


def test_side_pool_config_is_validated() -> None:
    with pytest.raises(MisuseError, match="TRAILING_PAGES"):
        make(device_states=1)  # states without a Mamba pool
    with pytest.raises(MisuseError, match="device_states"):
        make(side_pools=(MAMBA,), host_states=1)
    with pytest.raises(MisuseError, match="host_states"):
        make(side_pools=(MAMBA,), device_states=1)  # an L2 but no L2 state slot
    with pytest.raises(MisuseError, match="distinct"):
        make(side_pools=(INDEXER, INDEXER))
    with pytest.raises(MisuseError, match="sequence"):
        make(side_pools=INDEXER)
    indexer_only = make(side_pools=[INDEXER])
    assert indexer_only.config.side_pools == (INDEXER,)
    assert not indexer_only.has_states
    with pytest.raises(MisuseError):
        indexer_only.alloc_device_state()


def test_a_state_sits_at_a_node_end_and_a_split_reports_less() -> None:
    cache = make_hybrid(device_states=3)
    assert hybrid_request(cache, (1, 2, 3, 4)).state_kept
    full = cache.match_prefix((1, 2, 3, 4))
    assert (full.device_pages, full.host_pages) == (4, 0)
    assert full.device_state_slot is not None
    assert cache.device_state.read(full.device_state_slot) == ("state", pages_of((1, 2, 3, 4))[3])
    # the match splits the node after page 2: the new node end has no state, so nothing is usable
    half = cache.match_prefix((1, 2))
    assert (half.device_pages, half.host_pages, half.device_state_slot) == (0, 0, None)
    assert cache.state_residency((1, 2, 3, 4)) == (None, None, None, W)
    assert cache.match_prefix((1, 2, 3, 4)).device_pages == 4  # the split moved nothing
    # a request that ends at the split brings its own state; a second copy is given back
    assert hybrid_request(cache, (1, 2)).state_kept
    assert cache.match_prefix((1, 2, 3)).device_pages == 2
    drain(cache)  # the state-only write-through of (1, 2)'s state, then its backup
    assert cache.state_residency((1, 2)) == (None, B)
    assert cache.l3_exists((1, 2)) == 2
    assert not hybrid_request(cache, (1, 2)).state_kept
    assert cache.device_state.used_count == 2


def test_dropped_state_reports_less_and_a_state_only_load_back_restores_it() -> None:
    cache = make_hybrid()
    hybrid_request(cache, (1, 2, 3))
    drain(cache)
    assert cache.state_residency((1, 2, 3))[-1] is B
    leaf = cache.match_prefix((1, 2, 3)).device_node
    cache.evict_state(leaf)  # L1 copy dropped, L2 copy kept: readable from L2 only
    result = cache.match_prefix((1, 2, 3))
    assert (result.device_pages, result.host_pages, result.host_node) == (0, 3, leaf)
    op = cache.load_back(result.host_node)
    assert op is not None and cache.load_ops[-1].pages == () and cache.load_ops[-1].states
    assert cache.match_prefix((1, 2, 3)).device_pages == 0  # not usable on L1 before the ack
    cache.ack_load()
    assert cache.match_prefix((1, 2, 3)).device_pages == 3
    cache.evict_state(leaf, host=True)  # now drop the L2 copy: L1 stays usable
    assert cache.state_residency((1, 2, 3))[-1] is D
    assert cache.match_prefix((1, 2, 3)).device_pages == 3
    cache.evict_state(leaf)  # and the L1 copy: the state is gone
    assert cache.state_residency((1, 2, 3))[-1] is None
    assert cache.device_state.used_count == cache.host_state.used_count == 0


def test_evict_state_misuse_is_rejected_without_change() -> None:
    cache = make_hybrid()
    hybrid_request(cache, (1, 2, 3))
    leaf = cache.match_prefix((1, 2, 3)).device_node
    cache.ack_write()  # the backup is queued and pins the L2 state copy
    before = hybrid_snapshot(cache)
    with pytest.raises(MisuseError, match="pinned"):
        cache.evict_state(leaf, host=True)
    cache.match_prefix((1, 9))  # splits: a node end without a state
    stateless = cache.tree.walk((1,), DEFAULT_NAMESPACE, split=False).last.node_id
    before = hybrid_snapshot(cache)
    with pytest.raises(MisuseError, match="no idle"):
        cache.evict_state(stateless)
    with pytest.raises(MisuseError):
        cache.evict_state(10**6)
    with pytest.raises(MisuseError):
        cache.evict_state(cache.tree.root(DEFAULT_NAMESPACE).node_id)
    cache.lock(leaf)
    before = hybrid_snapshot(cache)
    with pytest.raises(MisuseError, match="locked"):
        cache.evict_state(leaf)
    assert hybrid_snapshot(cache) == before
    plain = make()
    request(plain, (1,))
    with pytest.raises(MisuseError, match="keeps no states"):
        plain.evict_state(plain.match_prefix((1,)).device_node)


def test_state_slot_misuse_is_rejected_without_change() -> None:
    cache = make_hybrid()
    slot = cache.alloc_device_state()
    before = hybrid_snapshot(cache)
    with pytest.raises(MisuseError, match="not held"):
        cache.insert((1,), DEFAULT_NAMESPACE, cache.alloc_device(1), state_slot=slot + 1)
    cache.free_device(tuple(cache.scheduler_slots))
    before = hybrid_snapshot(cache)
    with pytest.raises(MisuseError, match="full page"):
        cache.insert((), DEFAULT_NAMESPACE, (), state_slot=slot)
    with pytest.raises(MisuseError):
        cache.write_device_state(slot + 1, ("state", None))
    with pytest.raises(MisuseError):
        cache.free_device_state(slot + 1)
    assert hybrid_snapshot(cache) == before
    cache.free_device_state(slot)
    assert cache.device_state.used_count == 0


def test_l1_state_slots_are_reused_least_recently_used_first() -> None:
    cache = make_hybrid(device_states=1, write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE)
    hybrid_request(cache, (1,))
    hybrid_request(cache, (2,))  # takes the only L1 state slot from (1,)'s state (L1 only: gone)
    assert cache.state_residency((1,)) == (None,)
    assert cache.match_prefix((1,)).device_pages == 0
    assert cache.match_prefix((2,)).device_pages == 1
    cache.lock(cache.match_prefix((2,)).device_node)
    with pytest.raises(CapacityError):
        cache.alloc_device_state()  # the only state is in use


def test_write_through_is_all_or_nothing_over_pools() -> None:
    cache = make_hybrid(device_states=3, host_states=1)
    hybrid_request(cache, (1,))
    cache.ack_write()  # the backup pins the only L2 state slot
    host_used = cache.host.used_count
    hybrid_request(cache, (2,))
    assert cache.residency((2,)) == (D,)  # no L2 state slot: no L2 page either
    assert cache.host.used_count == host_used and not cache.write_ops
    drain(cache)
    hybrid_request(cache, (3,))  # (1,)'s L2 state is unpinned now and can be dropped
    assert cache.residency((3,)) == (W,)
    assert cache.state_residency((1,)) == (D,)


def test_l1_eviction_demotes_or_deletes_states_with_their_pages() -> None:
    cache = make_hybrid(device_pages=2)
    hybrid_request(cache, (1, 2))
    drain(cache)
    cache.evict(2)
    assert cache.residency((1, 2)) == (H, H)
    assert cache.state_residency((1, 2)) == (None, H)
    result = cache.match_prefix((1, 2))
    assert (result.device_pages, result.host_pages) == (0, 2)
    cache.evict_host(2)
    assert cache.residency((1, 2)) == ()
    assert cache.host_state.used_count == 0


def pages_of(tokens: tuple[int, ...]) -> tuple[PageHash, ...]:
    return chain_page_hashes(tokens, 1, DEFAULT_NAMESPACE)


def test_backup_writes_every_pool_and_a_missing_side_object_is_a_miss() -> None:
    cache = make_hybrid()
    hybrid_request(cache, (1, 2, 3, 4))
    hybrid_request(cache, (1, 2))  # a second state, at page 2
    drain(cache)
    pages = pages_of((1, 2, 3, 4))
    for index, page in enumerate(pages):
        assert cache.store.contains(KEYS.key(DEFAULT_NAMESPACE, "indexer", "idx", page))
        has_state = index in (1, 3)
        for component in ("conv0", "temporal"):
            key = KEYS.key(DEFAULT_NAMESPACE, "mamba", component, page)
            assert cache.store.contains(key) is has_state
    assert cache.l3_exists((1, 2, 3, 4)) == 4
    cache.store_evict(KEYS.key(DEFAULT_NAMESPACE, "indexer", "idx", pages[2]))
    assert cache.l3_exists((1, 2, 3, 4)) == 2  # usable only up to the state before the hole
    cache.store_evict(KEYS.key(DEFAULT_NAMESPACE, "mamba", "temporal", pages[1]))
    assert cache.l3_exists((1, 2, 3, 4)) == 0


def test_schema_2_stores_each_side_entry_as_one_object() -> None:
    """Under key schema 2 an indexer page and a Mamba state are one ``page`` object each (issue
    20): nothing is written under the per-component keys, losing that one object is a miss, and
    I1 refuses a side key naming a component the schema does not store."""
    keys = attrs.evolve(KEYS, schema=2)
    cache = make_hybrid(keys=keys)
    hybrid_request(cache, (1, 2, 3, 4))
    drain(cache)
    pages = pages_of((1, 2, 3, 4))
    for index, page in enumerate(pages):
        assert cache.store.contains(keys.key(DEFAULT_NAMESPACE, "indexer", "page", page))
        assert not cache.store.contains(keys.key(DEFAULT_NAMESPACE, "indexer", "idx", page))
        for component in ("conv0", "temporal"):
            key = keys.key(DEFAULT_NAMESPACE, "mamba", component, page)
            assert not cache.store.contains(key)
        state = keys.key(DEFAULT_NAMESPACE, "mamba", "page", page)
        assert cache.store.contains(state) is (index == 3)
    assert sum(1 for _ in cache.store.visible_items()) == 4 + 4 + 1  # KV, indexer, one state
    assert cache.l3_exists((1, 2, 3, 4)) == 4
    cache.store_evict(keys.key(DEFAULT_NAMESPACE, "mamba", "page", pages[3]))
    assert cache.l3_exists((1, 2, 3, 4)) == 0
    stray = keys.key(DEFAULT_NAMESPACE, "mamba", "temporal", pages[0])  # a schema-1 component
    assert cache.store.begin_put(stray)
    cache.store.end_put(stray, (pages[0], "temporal"))
    with pytest.raises(InvariantViolation, match="I1"):
        check_i1_keys(cache)


@pytest.mark.parametrize("schema", [1, 2])
def test_side_pools_with_a_layout_write_under_it_and_i1_refuses_another(schema: int) -> None:
    """A side pool with a layout token keeps every object under ``name.layout``; a key of the same
    pool name under another layout (a deployment whose entries are laid out differently) lies
    outside this cache's key space (I1), and its objects never count as this cache's hits."""
    keys = attrs.evolve(KEYS, schema=schema)
    mamba = attrs.evolve(MAMBA, layout="5eed")
    cache = make_hybrid(keys=keys, side_pools=(INDEXER, mamba))
    hybrid_request(cache, (1, 2, 3, 4))
    drain(cache)
    pages = pages_of((1, 2, 3, 4))
    state_keys = side_page_keys(keys, DEFAULT_NAMESPACE, mamba, pages[3])
    assert all(cache.store.contains(key) for key in state_keys)
    assert {parse_store_key(key).pool for key in state_keys} == {"mamba.5eed"}
    assert not any(
        cache.store.contains(key)
        for key in side_page_keys(keys, DEFAULT_NAMESPACE, MAMBA, pages[3])
    )
    check_i1_keys(cache)
    assert cache.l3_exists((1, 2, 3, 4)) == 4
    other = attrs.evolve(MAMBA, layout="f00d")
    for key in side_page_keys(keys, DEFAULT_NAMESPACE, other, pages[1]):
        assert cache.store.begin_put(key)
        cache.store.end_put(key, key.text)
    with pytest.raises(InvariantViolation, match="I1"):
        check_i1_keys(cache)


def test_prefetch_reads_the_state_after_the_kv_range_and_commits_it_on_l2() -> None:
    source = make_hybrid()
    hybrid_request(source, (1, 2, 3, 4))
    hybrid_request(source, (1, 2))
    drain(source)
    target = make_hybrid(source.store)
    op_id = target.prefetch((1, 2, 3, 4))
    assert op_id is not None
    op = target.prefetch_ops[op_id]
    assert len(op.pages) == 4 and op.state_slot is not None
    # the state of the last page vanishes after the reservation: the read falls back to page 2
    source.store_evict(KEYS.key(DEFAULT_NAMESPACE, "mamba", "conv0", pages_of((1, 2, 3, 4))[3]))
    assert target.prefetch_arrive(op_id, 4) == 2
    assert op.state_page == pages_of((1, 2))[1] and op.state is PrefetchState.COMPLETE
    assert target.prefetch_commit(op_id) == 2
    assert target.residency((1, 2, 3, 4)) == (H, H)
    assert target.state_residency((1, 2)) == (None, H)
    result = target.match_prefix((1, 2, 3, 4))
    assert (result.device_pages, result.host_pages) == (0, 2)
    assert target.host.used_count == 2 and target.host_state.used_count == 1
    assert target.load_back(result.host_node) is not None
    target.ack_load()
    assert target.match_prefix((1, 2)).device_pages == 2


def test_prefetch_never_reserves_a_page_whose_indexer_object_is_missing() -> None:
    source = make_hybrid()
    hybrid_request(source, (1, 2))
    hybrid_request(source, (1, 2, 3, 4))
    drain(source)
    source.store_evict(KEYS.key(DEFAULT_NAMESPACE, "indexer", "idx", pages_of((1, 2, 3))[2]))
    target = make_hybrid(source.store)
    op_id = target.prefetch((1, 2, 3, 4))
    assert op_id is not None
    assert len(target.prefetch_ops[op_id].pages) == 2  # KV hit 4, usable 2
    target.prefetch_abort(op_id)  # still loading: the slots stay held until the drain
    assert target.host.used_count == 2 and target.host_state.used_count == 1
    target.prefetch_drain(op_id)
    assert target.host.used_count == target.host_state.used_count == 0


def test_an_impossible_alloc_is_refused_before_anything_is_evicted() -> None:
    """Issue 17: asking for more L1 pages than free + evictable evicts nothing."""
    cache = make(write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE)
    request(cache, (1, 2, 3, 4, 5, 6))  # 6 of 8 pages cached, unlocked
    before = (repr(cache.page_info), cache.device.allocated())
    with pytest.raises(CapacityError):
        cache.alloc_device(9)  # more than L1 holds
    assert (repr(cache.page_info), cache.device.allocated()) == before
    assert cache.match_prefix((1, 2, 3, 4, 5, 6)).device_pages == 6
    assert len(cache.alloc_device(8)) == 8  # a possible ask still evicts what it needs


class _Index:
    """An integer type that is not an ``int`` (as numpy's are): it has ``__index__``."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def test_page_counts_take_any_integer_type_never_a_bool_or_a_negative() -> None:
    cache = make()
    assert len(cache.alloc_device(_Index(2))) == 2  # type: ignore[arg-type]
    assert cache.evict(_Index(0)) == 0  # type: ignore[arg-type]
    assert cache.evict_host(_Index(0)) == 0  # type: ignore[arg-type]
    for bad in (True, -1, 1.0, "1", None):
        for verb in (cache.alloc_device, cache.evict, cache.evict_host):
            with pytest.raises(MisuseError, match="pages must be an int"):
                verb(bad)  # type: ignore[arg-type]
