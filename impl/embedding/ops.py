"""The batch puts and gets in flight of the embedding cache (SPEC §6), the implementation of
:mod:`kvstrata.model.embedding.ops`.

Owned here: every pending op (its items, each with the generation its extents were captured for
and its count of store objects; the extents go to the op's job), the request ids of ``prefetch``,
the op sequence, the I/O executor and the queue its results come back on, and the counters of
applied results. Keys are rendered here (:meth:`Ops.object_keys`: one object per unit,
``KeySpace.key(namespace, "emb", "u<i>of<n>", media)``). Entry states change only through
:class:`~kvstrata.impl.embedding.entries.Entries`.

Invariants upheld here alone:

* an entry is PUSHING (LOADING) exactly while one pending put (get) holds its extents, and those
  extents are the units of the entry's *current* generation (an extent is captured from a pinned
  entry, :meth:`Ops.capture`); a result for another generation is a stale offset (``I5``);
* results are applied only on the caller's thread (:meth:`Ops.poll`), item by item as the model's
  ``ack_push(op, failed)`` / ``ack_get(op, failed)``: an item whose *every* object is DONE
  completes; an item with *any* failed object failed (a put item is READY again, a get item is
  freed and forgotten), whatever the other items of the batch did;
* a job never raises into the executor: an exception fails every extent of its op;
* a job runs on the executor's worker, or on the caller's thread when :meth:`Ops.wait` /
  :meth:`Ops.flush` run the queued jobs themselves (a job only moves bytes and queues its result,
  so where it runs changes nothing but the latency).
"""

from __future__ import annotations

import queue
from collections.abc import Sequence

import attrs

from kvstrata.impl.embedding.entries import Entries, LiveEntry
from kvstrata.impl.embedding.store import EmbeddingStore, Extents, ExtentStatus
from kvstrata.impl.errors import InvariantViolation, MisuseError
from kvstrata.impl.executors import (
    Joinable,
    ManualExecutor,
    RunsHere,
    deadline_after,
    seconds_left,
)
from kvstrata.impl.kernels import join_keys
from kvstrata.impl.transfer import Executor
from kvstrata.model.keys import KeySpace, Namespace, PageHash, RenderedKeys, StoreKey
from kvstrata.model.lifecycles import EntryEvent

__all__ = ["POOL", "Item", "Op", "Ops"]

POOL = "emb"


@attrs.frozen
class Item:
    """One entry of a pending op, as it was when the op started: its generation, and how many
    store objects (units) of the op's :class:`Extents` are its own, in order."""

    media: PageHash
    generation: int
    objects: int


@attrs.frozen
class Op:
    """A pending batch put (``push``) or get: its items in order, as its store call names their
    objects (item by item, each item's unit by unit; the call's job holds the extents)."""

    op_id: int
    push: bool
    items: tuple[Item, ...]


