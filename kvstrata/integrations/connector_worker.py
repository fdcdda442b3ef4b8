"""An engine KV connector's worker side without the engine: :class:`ConnectorWorker` runs each step
plan of :class:`~kvstrata.integrations.connector.ConnectorIndex` between the host pool (L2 slots and
staging slots), the store (L3) and the engine's blocks (:class:`BlockIO`).

The worker owns the bytes and checks every L2 read against what it last wrote into that slot
(``written``): a plan that names a slot holding another page (a stale offset, by any route) is a load
error, never served. A load error fails the page and every later page of that request. The engine's
step then runs as if the load had worked, so every page the request computes in that step attends
over bad KV: the worker drops the request's saves from its first failed page on (with ``agree``, the
first failed page agreed by every rank: a rank whose own load went well computed its pages from the
failed rank's hidden states), and the index takes them back once the engine reports the failure.

An engine that plans ahead (vLLM's async scheduling, its pipeline's batch queue) reports a step's
failed loads after it built the next plans (up to the index's ``lag``), whose saves were computed
over the same bad KV: the worker keeps each failure (``poisoned``) until a plan says it was
reported (``Plan.reported_through``) and drops those saves too.

The store calls run on a :class:`~kvstrata.integrations.connector_backup.BackupLane`: with a
thread executor a save's puts land behind the step (the copies into L2 slots do not), a slot a
pending put reads is written only once the put landed (C4), a load's L3 reads run behind the
queued puts, and outcomes (a failed put waits in ``unbacked``) are applied on this worker's
thread at its next load, save, stats or flush.

Pipeline parallelism (a :class:`StagePipe`): a stage computes its layers from the hidden states of
the stages before it, so an earlier stage's failed load makes a later stage's pages of that step
wrong too (not the other way round: a stage's KV depends on its own layers and the ones before).
Each stage sends its loads' first failed pages (agreed over its tensor-parallel ranks) to every
later stage when it loads, and receives every earlier stage's when it saves: a later stage saves
only after its forward, which waited for the earlier stages' forward of the same step, so the
message was sent before it is awaited (no collective: the stages never wait for a later one).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import attrs
import torch

from kvstrata.impl.errors import InvariantViolation, MisuseError
from kvstrata.impl.executors import Executor, InlineExecutor
from kvstrata.impl.pools.host import HostKVPool
from kvstrata.impl.storage.base import GetStatus, PutStatus, StorageBackend
from kvstrata.integrations.connector import NO_FAILURE, NO_SLOT, PageMove, Plan
from kvstrata.integrations.connector_backup import BackupLane, LandedPut
from kvstrata.model.connector import RETRY_PAGES, PageSource
from kvstrata.model.keys import Namespace, PageHash

__all__ = ["BlockIO", "ConnectorWorker", "StagePipe", "TorchStagePipe", "WorkerStats"]

log = logging.getLogger("kvstrata.integrations.connector_worker")


class BlockIO(Protocol):
    """An engine's KV blocks as kvstrata pages: ``save(blocks, host, slots)`` copies the blocks
    into the host pool's pages ``slots``, ``load(host, slots, blocks)`` the pages into the blocks
    (pairs in order, each side distinct)."""

    def save(self, blocks: Sequence[int], host: HostKVPool, slots: Sequence[int]) -> None: ...

    def load(self, host: HostKVPool, slots: Sequence[int], blocks: Sequence[int]) -> None: ...


class StagePipe(Protocol):
    """Pipeline parallelism: each step's failed loads, from a stage to every later stage. Every
    stage runs every plan, in order; ``send`` never waits for a later stage."""

    def send(self, plan: int, cuts: Sequence[int]) -> None:
        """Plan ``plan``'s loads' first failed pages on this stage, to every later stage."""

    def receive(self, plan: int, count: int) -> list[list[int]]:
        """Plan ``plan``'s ``count`` first failed pages from each earlier stage (waits for them)."""


