"""Page residency: the only module that moves a node's pages between L1 and L2 (SPEC §3; model:
``kvstrata.model.cache.tiers``): write-through, demotion, write_back staging, L2 eviction, load-back,
and what a copy's ack or failure does (the queues of pending copies: :mod:`.copies`).

Invariants: residency changes only through ``PAGE_RESIDENCY`` (:meth:`Tiers.advance`) and a state
moves with its node's pages (:mod:`.states`); I3, host-backed nodes form a root-anchored prefix
(write-throughs start under a host-claimed parent, host-only nodes under a readable one, or the
root; L2 eviction takes host-only leaves); a copy pins its source until acked and an ack reaches
every node the op covers, splits included (I4); a failed copy gives its destination back and leaves
the source as it was; a host page a backup reads (``backup_pins``) is never evicted or reused (I5).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np

from kvstrata.impl.cache.clock import StepClock
from kvstrata.impl.cache.copies import CopyQueues
from kvstrata.impl.cache.index import TreeIndex
from kvstrata.impl.cache.locks import LockBook, is_device_leaf
from kvstrata.impl.cache.node import Allocator, CacheStats, CopyOp, Node, Pages
from kvstrata.impl.cache.pages import EMPTY
from kvstrata.impl.cache.states import StateBook
from kvstrata.impl.config import RadixCacheConfig
from kvstrata.impl.transfer import Direction, PoolTransfer, TransferController
from kvstrata.model.cache import WritePolicy
from kvstrata.model.keys import Namespace
from kvstrata.model.lifecycles import (
    HOST_CLAIMED,
    HOST_VALID,
    LOAD_OP,
    PAGE_RESIDENCY,
    WRITE_OP,
    OpEvent,
    Residency,
    ResidencyEvent,
)

__all__ = ["BackupSink", "Tiers"]

_HOST_CLAIMED_T = tuple(HOST_CLAIMED)
_HOST_VALID_T = tuple(HOST_VALID)

#: where pages that reached L2 go for an L3 backup: (namespace, nodes, node whose end state goes too)
BackupSink = Callable[[Namespace, list[Node], Node | None], None]


class Tiers:
    """See the module docstring. ``host`` / ``transfer`` are ``None`` without an L2; ``copy_now``
    is the blocking copy ``write_back`` stages with."""

    def __init__(
        self,
        config: RadixCacheConfig,
        clock: StepClock,
        index: TreeIndex,
        locks: LockBook,
        states: StateBook,
        *,
        device: Allocator,
        host: Allocator | None,
        transfer: TransferController | None,
        copy_now: Callable[[Direction, Pages, Pages], int] | None,
        side_copy_now: Callable[[Direction, PoolTransfer], int] | None,
    ) -> None:
        self.config = config
        self._clock = clock
        self._index = index
        self._locks = locks
        self._states = states
        self.device = device
        self.host = host
        self.transfer = transfer
        self._copy_now = copy_now
        self._side_copy_now = side_copy_now
        self.copies = CopyQueues(clock)
        self.stats = CacheStats()
        self.page_nbytes = 0  # bytes of one KV page (for the byte counters)
        self.backup: BackupSink | None = None  # set when an L3 tier is attached

    has_host = property(lambda self: self.host is not None)
    device_free = property(lambda self: self.device.free_count)
    host_free = property(lambda self: 0 if self.host is None else self.host.free_count)

    def flush(self) -> None:
        """Hand the copies queued by this call to the transfer worker (one batch per direction)."""
        if self.transfer is not None:
            self.transfer.flush()

    def advance(self, node: Node, event: ResidencyEvent) -> None:
        assert node.state is not None
        node.state = PAGE_RESIDENCY.next(node.state, event)
        self._clock.version += 1

    # ------------------------------------------------------------------ insert
    def add_device_leaf(self, parent: Node, fps: bytes, hashes: object, pages: Pages) -> Node:
        """A new leaf under ``parent`` holding freshly computed L1 ``pages`` (INSERT)."""
        leaf = self._index.add_leaf(parent, fps, hashes)  # type: ignore[arg-type]
        self._locks.push(leaf)
        self.advance(leaf, ResidencyEvent.INSERT)
        leaf.device = pages
        self._locks.count_device(leaf, +1)
        return leaf

    def adopt(self, path: list[Node], given: Pages) -> tuple[int, int, bool]:
        """The cached ``path`` takes its pages of ``given``: host-only nodes are revived with them; a
        given page where the tree holds one (valid or loading) is spare and freed; below a loading
        node nothing is adopted (I3 if it fails). Returns (revived, spare, whether loading cut it)."""
        revived = 0
        offset = 0
        owned: list[Pages] = []
        loading = False
        for node in path:
            pages = node.num_pages
            if node.state is Residency.LOADING:  # nothing below it is adopted (I3 if it fails)
                assert node.device is not None
                owned.append(node.device)
                offset += pages
                loading = True
                break
            if node.state is Residency.HOST:
                node.device = given[offset : offset + pages].copy()
                self.advance(node, ResidencyEvent.REVIVE)
                self._locks.count_device(node, +1)
                revived += pages
            assert node.device is not None
            owned.append(node.device)
            offset += pages
        if not owned:
            return revived, 0, False
        head = given[:offset]
        spare = head[np.concatenate(owned) != head]
        if loading:
            spare = np.concatenate([spare, given[offset:]])
        return revived, self.give_back(spare), loading

    def give_back(self, spare: Pages) -> int:
        """Free given pages the tree did not need (it holds those positions already)."""
        if len(spare):
            self.device.free(spare)
        return len(spare)

    # ------------------------------------------------------------------ write-through
    def write_through_chain(self, node: Node) -> None:
        """Start a write-through of every L1-only node on ``node``'s path (root side first, each
        under a host-claimed parent: I3), and of ``node``'s end state if it alone is missing."""
        transfer = self.transfer
        if self.host is None or transfer is None:
            return
        states = self._states
        chain = [n for n in self._index.ancestors(node) if n.state is Residency.DEVICE]
        for current in reversed(chain):
            parent = current.parent
            assert parent is not None
            if not (parent.is_root or parent.state in _HOST_CLAIMED_T):
                return
            host = self._alloc_host_for(current)
            if host is None:
                return
            current.host = host
            self._locks.lock(current, +1)
            self.advance(current, ResidencyEvent.WRITE_START)
            op = CopyOp(self._clock.new_op(), Direction.WRITE, current, [current])
            side: tuple[PoolTransfer, ...] = ()
            if states.enabled and states.moving(current) is not None:
                op.state_node = current  # its host slot came with the pages (_alloc_host_for)
                side = states.start_copy(current, write=True)
            current.write_op = op
            self.copies.write.append(op)
            assert current.device is not None
            transfer.enqueue(Direction.WRITE, op.op_id, current.device, host, side)
        if states.enabled and states.alone(node):
            self._write_state_through(node)

    def _write_state_through(self, node: Node) -> None:
        """A state-only write-through of ``node``'s end state (queued FIFO behind the node's own
        write-through), if L2 has a state slot (dropping the LRU idle L2 state copy if needed)."""
        assert self.transfer is not None
        states = self._states
        LockBook.raw_lock(node, +1)
        room = states.make_room(host=True)
        LockBook.raw_lock(node, -1)
        if not room:
            return
        states.info[node].host = states.alloc(host=True)
        self._locks.lock(node, +1)
        op = CopyOp(self._clock.new_op(), Direction.WRITE, node, [], state_node=node)
        self.copies.write.append(op)
        side = states.start_copy(node, write=True)
        self.transfer.enqueue(Direction.WRITE, op.op_id, EMPTY, EMPTY, side)

    def _alloc_host_for(self, node: Node) -> Pages | None:
        """Host pages for every page of ``node`` and, with states, a host state slot for its L1-only
        end state (set on its :class:`StateInfo`), evicting L2 if needed: all or nothing."""
        host = self.host
        assert host is not None
        needed = node.num_pages
        if needed > host.free_count:
            LockBook.raw_lock(node, +1)
            self.evict_host(needed - host.free_count)
            LockBook.raw_lock(node, -1)
        if needed > host.free_count:
            return None
        states = self._states
        if states.enabled:
            info = states.moving(node)
            if info is not None:
                LockBook.raw_lock(node, +1)
                room = states.make_room(host=True)
                LockBook.raw_lock(node, -1)
                if not room:
                    return None
                info.host = states.alloc(host=True)
        return np.asarray(host.alloc(needed), dtype=np.int64)

    # ------------------------------------------------------------------ eviction
    def evict_device(self, pages: int) -> int:
        """Free at least ``pages`` L1 pages if possible (LRU over unlocked L1 leaves): a leaf with
        a host copy is demoted, one without is deleted (or staged under ``write_back``)."""
        if pages <= 0:
            return 0
        locks = self._locks
        locks.compact(self._index.nodes)
        states = self._states
        freed = 0
        released_all: list[Pages] = []  # freed in one allocator call at the end
        while freed < pages:
            node = locks.pop_leaf()
            if node is None:
                break
            assert node.device is not None
            released = node.device
            freed += node.num_pages
            locks.count_device(node, -1)
            parent = node.parent
            if node.state is Residency.BOTH:
                self.advance(node, ResidencyEvent.DEMOTE)
                if states.enabled:
                    states.drop_device_copy(node)
            elif not (self.config.write_policy is WritePolicy.WRITE_BACK and self._stage(node)):
                self.advance(node, ResidencyEvent.DELETE)
                if states.enabled:
                    states.forget(node)
                self._index.remove_leaf(node)
            node.device = None
            released_all.append(released)
            if parent is not None and not parent.is_root and is_device_leaf(parent):
                locks.push(parent)
        if released_all:
            self.device.free(
                released_all[0] if len(released_all) == 1 else np.concatenate(released_all)
            )
        return freed

    def _stage(self, node: Node) -> bool:
        """write_back: a blocking L1 -> L2 copy of an evicted L1-only node, if it keeps I3."""
        parent = node.parent
        host_pool = self.host
        if (
            host_pool is None
            or parent is None
            or not (parent.is_root or parent.state in _HOST_VALID_T)
        ):
            return False
        host = self._alloc_host_for(node)
        if host is None:
            return False
        assert self._copy_now is not None and node.device is not None
        states = self._states
        moving = states.enabled and states.moving(node) is not None
        try:
            self._copy_now(Direction.WRITE, node.device, host)
            if moving:
                assert self._side_copy_now is not None
                for transfer in states.staging(node):
                    self._side_copy_now(Direction.WRITE, transfer)
        except Exception:  # a failed staging copy: the node is dropped instead (smaller cache)
            host_pool.free(host)
            if moving:
                states.unstage(node)
            return False
        node.host = host
        self.advance(node, ResidencyEvent.STAGE)
        if moving:
            states.staged(node)
        if self.backup is not None:
            self.backup(node.namespace, [node], node if moving else None)
        return True

    def _is_host_leaf(self, node: Node) -> bool:
        if node.children or node.lock_ref or node.backup_pins or node.state is not Residency.HOST:
            return False
        # a backup still reading the L2 state at its end pins it too
        return not (self._states.enabled and self._states.host_pinned(node))

    def evict_host(self, pages: int) -> int:
        """Free at least ``pages`` L2 pages if possible (LRU over unlocked, unpinned host-only
        leaves; a parent that becomes one joins)."""
        host = self.host
        if pages <= 0 or host is None:
            return 0
        heap = [(n.last_access, n.id, n) for n in self._index.nodes() if self._is_host_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < pages and heap:
            _, _, node = heapq.heappop(heap)
            assert node.host is not None
            released = node.host
            parent = node.parent
            self.advance(node, ResidencyEvent.DELETE)
            if self._states.enabled:
                self._states.forget(node)
            self._index.remove_leaf(node)
            node.host = None
            host.free(released)
            freed += len(released)
            if parent is not None and not parent.is_root and self._is_host_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    # ------------------------------------------------------------------ load-back
    def load_back(self, node: Node) -> int | None:
        """Start loading the host-only chain ending at ``node`` back to L1, all or nothing (with its
        end state if that is on L2 only); the op id, or ``None`` when declined (below the threshold,
        over the quota, no L1 room). A state-only load moves no KV: no threshold, no quota."""
        chain = []
        for current in self._index.ancestors(node):
            if current.state is not Residency.HOST:
                break
            chain.append(current)
        chain.reverse()
        pages = sum(n.num_pages for n in chain)
        quota = self.config.load_back_quota
        states = self._states
        info = states.loadable(node) if states.enabled else None
        transfer = self.transfer
        if (
            (not chain and info is None)
            or transfer is None
            or (
                chain
                and (
                    pages * self.config.page_size < self.config.load_back_threshold
                    or (quota is not None and pages > quota)
                )
            )
        ):
            return None
        device = self.device
        self._locks.lock(node, +1)
        if pages > device.free_count:
            self.evict_device(pages - device.free_count)
        if pages > device.free_count or (info is not None and not states.make_room(host=False)):
            self._locks.lock(node, -1)
            return None
        op = CopyOp(self._clock.new_op(), Direction.LOAD, node, list(chain))
        sources: list[Pages] = []
        targets: list[Pages] = []
        for current in chain:
            current.device = np.asarray(device.alloc(current.num_pages), dtype=np.int64)
            assert current.host is not None
            sources.append(current.host)
            targets.append(current.device)
            current.load_op = op
            self.advance(current, ResidencyEvent.LOAD_START)
        side: tuple[PoolTransfer, ...] = ()
        if info is not None:
            info.device = states.alloc(host=False)
            op.state_node = node
            side = states.start_copy(node, write=False)
        self.copies.load.append(op)
        transfer.enqueue(
            Direction.LOAD,
            op.op_id,
            np.concatenate(sources) if sources else EMPTY,
            np.concatenate(targets) if targets else EMPTY,
            side,
        )
        return op.op_id

    # ------------------------------------------------------------------ acks
    def ack(self, op: CopyOp) -> None:
        """A copy op landed: its nodes are valid in the destination tier; a write goes to L3."""
        write = op.direction is Direction.WRITE
        op.state = (WRITE_OP if write else LOAD_OP).next(op.state, OpEvent.ACK)
        self.stats.count_copy(
            sum(node.num_pages for node in op.nodes), self.page_nbytes, write=write
        )
        for node in op.nodes:
            if write:
                self.advance(node, ResidencyEvent.WRITE_ACK)
                node.write_op = None
            else:
                self.advance(node, ResidencyEvent.LOAD_ACK)
                node.load_op = None
                self._locks.count_device(node, +1)
        if op.state_node is not None:
            self._states.end_copy(op.state_node, write=write, ok=True)
        self._locks.lock(op.node, -1)
        if op.nodes:
            self._locks.refresh(op.nodes)
        if write and self.backup is not None:
            self.backup(op.node.namespace, op.nodes, op.state_node)

    def fail(self, op: CopyOp) -> None:
        """A copy op failed: its destination pages go back; the source is as it was."""
        write = op.direction is Direction.WRITE
        op.state = (WRITE_OP if write else LOAD_OP).next(op.state, OpEvent.FAIL)
        for node in op.nodes:
            if write:
                assert node.host is not None and self.host is not None
                self.host.free(node.host)
                node.host = None
                node.write_op = None
                self.advance(node, ResidencyEvent.WRITE_FAIL)
            else:
                assert node.device is not None
                self.device.free(node.device)
                node.device = None
                node.load_op = None
                self.advance(node, ResidencyEvent.LOAD_FAIL)
        if op.state_node is not None:
            self._states.end_copy(op.state_node, write=write, ok=False)
        self._locks.lock(op.node, -1)
        if op.nodes:
            self._locks.refresh(op.nodes)

    # ------------------------------------------------------------------ prefetched pages
    def commit_host_pages(self, parent: Node, fps: bytes, digests: bytes, host: Pages) -> Node:
        """Prefetched pages in L2 ``host`` become a host-only leaf under ``parent`` (a root, or
        readable on L2: I3 even if a write-through in flight fails)."""
        assert parent.is_root or parent.state in _HOST_VALID_T
        leaf = self._index.add_leaf(parent, fps, digests)
        leaf.host = host
        self.advance(leaf, ResidencyEvent.COMMIT_PREFETCH)
        return leaf

    # ------------------------------------------------------------------ reset
    def reset(self) -> None:
        """Free every page the tree holds (nothing pending, nothing locked: the caller checked)."""
        for node in list(self._index.nodes()):
            if node.device is not None:
                self.device.free(node.device)
            if node.host is not None and self.host is not None:
                self.host.free(node.host)
            node.state = Residency.GONE
        self._clock.version += 1
