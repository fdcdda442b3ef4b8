"""The invariants of SPEC §7, each a function over a :class:`CacheView` (what
:class:`~kvstrata.model.cache.CacheModel` shows of its pieces).

:func:`check_cache` runs them all; the model calls it after every public operation (``config.check``),
and the stateful tests call it again after every step. Each raises :class:`InvariantViolation` naming the
invariant, with the bug it prevents in its docstring.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence, Set
from typing import TYPE_CHECKING, NoReturn, Protocol

from kvstrata.model.errors import InvariantViolation, KeyParseError
from kvstrata.model.hybrid import KV_POOL, side_components
from kvstrata.model.keys import PageHash, parse_store_key, render_store_key
from kvstrata.model.lifecycles import (
    DEVICE_CLAIMED,
    DEVICE_VALID,
    HOST_CLAIMED,
    HOST_VALID,
    BackupState,
    PrefetchState,
    Residency,
)

if TYPE_CHECKING:
    from kvstrata.model.cache.config import CacheConfig
    from kvstrata.model.cache.index import Node, RadixTree
    from kvstrata.model.cache.node import CopyOp, PageInfo
    from kvstrata.model.l3.backup import BackupOp
    from kvstrata.model.l3.prefetch import PrefetchOp
    from kvstrata.model.slots import SlotPool
    from kvstrata.model.store import StoreModel

__all__ = [
    "ALL_CHECKS",
    "CacheView",
    "check_accounting",
    "check_cache",
    "check_i1_keys",
    "check_i2_visible_durable",
    "check_i3_host_anchored",
    "check_i4_coverage",
    "check_i5_slots",
    "check_i6_reported",
    "check_i6_states",
    "check_i7_contents",
    "check_i8_hashes",
]


class CacheView(Protocol):
    """What the invariants read of a cache model (``CacheModel`` is one): its configuration, store
    and tree, the records, queues and pools its pieces own, and its counters."""

    @property
    def config(self) -> CacheConfig: ...
    @property
    def store(self) -> StoreModel: ...
    @property
    def tree(self) -> RadixTree: ...
    @property
    def page_info(self) -> Mapping[PageHash, PageInfo]: ...
    @property
    def state_info(self) -> Mapping[PageHash, PageInfo]: ...
    @property
    def write_ops(self) -> Iterable[CopyOp]: ...
    @property
    def load_ops(self) -> Iterable[CopyOp]: ...
    @property
    def backup_ops(self) -> Collection[BackupOp]: ...
    @property
    def prefetch_ops(self) -> Mapping[int, PrefetchOp]: ...
    @property
    def scheduler_slots(self) -> Set[int]: ...
    @property
    def scheduler_state_slots(self) -> Set[int]: ...
    @property
    def device(self) -> SlotPool: ...
    @property
    def host(self) -> SlotPool: ...
    @property
    def device_state(self) -> SlotPool: ...
    @property
    def host_state(self) -> SlotPool: ...
    @property
    def evictable_pages(self) -> int: ...
    @property
    def protected_pages(self) -> int: ...
    @property
    def has_states(self) -> bool: ...
    def residency_of(self, node: Node) -> Residency | None: ...
    def state_content(self, page: PageHash) -> Hashable: ...
    def prefetch_reserved(self) -> int: ...


def _fail(invariant: str, detail: str) -> NoReturn:
    raise InvariantViolation(invariant, detail)


def check_i1_keys(cache: CacheView) -> None:
    """I1: every key in the store was built by the one schema function and parses back (prevents
    the double tag: a key tagged twice never parses, and every lookup of it would miss), and lies
    in this cache's key space: its model, shard, tag and schema version, and a pool of this cache
    (by its key segment, so a side pool's layout included) with one of the objects that pool's
    entry is under that version (the KV components, or a side pool's
    :func:`~kvstrata.model.hybrid.side_components`)."""
    keys = cache.config.keys
    store = cache.store
    # the objects each pool's entry is stored as under the key space's schema version
    objects = {} if keys is None else {KV_POOL: keys.components}
    if keys is not None:
        objects.update(
            {pool.segment: side_components(keys, pool) for pool in cache.config.side_pools}
        )
    for key in [
        *(k for k, _ in store.visible_items()),
        *store.writing_keys(),
        *store.lagging_keys(),
    ]:
        try:
            parts = parse_store_key(key)
        except KeyParseError as exc:
            _fail("I1", f"store holds a key the schema did not make: {key.text!r} ({exc})")
        if render_store_key(parts) != key:
            _fail("I1", f"key does not render back to itself: {key.text!r}")
        if keys is not None and (
            parts.model != keys.model
            or parts.shard != keys.shard
            or parts.tag != keys.tag
            or parts.version != keys.schema
            or parts.component not in objects.get(parts.pool, ())
        ):
            _fail("I1", f"key outside this cache's key space: {key.text!r}")


def check_i2_visible_durable(cache: CacheView) -> None:
    """I2: a visible object holds exactly the bytes its key names (prevents hits on partial or
    poisoned objects: a stale offset pushed to the store would hold another page's bytes)."""
    for key, content in cache.store.visible_items():
        parts = parse_store_key(key)
        if content != (parts.page_hash, parts.component):
            _fail("I2", f"store object {key.text!r} holds {content!r}")
    visible = {k for k, _ in cache.store.visible_items()}
    writing, lagging = cache.store.writing_keys(), cache.store.lagging_keys()
    overlap = (visible & writing) | (visible & lagging) | (writing & lagging)
    if overlap:
        _fail("I2", f"keys in two of visible/writing/lagging: {sorted(k.text for k in overlap)}")


def check_i3_host_anchored(cache: CacheView) -> None:
    """I3: nodes with a host copy (or one on its way) form a root-anchored prefix, and so do nodes
    with a device copy (prevents load-back of a chain with a hole, and L2 hits that cannot be
    reached). Stricter, so a copy that may still fail never carries a finished one: a node whose
    L2 (L1) copy is readable sits under a node whose copy is readable too (a failed write-through
    or load-back takes back only a claim, never a parent of a finished child)."""
    tree = cache.tree
    for node in tree.non_root_nodes():
        parent = tree.parent(node)
        assert parent is not None
        if parent.is_root:
            continue
        state, parent_state = cache.residency_of(node), cache.residency_of(parent)
        if state in HOST_CLAIMED and parent_state not in HOST_CLAIMED:
            _fail("I3", f"node {node.node_id} ({state}) under {parent.node_id} ({parent_state})")
        if state in DEVICE_CLAIMED and parent_state not in DEVICE_CLAIMED:
            _fail("I3", f"L1 node {node.node_id} ({state}) under {parent.node_id} ({parent_state})")
        if state in HOST_VALID and parent_state not in HOST_VALID:
            _fail(
                "I3",
                f"L2-readable {node.node_id} ({state}) under {parent.node_id} ({parent_state})",
            )
        if state in DEVICE_VALID and parent_state not in DEVICE_VALID:
            _fail(
                "I3",
                f"L1-readable {node.node_id} ({state}) under {parent.node_id} ({parent_state})",
            )


def check_i4_coverage(cache: CacheView) -> None:
    """I4: every page waiting for a copy is covered by exactly one pending op, and every op covers
    exactly pages in the matching state (prevents the lost split: an op that follows a node instead of
    its enqueued range leaves the split-off prefix without a host copy or without a backup)."""
    writing = Counter(page for op in cache.write_ops for page in op.pages)
    loading = Counter(page for op in cache.load_ops for page in op.pages)
    backing = Counter(
        page for op in cache.backup_ops if op.state is not BackupState.DONE for page in op.pages
    )
    for page, info in cache.page_info.items():
        expect_w = 1 if info.residency is Residency.WRITING else 0
        expect_l = 1 if info.residency is Residency.LOADING else 0
        if writing.get(page, 0) != expect_w:
            _fail(
                "I4", f"{page} is {info.residency.value} but {writing.get(page, 0)} writes cover it"
            )
        if loading.get(page, 0) != expect_l:
            _fail(
                "I4", f"{page} is {info.residency.value} but {loading.get(page, 0)} loads cover it"
            )
        if backing.get(page, 0) != info.host_pins:
            _fail("I4", f"{page} has {info.host_pins} host pins, {backing.get(page, 0)} backups")
    for page in [*writing, *loading, *backing]:
        if page not in cache.page_info:
            _fail("I4", f"an op covers {page}, which is no longer cached")
    for op in cache.backup_ops:
        if not op.pages and not op.states:
            _fail("I4", f"backup op {op.op_id} covers nothing")
    s_writing = Counter(page for op in cache.write_ops for page in op.states)
    s_loading = Counter(page for op in cache.load_ops for page in op.states)
    s_backing = Counter(
        page for op in cache.backup_ops if op.state is not BackupState.DONE for page in op.states
    )
    for page, info in cache.state_info.items():
        expect_w = 1 if info.residency is Residency.WRITING else 0
        expect_l = 1 if info.residency is Residency.LOADING else 0
        if (s_writing.get(page, 0), s_loading.get(page, 0)) != (expect_w, expect_l):
            _fail("I4", f"state of {page} is {info.residency.value} but ops cover it otherwise")
        if s_backing.get(page, 0) != info.host_pins:
            _fail(
                "I4", f"state of {page} has {info.host_pins} pins, {s_backing.get(page, 0)} backups"
            )
    for page in [*s_writing, *s_loading, *s_backing]:
        if page not in cache.state_info:
            _fail("I4", f"an op covers the state of {page}, which is no longer cached")


def check_i5_slots(cache: CacheView) -> None:
    """I5: every allocated slot is referenced exactly once (by a page or a prefetch op) and no page
    references a free slot (prevents use-after-free and double free of L1/L2 pages)."""
    device: Counter[int] = Counter()
    host: Counter[int] = Counter()
    for page, info in cache.page_info.items():
        has_device = info.device_slot is not None
        has_host = info.host_slot is not None
        if has_device != (info.residency in DEVICE_CLAIMED):
            _fail("I5", f"{page} is {info.residency.value} with device slot {info.device_slot}")
        if has_host != (info.residency in HOST_CLAIMED):
            _fail("I5", f"{page} is {info.residency.value} with host slot {info.host_slot}")
        if info.device_slot is not None:
            device[info.device_slot] += 1
        if info.host_slot is not None:
            host[info.host_slot] += 1
    for op in cache.prefetch_ops.values():
        for slot in op.held_slots:
            host[slot] += 1
    for slot in cache.scheduler_slots:
        device[slot] += 1
    device_state: Counter[int] = Counter(cache.scheduler_state_slots)
    host_state: Counter[int] = Counter()
    for page, info in cache.state_info.items():
        if (info.device_slot is not None) != (info.residency in DEVICE_CLAIMED):
            _fail("I5", f"state of {page} is {info.residency.value}, L1 slot {info.device_slot}")
        if (info.host_slot is not None) != (info.residency in HOST_CLAIMED):
            _fail("I5", f"state of {page} is {info.residency.value}, L2 slot {info.host_slot}")
        if info.device_slot is not None:
            device_state[info.device_slot] += 1
        if info.host_slot is not None:
            host_state[info.host_slot] += 1
    for op in cache.prefetch_ops.values():
        if op.held_state_slot is not None:
            host_state[op.held_state_slot] += 1
    for name, counts, pool in (
        ("L1", device, cache.device),
        ("L2", host, cache.host),
        ("L1-state", device_state, cache.device_state),
        ("L2-state", host_state, cache.host_state),
    ):
        shared = [slot for slot, n in counts.items() if n > 1]
        if shared:
            _fail("I5", f"{name} slots referenced twice: {shared}")
        if set(counts) != pool.allocated():
            _fail(
                "I5",
                f"{name} allocated {sorted(pool.allocated())} but referenced {sorted(counts)}",
            )


def check_i7_contents(cache: CacheView) -> None:
    """I7: every valid copy holds the bytes of its own page (prevents reading a slot that was never
    filled, or one refilled for another page)."""
    for page, info in cache.page_info.items():
        if info.residency in DEVICE_VALID:
            assert info.device_slot is not None
            if cache.device.read(info.device_slot) != page:
                _fail("I7", f"L1 slot {info.device_slot} of {page} holds another page")
        if info.residency in HOST_VALID:
            assert info.host_slot is not None
            if cache.host.read(info.host_slot) != page:
                _fail("I7", f"L2 slot {info.host_slot} of {page} holds another page")
    for op in cache.prefetch_ops.values():
        for index in range(op.released, op.arrived):
            if cache.host.read(op.host_slots[index]) != op.pages[index]:
                _fail("I7", f"prefetch {op.op_id} page {index} holds another page")
        slot = op.held_state_slot
        if (
            slot is not None
            and op.state_page is not None
            and cache.host_state.read(slot) != cache.state_content(op.state_page)
        ):
            _fail("I7", f"prefetch {op.op_id} state slot {slot} holds another state")
    for page, info in cache.state_info.items():
        expected = cache.state_content(page)
        if info.residency in DEVICE_VALID:
            assert info.device_slot is not None
            if cache.device_state.read(info.device_slot) != expected:
                _fail("I7", f"L1 state slot {info.device_slot} of {page} holds another state")
        if info.residency in HOST_VALID:
            assert info.host_slot is not None
            if cache.host_state.read(info.host_slot) != expected:
                _fail("I7", f"L2 state slot {info.host_slot} of {page} holds another state")


def check_i6_states(cache: CacheView) -> None:
    """I6 (tree): what ``match_prefix`` relies on to report only usable prefixes. Every state sits at the
    end of a node (a split never moves one: the new node end simply has none; a state attached to
    another page of its node would name a prefix no match ends at), and a state is valid (or holds
    a slot) in a tier only where its page is (a state on L1 whose KV is not would make an L1 prefix
    look usable). No state exists without a ``TRAILING_PAGES`` pool."""
    if cache.state_info and not cache.has_states:
        _fail("I6", "states cached without a TRAILING_PAGES side pool")
    ends = {node.pages[-1] for node in cache.tree.non_root_nodes()}
    for page, info in cache.state_info.items():
        if page not in ends:
            _fail("I6", f"state of {page} is not at a node end")
        page_state = cache.page_info[page].residency
        for group in (DEVICE_VALID, DEVICE_CLAIMED, HOST_VALID, HOST_CLAIMED):
            if info.residency in group and page_state not in group:
                _fail(
                    "I6", f"state of {page} is {info.residency.value}, its page {page_state.value}"
                )


def check_i6_reported(
    cache: CacheView, pages: Sequence[PageHash], device_pages: int, host_pages: int
) -> None:
    """I6 (tree): a prefix ``match_prefix`` reports over ``pages`` (the page hashes along its path) is
    usable in every pool of the tier it is read from: the first ``device_pages`` pages are valid on
    L1 and, with a ``TRAILING_PAGES`` pool, so is the state at the last of them; the next
    ``host_pages`` are valid on L2 and so is the state at the last of them. ``ALL_PAGES`` pools
    share the KV page's slots on L1/L2, so the KV check covers them (prevents reporting a prefix
    whose Mamba state was evicted or never existed, e.g. after a split)."""
    if device_pages + host_pages > len(pages):
        _fail("I6", f"reported {device_pages}+{host_pages} pages of a {len(pages)}-page path")
    reported = (
        (DEVICE_VALID, pages[:device_pages], "L1"),
        (HOST_VALID, pages[device_pages : device_pages + host_pages], "L2"),
    )
    for valid, part, tier in reported:
        for page in part:
            info = cache.page_info.get(page)
            if info is None or info.residency not in valid:
                _fail("I6", f"reported {page} as usable on {tier}, it is not there")
        if part and cache.has_states:
            state = cache.state_info.get(part[-1])
            if state is None or state.residency not in valid:
                _fail(
                    "I6", f"reported an {tier} prefix ending at {part[-1]} without its state there"
                )


def check_i8_hashes(cache: CacheView) -> None:
    """I8: every node's page hashes are what the chain function gives for its tokens and its parent
    (deterministic, namespace-seeded keys; prevents keys that differ between processes or runs)."""
    for node in cache.tree.non_root_nodes():
        if node.pages != cache.tree.expected_pages(node):
            _fail("I8", f"node {node.node_id} holds page hashes its tokens do not give")


def check_accounting(cache: CacheView) -> None:
    """Accounting: the tree's shape, locks and sizes agree with what the cache counts (prevents
    evicting locked nodes, leaking pages, or refusing work because of a drifted counter)."""
    tree = cache.tree
    size = tree.page_size
    for node_id, node in tree.nodes.items():
        if node.node_id != node_id:
            _fail("accounting", f"node {node_id} filed under the wrong id")
        if node.is_root:
            if tree.roots.get(node.namespace) != node_id:
                _fail("accounting", f"stray root {node_id}")
            continue
        if not node.pages or len(node.tokens) != len(node.pages) * size:
            _fail("accounting", f"node {node_id} has {len(node.tokens)} tokens")
        states = {cache.page_info[page].residency for page in node.pages}
        if len(states) != 1:
            _fail("accounting", f"node {node_id} mixes residencies {states}")
        parent = tree.parent(node)
        if parent is None or parent.children.get(node.tokens[:size]) != node_id:
            _fail("accounting", f"node {node_id} is not its parent's child")
        if parent.namespace != node.namespace:
            _fail("accounting", f"node {node_id} crosses namespaces")
    in_tree = [page for node in tree.non_root_nodes() for page in node.pages]
    if len(in_tree) != len(set(in_tree)) or set(in_tree) != set(cache.page_info):
        _fail("accounting", "pages in the tree and page records differ")
    subtree_pins: dict[int, int] = {}
    for node in sorted(tree.nodes.values(), key=lambda n: -len(tree.prefix_tokens(n))):
        total = node.pins + sum(subtree_pins[child] for child in node.children.values())
        subtree_pins[node.node_id] = total
        if not node.is_root and node.lock_ref != total:
            _fail("accounting", f"node {node.node_id} lock_ref {node.lock_ref} != {total}")
    evictable = protected = 0
    for node in tree.non_root_nodes():
        if cache.residency_of(node) in DEVICE_VALID:
            if node.lock_ref:
                protected += len(node.pages)
            else:
                evictable += len(node.pages)
    if (evictable, protected) != (cache.evictable_pages, cache.protected_pages):
        _fail(
            "accounting",
            f"evictable/protected {cache.evictable_pages}/{cache.protected_pages}, "
            f"tree says {evictable}/{protected}",
        )
    reserved = cache.prefetch_reserved()
    if reserved > cache.config.host_pages // 2:
        _fail("accounting", f"prefetch holds {reserved} host pages, over half of L2")
    for op in cache.prefetch_ops.values():
        if op.state is PrefetchState.DONE:
            _fail("accounting", f"finished prefetch {op.op_id} still listed")
        if not op.arrived <= op.limit <= len(op.pages) == len(op.host_slots):
            _fail("accounting", f"prefetch {op.op_id} counters out of range")


ALL_CHECKS: tuple[Callable[[CacheView], None], ...] = (
    check_i1_keys,
    check_i2_visible_durable,
    check_i3_host_anchored,
    check_i4_coverage,
    check_i5_slots,
    check_i6_states,
    check_i7_contents,
    check_i8_hashes,
    check_accounting,
)


def check_cache(cache: CacheView) -> None:
    """Run every invariant; raises :class:`InvariantViolation` at the first one that fails."""
    for check in ALL_CHECKS:
        check(cache)
