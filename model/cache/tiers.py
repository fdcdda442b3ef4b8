"""Page residency across L1 (device) and L2 (host): the only module that advances it (SPEC §3).

Write-through, staging, demotion, deletion, L2 eviction, load-back, their acks and failures, and the
pages ``insert`` and a prefetch commit add. Owns the L1/L2 page pools, the scheduler's L1 slots and
the write-through and load-back queues. Invariants upheld here alone:

* every page residency change goes through ``PAGE_RESIDENCY.next`` (:meth:`Tiers.advance_page`);
* a copy op captures the pages (and the end state) it covers when it is enqueued and its ack or
  failure applies to exactly those (I4, the "lost split"); acks are FIFO and a failure fails every
  pending op of its queue, so host (and device) copies stay root-anchored (I3);
* every copy reads its source slot, every slot is freed exactly when its copy is dropped (I5, I7);
  a transfer's allocation is all or nothing over pools (KV pages and the state slot);
* a state moves with its node (write-through, stage, demote, delete, load-back; :mod:`.states` does
  the state's part); acked (or staged) host copies go to the L3 backup queue (``backup``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Sequence

import attrs

from kvstrata.model.cache.clock import Clock
from kvstrata.model.cache.config import CacheConfig, WritePolicy
from kvstrata.model.cache.index import Node, RadixTree, Walk
from kvstrata.model.cache.locks import Locks
from kvstrata.model.cache.node import BackupQueue, CopyOp, PageInfo, PageTable, Placed
from kvstrata.model.cache.states import States
from kvstrata.model.errors import MisuseError
from kvstrata.model.keys import Namespace, PageHash, chain_page_hashes
from kvstrata.model.lifecycles import (
    DEVICE_VALID,
    HOST_CLAIMED,
    HOST_VALID,
    L1_DROPPABLE,
    L1_WITH_L2,
    LOAD_OP,
    PAGE_RESIDENCY,
    WRITE_OP,
    OpEvent,
    Residency,
    ResidencyEvent,
    StateEvent,
)
from kvstrata.model.slots import SlotPool

__all__ = ["Tiers"]


@attrs.define
class Tiers:
    config: CacheConfig
    tree: RadixTree = attrs.field(repr=False)
    clock: Clock = attrs.field(repr=False)
    pages: PageTable = attrs.field(repr=False)
    locks: Locks = attrs.field(repr=False)
    states: States = attrs.field(repr=False)
    # the L3 sink (None without L3), wired by the facade
    backup: BackupQueue | None = attrs.field(default=None, repr=False)
    device: SlotPool = attrs.field(init=False)
    host: SlotPool = attrs.field(init=False)
    write_ops: deque[CopyOp] = attrs.field(init=False, factory=deque)
    load_ops: deque[CopyOp] = attrs.field(init=False, factory=deque)
    scheduler_slots: set[int] = attrs.field(init=False, factory=set)

    def __attrs_post_init__(self) -> None:
        self.device = SlotPool("L1", self.config.device_pages)
        self.host = SlotPool("L2", self.config.host_pages)

    def advance(self, node: Node, event: ResidencyEvent) -> None:
        for page in node.pages:
            self.advance_page(page, event)

    def advance_page(self, page: PageHash, event: ResidencyEvent) -> None:
        info = self.pages.records[page]
        info.residency = PAGE_RESIDENCY.next(info.residency, event)

    def host_claimed_or_root(self, node: Node) -> bool:
        """Enough for a write-through below ``node`` (pending writes fail together)."""
        return node.is_root or self.pages.residency_of(node) in HOST_CLAIMED

    def host_valid_or_root(self, node: Node) -> bool:
        """What a host-only child needs (I3): a write-through in flight may still fail."""
        return node.is_root or self.pages.residency_of(node) in HOST_VALID

    def op_pins(self, node: Node) -> int:
        """Locks held on ``node`` by pending write-throughs and load-backs."""
        return sum(1 for op in (*self.write_ops, *self.load_ops) if op.node_id == node.node_id)

    def pin(self, pages: Iterable[PageHash], delta: int) -> None:
        """Backups pin (+1) and release (-1) the host copies they read."""
        for page in pages:
            self.pages.records[page].host_pins += delta

    def take_device(self, pages: int) -> tuple[int, ...] | None:
        """``pages`` fresh L1 slots for the scheduler, evicting as needed; None if too few. An ask
        that eviction could never meet (more than the free slots plus every unlocked L1 page) is
        refused before anything is evicted."""
        if pages > self.device.free_count + self.locks.evictable_pages:
            return None
        if pages > self.device.free_count:
            self.evict_device(pages - self.device.free_count)
        if pages > self.device.free_count:
            return None
        slots = self.device.alloc(pages)
        self.scheduler_slots.update(slots)
        return slots

    def write_scheduler(self, slot: int, content: Hashable) -> None:
        if slot not in self.scheduler_slots:
            raise MisuseError(f"L1 slot {slot} is not held by the scheduler")
        self.device.write(slot, content)

    def check_scheduler(self, slots: tuple[int, ...]) -> None:
        if len(set(slots)) != len(slots) or not set(slots) <= self.scheduler_slots:
            raise MisuseError(f"L1 slots {slots} are not all held by the scheduler")

    def free_scheduler(self, slots: tuple[int, ...]) -> None:
        self.scheduler_slots.difference_update(slots)
        self.device.free(slots)

    def check_insert(self, walk: Walk, slots: tuple[int, ...]) -> None:
        """Every slot is the scheduler's or the cached L1 slot of its page (``MisuseError``)."""
        cached = [
            self.pages.records[page].device_slot
            if self.pages.residency_of(node) in DEVICE_VALID
            else None
            for node in walk.path
            for page in node.pages
        ]
        for index, slot in enumerate(slots):
            if slot in self.scheduler_slots:
                continue
            if index >= len(cached) or cached[index] != slot:
                raise MisuseError(f"L1 slot {slot} for page {index} is not the scheduler's")

    def place(
        self, walk: Walk, tokens: tuple[int, ...], namespace: Namespace, slots: tuple[int, ...]
    ) -> Placed:
        """Take ownership of ``slots`` along ``walk``: pages held on L1 (or loading) give their
        fresh slot back (duplicates), host-only pages are revived on L1 with it, the rest form a
        new leaf. Below a node still loading back to L1 nothing is revived or added (its slots go
        back too): if that load failed, L1 pages would hang under a host-only parent (I3)."""
        self.scheduler_slots.difference_update(slots)
        duplicates: list[int] = []
        revived = offset = 0
        loading = False  # a node on the path so far is still loading back to L1
        for node in walk.path:
            node.last_access = self.clock.now
            node.hits += 1
            given = slots[offset : offset + len(node.pages)]
            offset += len(node.pages)
            state = self.pages.residency_of(node)
            if loading:
                duplicates.extend(given)
            elif state is Residency.HOST:
                self._revive(node, given)
                revived += len(node.pages)
            else:
                own = [self.pages.records[page].device_slot for page in node.pages]
                duplicates.extend(s for s, o in zip(given, own, strict=True) if s != o)
            loading = loading or state is Residency.LOADING
        new_pages = 0 if loading else len(slots) - walk.matched_pages
        if loading:
            duplicates.extend(slots[walk.matched_pages :])
        self.device.free(duplicates)
        deepest = walk.last
        if new_pages:
            size = self.config.page_size
            leaf_tokens = tokens[walk.matched_pages * size : len(slots) * size]
            pages = chain_page_hashes(leaf_tokens, size, namespace, deepest.last_page)
            deepest = self.tree.add_leaf(deepest, leaf_tokens, pages, self.clock.now)
            for page, slot in zip(pages, slots[walk.matched_pages :], strict=True):
                self.pages.records[page] = PageInfo(Residency.NEW, device_slot=slot)
                self.advance_page(page, ResidencyEvent.INSERT)
            self.locks.count_device(deepest, +1)
        return Placed(deepest, new_pages, revived, len(duplicates), loading)

    def _revive(self, node: Node, slots: Sequence[int]) -> None:
        for page, slot in zip(node.pages, slots, strict=True):
            self.pages.records[page].device_slot = slot
            self.advance_page(page, ResidencyEvent.REVIVE)
        self.locks.count_device(node, +1)

    def add_host_leaf(
        self,
        parent: Node,
        tokens: tuple[int, ...],
        pages: tuple[PageHash, ...],
        slots: Sequence[int],
    ) -> None:
        """A prefetch commit: ``pages`` (already in ``slots``) become a host-only leaf."""
        self.tree.add_leaf(parent, tokens, pages, self.clock.now)
        for page, slot in zip(pages, slots, strict=True):
            self.pages.records[page] = PageInfo(Residency.NEW, host_slot=slot)
            self.advance_page(page, ResidencyEvent.COMMIT_PREFETCH)

    def write_through_hot(self, path: Iterable[Node]) -> None:
        """write_through_selective: write the nodes hit often enough (after a match)."""
        for node in path:
            if node.hits >= self.config.write_through_threshold and (
                self.pages.residency_of(node) is Residency.DEVICE or self.state_alone(node)
            ):
                self.write_through_chain(node)

    def write_through_chain(self, node: Node) -> None:
        """Write ``node`` and its ancestors that have no host copy yet, top-down, as far as L2 room
        allows (host copies stay root-anchored: I3; FIFO acks keep it so while in flight)."""
        if self.config.host_pages == 0:
            return
        chain = [
            n for n in self.tree.ancestors(node) if self.pages.residency_of(n) is Residency.DEVICE
        ]
        for current in reversed(chain):
            parent = self.tree.parent(current)
            assert parent is not None
            if not self.host_claimed_or_root(parent) or not self._alloc_host_for(current):
                return
            self.locks.lock(current, +1)
            self.advance(current, ResidencyEvent.WRITE_START)
            states = self.states.moving(current)
            for page in states:
                self.states.advance(page, StateEvent.WRITE_START)
            op = CopyOp(self.clock.op_id(), current.node_id, current.pages, states=states)
            self.write_ops.append(op)
        if self.state_alone(node):
            self._write_state_through(node)

    def state_alone(self, node: Node) -> bool:
        """Whether ``node``'s end state is on L1 only while its KV has (or is getting) an L2
        copy: a state attached after the node was written through."""
        written = not node.is_root and self.pages.residency_of(node) in L1_WITH_L2
        return written and bool(self.states.moving(node))

    def _write_state_through(self, node: Node) -> None:
        """A state-only write-through (queued behind the node's own, FIFO), if L2 has room."""
        with self.locks.shield(node):
            room = self.states.free_slot(host=True)
        if not room:
            return
        (page,) = self.states.moving(node)
        self.states.reserve_host(page)
        self.locks.lock(node, +1)
        self.states.advance(page, StateEvent.WRITE_START)
        self.write_ops.append(CopyOp(self.clock.op_id(), node.node_id, (), states=(page,)))

    def _alloc_host_for(self, node: Node) -> bool:
        """Give every page of ``node`` a host slot, and its L1-only end state a host state slot
        (evicting L2 if needed); all or nothing: False, nothing allocated, if impossible."""
        needed = len(node.pages)
        if needed > self.host.free_count:
            with self.locks.shield(node):
                self.evict_host(needed - self.host.free_count)
        if needed > self.host.free_count:
            return False
        states = self.states.moving(node)
        if states:
            with self.locks.shield(node):
                room = self.states.free_slot(host=True)
            if not room:
                return False
            self.states.reserve_host(states[0])
        for page, slot in zip(node.pages, self.host.alloc(needed), strict=True):
            self.pages.records[page].host_slot = slot
        return True

    def check_copy(self, ops: deque[CopyOp], event: OpEvent) -> None:
        """``MisuseError`` (nothing changed) unless the queue's ops may take ``event``."""
        if not ops:
            kind = "write-through" if ops is self.write_ops else "load-back"
            raise MisuseError(f"no {kind} is pending")
        lifecycle = WRITE_OP if ops is self.write_ops else LOAD_OP
        for op in ops if event is OpEvent.FAIL else (ops[0],):
            lifecycle.next(op.state, event)

    def ack_write(self) -> int:
        """The oldest pending write-through completes (FIFO); its pages go to the backup queue."""
        op = self.write_ops.popleft()
        op.state = WRITE_OP.next(op.state, OpEvent.ACK)
        for page in op.pages:
            info = self.pages.records[page]
            assert info.device_slot is not None and info.host_slot is not None
            self.host.write(info.host_slot, self.device.read(info.device_slot))
            self.advance_page(page, ResidencyEvent.WRITE_ACK)
        for page in op.states:
            self.states.copy(page, to_host=True)
            self.states.advance(page, StateEvent.WRITE_ACK)
        self.locks.lock(self.tree.node(op.node_id), -1)
        node = self.tree.node(op.node_id)
        if self.backup is not None:
            self.backup.enqueue(node.namespace, op.pages, op.states)
        return len(op.pages)

    def fail_copies(self, ops: deque[CopyOp]) -> int:
        """Every pending op of ``ops`` (write-throughs or load-backs) fails, FIFO: the pages stay
        where their source is and the destination slots (and state slots) go back."""
        to_host = ops is self.write_ops
        lifecycle, event = (
            (WRITE_OP, ResidencyEvent.WRITE_FAIL)
            if to_host
            else (LOAD_OP, ResidencyEvent.LOAD_FAIL)
        )
        pages = 0
        while ops:
            op = ops.popleft()
            op.state = lifecycle.next(op.state, OpEvent.FAIL)
            slots = []
            for page in op.pages:
                info = self.pages.records[page]
                slot = info.host_slot if to_host else info.device_slot
                assert slot is not None
                slots.append(slot)
                if to_host:
                    info.host_slot = None
                else:
                    info.device_slot = None
                self.advance_page(page, event)
            (self.host if to_host else self.device).free(slots)
            for page in op.states:
                self.states.copy_fail(page, to_host=to_host)
            self.locks.lock(self.tree.node(op.node_id), -1)
            pages += len(op.pages)
        return pages

    def evict_device(self, pages: int) -> int:
        """Free at least ``pages`` L1 pages if possible (LRU over unlocked L1 leaves): demote nodes
        with a host copy, stage (write_back) or delete the others."""
        freed = 0
        while freed < pages:
            leaves = self.locks.device_victims()
            if not leaves:
                break
            node = leaves[0]
            freed += len(node.pages)
            slots = [self.pages.device_slot(page) for page in node.pages]
            self.locks.count_device(node, -1)
            state = self.pages.residency_of(node)
            if state is Residency.BOTH:
                self.advance(node, ResidencyEvent.DEMOTE)
                if self.states.state_of(node.pages[-1]) in L1_DROPPABLE:
                    self.states.drop(node.pages[-1], host=False)
            elif self.config.write_policy is WritePolicy.WRITE_BACK and self._stage(node):
                pass
            else:
                self.advance(node, ResidencyEvent.DELETE)
                self._forget(node)
            for page in node.pages:
                if page in self.pages.records:
                    self.pages.records[page].device_slot = None
            self.device.free(slots)
        return freed

    def _stage(self, node: Node) -> bool:
        """write_back: copy an evicted L1-only node to L2 (blocking) if it keeps I3 and fits."""
        parent = self.tree.parent(node)
        if parent is None or not self.host_valid_or_root(parent) or self.config.host_pages == 0:
            return False
        if not self._alloc_host_for(node):
            return False
        for page in node.pages:
            info = self.pages.records[page]
            assert info.device_slot is not None and info.host_slot is not None
            self.host.write(info.host_slot, self.device.read(info.device_slot))
        self.advance(node, ResidencyEvent.STAGE)
        states = self.states.moving(node)
        for page in states:
            self.states.stage(page)
        if self.backup is not None:
            self.backup.enqueue(node.namespace, node.pages, states)
        return True

    def _forget(self, node: Node) -> None:
        """Drop a deleted node: its page records, and the state at its end with its slot."""
        self.states.forget(node)
        for page in node.pages:
            del self.pages.records[page]
        self.tree.remove_leaf(node)

    def evict_host(self, pages: int) -> int:
        """Free at least ``pages`` L2 pages if possible (LRU over unpinned host-only leaves)."""
        freed = 0
        while freed < pages:
            leaves = self.locks.host_victims()
            if not leaves:
                break
            node = leaves[0]
            slots = [self.pages.records[page].host_slot for page in node.pages]
            self.advance(node, ResidencyEvent.DELETE)
            self._forget(node)
            self.host.free(slot for slot in slots if slot is not None)
            freed += len(slots)
        return freed

    def load_back(self, node: Node) -> int | None:
        """Start loading the host-only chain that ends at ``node`` back to L1, all or nothing; None
        if skipped (threshold, quota, no room). The state at ``node``'s end comes along if it is
        on L2 only (its L1 slot is part of the allocation); a state-only load moves no KV, so the
        threshold and the quota (they bound KV pages) do not apply to it."""
        chain: list[Node] = []
        for current in self.tree.ancestors(node):
            if self.pages.residency_of(current) is not Residency.HOST:
                break
            chain.append(current)
        chain.reverse()
        pages = sum(len(n.pages) for n in chain)
        quota = self.config.load_back_quota
        end_state = None if node.is_root else self.states.state_of(node.pages[-1])
        states = (node.pages[-1],) if end_state is Residency.HOST else ()
        too_few = pages * self.config.page_size < self.config.load_back_threshold
        if (not chain and not states) or (
            chain and (too_few or (quota is not None and pages > quota))
        ):
            return None
        self.locks.lock(node, +1)
        if pages > self.device.free_count:
            self.evict_device(pages - self.device.free_count)
        if pages > self.device.free_count or (states and not self.states.free_slot(host=False)):
            self.locks.lock(node, -1)
            return None
        for current in chain:
            slots = self.device.alloc(len(current.pages))
            for page, slot in zip(current.pages, slots, strict=True):
                self.pages.records[page].device_slot = slot
            self.advance(current, ResidencyEvent.LOAD_START)
        for page in states:
            self.states.load_start(page)
        covered = tuple(page for current in chain for page in current.pages)
        op = CopyOp(self.clock.op_id(), node.node_id, covered, states=states)
        self.load_ops.append(op)
        return op.op_id

    def ack_load(self) -> int:
        """The oldest pending load-back completes (FIFO); its nodes become L1-valid and unpinned."""
        op = self.load_ops.popleft()
        op.state = LOAD_OP.next(op.state, OpEvent.ACK)
        node = self.tree.node(op.node_id)
        for page in op.pages:
            info = self.pages.records[page]
            assert info.device_slot is not None and info.host_slot is not None
            self.device.write(info.device_slot, self.host.read(info.host_slot))
            self.advance_page(page, ResidencyEvent.LOAD_ACK)
        for page in op.states:
            self.states.copy(page, to_host=False)
            self.states.advance(page, StateEvent.LOAD_ACK)
        for current in self.tree.ancestors(node):
            if current.pages[0] in op.pages:
                self.locks.count_device(current, +1)
        self.locks.lock(node, -1)
        return len(op.pages)
