"""The differential machine (imported by ``tests/stateful``): the real L1/L2 radix cache (torch pools,
transfer controller) against the reference model, side by side: every rule is applied to both and
everything observable is compared after every step. Subclasses choose the write policy and may add
tiers (``test_l3_differential`` attaches an L3 backend through :meth:`DifferentialMachine.storage`).

Compared: match lengths per tier and the deepest nodes, page indices handed out, insert results, freed
counts, residency of every page of every sequence seen, free pages per pool, pending copies, evictable
and protected sizes. Bytes are compared too: the KV of a page is a deterministic function of its page
hash (so of its prefix), and every L1 page a match returns is read back from the device pool and
compared bit for bit, which proves every write-through and load-back copy on the way.

Copies run on a ManualExecutor over a DeferredStream (the CPU stand-in for a CUDA stream), one page
per issued copy: rules decide when the oldest batch completes whole (or fails), when it advances one
step (issue a chunk, synchronise, report), when an issued copy lands, and when one fails as it lands.
So every other rule also runs while a copy is half done, and an ack before the data landed shows as
wrong bytes (issue 19, item 3).
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

from kvstrata.impl.cache import HierarchicalRadixCache, Node
from kvstrata.impl.config import RadixCacheConfig
from kvstrata.impl.errors import CapacityError, MisuseError
from kvstrata.impl.pools import DeviceKVPool, HostKVPool, HostLayout, KVShape
from kvstrata.impl.pools.side import SideBuffer, SideSpec, indexer_spec, mamba_spec
from kvstrata.impl.transfer import DeferredStream, Direction, ManualExecutor, PoolTransfer
from kvstrata.model.cache import CacheConfig, CacheModel, WritePolicy
from kvstrata.model.keys import DEFAULT_NAMESPACE, KVKind, Namespace, PageHash, chain_page_hashes
from kvstrata.model.lifecycles import Residency

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


@st.composite
def wide_tokens(draw: st.DrawFn, known: list[tuple[int, ...]], page: int) -> tuple[int, ...]:
    """Up to three pages of ``page`` tokens: fresh, a known request cut and extended, or a known
    request with one token changed anywhere (pages that differ from a cached one in one position:
    the tree must tell them apart whatever the position)."""
    alphabet = st.integers(1, 3)
    if not known or draw(st.integers(0, 2)) == 0:
        return tuple(draw(st.lists(alphabet, max_size=3 * page)))
    base = draw(st.sampled_from(known))
    if base and draw(st.booleans()):
        at = draw(st.integers(0, len(base) - 1))
        other = draw(alphabet.filter(lambda token: token != base[at]))
        return (*base[:at], other, *base[at + 1 :])
    cut = draw(st.integers(0, len(base)))
    return (*base[:cut], *draw(st.lists(alphabet, max_size=page)))[: 3 * page]


def kv_for(shape: KVShape, page: PageHash) -> torch.Tensor:
    """The KV of one page: bytes derived from its page hash only, shaped [planes, L, 1, page, H, D]."""
    dims = shape.canonical(1)
    count = int(np.prod(dims)) * shape.itemsize
    stream = hashlib.shake_256(page.digest).digest(count)
    raw = torch.frombuffer(bytearray(stream), dtype=torch.uint8)
    return raw.view(shape.dtype).reshape(dims)


def model_locks(model: Any, tokens: tuple[int, ...], namespace: Namespace) -> tuple[object, ...]:
    """Per cached page of ``tokens``: its node's ``(lock_ref, pins)`` in the model (issue 19: locks
    compared node by node, not as totals)."""
    walk = model.tree.walk(list(tokens), namespace, split=False)
    return tuple((node.lock_ref, node.pins) for node in walk.path for _ in node.pages)


def impl_locks(impl: Any, tokens: tuple[int, ...], namespace: Namespace) -> tuple[object, ...]:
    """The same view of the implementation's tree."""
    path = impl._index.cached_path(list(tokens), namespace)
    return tuple((node.lock_ref, node.pins) for node in path for _ in range(node.num_pages))


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
    #: when set, the page size is drawn from it (not 1-2) and requests from :func:`wide_tokens`
    wide_pages: st.SearchStrategy[int] | None = None

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
        if self.wide_pages is not None:
            page_size = data.draw(self.wide_pages, label="wide page_size")
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
                **self.impl_extras(),
            ),
            self.device_pool,
            self.host_pool,
            executor=self.executor,
            **self.storage(),
        )
        self.stream = DeferredStream()
        self.stale_copies: list[str] = []
        if self.impl.transfer is not None:
            transfer = self.impl.transfer
            transfer.use_stream(self.stream, chunk_pages=1)
            real_copy = transfer._copy

            def copy(direction: Direction, src: np.ndarray, dst: np.ndarray) -> int:
                self.check_destinations(direction, dst)
                if self.flaky.fail_next:
                    self.flaky.fail_next = False
                    raise RuntimeError("injected copy failure")
                return real_copy(direction, src, dst)

            transfer._copy = copy
            real_side = transfer._side_copy
            if real_side is not None:

                def side_copy(direction: Direction, part: PoolTransfer) -> int:
                    if self.flaky.fail_next:
                        self.flaky.fail_next = False
                        raise RuntimeError("injected side-pool copy failure")
                    return real_side(direction, part)

                transfer._side_copy = side_copy
        self.page_size = page_size
        self.known: list[tuple[int, ...]] = []
        self.seen: set[tuple[Namespace, tuple[int, ...]]] = set()
        self.locked: list[int] = []
        self.ready = True

    def check_destinations(self, direction: Direction, dst: np.ndarray) -> None:
        """A copy writes only pages that a pending op of its direction holds: a page freed (by a
        failed batch, an eviction, ...) while a copy into it is still in flight is a stale offset,
        whoever gets the page next. Recorded, not raised: the worker turns an exception into a
        failed batch (:meth:`no_stale_copy` fails the test)."""
        copies = self.impl._tiers.copies
        held: set[int] = set()
        for op in copies.write if direction is Direction.WRITE else copies.load:
            for node in op.nodes:
                pages = node.host if direction is Direction.WRITE else node.device
                if pages is not None:
                    held.update(int(page) for page in pages)
        stale = {int(page) for page in dst} - held
        if stale:
            self.stale_copies.append(f"a {direction.value} copy writes pages {sorted(stale)}")

    @invariant()
    def no_stale_copy(self) -> None:
        assert not getattr(self, "stale_copies", []), self.stale_copies

    # ------------------------------------------------------------ hooks for subclasses
    page_first_only = False  # an L3 backend needs a page-first host layout
    page_hashes: st.SearchStrategy[bool] = st.booleans()  # an L3 backend needs them on

    def model_extras(
        self, data: st.DataObject, kind: KVKind, page_size: int, host_pages: int
    ) -> dict[str, Any]:
        """Extra ``CacheConfig`` fields (none here)."""
        return {}

    def impl_extras(self) -> dict[str, Any]:
        """Extra ``RadixCacheConfig`` fields (none here)."""
        return {}

    def model_store(self) -> dict[str, Any]:
        """Extra ``CacheModel`` arguments (none here)."""
        return {}

    def storage(self) -> dict[str, Any]:
        """Extra ``HierarchicalRadixCache.build`` keyword arguments (none here)."""
        return {}

    # ------------------------------------------------------------ helpers
    def draw_tokens(self, data: st.DataObject) -> tuple[tuple[int, ...], Namespace]:
        if self.wide_pages is None:
            tokens = data.draw(related_tokens(self.known), label="tokens")
        else:
            tokens = data.draw(wide_tokens(self.known, self.page_size), label="tokens")
        ns = data.draw(st.sampled_from(NAMESPACES), label="namespace")
        self.seen.add((ns, tokens))
        return tokens, ns

    def impl_node(self, node_id: int) -> Node:
        for node in self.impl.nodes():
            if node.id == node_id:
                return node
        raise AssertionError(f"the implementation has no node {node_id}")

    def both_match(self, tokens: tuple[int, ...], ns: Namespace) -> tuple[object, object]:
        expected = self.model.match_prefix(tokens, ns)
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
        self.do_request(data, with_state=False)

    def write_fresh(self, slots: np.ndarray, pages: tuple[PageHash, ...]) -> None:
        """The scheduler computed the KV of ``pages`` into its fresh L1 ``slots``."""
        kv = torch.cat([kv_for(self.shape, p) for p in pages], dim=2)
        self.device_pool.write_pages(slots, kv)

    def alloc_both(self, pages: int) -> tuple[tuple[int, ...], np.ndarray] | None:
        """``pages`` fresh L1 slots from both sides, the same ones (the pools hand out alike), or
        ``None`` when both are full of locked pages (only one of them full is a failure)."""
        model_slots = try_alloc(self.model.alloc_device, pages)
        impl_slots = try_alloc(self.impl.alloc_device, pages)
        assert (model_slots is None) == (impl_slots is None), (model_slots, impl_slots)
        if model_slots is None or impl_slots is None:
            return None
        assert impl_slots.tolist() == list(model_slots)
        return model_slots, impl_slots

    def compute_fresh(
        self, fresh: tuple[tuple[int, ...], np.ndarray], pages: tuple[PageHash, ...]
    ) -> None:
        """The request computed the KV of ``pages`` into the ``fresh`` slots of both sides."""
        model_slots, impl_slots = fresh
        for slot, page in zip(model_slots, pages, strict=True):
            self.model.write_device(slot, page)
        if pages:
            self.write_fresh(impl_slots, pages)

    def take_state(self, page: PageHash) -> tuple[int | None, int | None]:
        """Hybrid machines: an L1 state slot from both, holding the state after ``page``."""
        raise NotImplementedError

    def do_request(self, data: st.DataObject, *, with_state: bool) -> None:
        tokens, ns = self.draw_tokens(data)
        running = data.draw(st.sampled_from([False, False, False, True]), label="keeps running")
        self.request_tokens(tokens, ns, with_state=with_state, running=running)

    def request_tokens(
        self, tokens: tuple[int, ...], ns: Namespace, *, with_state: bool, running: bool = False
    ) -> None:
        """One request on both: match, lock the L1 prefix, allocate, compute, insert, unlock.
        ``running``: the request goes on (a scheduler keeps its prefix locked while it decodes),
        so the node its tokens end at stays locked, for :meth:`unlock` to release later."""
        expected, actual = self.both_match(tokens, ns)
        pages = chain_page_hashes(tokens, self.page_size, ns)
        node_id = expected.device_node  # type: ignore[attr-defined]
        locked = not self.model.tree.nodes[node_id].is_root
        if locked:
            self.model.lock(node_id)
            self.impl.lock(actual.device_node)  # type: ignore[attr-defined]
        need = len(pages) - expected.device_pages  # type: ignore[attr-defined]
        fresh = self.alloc_both(need)
        if fresh is not None:
            model_fresh, impl_fresh = fresh
            self.compute_fresh(fresh, pages[len(pages) - need :])
            model_state = impl_state = None
            if with_state and pages:
                model_state, impl_state = self.take_state(pages[-1])
            prefix = list(expected.device_slots)  # type: ignore[attr-defined]
            if model_state is None:
                want = self.model.insert(tokens, ns, prefix + list(model_fresh))
                got = self.impl.insert(tokens, prefix + impl_fresh.tolist(), ns)
            else:
                want = self.model.insert(
                    tokens, ns, prefix + list(model_fresh), state_slot=model_state
                )
                got = self.impl.insert(
                    tokens, prefix + impl_fresh.tolist(), ns, state_slot=impl_state
                )
                event("insert with a state" + (" (kept)" if want.state_kept else " (given back)"))
            assert (
                got.node.id,
                got.new_pages,
                got.revived_pages,
                got.duplicate_pages,
                got.state_kept,
            ) == (
                want.node_id,
                want.new_pages,
                want.revived_pages,
                want.duplicate_pages,
                want.state_kept,
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
        if running and fresh is not None:
            self.lock_match(tokens, ns)
            event("a running request keeps its node locked")

    @rule(data=st.data())
    def racing_requests(self, data: st.DataObject) -> None:
        """Two requests for the same tokens in one prefill batch: both match the same prefix and
        compute its uncached pages, the first inserts, and the second's pages where the tree now
        holds the first's are duplicates, given back (the spare pages of ``check_pages``)."""
        tokens, ns = self.draw_tokens(data)
        expected, actual = self.both_match(tokens, ns)
        pages = chain_page_hashes(tokens, self.page_size, ns)
        need = len(pages) - expected.device_pages  # type: ignore[attr-defined]
        if not need:
            return
        node_id = expected.device_node  # type: ignore[attr-defined]
        locked = not self.model.tree.nodes[node_id].is_root
        if locked:
            self.model.lock(node_id)
            self.impl.lock(actual.device_node)  # type: ignore[attr-defined]
        computed: list[tuple[tuple[int, ...], np.ndarray]] = []
        for _ in range(2):
            fresh = self.alloc_both(need)
            if fresh is None:
                break
            self.compute_fresh(fresh, pages[-need:])
            computed.append(fresh)
        prefix = list(expected.device_slots)  # type: ignore[attr-defined]
        # the second may match again right before its insert: the tree's pages are then the
        # match's own and its duplicates are found against them (the insert's fast path)
        rematch = data.draw(st.booleans(), label="the second matches again")
        for turn, (model_fresh, impl_fresh) in enumerate(computed):
            if turn and rematch:
                self.both_match(tokens, ns)
            want = self.model.insert(tokens, ns, prefix + list(model_fresh))
            got = self.impl.insert(tokens, prefix + impl_fresh.tolist(), ns)
            assert (got.node.id, got.new_pages, got.revived_pages, got.duplicate_pages) == (
                want.node_id,
                want.new_pages,
                want.revived_pages,
                want.duplicate_pages,
            )
        if len(computed) == 2:
            event("racing requests: the second one's pages given back as duplicates")
            if tokens not in self.known:
                self.known.append(tokens)
        if locked:
            self.model.unlock(node_id)
            self.impl.unlock(actual.device_node)  # type: ignore[attr-defined]
        self.both_match(tokens, ns)

    def lock_match(self, tokens: tuple[int, ...], ns: Namespace) -> None:
        """Lock, on both, the L1 node the match of ``tokens`` ends at (not the root)."""
        expected, actual = self.both_match(tokens, ns)
        node_id = expected.device_node  # type: ignore[attr-defined]
        if not self.model.tree.nodes[node_id].is_root:
            self.model.lock(node_id)
            self.impl.lock(actual.device_node)  # type: ignore[attr-defined]
            self.locked.append(node_id)

    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        splits = len(self.model.tree.nodes)
        in_flight = bool(self.model.write_ops)
        self.both_match(*self.draw_tokens(data))
        if len(self.model.tree.nodes) > splits and in_flight:
            event("split while a write-through is in flight")

    @rule(data=st.data())
    def lock(self, data: st.DataObject) -> None:
        self.lock_match(*self.draw_tokens(data))

    def unlock_all(self) -> None:
        """Every running request ends: each lock this machine holds is released, on both."""
        while self.locked:
            node_id = self.locked.pop()
            self.model.unlock(node_id)
            self.impl.unlock(self.impl_node(node_id))

    @precondition(lambda self: self.ready and self.locked)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        node_id = data.draw(st.sampled_from(self.locked))
        self.locked.remove(node_id)
        self.model.unlock(node_id)
        self.impl.unlock(self.impl_node(node_id))
        event("a node unlocked")

    @rule(pages=st.integers(0, 4), host=st.booleans())
    def evict(self, pages: int, host: bool) -> None:
        if host:
            assert self.impl.evict_host(pages) == self.model.evict_host(pages)
        else:
            assert self.impl.evict(pages) == self.model.evict(pages)

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
        fresh = self.alloc_both(pages)
        if fresh is not None:
            self.model.free_device(fresh[0])
            self.impl.free_device(fresh[1])

    # ------------------------------------------------------------ background completion
    @precondition(lambda self: self.ready and self.executor.jobs)
    @rule(fail=st.sampled_from([False, False, False, True]), at_launch=st.booleans())
    def complete_copy_batch(self, fail: bool, at_launch: bool = False) -> None:
        """The oldest copy batch runs to its end; ``fail``: a copy fails as it lands, or (``at_launch``)
        the batch's second copy fails to launch while its first is still in flight."""
        if fail and len(self.executor.jobs) > 1:
            event("a copy batch fails while a later batch is queued")
        if fail and at_launch:
            self.executor.step_next()
            self.stream.refuse_next = True
            self.executor.run_next()
            if not self.stream.refuse_next:
                event("a copy fails to launch while another of its batch is in flight")
            self.stream.refuse_next = False
        else:
            self.flaky.fail_next = fail
            self.executor.run_next()
            self.flaky.fail_next = False
        self.deliver_copies()

    @precondition(lambda self: self.ready and self.executor.jobs)
    @rule(launch_fails=st.sampled_from([False, False, False, True]))
    def copy_step(self, launch_fails: bool) -> None:
        """The oldest copy batch advances one step: issues one page (which may fail to launch while
        pages issued before it are still in flight), synchronises, or reports."""
        self.stream.refuse_next = launch_fails
        self.executor.step_next()
        if launch_fails and not self.stream.refuse_next:
            event("a copy fails to launch mid-batch")
        self.stream.refuse_next = False
        self.deliver_copies()

    @precondition(lambda self: self.ready and self.stream.issued)
    @rule(fault=st.sampled_from([False, False, True]))
    def copy_lands(self, fault: bool) -> None:
        """The oldest issued copy lands (its bytes move now), or fails as it lands (the batch then
        fails at its synchronisation)."""
        if fault:
            event("an issued copy fails as it lands")

            def broken() -> int:
                raise RuntimeError("injected fault of an issued copy")

            self.stream.issued[0] = broken
        else:
            event("an issued copy lands before its batch synchronised")
        self.stream.land()

    def deliver_copies(self) -> None:
        """Apply every finished copy batch to the implementation and mirror it to the model."""
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
    @rule(bad=st.sampled_from(["tokens", "slots", "repeat", "evict", "unlock", "node", "alloc"]))
    def misuse(self, bad: str) -> None:
        before = self.observe()
        held: tuple[tuple[int, ...], np.ndarray] | None = None
        if bad == "repeat":  # two held L1 slots, the first named twice (not only at position 0)
            held = self.alloc_both(2)
            if held is None:
                return
            model_slots, impl_slots = held
            before = self.observe()
            tokens = [7] * (2 * self.page_size)
            calls = (
                lambda: self.model.insert(tokens, DEFAULT_NAMESPACE, model_slots[:1] * 2),
                lambda: self.impl.insert(tokens, np.repeat(impl_slots[:1], 2)),
            )
        elif bad == "tokens":
            calls = (lambda: self.model.insert([1, -1]), lambda: self.impl.insert([1, -1], []))
        elif bad == "slots":
            tokens = [7] * self.page_size
            calls = (
                lambda: self.model.insert(tokens, DEFAULT_NAMESPACE, [0, 1]),
                lambda: self.impl.insert(tokens, [0, 1]),
            )
        elif bad == "evict":
            calls = (lambda: self.model.evict(-1), lambda: self.impl.evict(-1))
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
        if held is not None:
            self.model.free_device(held[0])
            self.impl.free_device(held[1])
        event(f"misuse {bad} rejected by both")

    # ------------------------------------------------------------ comparison
    def observe(self) -> tuple[object, object]:
        model, impl = self.model, self.impl
        seen = sorted(self.seen, key=repr)
        residency_model = tuple(model.residency(t, ns) for ns, t in seen)
        residency_impl = tuple(impl.residency(t, ns) for ns, t in seen)
        locks_model = tuple(model_locks(model, t, ns) for ns, t in seen)
        locks_impl = tuple(impl_locks(impl, t, ns) for ns, t in seen)
        model_view = (
            model.device.free_count,
            model.host.free_count,
            len(model.write_ops),
            len(model.load_ops),
            model.evictable_pages,
            model.protected_pages,
            residency_model,
            locks_model,
        )
        impl_view = (
            impl.device_free,
            impl.host_free,
            impl.pending().write,
            impl.pending().load,
            impl.evictable_pages,
            impl.protected_pages,
            residency_impl,
            locks_impl,
        )
        return model_view, impl_view

    @invariant()
    def reported_copies_landed(self) -> None:
        """No copy of a reported batch is still in flight: whatever the stream holds belongs to the
        batch the executor is part-way through (a failed batch, too, waits for what it issued)."""
        if not self.ready or not self.stream.issued:
            return
        jobs = self.executor.jobs
        assert jobs and getattr(jobs[0], "started", False), (
            f"{len(self.stream.issued)} copies still in flight after their batch was reported"
        )

    @invariant()
    def agree(self) -> None:
        if not self.ready:
            return
        model_view, impl_view = self.observe()
        assert model_view == impl_view, f"model {model_view} != impl {impl_view}"

    def teardown(self) -> None:
        if self.ready:
            self.executor.jobs.clear()
            self.stream.issued.clear()


# ---------------------------------------------------------------------------------------------------
# Hybrid models (SPEC §5): an indexer pool (ALL_PAGES) and a Mamba state pool (TRAILING_PAGES)
INDEXER = "indexer"
MAMBA = "mamba"


def side_bytes(spec: SideSpec, page: PageHash) -> tuple[torch.Tensor, ...]:
    """One entry of side pool ``spec`` for ``page``: per component, bytes derived from the pool's
    name, its dtypes and the page hash only, shaped ``[1, *shape]`` (the indexer keys of that
    page, or the state at the end of that page's prefix). The same state in other dtypes of the
    same size is other bytes, as it is on a real engine; the seed does not come from the key code,
    so a reader that got another layout's objects sees other bytes even if the keys were alike."""
    out = []
    dtypes = ",".join(str(dtype) for dtype in spec.dtypes)
    for component, shape, dtype in zip(spec.components, spec.shapes, spec.dtypes, strict=True):
        count = int(np.prod(shape)) * dtype.itemsize
        seed = f"{spec.name}/{dtypes}/{component}/".encode() + page.digest
        raw = torch.frombuffer(bytearray(hashlib.shake_256(seed).digest(count)), dtype=torch.uint8)
        out.append(raw.view(dtype).reshape(1, *shape))
    return tuple(out)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


class HybridDifferentialMachine(DifferentialMachine):
    """The differential machine with one ``ALL_PAGES`` indexer pool and one ``TRAILING_PAGES`` Mamba
    pool (two components) and 2-3 state slots per tier. Adds requests that insert a state, state
    eviction (L1/L2, misuse included) and state-slot misuse; compares, after every step, the state
    residency of every page seen and the free state slots per tier, and on every match the state
    slot and the bytes: the L1 state a match reports is the state of its last page, every L1
    indexer entry of a matched page is that page's (so every side-pool copy is proven)."""

    def model_extras(
        self, data: st.DataObject, kind: KVKind, page_size: int, host_pages: int
    ) -> dict[str, Any]:
        self.specs = (
            indexer_spec(layers=2, page_size=page_size, dim=2, dtype=torch.float16),
            mamba_spec(layers=2, conv=[(3,)], temporal=(2, 2), dtype=torch.float16),
        )
        self.device_states = data.draw(st.integers(2, 3), label="device_states")
        self.host_states = data.draw(st.integers(2, 3), label="host_states") if host_pages else 0
        return self.state_fields()

    def state_fields(self) -> dict[str, Any]:
        return {
            "side_pools": tuple(spec.pool for spec in self.specs),
            "device_states": self.device_states,
            "host_states": self.host_states,
        }

    def impl_extras(self) -> dict[str, Any]:
        return self.state_fields()

    def storage(self) -> dict[str, Any]:
        return {"side_specs": self.specs}

    # ------------------------------------------------------------ helpers
    def same_op(self, want: int | None, got: int | None) -> bool:
        """Whether a model op id and an implementation op id agree (equal here; a machine whose
        implementation takes op ids the model does not, such as L3 prefetch queries, compares
        only whether an op started)."""
        return want == got

    def side(self, name: str) -> SideBuffer:
        assert self.impl.device_group is not None
        return self.impl.device_group.side[name]

    def write_fresh(self, slots: np.ndarray, pages: tuple[PageHash, ...]) -> None:
        super().write_fresh(slots, pages)
        indexer = self.side(INDEXER)
        parts = [side_bytes(indexer.spec, page) for page in pages]
        indexer.write(slots, [torch.cat(column) for column in zip(*parts, strict=True)])

    def take_state(self, page: PageHash) -> tuple[int | None, int | None]:
        model_slot = try_alloc(lambda _: self.model.alloc_device_state(), 1)
        impl_slot = try_alloc(lambda _: self.impl.alloc_device_state(), 1)
        assert model_slot == impl_slot, (model_slot, impl_slot)
        if model_slot is None or impl_slot is None:
            event("no L1 state slot: request inserted without a state")
            return None, None
        self.model.write_device_state(model_slot, self.model.state_content(page))
        mamba = self.side(MAMBA)
        mamba.write([impl_slot], side_bytes(mamba.spec, page))
        return model_slot, impl_slot

    def both_match(self, tokens: tuple[int, ...], ns: Namespace) -> tuple[object, object]:
        expected, actual = super().both_match(tokens, ns)
        got = actual.device_state_slot  # type: ignore[attr-defined]
        assert got == expected.device_state_slot, (got, expected)  # type: ignore[attr-defined]
        device_pages = actual.device_pages  # type: ignore[attr-defined]
        if device_pages:
            pages = chain_page_hashes(tokens, self.page_size, ns)[:device_pages]
            mamba, indexer = self.side(MAMBA), self.side(INDEXER)
            assert got is not None, "an L1 prefix without a state slot"
            for have, want in zip(
                mamba.read([got]), side_bytes(mamba.spec, pages[-1]), strict=True
            ):
                assert same_bits(have, want), "L1 state bytes differ"
            wanted = [side_bytes(indexer.spec, page) for page in pages]
            read = indexer.read(actual.device_indices)  # type: ignore[attr-defined]
            for have, column in zip(read, zip(*wanted, strict=True), strict=True):
                assert same_bits(have, torch.cat(column)), "L1 indexer bytes differ"
            event("L1 state and indexer bytes compared")
        return expected, actual

    # ------------------------------------------------------------ rules
    @rule(data=st.data(), with_state=st.sampled_from([True, True, True, False]))
    def request(self, data: st.DataObject, with_state: bool) -> None:  # type: ignore[override]
        self.do_request(data, with_state=with_state)

    @precondition(lambda self: self.ready and self.executor.jobs)
    @rule()
    def drain_copies(self) -> None:
        """Every queued copy batch completes: states reach L2 (and L1 again) often."""
        while self.executor.jobs:
            self.complete_copy_batch(fail=False)

    @precondition(lambda self: self.ready and self.executor.jobs)
    @rule(fail=st.sampled_from([False, False, False, True]))
    def complete_copy_batch(self, fail: bool) -> None:
        for op in (*self.model.write_ops, *self.model.load_ops)[:1]:
            if op.states:
                kind = "with pages" if op.pages else "state only"
                event(f"a copy carrying a state ({kind}) {'fails' if fail else 'completes'}")
        super().complete_copy_batch(fail)

    @rule(data=st.data())
    def load_back(self, data: st.DataObject) -> None:
        loads = len(self.model.load_ops)
        super().load_back(data)
        if len(self.model.load_ops) > loads:
            op = self.model.load_ops[-1]
            event("load-back " + ("with its state" if op.states else "of KV only"))
            if not op.pages:
                event("state-only load-back")

    @rule(data=st.data())
    def load_back_node(self, data: st.DataObject) -> None:
        """Load back a node whose end state (or whose KV) is on L2 only, by node: state-only
        loads (KV on L1, state on L2 after ``evict_state``) are reached this way."""
        model = self.model
        nodes = sorted(
            node.node_id
            for node in model.tree.non_root_nodes()
            if model.residency_of(node) is Residency.HOST
            or model._state_of(node.pages[-1]) is Residency.HOST
        )
        if not nodes:
            return
        node_id = data.draw(st.sampled_from(nodes), label="load-back node")
        want = model.load_back(node_id)
        got = self.impl.load_back(self.impl_node(node_id))
        assert self.same_op(want, got), (want, got)
        if want is not None:
            op = model.load_ops[-1]
            event("load-back " + ("with its state" if op.states else "of KV only"))
            if not op.pages:
                event("state-only load-back")

    @rule(data=st.data())
    def state_round_trip(self, data: st.DataObject) -> None:
        """A state on L1 and L2 loses its L1 copy, is loaded back from L2 and matched again: the
        bytes the match reports must be the ones the write-through copied (L1 -> L2 -> L1)."""
        candidates = sorted(
            {
                (ns, tokens[: (index + 1) * self.page_size])
                for ns, tokens in self.seen
                for index, state in enumerate(self.model.state_residency(tokens, ns))
                if state is Residency.BOTH
            },
            key=repr,
        )
        if not candidates:
            return
        ns, tokens = data.draw(st.sampled_from(candidates), label="state to round-trip")
        expected, actual = self.both_match(tokens, ns)
        node_id = expected.device_node  # type: ignore[attr-defined]
        node = self.model.tree.nodes[node_id]
        if (
            node.is_root
            or node.lock_ref
            or self.model._state_of(node.pages[-1]) is not Residency.BOTH
        ):
            return
        self.model.evict_state(node_id)
        self.impl.evict_state(actual.device_node)  # type: ignore[attr-defined]
        want = self.model.load_back(node_id)
        got = self.impl.load_back(actual.device_node)  # type: ignore[attr-defined]
        assert self.same_op(want, got), (want, got)
        self.drain_copies()
        again, _ = self.both_match(tokens, ns)
        if again.device_pages:  # type: ignore[attr-defined]
            event("state round trip L1 -> L2 -> L1, bytes compared")

    @rule(data=st.data(), host=st.booleans(), any_node=st.sampled_from([False, False, True]))
    def evict_state(self, data: st.DataObject, host: bool, any_node: bool) -> None:
        """Drop a state's L1 (or L2) copy on both; a node with no idle copy there, a locked node or
        a node with no state is misuse on both, with nothing changed."""
        nodes = sorted(
            node.node_id
            for node in self.model.tree.non_root_nodes()
            if any_node or node.pages[-1] in self.model.state_info
        )
        if not nodes:
            return
        node_id = data.draw(st.sampled_from(nodes), label="state node")
        before = self.observe()
        outcomes = []
        for call in (
            lambda: self.model.evict_state(node_id, host=host),
            lambda: self.impl.evict_state(self.impl_node(node_id), host=host),
        ):
            try:
                call()
            except MisuseError:
                outcomes.append(False)
            else:
                outcomes.append(True)
        assert outcomes[0] == outcomes[1], f"evict_state: model {outcomes[0]}, impl {outcomes[1]}"
        if not outcomes[0]:
            assert self.observe() == before, "a refused evict_state changed something"
            event("evict_state refused by both")
        else:
            event(f"evict_state on {'L2' if host else 'L1'}")

    @rule()
    def aborted_state(self) -> None:
        """A request takes a state slot and goes away."""
        model_slot = try_alloc(lambda _: self.model.alloc_device_state(), 1)
        impl_slot = try_alloc(lambda _: self.impl.alloc_device_state(), 1)
        assert model_slot == impl_slot
        if model_slot is not None and impl_slot is not None:
            self.model.free_device_state(model_slot)
            self.impl.free_device_state(impl_slot)

    @rule(bad=st.sampled_from(["unheld", "no_pages", "free_unheld", "root"]))
    def misuse_state(self, bad: str) -> None:
        before = self.observe()
        slot = 0  # never held outside a request
        tokens = [7] * self.page_size
        if bad == "unheld":
            both = self.alloc_both(1)
            if both is None:
                return
            fresh, impl_fresh = both
            self.model.free_device(fresh)  # give them back: only the state slot is bad below
            self.impl.free_device(impl_fresh)
            before = self.observe()
            calls = (
                lambda: self.model.insert(tokens, DEFAULT_NAMESPACE, fresh, state_slot=slot),
                lambda: self.impl.insert(tokens, impl_fresh, state_slot=slot),
            )
        elif bad == "no_pages":
            calls = (
                lambda: self.model.insert([], DEFAULT_NAMESPACE, [], state_slot=slot),
                lambda: self.impl.insert([], [], state_slot=slot),
            )
        elif bad == "free_unheld":
            calls = (
                lambda: self.model.free_device_state(slot),
                lambda: self.impl.free_device_state(slot),
            )
        else:
            root = next(iter(self.impl.roots.values()), None)
            if root is None:
                return
            calls = (
                lambda: self.model.evict_state(root.id),
                lambda: self.impl.evict_state(root),
            )
        for call in calls:
            try:
                call()
            except MisuseError:
                pass
            else:
                raise AssertionError(f"state misuse {bad} was accepted")
        assert self.observe() == before, f"state misuse {bad} changed something"
        event(f"state misuse {bad} rejected by both")

    # ------------------------------------------------------------ comparison
    def observe(self) -> tuple[object, object]:
        model_view, impl_view = super().observe()
        seen = sorted(self.seen, key=repr)
        model_states = (
            tuple(self.model.state_residency(t, ns) for ns, t in seen),
            self.model.device_state.free_count,
            self.model.host_state.free_count,
        )
        impl_states = (
            tuple(self.impl.state_residency(t, ns) for ns, t in seen),
            self.impl.device_states_free,
            self.impl.host_states_free,
        )
        return (model_view, model_states), (impl_view, impl_states)
