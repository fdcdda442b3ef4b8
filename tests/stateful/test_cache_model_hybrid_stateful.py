"""The cache model with hybrid side pools (SPEC §5), driven by Hypothesis: an ``ALL_PAGES`` indexer
pool and a ``TRAILING_PAGES`` Mamba pool (``conv0`` + ``temporal``) next to the KV, on two cache
instances that share one L3 store. Rules: insert with or without a state, match (splits), lock,
ack/fail copies, evict L1/L2, evict_state, load-back, backup, store eviction of a chosen KV, indexer or
state object, prefetch / arrive / commit / abort / drain, and misuse.

Oracles that do not trust the model's reporting code:
* match: the reported L1 prefix is recomputed from the per-page residencies: the deepest page of the
  leading L1-valid run whose state is valid on L1; the L2 continuation likewise on L2. The L1 slots and
  the state slot a match returns hold exactly the recomputed page / state identities;
* prefetch: the reserved pages are exactly the usable L3 prefix, recomputed here by rendering every key
  through the key space (KV, indexer, and the state at the last page); pages and the state that
  ``prefetch_arrive`` reports read hold objects that are in the store right then;
* L3 coverage: after draining, every prefix an instance can serve from L2 (pages and end state) is
  servable from L3, unless the test evicted one of its objects;
* misuse raises a typed error and leaves the model exactly as it was.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import event, note, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from support.running import keep_running

from kvstrata.model.cache import DEVICE_VALID, HOST_VALID, CacheConfig, CacheModel, WritePolicy
from kvstrata.model.errors import CapacityError, IllegalTransition, MisuseError
from kvstrata.model.hybrid import HitPolicy, SidePool
from kvstrata.model.invariants import check_cache
from kvstrata.model.keys import (
    DEFAULT_NAMESPACE,
    SCHEMA_VERSIONS,
    KeySpace,
    KVKind,
    ModelIdentity,
    Namespace,
    PageHash,
    StoreKey,
    chain_page_hashes,
    parse_store_key,
)
from kvstrata.model.l3.prefetch import PrefetchOp, PrefetchPolicy
from kvstrata.model.lifecycles import BackupState, PrefetchState, Residency
from kvstrata.model.store import StoreModel

NAMESPACES = (DEFAULT_NAMESPACE, Namespace(extra_key="lora-1"))
INDEXER = SidePool("indexer", HitPolicy.ALL_PAGES, ("idx",))
MAMBA = SidePool("mamba", HitPolicy.TRAILING_PAGES, ("conv0", "temporal"))
fresh_tokens = st.lists(st.integers(1, 3), max_size=6).map(tuple)


@st.composite
def related_tokens(draw: st.DrawFn, known: list[tuple[int, ...]]) -> tuple[int, ...]:
    """Often a prefix of (or a branch off) a sequence inserted before, so matches split nodes."""
    if known and draw(st.booleans()):
        base = draw(st.sampled_from(known))
        cut = draw(st.integers(0, len(base)))
        tail = draw(st.lists(st.integers(1, 3), max_size=3))
        return (*base[:cut], *tail)[:8]
    return draw(fresh_tokens)


def snapshot(cache: CacheModel) -> tuple[object, ...]:
    """Everything observable about one instance, for 'misuse changes nothing' checks."""
    nodes = tuple(
        sorted(
            (n.node_id, n.parent_id, n.tokens, n.pins, n.lock_ref, n.last_access, n.hits)
            for n in cache.tree.nodes.values()
        )
    )
    pages = tuple(sorted((p.hex(), repr(i)) for p, i in cache.page_info.items()))
    states = tuple(sorted((p.hex(), repr(i)) for p, i in cache.state_info.items()))
    ops = (
        repr(list(cache.write_ops)),
        repr(list(cache.load_ops)),
        repr(cache.backup_ops),
        repr(cache.prefetch_ops),
    )
    pools = tuple(
        (pool.allocated(), tuple(pool.peek(s) for s in sorted(pool.allocated())))
        for pool in (cache.device, cache.host, cache.device_state, cache.host_state)
    )
    held = (frozenset(cache.scheduler_slots), frozenset(cache.scheduler_state_slots))
    return (nodes, pages, states, ops, pools, held, cache.store.visible_items(), cache.clock)


def leading(flags: list[bool]) -> int:
    count = 0
    while count < len(flags) and flags[count]:
        count += 1
    return count


class HybridCacheMachine(RuleBasedStateMachine):
    """Subclasses fix the write policies drawn from, so write-through (the path to L2 and L3)
    gets a share of its own."""

    policies: st.SearchStrategy[WritePolicy] = st.sampled_from(WritePolicy)

    def __init__(self) -> None:
        super().__init__()
        self.caches: list[CacheModel] = []

    @initialize(
        data=st.data(),
        page_size=st.integers(1, 2),
        device_pages=st.integers(4, 8),
        host_pages=st.integers(4, 10),
        device_states=st.integers(1, 3),
        host_states=st.integers(1, 3),
        mla=st.booleans(),
        prefetch_policy=st.sampled_from(PrefetchPolicy),
    )
    def setup(  # noqa: PLR0917 (Hypothesis passes rule arguments by keyword)
        self,
        data: st.DataObject,
        page_size: int,
        device_pages: int,
        host_pages: int,
        device_states: int,
        host_states: int,
        mla: bool,
        prefetch_policy: PrefetchPolicy,
    ) -> None:
        policy = data.draw(self.policies, label="write policy")
        kind = KVKind.MLA if mla else KVKind.MHA
        self.keys = KeySpace(
            ModelIdentity("tiny", "bf16", kind, page_size=page_size),
            schema=data.draw(st.sampled_from(SCHEMA_VERSIONS), label="key_schema"),
        )
        config = CacheConfig(
            page_size=page_size,
            device_pages=device_pages,
            host_pages=host_pages,
            write_policy=policy,
            write_through_threshold=2,
            load_back_quota=data.draw(st.sampled_from([None, 2, 4]), label="quota"),
            prefetch_threshold=page_size,
            prefetch_policy=prefetch_policy,
            keys=self.keys,
            side_pools=(INDEXER, MAMBA),
            device_states=device_states,
            host_states=host_states,
        )
        store = StoreModel()
        self.caches = [CacheModel(config, store), CacheModel(config, store)]
        self.store = store
        self.page_size = page_size
        self.inserted: list[set[tuple[Namespace, tuple[int, ...]]]] = [set(), set()]
        self.locked: list[list[int]] = [[], []]
        self.evicted_pages: set[bytes] = set()
        self.known: list[tuple[int, ...]] = []

    # ------------------------------------------------------------ helpers
    def pick(self, data: st.DataObject) -> tuple[int, CacheModel]:
        index = data.draw(st.integers(0, 1), label="instance")
        return index, self.caches[index]

    def draw_tokens(self, data: st.DataObject) -> tuple[tuple[int, ...], Namespace]:
        tokens = data.draw(related_tokens(self.known), label="tokens")
        return tokens, data.draw(st.sampled_from(NAMESPACES), label="namespace")

    def pages_of(self, tokens: tuple[int, ...], ns: Namespace) -> tuple[PageHash, ...]:
        return chain_page_hashes(tokens, self.page_size, ns)

    def side_objects(self, *components: str) -> tuple[str, ...]:
        """What a side entry is stored as, restated for the oracle: one object per component
        under key schema 1, the one ``page`` object (every component's bytes) under schema 2."""
        return components if self.keys.schema == 1 else ("page",)

    def kv_keys(self, ns: Namespace, page: PageHash) -> list[StoreKey]:
        return [
            *self.keys.page_keys(ns, page),
            *(self.keys.key(ns, "indexer", c, page) for c in self.side_objects("idx")),
        ]

    def state_keys(self, ns: Namespace, page: PageHash) -> list[StoreKey]:
        return [self.keys.key(ns, "mamba", c, page) for c in self.side_objects("conv0", "temporal")]

    def present(self, keys: list[StoreKey]) -> bool:
        return all(self.store.contains(key) for key in keys)

    def usable_in_l3(self, ns: Namespace, pages: tuple[PageHash, ...]) -> int:
        """The usable L3 prefix by brute force: KV and indexer on every page, state at the last."""
        run = leading([self.present(self.kv_keys(ns, page)) for page in pages])
        return max(
            (n for n in range(1, run + 1) if self.present(self.state_keys(ns, pages[n - 1]))),
            default=0,
        )

    def expected_match(
        self, cache: CacheModel, tokens: tuple[int, ...], ns: Namespace
    ) -> tuple[int, int]:
        """The prefix match must report, from the per-page residencies alone."""
        pages = cache.residency(tokens, ns)
        states = cache.state_residency(tokens, ns)
        run = leading([state in DEVICE_VALID for state in pages])
        device = max((n for n in range(1, run + 1) if states[n - 1] in DEVICE_VALID), default=0)
        run = leading([state in HOST_VALID for state in pages[device:]])
        host = max(
            (n for n in range(1, run + 1) if states[device + n - 1] in HOST_VALID), default=0
        )
        return device, host

    def checked_match(self, cache: CacheModel, tokens: tuple[int, ...], ns: Namespace) -> object:
        nodes_before = len(cache.tree.nodes)
        result = cache.match_prefix(tokens, ns)
        device, host = self.expected_match(cache, tokens, ns)
        assert (result.device_pages, result.host_pages) == (device, host), (result, device, host)
        pages = self.pages_of(tokens, ns)
        assert cache.device_content(result.device_slots) == pages[:device]
        if device:
            assert result.device_state_slot is not None
            assert cache.device_state.read(result.device_state_slot) == ("state", pages[device - 1])
        else:
            assert result.device_state_slot is None
        kv_run = leading([s in DEVICE_VALID for s in cache.residency(tokens, ns)])
        if kv_run > device:
            event("L1 prefix cut back to a state")
            if len(cache.tree.nodes) > nodes_before:
                event("split below a state")
        return result

    # ------------------------------------------------------------ scheduler rules
    def schedule(
        self, cache: CacheModel, tokens: tuple[int, ...], ns: Namespace, with_state: bool
    ) -> bool:
        """match, lock, take fresh L1 pages (and a state slot), compute, insert, unlock."""
        result = cache.match_prefix(tokens, ns)
        pages = self.pages_of(tokens, ns)
        locked = not cache.tree.nodes[result.device_node].is_root
        if locked:
            cache.lock(result.device_node)
        done = False
        try:
            fresh = cache.alloc_device(len(pages) - result.device_pages)
        except CapacityError:
            event("request refused: L1 full of locked pages")
            fresh = None
        if fresh is not None:
            state_slot = None
            if with_state and pages:
                try:
                    state_slot = cache.alloc_device_state()
                except CapacityError:
                    event("no L1 state slot for a request")
                if state_slot is not None:
                    cache.write_device_state(state_slot, cache.state_content(pages[-1]))
            for slot, page in zip(fresh, pages[result.device_pages :], strict=True):
                cache.write_device(slot, page)
            inserted = cache.insert(tokens, ns, result.device_slots + fresh, state_slot=state_slot)
            if state_slot is not None and not inserted.state_kept:
                event("insert gave the state slot back")
            done = True
        if locked:
            cache.unlock(result.device_node)
        return done

    @rule(data=st.data(), with_state=st.sampled_from([True, True, True, False]))
    def insert(self, data: st.DataObject, with_state: bool) -> None:
        index, cache = self.pick(data)
        tokens, ns = self.draw_tokens(data)
        if self.schedule(cache, tokens, ns, with_state):
            self.inserted[index].add((ns, tokens))
            if tokens not in self.known:
                self.known.append(tokens)
            keep_running(data, cache, self.locked[index], tokens, ns)

    @rule(data=st.data())
    def insert_and_write_through(self, data: st.DataObject) -> None:
        """A request with its state whose write-throughs complete at once (more L2 and L3)."""
        self.insert(data, with_state=True)
        for cache in self.caches:
            while cache.write_ops:
                if cache.write_ops[0].states:
                    event("write-through carries a state")
                    if not cache.write_ops[0].pages:
                        event("state-only write-through")
                cache.ack_write()

    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        _, cache = self.pick(data)
        self.checked_match(cache, *self.draw_tokens(data))

    @rule(data=st.data())
    def lock(self, data: st.DataObject) -> None:
        index, cache = self.pick(data)
        node = cache.match_prefix(*self.draw_tokens(data)).device_node
        if not cache.tree.nodes[node].is_root:
            cache.lock(node)
            self.locked[index].append(node)

    @precondition(lambda self: any(self.locked))
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        index = 0 if self.locked[0] else 1
        node = data.draw(st.sampled_from(self.locked[index]))
        self.locked[index].remove(node)
        self.caches[index].unlock(node)

    @rule(data=st.data(), pages=st.integers(0, 4), host=st.booleans())
    def evict(self, data: st.DataObject, pages: int, host: bool) -> None:
        _, cache = self.pick(data)
        if host:
            cache.evict_host(pages)
        else:
            cache.evict(pages)

    @precondition(lambda self: any(c.state_info for c in self.caches))
    @rule(data=st.data(), host=st.booleans())
    def evict_state(self, data: st.DataObject, host: bool) -> None:
        """Drop one state without touching KV; a match of its prefix then reports no more."""
        _, cache = self.pick(data)
        ends = sorted(
            (node.node_id, node)
            for node in cache.tree.non_root_nodes()
            if node.pages[-1] in cache.state_info
        )
        if not ends:
            return
        node_id, node = data.draw(st.sampled_from(ends))
        tokens = cache.tree.prefix_tokens(node)
        before = cache.match_prefix(tokens, node.namespace)  # may start a write-through (selective)
        info = cache.state_info[node.pages[-1]]
        allowed = (Residency.BOTH, Residency.HOST) if host else (Residency.DEVICE, Residency.BOTH)
        ok = info.residency in allowed and not node.lock_ref and not (host and info.host_pins)
        if not ok:
            snap = snapshot(cache)
            try:
                cache.evict_state(node_id, host=host)
            except MisuseError:
                event("misuse evict_state rejected")
            else:
                raise AssertionError("evict_state of a busy or absent state was accepted")
            assert snapshot(cache) == snap
            return
        cache.evict_state(node_id, host=host)
        left = cache.state_info.get(node.pages[-1])
        assert left is None or left.residency not in (HOST_VALID if host else DEVICE_VALID)
        after = self.checked_match(cache, tokens, node.namespace)
        assert after.device_pages <= before.device_pages  # type: ignore[attr-defined]
        if (after.device_pages, after.host_pages) != (before.device_pages, before.host_pages):  # type: ignore[attr-defined]
            event("state evicted, match reported less")
        if after.host_pages and cache.load_back(after.host_node) is not None:  # type: ignore[attr-defined]
            event("load-back of a dropped state started")
            if not cache.load_ops[-1].pages:
                event("state-only load-back started")

    @rule(data=st.data())
    def load_back(self, data: st.DataObject) -> None:
        index, cache = self.pick(data)
        if self.inserted[index] and data.draw(st.booleans()):
            ns, tokens = data.draw(st.sampled_from(sorted(self.inserted[index], key=repr)))
        else:
            tokens, ns = self.draw_tokens(data)
        cache.evict(data.draw(st.integers(0, 3), label="L1 pages evicted first"))
        result = cache.match_prefix(tokens, ns)
        if result.host_pages and cache.load_back(result.host_node) is not None:
            if not cache.load_ops[-1].pages:
                event("state-only load-back started")
            else:
                event("load-back started")

    # ------------------------------------------------------------ background completion
    @precondition(lambda self: any(c.write_ops or c.load_ops for c in self.caches))
    @rule(data=st.data(), fail=st.sampled_from([False, False, False, True]))
    def ack_copy(self, data: st.DataObject, fail: bool) -> None:
        cache = data.draw(st.sampled_from([c for c in self.caches if c.write_ops or c.load_ops]))
        if cache.write_ops and (not cache.load_ops or data.draw(st.booleans())):
            if cache.write_ops[0].states:
                event("write-through carries a state")
            (cache.fail_write if fail else cache.ack_write)()
        else:
            (cache.fail_load if fail else cache.ack_load)()

    @precondition(lambda self: any(c.backup_ops for c in self.caches))
    @rule(data=st.data(), fail=st.booleans())
    def backup_step(self, data: st.DataObject, fail: bool) -> None:
        cache = data.draw(st.sampled_from([c for c in self.caches if c.backup_ops]))
        if any(op.state is BackupState.IN_FLIGHT for op in cache.backup_ops):
            if fail:
                cache.fail_backup()
            else:
                cache.ack_backup()
        else:
            cache.start_backup()

    @precondition(lambda self: self.caches and len(self.store) > 0)
    @rule(data=st.data(), pool=st.sampled_from(["kv", "indexer", "mamba"]))
    def store_evicts_object(self, data: st.DataObject, pool: str) -> None:
        """The store drops one object on its own, preferably of the pool asked for."""
        items = [k for k, _ in self.store.visible_items() if parse_store_key(k).pool == pool]
        if not items:
            items = [k for k, _ in self.store.visible_items()]
        key = data.draw(st.sampled_from(items))
        self.evicted_pages.add(parse_store_key(key).page_hash.digest)
        self.caches[0].store_evict(key)

    # ------------------------------------------------------------ prefetch
    def start_prefetch(
        self, cache: CacheModel, tokens: tuple[int, ...], ns: Namespace
    ) -> int | None:
        op_id = cache.prefetch(tokens, ns)
        if op_id is None:
            return None
        op = cache.prefetch_ops[op_id]
        rest = self._continuation(op)
        usable = self.usable_in_l3(ns, rest)
        assert len(op.pages) == usable, (len(op.pages), usable)
        kv_only = self.store.exists_pages(self.keys.page_keys(ns, page) for page in rest)
        if kv_only > usable:
            event("prefetch cut by a missing side object")
        event("prefetch started")
        return op_id

    def _continuation(self, op: PrefetchOp) -> tuple[PageHash, ...]:
        """The op's reserved pages, recomputed from the request's tokens."""
        tokens = (*op.prefix_tokens, *(t for page in op.page_tokens for t in page))
        pages = self.pages_of(tokens, op.namespace)[len(op.prefix_tokens) // self.page_size :]
        assert pages == op.pages
        return pages

    @rule(data=st.data())
    def prefetch(self, data: st.DataObject) -> None:
        _, cache = self.pick(data)
        tokens, ns = self.draw_tokens(data)
        self.start_prefetch(cache, tokens, ns)

    @precondition(lambda self: any(self.inserted))
    @rule(
        data=st.data(),
        lose=st.sampled_from([None, None, "indexer", "mamba"]),
        lose_late=st.booleans(),
        commit=st.booleans(),
    )
    def share_through_l3(
        self, data: st.DataObject, lose: str | None, lose_late: bool, commit: bool
    ) -> None:
        """One instance finishes its backups; the other prefetches what it inserted (SPEC §10)
        and may commit at once. The store may lose one side object of those pages before the
        prefetch asks, or after it reserved its pages (then the read finds it missing)."""
        source = data.draw(st.sampled_from([i for i in (0, 1) if self.inserted[i]]))
        self._drain()
        held = sorted(self.inserted[source], key=repr)
        on_l2 = [
            (ns, tokens)
            for ns, tokens in held
            if any(state in HOST_VALID for state in self.caches[source].state_residency(tokens, ns))
        ]
        ns, tokens = data.draw(st.sampled_from(on_l2 or held))
        if lose is not None and not lose_late:
            self.lose_object(data, ns, self.pages_of(tokens, ns), lose)
        tail = data.draw(st.lists(st.integers(1, 3), max_size=2))
        target = self.caches[1 - source]
        op_id = self.start_prefetch(target, (*tokens, *tail), ns)
        if op_id is None:
            return
        event("prefetch of pages another instance backed up")
        if lose is not None and lose_late:
            self.lose_object(data, ns, target.prefetch_ops[op_id].pages, lose)
        arrive = data.draw(st.integers(0, 4), label="pages arriving at once")
        if arrive:
            self.arrive(target, op_id, arrive)
        if commit:
            op = target.prefetch_ops[op_id]
            state_page = op.state_page
            added = target.prefetch_commit(op_id)
            if added and state_page is not None and state_page in target.state_info:
                event("prefetch committed pages with their state")

    def lose_object(
        self, data: st.DataObject, ns: Namespace, pages: tuple[PageHash, ...], pool: str
    ) -> None:
        """The store drops the indexer object or one state component of one of ``pages``."""
        if not pages:
            return
        page = data.draw(st.sampled_from(pages), label="page losing an object")
        key = self.state_keys(ns, page)[0] if pool == "mamba" else self.kv_keys(ns, page)[-1]
        if self.store.contains(key):
            self.evicted_pages.add(page.digest)
            self.caches[0].store_evict(key)

    def _pick_prefetch(
        self, data: st.DataObject, *states: PrefetchState
    ) -> tuple[CacheModel, int] | None:
        ops = [
            (index, op_id)
            for index, cache in enumerate(self.caches)
            for op_id, op in sorted(cache.prefetch_ops.items())
            if op.state in states
        ]
        if not ops:
            return None
        index, op_id = data.draw(st.sampled_from(ops))
        return self.caches[index], op_id

    def arrive(self, cache: CacheModel, op_id: int, pages: int) -> None:
        """Read more pages; what was reported read must be in the store now (it cannot change
        within the call)."""
        op = cache.prefetch_ops[op_id]
        before = op.arrived
        cut_before = op.limit
        cache.prefetch_arrive(op_id, pages)
        for index in range(before, op.arrived):
            assert self.present(self.kv_keys(op.namespace, op.pages[index])), index
        if op.state_page is not None:
            assert op.arrived and op.state_page == op.pages[op.arrived - 1]
            assert self.present(self.state_keys(op.namespace, op.state_page))
        if op.state is PrefetchState.COMPLETE and op.limit < cut_before:
            event("prefetch cut by a missing side object")

    @precondition(lambda self: any(c.prefetch_ops for c in self.caches))
    @rule(data=st.data(), pages=st.integers(1, 3))
    def prefetch_arrive(self, data: st.DataObject, pages: int) -> None:
        picked = self._pick_prefetch(data, PrefetchState.LOADING)
        if picked is not None:
            self.arrive(picked[0], picked[1], pages)

    @precondition(lambda self: any(c.prefetch_ops for c in self.caches))
    @rule(data=st.data(), abort=st.booleans())
    def prefetch_finish(self, data: st.DataObject, abort: bool) -> None:
        picked = self._pick_prefetch(data, PrefetchState.LOADING, PrefetchState.COMPLETE)
        if picked is None:
            return
        cache, op_id = picked
        if abort:
            cache.prefetch_abort(op_id)
        elif not cache.prefetch_ready(op_id):
            event("scheduler keeps waiting for a prefetch")
        else:
            op = cache.prefetch_ops[op_id]
            state_page = op.state_page
            added = cache.prefetch_commit(op_id)
            if added and state_page is not None and state_page in cache.state_info:
                event("prefetch committed pages with their state")

    @precondition(lambda self: any(c.prefetch_ops for c in self.caches))
    @rule(data=st.data())
    def prefetch_drain(self, data: st.DataObject) -> None:
        picked = self._pick_prefetch(data, PrefetchState.CANCELLING)
        if picked is not None:
            picked[0].prefetch_drain(picked[1])

    @rule(steps=st.integers(1, 8))
    def tick(self, steps: int) -> None:
        for cache in self.caches:
            cache.tick(steps)

    # ------------------------------------------------------------ oracles
    def _drain(self) -> None:
        while any(c.write_ops or c.backup_ops for c in self.caches):
            for cache in self.caches:
                while cache.write_ops:
                    cache.ack_write()
                if any(op.state is BackupState.IN_FLIGHT for op in cache.backup_ops):
                    cache.ack_backup()
                elif cache.backup_ops:
                    cache.start_backup()

    @rule()
    def drain_and_check_l3(self) -> None:
        """Finish every write-through and backup; then every prefix an instance can serve from L2
        (pages and the state at its end valid there) is servable from L3, unless the test evicted
        one of its objects."""
        self._drain()
        for index, cache in enumerate(self.caches):
            for ns, tokens in sorted(self.inserted[index], key=repr):
                pages = self.pages_of(tokens, ns)
                residency = cache.residency(tokens, ns)
                states = cache.state_residency(tokens, ns)
                run = leading(
                    [
                        state in HOST_VALID and page.digest not in self.evicted_pages
                        for state, page in zip(residency, pages, strict=False)
                    ]
                )
                held = max((n for n in range(1, run + 1) if states[n - 1] in HOST_VALID), default=0)
                exists = cache.l3_exists(tokens, ns)
                note(f"instance {index} {tokens} {ns}: L2-usable {held}, L3 {exists}")
                assert exists >= held, f"L3 lost a usable prefix of {tokens}: {exists} < {held}"
                if held:
                    event("L3 coverage checked on a usable prefix")

    # ------------------------------------------------------------ misuse: typed error, no change
    @rule(
        data=st.data(),
        bad=st.sampled_from(
            [
                "evict_state_none",
                "evict_state_root",
                "state_slot_foreign",
                "state_slot_empty_tokens",
                "write_state_foreign",
                "free_state_foreign",
                "store_evict_text",
                "evict_state_node",
            ]
        ),
    )
    def misuse(self, data: st.DataObject, bad: str) -> None:
        _, cache = self.pick(data)
        held = None
        if bad == "state_slot_empty_tokens":
            try:
                held = cache.alloc_device_state()
            except CapacityError:
                return
        before = snapshot(cache)
        foreign = 10**6
        if bad == "evict_state_none":
            stateless = [
                n for n in cache.tree.non_root_nodes() if n.pages[-1] not in cache.state_info
            ]
            if not stateless:
                return
            node_id = stateless[0].node_id
            call = lambda: cache.evict_state(node_id, host=data.draw(st.booleans()))  # noqa: E731
        elif bad == "evict_state_root":
            root = cache.tree.root(DEFAULT_NAMESPACE).node_id
            before = snapshot(cache)  # root() may have created the root
            call = lambda: cache.evict_state(root)  # noqa: E731
        elif bad == "evict_state_node":
            call = lambda: cache.evict_state(foreign)  # noqa: E731
        elif bad == "state_slot_foreign":
            tokens = tuple(range(100, 100 + self.page_size))  # a page the tree never holds
            try:
                slots = cache.alloc_device(1)
            except CapacityError:
                return
            before = snapshot(cache)
            call = lambda: cache.insert(tokens, DEFAULT_NAMESPACE, slots, state_slot=foreign)  # noqa: E731
        elif bad == "state_slot_empty_tokens":
            call = lambda: cache.insert((), DEFAULT_NAMESPACE, (), state_slot=held)  # noqa: E731
        elif bad == "write_state_foreign":
            call = lambda: cache.write_device_state(foreign, ("state", None))  # noqa: E731
        elif bad == "free_state_foreign":
            call = lambda: cache.free_device_state(foreign)  # noqa: E731
        else:
            call = lambda: cache.store_evict("kvs1/not-a-key")  # type: ignore[arg-type]  # noqa: E731
        try:
            call()
        except (MisuseError, IllegalTransition):
            event(f"misuse {bad} rejected")
        else:
            raise AssertionError(f"{bad} misuse was accepted")
        assert snapshot(cache) == before, f"{bad} misuse changed the model"
        if held is not None:
            cache.free_device_state(held)
        if bad == "state_slot_foreign":
            cache.free_device(slots)

    @invariant()
    def invariants_hold(self) -> None:
        for cache in self.caches:
            check_cache(cache)


class HybridWriteThroughMachine(HybridCacheMachine):
    policies = st.just(WritePolicy.WRITE_THROUGH)


STEPS = settings(stateful_step_count=60)
TestHybridCacheModel = HybridCacheMachine.TestCase
TestHybridCacheModel.settings = STEPS
TestHybridWriteThrough = HybridWriteThroughMachine.TestCase
TestHybridWriteThrough.settings = STEPS
