"""The cache model alone, driven by Hypothesis: insert / match (splits) / ack / backup / exists /
evict / load-back / prefetch / abort / lock on two cache instances that share one L3 store, with the
model's invariants and independent oracles checked after every step.

Oracles that do not trust the model:
* bytes: every L1 slot a match returns holds the page hash of exactly that prefix (recomputed here);
* L3 coverage: after everything pending is drained, every page an instance holds on L2 exists in L3,
  unless the test itself evicted one of its objects from the store;
* misuse raises a typed error and leaves the model exactly as it was.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import event, note, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from support.running import keep_running

from kvstrata.model.cache import HOST_VALID, CacheConfig, CacheModel, WritePolicy
from kvstrata.model.errors import CapacityError, IllegalTransition, MisuseError
from kvstrata.model.invariants import check_cache
from kvstrata.model.keys import (
    DEFAULT_NAMESPACE,
    SCHEMA_VERSIONS,
    KeySpace,
    KVKind,
    ModelIdentity,
    Namespace,
    PageHash,
    chain_page_hashes,
    parse_store_key,
)
from kvstrata.model.l3.policy import PrefetchPolicy
from kvstrata.model.lifecycles import BackupState, PrefetchState
from kvstrata.model.store import StoreModel

NAMESPACES = (DEFAULT_NAMESPACE, Namespace(extra_key="lora-1"))
fresh_tokens = st.lists(st.integers(1, 3), max_size=6).map(tuple)


@st.composite
def related_tokens(draw: st.DrawFn, known: list[tuple[int, ...]]) -> tuple[int, ...]:
    """A token sequence that often shares a prefix with one inserted before (so matches split
    nodes and load-backs and prefetches find something), else a fresh one."""
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
    ops = (
        repr(list(cache.write_ops)),
        repr(list(cache.load_ops)),
        repr(cache.backup_ops),
        repr(cache.prefetch_ops),
    )
    pools = (cache.device.allocated(), cache.host.allocated())
    return (nodes, pages, ops, pools, cache.store.visible_items(), cache.clock)


class CacheModelMachine(RuleBasedStateMachine):
    """Subclasses fix the write policy and the L2 sizes, so every policy gets its share."""

    policy = WritePolicy.WRITE_THROUGH
    host_sizes: st.SearchStrategy[int] = st.integers(2, 10)

    def __init__(self) -> None:
        super().__init__()
        self.caches: list[CacheModel] = []

    @initialize(
        data=st.data(),
        page_size=st.integers(1, 2),
        device_pages=st.integers(4, 8),
        mla=st.booleans(),
        prefetch_policy=st.sampled_from(PrefetchPolicy),
        quota=st.sampled_from([None, 2, 4]),
    )
    def setup(  # noqa: PLR0917 (Hypothesis passes rule arguments by keyword)
        self,
        data: st.DataObject,
        page_size: int,
        device_pages: int,
        mla: bool,
        prefetch_policy: PrefetchPolicy,
        quota: int | None,
    ) -> None:
        kind = KVKind.MLA if mla else KVKind.MHA
        config = CacheConfig(
            page_size=page_size,
            device_pages=device_pages,
            host_pages=data.draw(self.host_sizes, label="host_pages"),
            write_policy=self.policy,
            write_through_threshold=2,
            load_back_quota=quota,
            prefetch_threshold=page_size,
            prefetch_policy=prefetch_policy,
            keys=KeySpace(
                ModelIdentity("tiny", "bf16", kind, page_size=page_size),
                schema=data.draw(st.sampled_from(SCHEMA_VERSIONS), label="key_schema"),
            ),
        )
        store = StoreModel()
        self.caches = [CacheModel(config, store), CacheModel(config, store)]
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

    def expected_pages(self, tokens: tuple[int, ...], ns: Namespace) -> tuple[PageHash, ...]:
        return chain_page_hashes(tokens, self.page_size, ns)

    # ------------------------------------------------------------ scheduler rules
    def schedule(self, cache: CacheModel, tokens: tuple[int, ...], ns: Namespace) -> bool:
        """What a scheduler does for one request: match, lock the L1 prefix, take fresh L1 pages
        for the rest, compute their KV, insert, unlock. False if L1 had no room."""
        nodes_before = len(cache.tree.nodes)
        result = cache.match_prefix(tokens, ns)
        if len(cache.tree.nodes) > nodes_before + (nodes_before == 0):
            event("request split a node")
        pages = self.expected_pages(tokens, ns)
        locked = not cache.tree.nodes[result.device_node].is_root
        if locked:
            cache.lock(result.device_node)
        try:
            fresh = cache.alloc_device(len(pages) - result.device_pages)
        except CapacityError:
            event("request refused: L1 full of locked pages")
            fresh = None
        if fresh is not None:
            for slot, page in zip(fresh, pages[result.device_pages :], strict=True):
                cache.write_device(slot, page)
            inserted = cache.insert(tokens, ns, result.device_slots + fresh)
            if inserted.duplicate_pages:
                event("insert gave duplicate pages back")
            if inserted.revived_pages:
                event("insert revived host-only pages")
        if locked:
            cache.unlock(result.device_node)
        return fresh is not None

    @rule(data=st.data())
    def insert(self, data: st.DataObject) -> None:
        index, cache = self.pick(data)
        tokens, ns = self.draw_tokens(data)
        if self.schedule(cache, tokens, ns):
            self.inserted[index].add((ns, tokens))
            if tokens not in self.known:
                self.known.append(tokens)
            keep_running(data, cache, self.locked[index], tokens, ns)

    @rule(data=st.data(), pages=st.integers(0, 3))
    def aborted_request(self, data: st.DataObject, pages: int) -> None:
        """A request takes L1 pages and goes away before inserting."""
        _, cache = self.pick(data)
        try:
            slots = cache.alloc_device(pages)
        except CapacityError:
            return
        cache.free_device(slots)

    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        _, cache = self.pick(data)
        tokens, ns = self.draw_tokens(data)
        nodes_before = len(cache.tree.nodes)
        in_flight = bool(cache.write_ops)
        result = cache.match_prefix(tokens, ns)
        expected = self.expected_pages(tokens, ns)[: result.device_pages]
        assert cache.device_content(result.device_slots) == expected
        assert result.device_pages + result.host_pages <= len(tokens) // self.page_size
        if len(cache.tree.nodes) > nodes_before and in_flight:
            event("split while a write-through is in flight")

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

    @rule(data=st.data())
    def load_back(self, data: st.DataObject) -> None:
        _, cache = self.pick(data)
        result = cache.match_prefix(*self.draw_tokens(data))
        if result.host_pages and cache.load_back(result.host_node) is not None:
            event("load-back started")

    # ------------------------------------------------------------ background completion
    @precondition(lambda self: any(c.write_ops or c.load_ops for c in self.caches))
    @rule(data=st.data(), fail=st.sampled_from([False, False, False, True]))
    def ack_copy(self, data: st.DataObject, fail: bool) -> None:
        cache = data.draw(st.sampled_from([c for c in self.caches if c.write_ops or c.load_ops]))
        if fail:
            event("an L1/L2 copy failed")
        if cache.write_ops and (not cache.load_ops or data.draw(st.booleans())):
            (cache.fail_write if fail else cache.ack_write)()
        else:
            (cache.fail_load if fail else cache.ack_load)()

    @precondition(lambda self: any(c.backup_ops for c in self.caches))
    @rule(data=st.data(), fail=st.booleans())
    def backup_step(self, data: st.DataObject, fail: bool) -> None:
        cache = data.draw(st.sampled_from([c for c in self.caches if c.backup_ops]))
        if any(op.state is BackupState.IN_FLIGHT for op in cache.backup_ops):
            if fail:
                event("backup batch failed and was queued again")
                cache.fail_backup()
            else:
                cache.ack_backup()
        else:
            cache.start_backup()

    @precondition(lambda self: self.caches and len(self.caches[0].store) > 0)
    @rule(data=st.data())
    def store_evicts_object(self, data: st.DataObject) -> None:
        cache = self.caches[0]
        key, _ = data.draw(st.sampled_from(cache.store.visible_items()))
        self.evicted_pages.add(parse_store_key(key).page_hash.digest)
        cache.store_evict(key)

    # ------------------------------------------------------------ prefetch
    @rule(data=st.data())
    def prefetch(self, data: st.DataObject) -> None:
        _, cache = self.pick(data)
        if cache.prefetch(*self.draw_tokens(data)) is not None:
            event("prefetch started")

    @precondition(lambda self: any(self.inserted))
    @rule(data=st.data())
    def share_through_l3(self, data: st.DataObject) -> None:
        """One instance finishes its backups; the other prefetches what it inserted (SPEC §10)."""
        source = 0 if self.inserted[0] else 1
        ns, tokens = data.draw(st.sampled_from(sorted(self.inserted[source], key=repr)))
        self._drain()
        tail = data.draw(st.lists(st.integers(1, 3), max_size=2))
        target = self.caches[1 - source]
        op_id = target.prefetch((*tokens, *tail), ns)
        if op_id is not None:
            event("prefetch of pages another instance backed up")
            arrive = data.draw(st.integers(0, 3), label="pages arriving at once")
            if arrive:
                target.prefetch_arrive(op_id, arrive)

    @precondition(lambda self: any(self.inserted))
    @rule(data=st.data(), fail=st.booleans())
    def prefetch_onto_writing(self, data: st.DataObject, fail: bool) -> None:
        """One instance backs up a sequence; the other computes its first pages (under
        write_through their write-through is then in flight), prefetches the rest onto them and
        commits before that write lands; then the write lands or fails. The fuzz run's I3 find:
        a commit under a write that may still fail would leave a host-only leaf under an L1-only
        node, so the pages go back until the anchor's L2 copy is readable."""
        source = 0 if self.inserted[0] else 1
        ns, tokens = data.draw(st.sampled_from(sorted(self.inserted[source], key=repr)))
        pages = len(tokens) // self.page_size
        if pages < 2:
            return
        self._drain()
        index = 1 - source
        target = self.caches[index]
        cut = data.draw(st.integers(1, pages - 1), label="pages computed locally") * self.page_size
        if not self.schedule(target, tokens[:cut], ns):
            return
        self.inserted[index].add((ns, tokens[:cut]))
        op_id = target.prefetch(tokens, ns)
        if op_id is None:
            return
        target.prefetch_arrive(op_id, pages)
        writing = bool(target.write_ops)
        committed = target.prefetch_commit(op_id)
        if writing:
            event("prefetch committed while a write-through was in flight")
        elif committed:
            event("prefetch committed onto a written-through anchor")
        while target.write_ops:
            (target.fail_write if fail else target.ack_write)()

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

    @precondition(lambda self: any(c.prefetch_ops for c in self.caches))
    @rule(data=st.data(), pages=st.integers(1, 3))
    def prefetch_arrive(self, data: st.DataObject, pages: int) -> None:
        picked = self._pick_prefetch(data, PrefetchState.LOADING)
        if picked is not None:
            picked[0].prefetch_arrive(picked[1], pages)

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
        elif cache.prefetch_commit(op_id):
            event("prefetch committed pages")

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
        """Every instance acks its copies and finishes its backups (in any order a retry needs)."""
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
        """Finish every write-through and backup; then L3 must hold every page an instance holds
        on L2 (unless the test evicted one of its objects from the store)."""
        self._drain()
        for index, cache in enumerate(self.caches):
            if not cache.has_l3:
                continue
            for ns, tokens in sorted(self.inserted[index], key=repr):
                held = 0
                pages = self.expected_pages(tokens, ns)
                for state, page in zip(cache.residency(tokens, ns), pages, strict=False):
                    if state not in HOST_VALID or page.digest in self.evicted_pages:
                        break
                    held += 1
                exists = cache.l3_exists(tokens, ns)
                note(f"instance {index} {tokens} {ns}: L2 prefix {held}, L3 {exists}")
                assert exists >= held, f"L3 lost pages of {tokens}: {exists} < {held}"
                if held:
                    event("L3 coverage checked on a non-empty prefix")

    # ------------------------------------------------------------ misuse: typed error, no change
    @rule(
        data=st.data(),
        bad=st.sampled_from(
            ["unlock", "ack", "tokens", "evict", "prefetch_op", "node", "slots", "foreign_slot"]
        ),
    )
    def misuse(self, data: st.DataObject, bad: str) -> None:
        index, cache = self.pick(data)
        before = snapshot(cache)
        if bad == "unlock":
            free = [
                n
                for n in cache.tree.non_root_nodes()
                if n.node_id not in self.locked[index] and cache._op_pins(n) == n.pins
            ]
            if not free:
                return
            node_id = free[0].node_id
            call = lambda: cache.unlock(node_id)  # noqa: E731
        elif bad == "ack":
            if cache.write_ops:
                return
            call = cache.ack_write
        elif bad == "tokens":
            call = lambda: cache.insert([1, -1, 2])  # noqa: E731
        elif bad == "slots":
            call = lambda: cache.insert([1] * self.page_size * 2, DEFAULT_NAMESPACE, [0])  # noqa: E731
        elif bad == "foreign_slot":
            owned = sorted(cache.device.allocated() - cache.scheduler_slots)
            if not owned:
                return
            tokens = tuple(range(100, 100 + self.page_size))  # a page the tree never holds
            call = lambda: cache.insert(tokens, DEFAULT_NAMESPACE, owned[:1])  # noqa: E731
        elif bad == "evict":
            call = lambda: cache.evict(-1)  # noqa: E731
        elif bad == "prefetch_op":
            call = lambda: cache.prefetch_arrive(10**6)  # noqa: E731
        else:
            call = lambda: cache.lock(10**6)  # noqa: E731
        try:
            call()
        except (MisuseError, IllegalTransition):
            event(f"misuse {bad} rejected")
        else:
            raise AssertionError(f"{bad} misuse was accepted")
        assert snapshot(cache) == before, f"{bad} misuse changed the model"

    @invariant()
    def invariants_hold(self) -> None:
        for cache in self.caches:
            check_cache(cache)


class WriteThroughMachine(CacheModelMachine):
    policy = WritePolicy.WRITE_THROUGH


class SelectiveMachine(CacheModelMachine):
    policy = WritePolicy.WRITE_THROUGH_SELECTIVE


class WriteBackMachine(CacheModelMachine):
    policy = WritePolicy.WRITE_BACK


class L1OnlyMachine(CacheModelMachine):
    host_sizes = st.just(0)


STEPS = settings(stateful_step_count=50)
TestWriteThrough = WriteThroughMachine.TestCase
TestWriteThrough.settings = STEPS
TestSelective = SelectiveMachine.TestCase
TestSelective.settings = STEPS
TestWriteBack = WriteBackMachine.TestCase
TestWriteBack.settings = STEPS
TestL1Only = L1OnlyMachine.TestCase
TestL1Only.settings = settings(STEPS, max_examples=max(10, settings().max_examples // 5))
