"""The differential machine (imported by ``tests/stateful``): the real L1/L2 radix cache (torch pools,
transfer controller) against the reference model, side by side: every rule is applied to both and
everything observable is compared after every step. Subclasses choose the write policy and may add
tiers (``test_l3_differential`` attaches an L3 backend through :meth:`DifferentialMachine.storage`).

Compared: match lengths per tier and the deepest nodes, page indices handed out, insert results, freed
counts, residency of every page of every sequence seen, free pages per pool, pending copies, evictable
and protected sizes. Bytes are compared too: the KV of a page is a deterministic function of its page
hash (so of its prefix), and every L1 page a match returns is read back from the device pool and
compared bit for bit, which proves every write-through and load-back copy on the way.

Copies run on a ManualExecutor: a rule decides when the oldest batch completes (or fails).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, TypeVar

import hypothesis.strategies as st
import numpy as np
import torch
from hypothesis import event
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstrata.impl.config import RadixCacheConfig
from kvstrata.impl.errors import CapacityError, MisuseError
from kvstrata.impl.pools import DeviceKVPool, HostKVPool, HostLayout, KVShape
from kvstrata.impl.radix_cache import HierarchicalRadixCache, Node
from kvstrata.impl.transfer import Direction, ManualExecutor
from kvstrata.model.cache import CacheConfig, CacheModel, WritePolicy
from kvstrata.model.keys import DEFAULT_NAMESPACE, KVKind, Namespace, PageHash, chain_page_hashes

T = TypeVar("T")
NAMESPACES = (DEFAULT_NAMESPACE, Namespace(extra_key="lora-1"))
fresh_tokens = st.lists(st.integers(1, 3), max_size=6).map(tuple)


@st.composite
def related_tokens(draw: st.DrawFn, known: list[tuple[int, ...]]) -> tuple[int, ...]:
    if known and draw(st.booleans()):
        base = draw(st.sampled_from(known))
        cut = draw(st.integers(0, len(base)))
        tail = draw(st.lists(st.integers(1, 3), max_size=3))
        return (*base[:cut], *tail)[:8]
    return draw(fresh_tokens)


def kv_for(shape: KVShape, page: PageHash) -> torch.Tensor:
    """The KV of one page: bytes derived from its page hash only, shaped [planes, L, 1, page, H, D]."""
    dims = shape.canonical(1)
    count = int(np.prod(dims)) * shape.itemsize
    stream = hashlib.shake_256(page.digest).digest(count)
    raw = torch.frombuffer(bytearray(stream), dtype=torch.uint8)
    return raw.view(shape.dtype).reshape(dims)


def try_alloc(alloc: Callable[[int], T], pages: int) -> T | None:
    """``alloc(pages)``, or None when the pool is full of locked pages."""
    try:
        return alloc(pages)
    except CapacityError:
        return None


class FlakyCopy:
    """Wraps the cache's copy function so a rule can make the next batch fail."""

    def __init__(self) -> None:
        self.fail_next = False


