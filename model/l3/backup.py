"""The L2 -> L3 backup queue of the cache model (SPEC §3, §4).

A write-through ack (or a write-back stage) queues the pages it copied, with the state at the node's
end; the store worker starts the oldest queued op (exists, then put what is missing) and acks or fails
it. ``store_evict`` is the store dropping an object on its own.

Invariants upheld here alone:

* an op covers the pages (and states) it was queued with, never a node's current range (I4, the
  "lost split" bug), and pins their host copies (and L2 state slots) until they are durable in L3,
  so L2 eviction never frees a slot a backup still reads (I5, the stale offset);
* every object is put under the key the key space rendered (I1) with the content its host slot
  holds (I2), and becomes visible no earlier than on ack (a lagging store makes it visible later,
  or never: :class:`~kvstrata.model.store.StoreModel`);
* a page counts as stored (backed up) only when every object of it is visible after the op's puts,
  never because a put returned success; the rest is queued again, never dropped (a failed op is
  retried with its pins kept).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from kvstrata.model.errors import MisuseError
from kvstrata.model.hybrid import state_page
from kvstrata.model.keys import Namespace, PageHash, StoreKey
from kvstrata.model.l3.objects import page_objects, state_objects
from kvstrata.model.lifecycles import BACKUP_OP, BackupEvent, BackupState
from kvstrata.model.store import StoreModel

if TYPE_CHECKING:
    from kvstrata.model.cache.clock import Clock
    from kvstrata.model.cache.config import CacheConfig
    from kvstrata.model.cache.states import States
    from kvstrata.model.cache.tiers import Tiers


@attrs.define
class BackupOp:
    """An L2 -> L3 write of whole pages; host copies are pinned until it is done."""

    op_id: int
    namespace: Namespace
    pages: tuple[PageHash, ...]
    state: BackupState = BackupState.QUEUED
    begun: tuple[StoreKey, ...] = ()
    attempts: int = 0
    states: tuple[PageHash, ...] = ()  # trailing states to write (host state slots pinned)


__all__ = ["Backup"]


@attrs.define
class Backup:
    config: CacheConfig
    store: StoreModel = attrs.field(repr=False)
    clock: Clock = attrs.field(repr=False)
    tiers: Tiers = attrs.field(repr=False)
    states: States = attrs.field(repr=False)
    ops: list[BackupOp] = attrs.field(init=False, factory=list)

    def enqueue(
        self, namespace: Namespace, pages: tuple[PageHash, ...], states: tuple[PageHash, ...] = ()
    ) -> None:
        """Queue ops covering ``pages`` in order, at most ``backup_batch_pages`` each (the states
        with the last): each one is started, acked or failed on its own."""
        self.tiers.pin(pages, +1)
        self.states.pin(states, +1)
        limit = self.config.backup_batch_pages or max(len(pages), 1)
        starts = list(range(0, len(pages), limit)) or [0]
        for start in starts:
            last = start == starts[-1]
            batch = pages[start : start + limit]
            self.ops.append(
                BackupOp(self.clock.op_id(), namespace, batch, states=states if last else ())
            )

    def op(self, state: BackupState, op_id: int | None = None) -> BackupOp:
        """The oldest op in ``state`` (``op_id``: that op, if it is in ``state``); ``MisuseError``
        if none."""
        for op in self.ops:
            if op.state is state and op_id in (None, op.op_id):
                return op
        raise MisuseError(f"no backup op {'' if op_id is None else op_id} is {state.value}")

    def start(self, op: BackupOp) -> int:
        """The store worker starts ``op``: exists-then-put-missing, puts begun."""
        state = BACKUP_OP.next(op.state, BackupEvent.START)
        begun: list[StoreKey] = []
        for page in op.pages:
            for _component, key in page_objects(self.config, op.namespace, page):
                if self.store.begin_put(key):
                    begun.append(key)
        for page in op.states:
            for _component, key in state_objects(self.config, op.namespace, page):
                if self.store.begin_put(key):
                    begun.append(key)
        op.begun = tuple(begun)
        op.attempts += 1
        op.state = state
        return op.op_id

    def ack(self, op: BackupOp, *, agreed: bool = False) -> int:
        """``op``'s puts complete, then the writer checks what a reader would see: a page counts as
        stored only if every object of it is visible *now* (the store accepted each put, but may
        lag or lose it, and a key another writer held may still be invisible). Stored pages drop
        their host pins; the rest are queued again, pins kept (I2, I4). Returns the pages stored.

        ``agreed`` (a TP group's agreed verdict ``STORED``): every rank's job already made that
        check and saw every object, so it is not made again. Each rank's store may have lost an
        object of its own shard since (the store's own loss, which a later query sees), and a
        check made now would end the op differently on different ranks."""
        begun = set(op.begun)
        page_objs = [page_objects(self.config, op.namespace, p) for p in op.pages]
        state_objs = [state_objects(self.config, op.namespace, p) for p in op.states]
        for page, objects in zip(op.pages, page_objs, strict=True):
            slot = self.tiers.pages.records[page].host_slot
            assert slot is not None
            content = self.tiers.host.read(slot)
            for component, key in objects:
                if key in begun:
                    self.store.end_put(key, (content, component))
        for page, objects in zip(op.states, state_objs, strict=True):
            slot = self.states.info[page].host_slot
            assert slot is not None
            named = state_page(self.states.host.read(slot))
            for component, key in objects:
                if key in begun:
                    self.store.end_put(key, (named, component))
        visible_after = [
            agreed or all(self.store.contains(key) for _c, key in objs) for objs in page_objs
        ]
        states_after = [
            agreed or all(self.store.contains(key) for _c, key in objs) for objs in state_objs
        ]
        event = BackupEvent.ACK if all(visible_after + states_after) else BackupEvent.RETRY
        state = BACKUP_OP.next(op.state, event)
        done = [page for page, ok in zip(op.pages, visible_after, strict=True) if ok]
        self.tiers.pin(done, -1)
        self.states.pin((p for p, ok in zip(op.states, states_after, strict=True) if ok), -1)
        op.state = state
        op.begun = ()
        self.ops.remove(op)
        if state is BackupState.QUEUED:
            op.pages = tuple(p for p, ok in zip(op.pages, visible_after, strict=True) if not ok)
            op.states = tuple(p for p, ok in zip(op.states, states_after, strict=True) if not ok)
            self.ops.append(op)
        return len(done)

    def fail(self, op: BackupOp) -> int:
        """``op`` fails: its puts are aborted and it is queued again (retried later, never
        dropped; host pages stay pinned)."""
        state = BACKUP_OP.next(op.state, BackupEvent.FAIL)
        for key in op.begun:
            self.store.abort_put(key)
        op.begun = ()
        op.state = state
        self.ops.remove(op)
        self.ops.append(op)
        return len(op.pages)

    def store_evict(self, key: StoreKey) -> bool:
        """The store drops one object on its own (eviction, owner gone)."""
        return self.store.evict(key)
