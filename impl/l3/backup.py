"""L2 -> L3 backup (SPEC §3, §4, §9; model: ``kvstrata.model.l3.backup``).

When a write-through (or a write_back staging copy) has put pages on L2, the cache hands
:meth:`Backups.enqueue` the nodes covering them. The op captures, *at that moment*, the pages' hashes
and host indices (a later split cannot change what it covers: I4) and pins every node
(``Node.backup_pins``: a pinned node's host pages are never evicted or reused: I5), then submits a
job at once. A result's pages that are in the store (stored, existed, or a non-writer's skip) are
done; the rest (store full, failures, not yet visible) form a retry op with back-off, and after
``StorageConfig.backup_retries`` retries they are abandoned and counted. Nodes are unpinned as soon
as none of their pages is pending any more.

Side pools: an op writes its pages' ``ALL_PAGES`` objects with them (a page is done only when all of
its objects are) and the state at the end of the copied node (``BackupOp.states``: the state's page
hash and host state slot fixed at enqueue, its :class:`StateInfo` pinned by ``host_pins`` so the
slot is neither dropped nor reused until the store confirms it). A result unpins each state that is
in the store and retries the rest with the failed pages (the model's ``ack_backup`` /
``fail_backup``).

Store down (issue 17; model: ``StoreLinkModel``): a backup the link refuses is *deferred*, its pins
kept, in a queue bounded by ``backup_deferred_pages`` pages; when a new one would overflow it, the
oldest are dropped (unpinned, counted in ``backup_dropped_pages``). :meth:`Backups.resume` issues
them again, in order, once the store is back; :meth:`Backups.republish` backs up every L2 node again
after the store came back empty. For ``StorageConfig.remount_grace_s`` after the store came back
from down or empty (:meth:`Backups.recovered`; under TP on every rank once the re-publish is
agreed), a batch whose only failures are "full" spends no retry: a restarted Mooncake master
refuses puts until its clients have remounted their segments (MOONCAKE.md §5.3, about 1 s), and
abandoning the re-published L2 then would lose what the recovery is for. Its back-off still grows
(``BackupOp.waits``), and the grace ends, so a store really full is abandoned as before.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

import attrs
import numpy as np

from kvstrata.impl.l3.context import L3Context
from kvstrata.impl.l3.port import Pages
from kvstrata.impl.storage.base import PutStatus
from kvstrata.impl.storage.worker import BackupResult
from kvstrata.model.keys import Namespace
from kvstrata.model.lifecycles import BACKUP_OP, BackupEvent, BackupState
from kvstrata.model.tp import BackupFact

if TYPE_CHECKING:
    from kvstrata.impl.cache.node import Node, StateInfo

__all__ = ["BackupOp", "Backups", "PageRef"]

_DIGEST = 32


@attrs.define(eq=False)
class PageRef:
    """Which node holds one page of a backup op, and where in it (re-pointed by splits)."""

    node: Node
    offset: int


@attrs.define(eq=False)
class BackupOp:
    """Pages of L2 being written to L3. ``digests``/``host`` are fixed at enqueue; ``refs[i]`` names
    the node holding page ``i`` (splits re-point it). Every distinct node among ``refs`` carries
    one ``backup_pins`` for this op until none of its pages is pending here. ``states[i]`` (side
    pools) is the state at the end of the page named by ``state_digests[i]``, read from host state
    slot ``state_slots[i]`` (both fixed at enqueue); it carries one ``host_pins`` for this op until
    it is in the store or abandoned."""

    op_id: int
    namespace: Namespace
    digests: bytes
    host: Pages
    refs: list[PageRef]
    state: BackupState = BackupState.QUEUED
    attempts: int = 0
    waits: int = 0  # retries that spent no attempt (full within the remount grace): back-off only
    retry_at: float = 0.0
    states: list[StateInfo] = attrs.field(factory=list)
    state_digests: bytes = b""
    state_slots: Pages = attrs.field(factory=lambda: np.zeros(0, dtype=np.int64))
    dropped: bool = False  # TP: dropped from the deferred queue here, released once agreed
    parked: bool = False  # TP: deferred on some rank (agreed): nothing finishes it while down
    quiet: bool = False  # TP: no rank runs a job of it or has one due (agreed)

    @property
    def num_pages(self) -> int:
        return len(self.host)

    def nodes(self) -> list[Node]:
        """The distinct nodes this op pins, in page order."""
        seen: dict[int, Node] = {}
        for ref in self.refs:
            seen.setdefault(id(ref.node), ref.node)
        return list(seen.values())


class Backups:
    """Every backup op of one cache, keyed by op id (retries keep their op's id)."""

    def __init__(self, context: L3Context) -> None:
        self._tree, self._worker, self.config = context.tree, context.worker, context.config
        self._counters, self._states = context.counters, context.states
        self._now, self._page_nbytes = context.now, context.page_nbytes
        self.ops: dict[int, BackupOp] = {}
        self._retry: list[BackupOp] = []
        self.deferred: collections.deque[BackupOp] = collections.deque()  # oldest first
        #: TP: deferred ops whose store came back here; each starts when the ranks agree that no
        #: rank defers it any more (:meth:`unpark`), never on its own: an op agreed parked and
        #: quiet (the cache idle) must not start a job before the next agreement says so
        self.ready: list[BackupOp] = []
        #: TP (``kvstrata.model.tp``): pins drop only by agreed facts, so a dropped op is marked
        #: and reported, never released here
        self.agreed = False
        self._deferred_pages = 0  # sum of the deferred ops' pages (kept, not recounted)
        self._grace_until = float("-inf")  # "full" spends no retry before this (remounting)
        #: per op id, the result last judged and whether it spent an attempt (judged once: the TP
        #: verdict and the later apply must not read the clock apart)
        self._judged: dict[int, tuple[BackupResult, bool]] = {}

    def recovered(self) -> None:
        """The store came back after an outage or empty (a re-publish): for ``remount_grace_s``, a
        batch refused only as full spends no retry (its clients may not have remounted their
        segments yet)."""
        self._grace_until = self._now() + self.config.remount_grace_s

    def _spends_attempt(self, result: BackupResult) -> bool:
        """Whether ``result`` counts against its op's retries: not when it was never tried (the
        store went down), nor when its only failures are "full" within the remount grace. Decided
        once per result."""
        judged = self._judged.get(result.op_id)
        if judged is not None and judged[0] is result:
            return judged[1]
        statuses = [*result.statuses, *result.states]
        spends = not result.skipped and (
            self._now() >= self._grace_until
            or not statuses
            or any(not status.ok and status is not PutStatus.FULL for status in statuses)
        )
        self._judged[result.op_id] = (result, spends)
        return spends

    def enqueue(
        self, namespace: Namespace, nodes: list[Node], state_node: Node | None = None
    ) -> None:
        """Back up the pages of ``nodes`` (in order; each has a host copy and its hashes), in
        batches of at most ``backup_batch_pages`` pages (a long node is cut across batches), and
        (side pools) the L2 state at the end of ``state_node`` with the last batch."""
        refs = [PageRef(node, i) for node in nodes for i in range(node.num_pages)]
        digests = b"".join(node.hashes for node in nodes)
        hosts = [node.host for node in nodes if node.host is not None]
        host = np.concatenate(hosts) if hosts else np.zeros(0, dtype=np.int64)
        assert len(host) * _DIGEST == len(digests) == len(refs) * _DIGEST, "a page lacks a copy"
        info = None
        if state_node is not None and self._states:
            info = self._tree.host_state(state_node)
        if not refs and info is None:
            return
        limit = self.config.backup_batch_pages
        starts = list(range(0, len(refs), limit)) or [0]
        for start in starts:
            end = start + limit
            op = BackupOp(
                self._tree.new_op(),
                namespace,
                digests[start * _DIGEST : end * _DIGEST],
                host[start:end].copy(),
                refs[start:end],
            )
            if info is not None and start == starts[-1]:
                assert state_node is not None and state_node.last_hash is not None
                assert info.host is not None
                op.states = [info]
                op.state_digests = state_node.last_hash.digest
                op.state_slots = np.array([info.host], dtype=np.int64)
                info.host_pins += 1  # the host state slot is read until the store confirms
            for node in op.nodes():
                node.backup_pins += 1
            self.ops[op.op_id] = op
            self._counters.backup_ops += 1
            self._start_backup(op)

    def _start_backup(self, op: BackupOp) -> None:
        state = BACKUP_OP.next(op.state, BackupEvent.START)
        submitted = self._worker.backup(
            op.op_id,
            op.namespace,
            op.digests,
            op.host,
            state_digests=op.state_digests,
            state_slots=op.state_slots,
        )
        if not submitted:
            self._defer(op)
            return
        op.state = state
        op.attempts += 1

    def _defer(self, op: BackupOp) -> None:
        """Keep ``op`` (pins and all) until the store is back; drop the oldest deferred ops while
        the queue holds more than ``backup_deferred_pages`` pages."""
        self.deferred.append(op)
        self._deferred_pages += op.num_pages
        limit = self.config.backup_deferred_pages
        while self.deferred and self._deferred_pages > limit:
            dropped = self.deferred.popleft()
            self._deferred_pages -= dropped.num_pages
            if self.agreed:
                dropped.dropped = True
            else:
                self.drop(dropped)

    def drop(self, op: BackupOp) -> None:
        """Forget ``op`` unwritten (the deferred queue overflowed): unpin it and count it."""
        self._release(op)
        del self.ops[op.op_id]
        self._counters.backup_dropped_pages += op.num_pages

    def drop_all(self) -> int:
        """Forget every op unwritten, counted as dropped (for ``reset``, which frees the host
        pages they read: a deferred op resumed later would put whatever then holds those pages
        under its keys). No job of any op may be running or due (the cache is idle: every op is
        deferred; under TP every op is parked and quiet, so here each is deferred, waiting for
        the ranks to agree that it may resume, dropped, or holding its result). Returns the
        pages dropped."""
        pages = 0
        for op in list(self.ops.values()):
            pages += op.num_pages
            self.drop(op)
        self.deferred.clear()
        self.ready.clear()
        self._retry.clear()
        self._judged.clear()
        self._deferred_pages = 0
        return pages

    def forget(self, op: BackupOp) -> None:
        """TP: ``op`` was given up by every rank while not in flight here (dropped from the
        deferred queue here or on another rank): drop it from whichever queue holds it."""
        if op in self.deferred:
            self.deferred.remove(op)
            self._deferred_pages -= op.num_pages
        if op in self.ready:
            self.ready.remove(op)
        self.drop(op)

    def waiting(self) -> set[int]:
        """TP: ``id()`` of every op waiting here without a job: deferred while the store is
        down, or in :attr:`ready` until the ranks agree that it may resume."""
        return {id(op) for op in self.deferred} | {id(op) for op in self.ready}

    def unpark(self, op: BackupOp) -> None:
        """TP: the ranks agreed that none defers ``op``: it is no longer parked, and if it was
        waiting here for that (its store came back), its job starts now."""
        op.parked = False
        if op in self.ready:
            self.ready.remove(op)
            self._start_backup(op)

    def _release(self, op: BackupOp) -> None:
        """Unpin every node and state ``op`` pins (it will not read them again)."""
        for node in op.nodes():
            node.backup_pins -= 1
        for info in op.states:
            info.host_pins -= 1

    def resume(self) -> None:
        """The store is back: issue every deferred op again, oldest first (TP: each waits in
        :attr:`ready` until the ranks agree that no rank defers it, :meth:`unpark`)."""
        deferred, self.deferred = self.deferred, collections.deque()
        self._deferred_pages = 0
        if self.agreed:
            self.ready.extend(deferred)
            return
        for op in deferred:
            self._start_backup(op)

    def republish(self, nodes: list[Node]) -> None:
        """The store came back without what it held: back up again every page of ``nodes`` (the
        nodes L2 holds; exists-then-put skips what is still there). States are not re-published:
        a missing state only shortens a hybrid hit."""
        by_namespace: dict[Namespace, list[Node]] = {}
        for node in nodes:
            by_namespace.setdefault(node.namespace, []).append(node)
        for namespace, group in by_namespace.items():
            self._counters.republished_pages += sum(node.num_pages for node in group)
            self.enqueue(namespace, group)

    def deferred_pages(self) -> int:
        """Pages of the ops waiting with no job (deferred, and under TP waiting to resume); the
        ``backup_deferred_pages`` bound holds the deferred queue alone."""
        return self._deferred_pages + sum(op.num_pages for op in self.ready)

    def on_split(self, node: Node, prefix: Node) -> None:
        """``node`` was split and ``prefix`` took its first pages: page references move to the
        prefix where they fall in it, and each op pins exactly the nodes it still covers."""
        cut = prefix.num_pages
        prefix.backup_pins = 0
        for op in self.ops.values():
            had = False
            for ref in op.refs:
                if ref.node is node:
                    had = True
                    if ref.offset < cut:
                        ref.node = prefix
                    else:
                        ref.offset -= cut
            if not had:
                continue
            covers = {id(ref.node) for ref in op.refs}
            if id(prefix) in covers:
                prefix.backup_pins += 1
            if id(node) not in covers:
                node.backup_pins -= 1

    def verdict(self, result: BackupResult) -> BackupFact:
        """What ``result`` means for its op here: stored, retry, or give up (retries spent)."""
        op = self.ops[result.op_id]
        failed, states_failed = self._failures(op, result)
        if not any(failed) and not any(states_failed):
            return BackupFact.STORED
        attempts = op.attempts - (0 if self._spends_attempt(result) else 1)
        return BackupFact.GIVE_UP if attempts > self.config.backup_retries else BackupFact.RETRY

    @staticmethod
    def _failures(op: BackupOp, result: BackupResult) -> tuple[list[bool], list[bool]]:
        failed = [not status.ok for status in result.statuses]
        states_failed = [not status.ok for status in result.states]
        if len(states_failed) != len(op.states):  # a result without its states: none is stored
            states_failed = [True] * len(op.states)
        return failed, states_failed

    def apply(self, result: BackupResult, agreed: BackupFact | None = None) -> None:
        """The model's ``ack_backup`` (every part in the store) or its retry: pages and states in
        the store are done (nodes with no page pending here and those states are unpinned); the
        rest is retried with back-off, or abandoned (and unpinned) after ``backup_retries``.
        ``agreed`` (TP): the ranks' verdict decides instead, for the whole op."""
        op = self.ops.get(result.op_id)
        if op is None:
            self._judged.pop(result.op_id, None)
            return
        failed, states_failed = self._failures(op, result)
        if agreed is not None and agreed is not BackupFact.STORED:
            failed, states_failed = [True] * len(failed), [True] * len(states_failed)
        counters = self._counters
        waited = False
        spends = self._spends_attempt(result)
        del self._judged[result.op_id]
        if not spends:  # never tried, or full while remounting
            op.attempts -= 1
            waited = not result.skipped
        for status in result.statuses if not result.skipped else ():
            counters.backup_pages[status.value] += 1
        counters.backup_bytes += self._page_nbytes * sum(
            status is PutStatus.STORED for status in result.statuses
        )
        retry_any = any(failed) or any(states_failed)
        event = BackupEvent.RETRY if retry_any else BackupEvent.ACK
        op.state = BACKUP_OP.next(op.state, event)
        del self.ops[op.op_id]
        abandon = retry_any and (
            op.attempts > self.config.backup_retries
            if agreed is None
            else agreed is BackupFact.GIVE_UP
        )
        pending = {id(ref.node) for ref, bad in zip(op.refs, failed, strict=True) if bad}
        for node in op.nodes():  # unpin every node with nothing left to retry here
            if abandon or id(node) not in pending:
                node.backup_pins -= 1
        for info, bad in zip(op.states, states_failed, strict=True):
            if abandon or not bad:  # in the store (or given up): the host state slot is free
                info.host_pins -= 1
        if not retry_any:
            return
        if abandon:
            counters.backup_abandoned_pages += sum(failed)
            return
        op.waits += waited
        retry = self._retry_op(op, failed, states_failed, skipped=result.skipped)
        self.ops[retry.op_id] = retry
        self._retry.append(retry)
        counters.backup_retries += 1

    def _retry_op(
        self, op: BackupOp, failed: list[bool], states_failed: list[bool], *, skipped: bool
    ) -> BackupOp:
        """The part of ``op`` to write again (same op id), due after its back-off."""
        mask = np.asarray(failed, dtype=bool)
        digests = b"".join(
            op.digests[i * _DIGEST : (i + 1) * _DIGEST] for i in np.flatnonzero(mask)
        )
        state_mask = np.asarray(states_failed, dtype=bool)
        retry = BackupOp(
            op.op_id,
            op.namespace,
            digests,
            op.host[mask] if len(mask) else op.host,
            [ref for ref, bad in zip(op.refs, failed, strict=True) if bad],
            attempts=op.attempts,
            waits=op.waits,
            retry_at=self._now()
            + (0.0 if skipped else self.config.backoff(op.attempts + op.waits)),
            states=[info for info, bad in zip(op.states, states_failed, strict=True) if bad],
            state_digests=b"".join(
                op.state_digests[i * _DIGEST : (i + 1) * _DIGEST]
                for i in np.flatnonzero(state_mask)
            ),
            state_slots=op.state_slots[state_mask] if len(state_mask) else op.state_slots,
        )
        return retry

    def next_retry_at(self) -> float | None:
        """When the earliest retry waiting for its back-off is due (``None``: no retry waits)."""
        return min((op.retry_at for op in self._retry), default=None)

    def resubmit_due(self) -> None:
        if not self._retry:
            return
        now = self._now()
        due = [op for op in self._retry if op.retry_at <= now]
        self._retry = [op for op in self._retry if op.retry_at > now]
        for op in due:
            self._start_backup(op)