class DifferentialMachine(RuleBasedStateMachine):
    policy = WritePolicy.WRITE_THROUGH
    host_sizes: st.SearchStrategy[int] = st.integers(2, 10)

    def __init__(self) -> None:
        super().__init__()
        self.ready = False

    @initialize(
        data=st.data(),
        page_size=st.integers(1, 2),
        device_pages=st.integers(4, 8),
        mla=st.booleans(),
        layout=st.sampled_from(HostLayout),
        quota=st.sampled_from([None, 2, 4]),
    )
    def setup(  # noqa: PLR0917 (Hypothesis passes rule arguments by keyword)
        self,
        data: st.DataObject,
        page_size: int,
        device_pages: int,
        mla: bool,
        layout: HostLayout,
        quota: int | None,
    ) -> None:
        host_pages = data.draw(self.host_sizes, label="host_pages")
        threshold = data.draw(st.integers(1, 2), label="threshold")
        self.hashes = data.draw(self.page_hashes, label="page_hashes")
        kind = KVKind.MLA if mla else KVKind.MHA
        self.model = CacheModel(
            CacheConfig(
                page_size=page_size,
                device_pages=device_pages,
                host_pages=host_pages,
                write_policy=self.policy,
                write_through_threshold=threshold,
                load_back_quota=quota,
                **self.model_extras(data, kind, page_size, host_pages),
            ),
            **self.model_store(),
        )
        self.shape = KVShape(
            kind,
            layers=2,
            heads=1 if mla else 2,
            head_dim=4,
            dtype=torch.float16,
            page_size=page_size,
        )
        self.device_pool = DeviceKVPool(self.shape, device_pages, "cpu")
        if host_pages and self.page_first_only and layout is HostLayout.LAYER_FIRST:
            layout = HostLayout.PAGE_FIRST
        self.host_pool = HostKVPool(self.shape, host_pages, layout) if host_pages else None
        self.executor = ManualExecutor()
        self.flaky = FlakyCopy()
        self.impl = HierarchicalRadixCache.build(
            RadixCacheConfig(
                page_size=page_size,
                write_policy=self.policy,
                write_through_threshold=threshold,
                load_back_quota=quota,
                page_hashes=self.hashes,
                fingerprint_seed=0,  # reproducible runs; the keys are secret in production
            ),
            self.device_pool,
            self.host_pool,
            executor=self.executor,
            **self.storage(),
        )
        if self.impl.transfer is not None:
            transfer = self.impl.transfer
            real_copy = transfer._copy

            def copy(direction: Direction, src: np.ndarray, dst: np.ndarray) -> int:
                if self.flaky.fail_next:
                    self.flaky.fail_next = False
                    raise RuntimeError("injected copy failure")
                return real_copy(direction, src, dst)

            transfer._copy = copy
        self.page_size = page_size
        self.known: list[tuple[int, ...]] = []
        self.seen: set[tuple[Namespace, tuple[int, ...]]] = set()
        self.locked: list[int] = []
        self.ready = True

    # ------------------------------------------------------------ hooks for subclasses
    page_first_only = False  # an L3 backend needs a page-first host layout
    page_hashes: st.SearchStrategy[bool] = st.booleans()  # an L3 backend needs them on

    def model_extras(
        self, data: st.DataObject, kind: KVKind, page_size: int, host_pages: int
    ) -> dict[str, Any]:
        """Extra ``CacheConfig`` fields (none here)."""
        return {}

    def model_store(self) -> dict[str, Any]:
        """Extra ``CacheModel`` arguments (none here)."""
        return {}

    def storage(self) -> dict[str, Any]:
        """Extra ``HierarchicalRadixCache.build`` keyword arguments (none here)."""
        return {}

    # ------------------------------------------------------------ helpers
    def draw_tokens(self, data: st.DataObject) -> tuple[tuple[int, ...], Namespace]:
        tokens = data.draw(related_tokens(self.known), label="tokens")
        ns = data.draw(st.sampled_from(NAMESPACES), label="namespace")
        self.seen.add((ns, tokens))
        return tokens, ns

    def impl_node(self, node_id: int) -> Node:
        for node in self.impl.nodes():
            if node.id == node_id:
                return node
        raise AssertionError(f"the implementation has no node {node_id}")

    def both_match(self, tokens: tuple[int, ...], ns: Namespace) -> tuple[object, object]:
        expected = self.model.match(tokens, ns)
        actual = self.impl.match_prefix(tokens, ns)
        assert actual.device_pages == expected.device_pages, (actual, expected)
        assert actual.host_pages == expected.host_pages, (actual, expected)
        assert actual.device_node.id == expected.device_node
        assert actual.host_node.id == expected.host_node
        assert actual.device_indices.tolist() == list(expected.device_slots)
        pages = chain_page_hashes(tokens, self.page_size, ns)[: actual.device_pages]
        if pages:
            want = torch.cat([kv_for(self.shape, page) for page in pages], dim=2)
            got = self.device_pool.read_pages(actual.device_indices)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), "L1 bytes differ"
            event("L1 bytes compared")
        self.check_page_hashes(tokens, ns)
        return expected, actual

    def check_page_hashes(self, tokens: tuple[int, ...], ns: Namespace) -> None:
        """With page hashes on, the tree holds the model's chain for every cached page of
        ``tokens`` (whatever splits happened); off, it refuses to give any."""
        if not self.hashes:
            try:
                self.impl.page_hashes(tokens, ns)
            except MisuseError:
                return
            raise AssertionError("page_hashes answered with page hashes off")
        cached = len(self.impl.residency(tokens, ns))
        expected = chain_page_hashes(tokens, self.page_size, ns)[:cached]
        assert self.impl.page_hashes(tokens, ns) == expected, "page hashes differ from the chain"

    # ------------------------------------------------------------ scheduler rules
    @rule(data=st.data())
    def request(self, data: st.DataObject) -> None:
        tokens, ns = self.draw_tokens(data)
        expected, actual = self.both_match(tokens, ns)
        pages = chain_page_hashes(tokens, self.page_size, ns)
        node_id = expected.device_node  # type: ignore[attr-defined]
        locked = not self.model.tree.nodes[node_id].is_root
        if locked:
            self.model.lock(node_id)
            self.impl.lock(actual.device_node)  # type: ignore[attr-defined]
        need = len(pages) - expected.device_pages  # type: ignore[attr-defined]
        model_fresh = try_alloc(self.model.alloc_device, need)
        impl_fresh = try_alloc(self.impl.alloc_device, need)
        assert (model_fresh is None) == (impl_fresh is None)
        if model_fresh is not None and impl_fresh is not None:
            assert impl_fresh.tolist() == list(model_fresh)
            for slot, page in zip(model_fresh, pages[expected.device_pages :], strict=True):  # type: ignore[attr-defined]
                self.model.write_device(slot, page)
            if need:
                kv = torch.cat([kv_for(self.shape, p) for p in pages[-need:]], dim=2)
                self.device_pool.write_pages(impl_fresh, kv)
            prefix = list(expected.device_slots)  # type: ignore[attr-defined]
            want = self.model.insert(tokens, ns, prefix + list(model_fresh))
            got = self.impl.insert(tokens, prefix + impl_fresh.tolist(), ns)
            assert (got.node.id, got.new_pages, got.revived_pages, got.duplicate_pages) == (
                want.node_id,
                want.new_pages,
                want.revived_pages,
                want.duplicate_pages,
            )
            if got.revived_pages:
                event("insert revived host-only pages")
            if tokens not in self.known:
                self.known.append(tokens)
        else:
            event("request refused: L1 full of locked pages")
        if locked:
            self.model.unlock(node_id)
            self.impl.unlock(actual.device_node)  # type: ignore[attr-defined]

    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        splits = len(self.model.tree.nodes)
        in_flight = bool(self.model.write_ops)
        self.both_match(*self.draw_tokens(data))
        if len(self.model.tree.nodes) > splits and in_flight:
            event("split while a write-through is in flight")

    @rule(data=st.data())
    def lock(self, data: st.DataObject) -> None:
        expected, actual = self.both_match(*self.draw_tokens(data))
        node_id = expected.device_node  # type: ignore[attr-defined]
        if not self.model.tree.nodes[node_id].is_root:
            self.model.lock(node_id)
            self.impl.lock(actual.device_node)  # type: ignore[attr-defined]
            self.locked.append(node_id)

    @precondition(lambda self: self.ready and self.locked)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        node_id = data.draw(st.sampled_from(self.locked))
        self.locked.remove(node_id)
        self.model.unlock(node_id)
        self.impl.unlock(self.impl_node(node_id))

    @rule(pages=st.integers(0, 4), host=st.booleans())
    def evict(self, pages: int, host: bool) -> None:
        if host:
            assert self.impl.evict_host(pages) == self.model.evict_host(pages)
        else:
            assert self.impl.evict(pages) == self.model.evict_device(pages)

    @rule(data=st.data())
    def load_back(self, data: st.DataObject) -> None:
        expected, actual = self.both_match(*self.draw_tokens(data))
        if not expected.host_pages:  # type: ignore[attr-defined]
            return
        want = self.model.load_back(expected.host_node)  # type: ignore[attr-defined]
        got = self.impl.load_back(actual.host_node)  # type: ignore[attr-defined]
        assert (want is None) == (got is None)
        if got is not None:
            event("load-back started")

    @rule(pages=st.integers(0, 3))
    def aborted_request(self, pages: int) -> None:
        model_slots = try_alloc(self.model.alloc_device, pages)
        impl_slots = try_alloc(self.impl.alloc_device, pages)
        assert (model_slots is None) == (impl_slots is None)
        if model_slots is not None and impl_slots is not None:
            self.model.free_device(model_slots)
            self.impl.free_device(impl_slots)

    # ------------------------------------------------------------ background completion
    @precondition(lambda self: self.ready and self.executor.jobs)
    @rule(fail=st.sampled_from([False, False, False, True]))
    def complete_copy_batch(self, fail: bool) -> None:
        self.flaky.fail_next = fail
        self.executor.run_next()
        self.flaky.fail_next = False
        for applied in self.impl.check_events():
            if not applied.op_ids:
                continue
            if not applied.ok:
                event("a copy batch failed")
                failed = (
                    self.model.fail_write
                    if applied.direction is Direction.WRITE
                    else self.model.fail_load
                )
                failed()
                continue
            ack = (
                self.model.ack_write
                if applied.direction is Direction.WRITE
                else self.model.ack_load
            )
            for _ in applied.op_ids:
                ack()

    # ------------------------------------------------------------ misuse: same typed error, no change
    @rule(bad=st.sampled_from(["tokens", "slots", "evict", "unlock", "node", "alloc"]))
    def misuse(self, bad: str) -> None:
        before = self.observe()
        if bad == "tokens":
            calls = (lambda: self.model.insert([1, -1]), lambda: self.impl.insert([1, -1], []))
        elif bad == "slots":
            tokens = [7] * self.page_size
            calls = (
                lambda: self.model.insert(tokens, DEFAULT_NAMESPACE, [0, 1]),
                lambda: self.impl.insert(tokens, [0, 1]),
            )
        elif bad == "evict":
            calls = (lambda: self.model.evict_device(-1), lambda: self.impl.evict(-1))
        elif bad == "alloc":
            calls = (lambda: self.model.alloc_device(-2), lambda: self.impl.alloc_device(-2))
        elif bad == "unlock":
            free = [n for n in self.impl.nodes() if n.pins == 0]
            if not free:
                return
            node = free[0]
            calls = (lambda: self.model.unlock(node.id), lambda: self.impl.unlock(node))
        else:
            calls = (lambda: self.model.lock(10**6), lambda: self.impl.lock(object()))  # type: ignore[arg-type]
        for call in calls:
            try:
                call()
            except MisuseError:
                pass
            else:
                raise AssertionError(f"{bad} misuse was accepted")
        assert self.observe() == before, f"{bad} misuse changed something"
        event(f"misuse {bad} rejected by both")

    # ------------------------------------------------------------ comparison
    def observe(self) -> tuple[object, object]:
        model, impl = self.model, self.impl
        residency_model = tuple(model.residency(t, ns) for ns, t in sorted(self.seen, key=repr))
        residency_impl = tuple(impl.residency(t, ns) for ns, t in sorted(self.seen, key=repr))
        model_view = (
            model.device.free_count,
            model.host.free_count,
            len(model.write_ops),
            len(model.load_ops),
            model.evictable_pages,
            model.protected_pages,
            residency_model,
        )
        impl_view = (
            impl.device_free,
            impl.host_free,
            len(impl.write_ops),
            len(impl.load_ops),
            impl.evictable_pages,
            impl.protected_pages,
            residency_impl,
        )
        return model_view, impl_view

    @invariant()
    def agree(self) -> None:
        if not self.ready:
            return
        model_view, impl_view = self.observe()
        assert model_view == impl_view, f"model {model_view} != impl {impl_view}"

    def teardown(self) -> None:
        if self.ready:
            self.executor.jobs.clear()