class TorchStagePipe:
    """A :class:`StagePipe` over a ``torch.distributed`` group of the stages (gloo: CPU tensors),
    on a tag of its own, so it never takes a message of the engine's own traffic on that group.
    ``ranks`` are the stages' global ranks in order; this process is stage ``stage``."""

    TAG = 0x6B7673  # "kvs"
    PENDING_WARNING = 256
    """Sends not taken yet past which a later stage is taken not to be receiving (warned once):
    vLLM's V1 runner with speculative decoding never runs a middle stage's ``wait_for_save``."""

    def __init__(self, group: object, ranks: Sequence[int], stage: int) -> None:
        if not 0 <= stage < len(ranks):
            raise MisuseError(f"TorchStagePipe: stage {stage} of {len(ranks)} ranks")
        self.group, self.ranks, self.stage = group, list(ranks), stage
        self._sending: list[tuple[object, torch.Tensor]] = []  # (work, the buffer it sends)
        self._warned = False

    def send(self, plan: int, cuts: Sequence[int]) -> None:
        import torch.distributed as dist  # noqa: PLC0415

        self._sending = [(w, t) for w, t in self._sending if not w.is_completed()]  # type: ignore[attr-defined]
        message = torch.tensor([plan, *cuts], dtype=torch.int64)
        for dst in self.ranks[self.stage + 1 :]:
            work = dist.isend(message, dst=dst, group=self.group, tag=self.TAG)  # type: ignore[arg-type]
            self._sending.append((work, message))
        if len(self._sending) > self.PENDING_WARNING and not self._warned:
            self._warned = True
            log.warning(
                "kvstrata connector, pipeline stage %d: %d failed-load messages not taken by a "
                "later stage (does it run wait_for_save?); they are kept until taken",
                self.stage,
                len(self._sending),
            )

    def receive(self, plan: int, count: int) -> list[list[int]]:
        import torch.distributed as dist  # noqa: PLC0415

        out = []
        for src in self.ranks[: self.stage]:
            message = torch.empty(count + 1, dtype=torch.int64)
            dist.recv(message, src=src, group=self.group, tag=self.TAG)  # type: ignore[arg-type]
            if int(message[0]) != plan:
                raise InvariantViolation(
                    "pipeline", f"stage {self.stage} got plan {int(message[0])}'s loads for {plan}"
                )
            out.append([int(cut) for cut in message[1:].tolist()])
        return out


@attrs.define
class WorkerStats:
    """What a worker did since its stats were last taken (:meth:`ConnectorWorker.take_stats`):
    pages into the engine's blocks by source, pages that failed to load (each failed page and every
    later page of its request, as the engine is told), pages saved into L2, backed up to L3 (stored,
    found there, or a replicated page another rank writes) and backup puts that failed (the page
    waits for a later save; a page that fails again counts again), and the bytes and seconds of the
    store's calls (a put of a page the store holds moves no bytes), and the seconds saves waited
    for puts (``backup_wait_seconds``: with the puts behind the step, only where the store fell
    behind and a save reused a slot a put still read; with an inline lane, every put). Counts are
    this worker's own:
    every tensor-parallel rank and pipeline stage moves its own copy of a page, and an engine that
    sums its workers counts each copy. Plain numbers, to ship between processes."""

    loaded_l2_pages: int = 0
    loaded_l3_pages: int = 0
    failed_load_pages: int = 0
    saved_pages: int = 0
    backed_up_pages: int = 0
    failed_backup_pages: int = 0
    l3_read_bytes: int = 0
    l3_written_bytes: int = 0
    l3_read_seconds: float = 0.0
    l3_write_seconds: float = 0.0
    backup_wait_seconds: float = 0.0

    def as_dict(self) -> dict[str, int | float]:
        return attrs.asdict(self)