class Ops:
    """One node's pending ops and requests. See the module docstring for the rules."""

    def __init__(
        self,
        entries: Entries,
        store: EmbeddingStore,
        keyspace: KeySpace,
        namespace: Namespace,
        executor: Executor,
    ) -> None:
        self.entries = entries
        self.pool = entries.pool
        self.store = store
        self.keyspace = keyspace
        self.namespace = namespace
        self.executor = executor
        self._joinable = executor if isinstance(executor, Joinable) else None
        self._runs_here = executor if isinstance(executor, RunsHere) else None
        # a ManualExecutor runs nothing until a test says so: a caller could never see its result
        self._can_wait = self._joinable is not None or not isinstance(executor, ManualExecutor)
        self.pushed = self.loaded = self.failed = self.store_full = 0
        self._ops: dict[int, Op] = {}
        self._requests: dict[str, int | None] = {}
        self._results: queue.SimpleQueue[tuple[int, list[ExtentStatus]]] = queue.SimpleQueue()
        self._next_op = 0
        self._landed: set[int] = set()  # ops whose result is queued (added on the I/O side)
        self._unit_labels: dict[int, tuple[str, ...]] = {}

    # ----------------------------------------------------------------------------- queries

    def handles(self) -> tuple[int, ...]:
        return tuple(sorted(self._ops))

    def object_keys(self, media: PageHash, tokens: int) -> tuple[StoreKey, ...]:
        """The store keys of the embedding of ``media`` with ``tokens`` rows, unit by unit."""
        return self.keyspace.component_keys(self.namespace, POOL, self._labels(tokens), media)

    def _labels(self, tokens: int) -> tuple[str, ...]:
        """The key components of an embedding of ``tokens`` rows: ``u<i>of<n>``, unit by unit."""
        return self._labels_of(self.pool.shape.units_for(tokens))

    def _labels_of(self, count: int) -> tuple[str, ...]:
        """The key components of an embedding of ``count`` units."""
        labels = self._unit_labels.get(count)
        if labels is None:
            labels = self._unit_labels[count] = tuple(f"u{i}of{count}" for i in range(count))
        return labels

    def visible(self, batch: Sequence[tuple[PageHash, int]]) -> list[bool]:
        """Per item: all its unit objects are visible in the store (one batch exists call); an
        object a short answer does not cover counts as absent (pushed again), as a put or get
        answer too short fails the items it does not cover. A batch of one-unit items (the
        common case) has its keys rendered as one batch, as :meth:`capture` does (part 29)."""
        if not batch:
            return []
        one = self.pool.shape.unit_tokens
        if all(tokens <= one for _media, tokens in batch):  # one object an item, in batch order
            rendered = self.keyspace.rendered(
                self.namespace,
                [media for media, _tokens in batch],
                POOL,
                self._labels_of(1),
                join_keys,
            )
            answered = self.store.exists(rendered)[: len(batch)]
            return answered + [False] * (len(batch) - len(answered))
        keys = [self.object_keys(media, tokens) for media, tokens in batch]
        flat = self.store.exists([key for group in keys for key in group])
        out, at = [], 0
        for group in keys:
            covered = flat[at : at + len(group)]
            out.append(len(covered) == len(group) and all(covered))
            at += len(group)
        return out

    def request(self, request_id: str) -> int | None:
        if not isinstance(request_id, str) or request_id not in self._requests:
            raise MisuseError(f"unknown request {request_id!r}")
        return self._requests[request_id]

    def check_new_request(self, request_id: str) -> None:
        if not isinstance(request_id, str) or request_id in self._requests:
            raise MisuseError(f"prefetch: request id must be a new string, got {request_id!r}")

    def wait_refused(self) -> str | None:
        """Why a verb may not wait for its own op here and now (``wait=True``); ``None``: it may."""
        if not self._can_wait:
            return "wait=True needs an executor that runs I/O, not a ManualExecutor"
        if self._runs_here is not None and not self._runs_here.can_run_here():
            return "wait=True on the I/O thread or inside one of its jobs would wait for itself"
        return None

    def is_pending(self, op_id: int | None) -> bool:
        return op_id in self._ops

    # ----------------------------------------------------------------------------- changes

    def start_request(self, request_id: str, op_id: int | None) -> None:
        self._requests[request_id] = op_id

    def release(self, request_id: str) -> None:
        self.request(request_id)
        del self._requests[request_id]

    def capture(self, entries: Sequence[LiveEntry]) -> tuple[tuple[Item, ...], Extents]:
        """The items and extents of ``entries``' current generations, in order (each entry is
        pinned by the caller, so its units stay its own until the op's result is applied): one
        object per unit, its rows from the unit's start; the keys rendered as one batch."""
        pool = self.pool
        row_nbytes, unit_ptr = pool.row_nbytes, pool.unit_ptr
        ptrs: list[int] = []
        sizes: list[int] = []
        items = []
        whole = True  # every entry in one unit: one rendering for the batch
        for entry in entries:
            units = entry.units
            if len(units) == 1:  # the common case: one unit, every row from its start
                ptrs.append(unit_ptr(units[0]))
                sizes.append(entry.tokens * row_nbytes)
            else:
                whole = False
                rows = pool.shape.rows
                for index, unit in enumerate(units):
                    ptrs.append(unit_ptr(unit))
                    sizes.append(rows(entry.tokens, index) * row_nbytes)
            items.append(Item(entry.media, entry.generation, len(units)))
        render, namespace = self.keyspace.rendered, self.namespace
        if whole:
            keys = render(
                namespace, [e.media for e in entries], POOL, self._labels_of(1), join_keys
            )
        else:
            keys = RenderedKeys.join(
                render(namespace, [e.media], POOL, self._labels_of(len(e.units)), join_keys)
                for e in entries
            )
        return tuple(items), Extents(keys, ptrs, sizes)

    def submit(self, push: bool, entries: Sequence[LiveEntry], *, wait: bool = False) -> int | None:
        """One batch put (``push``) or get of ``entries`` (pinned by the caller: PUSHING or
        LOADING) on the executor; the op's number, or ``None`` for no entries (no call). With
        ``wait`` (only where :meth:`wait_refused` is ``None``), it returns once the op's result
        (and every result before it) was applied: the job runs on this thread behind the queued
        ones, and a thread executor's worker is not woken for it (:meth:`ThreadExecutor.run_here`;
        at once, :meth:`ThreadExecutor.run_now`, when no other op of this node is pending and the
        executor is idle)."""
        if not entries:
            return None
        items, extents = self.capture(entries)
        op = Op(self._next_op, push, items)
        self._next_op += 1
        self._ops[op.op_id] = op
        call = self.store.put if push else self.store.get

        def job() -> None:
            done = [ExtentStatus.FAILED] * len(extents)
            try:
                done = call(extents)
            except Exception:  # a job never raises into the executor: the op failed
                pass
            finally:  # also for an interrupt on a caller's thread: the op is never left pending
                self._landed.add(op.op_id)
                self._results.put((op.op_id, done))

        if not wait:
            self.executor.submit(job)
            return op.op_id
        op_id, landed = op.op_id, self._landed
        if self._runs_here is not None:
            # no op of this node in flight (the only one pending is this): nothing to run first,
            # so the executor runs it at once if it is idle (no queue, no wake-up; part 29)
            alone = len(self._ops) == 1
            if not (alone and self._runs_here.run_now(job)):
                self._runs_here.run_here(job, lambda: op_id in landed)
            while op_id in self._ops:  # its result is queued, behind those of the ops before it
                self._apply_next(None)
        else:
            self.executor.submit(job)
            self.wait(op_id, None)
        return op_id

    def poll(self) -> int:
        """Apply every I/O result queued so far (on this thread); how many ops completed."""
        count = 0
        results = self._results
        while not results.empty():  # this thread is the only consumer: a result seen stays
            self._apply(*results.get_nowait())
            count += 1
        return count

    def wait(self, op_id: int | None, timeout: float | None) -> bool:
        """Apply results until op ``op_id`` was applied; ``False`` if ``timeout`` seconds (in all)
        passed first. The jobs queued up to this op's run on this thread (see the note below);
        the ones behind it stay with the worker."""
        deadline = deadline_after(timeout)
        if op_id in self._ops and self._joinable is not None:
            landed = self._landed
            self._joinable.run_queued(seconds_left(deadline), until=lambda: op_id in landed)
        while op_id in self._ops:
            if not self._apply_next(seconds_left(deadline)):
                return False
        return True

    def flush(self, timeout: float | None) -> bool:
        """Apply results until no op is pending; ``False`` if ``timeout`` seconds (in all) passed
        first. The jobs still queued run on this thread (see the note below)."""
        deadline = deadline_after(timeout)
        if self._ops and self._joinable is not None:
            self._joinable.run_queued(seconds_left(deadline))
        while self._ops:
            if not self._apply_next(seconds_left(deadline)):
                return False
        return True

    # Why a waiter runs the queued jobs itself (a Joinable thread executor): handing them to the
    # worker and waiting for its wake-up, then for ours, cost more than a 128 KiB store call on a
    # 2-core VM (issue 20). The timeout bounds the waiting; a store call made on this thread runs
    # to its end (bounded by the store client's own timeouts), as with an InlineExecutor.

    def _apply_next(self, timeout: float | None) -> bool:
        try:
            result = self._results.get(timeout=timeout)
        except queue.Empty:
            return False
        self._apply(*result)
        return True

    def _apply(self, op_id: int, done: list[ExtentStatus]) -> None:
        """Apply one op's per-extent results, item by item: an item whose every extent is DONE
        completes (``PUSH_ACK`` / ``LOADED``); any other item failed (a put item is READY again,
        a get item is freed and forgotten). A result list of the wrong length fails what it does
        not cover."""
        op = self._ops.pop(op_id)
        self._landed.discard(op_id)
        statuses = iter(done)
        ok = failed = full = 0
        entries, push = self.entries, op.push
        get, advance = entries.get, entries.advance
        done_status, failed_status = ExtentStatus.DONE, ExtentStatus.FAILED
        for item in op.items:
            entry = get(item.media)
            if entry is None or entry.generation != item.generation:
                raise InvariantViolation("I5", f"op {op_id}: stale offset for {item.media}")
            if item.objects == 1:  # the common case: one object
                mine: tuple[ExtentStatus, ...] = (next(statuses, failed_status),)
                good = mine[0] is done_status
            else:
                mine = tuple(next(statuses, failed_status) for _ in range(item.objects))
                good = all(status is done_status for status in mine)
            if good:
                ok += 1
                advance(entry, EntryEvent.PUSH_ACK if push else EntryEvent.LOADED)
                continue
            failed += 1
            if push:
                full += ExtentStatus.FULL in mine
                advance(entry, EntryEvent.PUSH_FAILED)
            else:
                entries.forget(entry, EntryEvent.LOAD_FAILED)
        self.failed += failed
        self.store_full += full
        self.pushed += ok if op.push else 0
        self.loaded += 0 if op.push else ok