class ConnectorWorker:
    """The worker side: the host pool (L2 and staging slots), the store (L3), the engine's blocks."""

    def __init__(
        self,
        host: HostKVPool,
        backend: StorageBackend | None,
        namespace: Namespace,
        blocks: BlockIO,
        executor: Executor | None = None,
    ) -> None:
        """``executor`` runs the store calls (:class:`BackupLane`): an :class:`InlineExecutor`
        (the default) makes every save wait for its puts; a :class:`ThreadExecutor` lets them
        land behind the step."""
        self.host, self.backend, self.namespace, self.blocks = host, backend, namespace, blocks
        self.lane: BackupLane | None = None
        if backend is not None:
            backend.attach(host)
            self.lane = BackupLane(backend, namespace, executor or InlineExecutor())
        self.written: dict[int, PageHash] = {}
        self.loaded_pages = 0
        #: failed loads not reported yet (plan number, failed blocks, each request's first failed
        #: page): a plan made before the report saves nothing computed over them
        self.poisoned: list[tuple[int, frozenset[int], dict[str, int]]] = []
        self.unbacked: dict[int, PageHash] = {}  # slot -> its page, whose backup put failed
        self.failed_puts: list[PageHash] = []  # pages whose failed put was applied since the last
        # save began (with an InlineExecutor: the pages whose put failed in the last save)
        self.stats = WorkerStats()

    def take_stats(self) -> WorkerStats:
        """The stats since the last call (the worker starts counting again from zero), with the
        puts that landed by now."""
        self._apply_landed()
        stats, self.stats = self.stats, WorkerStats()
        return stats

    def load(
        self,
        plan: Plan,
        agree: Callable[[list[int]], list[int]] | None = None,
        pipe: StagePipe | None = None,
    ) -> set[int]:
        """Run the plan's loads; the blocks that failed (each failed page and every later page of
        its request). Nothing failed is written to a block. ``agree`` (tensor parallel: every
        rank runs the same plan) takes each load's first failed page index on this rank
        (``NO_FAILURE`` if none) and returns the least over the ranks; every rank then fails
        from there, so no rank saves a page computed over another rank's failed load. ``pipe``
        (pipeline parallel) takes them to the later stages (see the module docstring)."""
        self._apply_landed()
        fetched = [(moves, self._fetch(moves)) for _request_id, moves in plan.loads]
        cuts = [
            moves[ok.index(False)].index if False in ok else NO_FAILURE for moves, ok in fetched
        ]
        if agree is not None and cuts:
            cuts = agree(cuts)
        if pipe is not None and cuts:
            pipe.send(plan.number, cuts)
        self._forget_reported(plan)
        for (_request_id, moves), cut in zip(plan.loads, cuts, strict=True):
            good = [move for move in moves if move.index < cut]
            self.stats.failed_load_pages += len(moves) - len(good)
            if good:
                self.blocks.load(self.host, [m.slot for m in good], [m.block for m in good])
                self.loaded_pages += len(good)
                remote = sum(move.source is PageSource.L3 for move in good)
                self.stats.loaded_l3_pages += remote
                self.stats.loaded_l2_pages += len(good) - remote
        return self._poison(plan, cuts)

    def _poison(self, plan: Plan, cuts: Sequence[int]) -> set[int]:
        """Keep plan ``plan``'s failed loads (each load's first failed page, ``cuts``) until a
        plan says they were reported; the blocks that failed."""
        failed: set[int] = set()
        failed_from: dict[str, int] = {}  # request -> its first failed page
        for (request_id, moves), cut in zip(plan.loads, cuts, strict=True):
            if cut != NO_FAILURE:
                failed_from[request_id] = cut
                failed.update(move.block for move in moves if move.index >= cut)
        if failed:
            self.poisoned.append((plan.number, frozenset(failed), failed_from))
        return failed

    def _forget_reported(self, plan: Plan) -> None:
        """Drop the failures the index was told of before it made ``plan`` (its saves skip them)."""
        self.poisoned = [item for item in self.poisoned if item[0] > plan.reported_through]

    def _fetch(self, moves: Sequence[PageMove]) -> list[bool]:
        ok = [
            move.slot != NO_SLOT
            and (move.source is PageSource.L3 or self.written.get(move.slot) == move.page)
            for move in moves
        ]
        remote = [k for k, move in enumerate(moves) if ok[k] and move.source is PageSource.L3]
        if remote:
            statuses, seconds = (  # behind the queued puts: one thread drives the store
                self.lane.get([moves[k].page for k in remote], [moves[k].slot for k in remote])
                if self.lane is not None
                else ([GetStatus.FAILED] * len(remote), 0.0)
            )
            self.stats.l3_read_seconds += seconds
            for k, status in zip(remote, statuses, strict=True):
                ok[k] = status is GetStatus.LOADED
                self.stats.l3_read_bytes += self.host.shape.bytes_per_page * ok[k]
        cut = ok.index(False) if False in ok else len(ok)
        return [True] * cut + [False] * (len(ok) - cut)

    def save(self, plan: Plan, pipe: StagePipe | None = None) -> None:
        """Put again the pages whose backup failed before (their slots still hold them; at most
        ``RETRY_PAGES``, oldest first), then copy the plan's saved blocks to their L2 slots and
        back them up to L3. A page whose put fails waits in ``unbacked`` for the next save.
        ``pipe``: the earlier stages' failed loads of this plan count as this stage's own."""
        if pipe is not None and plan.loads:
            earlier = pipe.receive(plan.number, len(plan.loads))
            if earlier:
                self._poison(plan, [min(cuts) for cuts in zip(*earlier, strict=True)])
        self.failed_puts = []
        self._retry(plan)
        moves = [move for _rid, batch in plan.saves for move in batch]
        for move in moves:
            self.written.pop(move.slot, None)  # the slot is being reused: its page leaves L2
            self.unbacked.pop(move.slot, None)  # (a save cut below included), as in the model
        # a request whose load failed (this step, or one not reported when this plan was made),
        # or that attends over a block such a load failed to fill, computed over bad KV
        self._forget_reported(plan)
        cuts: dict[str, int] = {}
        bad_blocks: set[int] = set()
        for _number, blocks, failed_from in self.poisoned:
            bad_blocks |= blocks
            for request_id, cut in failed_from.items():
                cuts[request_id] = min(cuts.get(request_id, NO_FAILURE), cut)
        for request_id, attended in plan.attends:
            bad = [k for k, block in enumerate(attended) if block in bad_blocks]
            if bad:
                cuts[request_id] = min(cuts.get(request_id, NO_FAILURE), bad[0])
        moves = [
            move
            for request_id, batch in plan.saves
            for move in batch
            if move.index < cuts.get(request_id, NO_FAILURE) and move.block not in bad_blocks
        ]
        # a full L2 reuses a slot within one plan: each run of distinct slots is written and its
        # put queued; a run overwrites a slot only once the put reading it landed (else L3 would
        # get the later page's bytes), and so does a later save
        while moves:
            seen: set[int] = set()
            run = []
            for move in moves:
                if move.slot in seen:
                    break
                seen.add(move.slot)
                run.append(move)
            moves = moves[len(run) :]
            self._settle([m.slot for m in run])  # C4: no put still reads a slot it overwrites
            self.blocks.save([m.block for m in run], self.host, [m.slot for m in run])
            self.stats.saved_pages += len(run)
            for move in run:
                self.written[move.slot] = move.page
                self.unbacked.pop(move.slot, None)  # the slot holds another page now
            self._put([m.page for m in run], [m.slot for m in run])

    def _retry(self, plan: Plan) -> None:
        """Put again the pages whose backup failed (their slots still hold them; at most
        ``RETRY_PAGES``, oldest first), once the puts still reading ``plan``'s slots landed: a
        put that failed after this save began is put again before its slot is reused, as when
        every save waited for its puts."""
        self._settle([move.slot for _rid, batch in plan.saves for move in batch])
        waiting = [(s, p) for s, p in self.unbacked.items() if self.written.get(s) == p]
        retried, self.unbacked = waiting[:RETRY_PAGES], dict(waiting[RETRY_PAGES:])
        if retried:
            self._put([p for _s, p in retried], [s for s, _p in retried])

    def _settle(self, slots: Sequence[int]) -> None:
        """Wait for the puts still reading ``slots`` (counted as waiting for the store), then apply
        what landed."""
        if self.lane is not None:
            started = time.perf_counter()
            self.lane.settle(slots)
            self.stats.backup_wait_seconds += time.perf_counter() - started
        self._apply_landed()

    def _put(self, pages: Sequence[PageHash], slots: Sequence[int]) -> None:
        if self.lane is not None:
            started = time.perf_counter()  # an inline lane's put runs here: the step waits
            self.lane.put(pages, slots)
            self.stats.backup_wait_seconds += time.perf_counter() - started
            self._apply_landed()  # an InlineExecutor's put has landed already

    def flush(self) -> None:
        """Wait for every put queued so far and apply its outcome (tests; before a shutdown)."""
        if self.lane is not None:
            self.lane.flush()
            self._apply_landed()

    def _apply_landed(self) -> None:
        """Apply the puts that landed: a page whose put failed waits in ``unbacked`` (while its
        slot holds it: the slot was not written since, C4)."""
        for put in self.lane.landed() if self.lane is not None else ():
            self.stats.l3_write_seconds += put.seconds
            self._count_put(put)

    def _count_put(self, put: LandedPut) -> None:
        for page, slot, status in zip(put.pages, put.slots, put.statuses, strict=True):
            if not status.ok:
                if self.written.get(slot) == page:  # waits for a retry while L2 holds it
                    self.unbacked[slot] = page
                self.failed_puts.append(page)
                self.stats.failed_backup_pages += 1
            else:  # stored, found there, or (replicated KV) another rank's duty: no bytes moved
                self.stats.backed_up_pages += 1
            if status is PutStatus.STORED:
                self.stats.l3_written_bytes += self.host.shape.bytes_per_page

    def close(self) -> None:
        """Let every queued put land (the store keeps what this worker saved), then close the
        executor and the store."""
        if self.lane is not None:
            self.lane.close()
            self._apply_landed()
        if self.backend is not None:
            self.backend.close()
