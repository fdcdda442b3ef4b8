"""An engine KV connector's two halves, without the engine: :class:`ConnectorIndex` (scheduler side)
and :class:`ConnectorWorker` (worker side). The vLLM adapter converts vLLM's types and delegates here.

The index is the model's :class:`~kvstrata.model.connector.ConnectorModel` with host slots attached
(``tests/stateful/test_connector_differential.py`` holds the two together): an L2 index of page hash
to host slot (LRU), the requests in :data:`~kvstrata.model.lifecycles.CONNECTOR_REQUEST`, and the
step plans. The L3 lookup of a new request runs in the background (``start_lookup``, a future); until
it lands the request's match is ``None``.

Slots: ``[0, capacity)`` hold L2 pages; ``[capacity, capacity + staging)`` are staging slots that L3
reads land in before they are copied to the engine's blocks. ``alloc`` reserves a staging slot for
each L3 page of its load and ``match`` never answers more L3 pages than there are free unreserved
slots (a hit is a load the worker can run); a staging slot is reused only two plans after the plan
that took it (an engine may build the next step's plan before the previous step ran). A page read
from L3 is not indexed in L2: had its read failed, the index would name bad bytes.

The worker owns the bytes and checks every L2 read against what it last wrote into that slot
(``written``): a plan that names a slot holding another page (a stale offset, by any route) is a load
error, never served. A load error fails the page and every later page of that request. The engine's
step then runs as if the load had worked, so every page the request computes in that step attends
over bad KV: the worker drops the request's saves from its first failed page on (with ``agree``, the
first failed page agreed by every rank: a rank whose own load went well computed its pages from the
failed rank's hidden states), and :meth:`ConnectorIndex.load_failed` takes them out of the index
and moves the request's saved mark back, so the pages computed again are saved later.

An engine that plans one step ahead (vLLM's async scheduling) reports a step's failed loads after
it built the next plan, whose saves were computed over the same bad KV: the worker keeps each
failure (``poisoned``) until a plan says it was reported (``Plan.reported_through``) and drops
those saves too; :meth:`ConnectorIndex.load_failures` takes back the saves of the failed plan and
of the plan after it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Protocol

import attrs
import torch

from kvstrata.impl.errors import MisuseError
from kvstrata.impl.pools.host import HostKVPool
from kvstrata.impl.storage.base import GetStatus, StorageBackend
from kvstrata.model.connector import RETRY_PAGES, PageSource
from kvstrata.model.keys import Namespace, PageHash
from kvstrata.model.lifecycles import CONNECTOR_REQUEST, MATCHABLE, RequestEvent, RequestState

__all__ = [
    "NO_FAILURE",
    "BlockIO",
    "ConnectorIndex",
    "ConnectorWorker",
    "PageMove",
    "Plan",
    "Scheduled",
]

NO_SLOT = -1
NO_FAILURE = 2**31 - 1  # a load's first failed page index when none failed (agreed by minimum)


@attrs.frozen
class PageMove:
    """One page between a host slot and an engine block (``slot == NO_SLOT``: no staging room)."""

    index: int
    page: PageHash
    slot: int
    block: int
    source: PageSource = PageSource.L2


@attrs.frozen
class Plan:
    """One step's work for the worker: loads (request id, pages in order) and saves."""

    loads: tuple[tuple[str, tuple[PageMove, ...]], ...] = ()
    saves: tuple[tuple[str, tuple[PageMove, ...]], ...] = ()
    attends: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """Per saving request, its blocks before its first saved page: the KV its new pages attend
    over (an engine's prefix cache may share them with another request's load of this step)."""
    number: int = 0
    """This plan's number (the first plan is 1)."""
    reported_through: int = 0
    """The newest plan whose failed loads the index had been told of when it made this plan."""


@attrs.frozen
class Scheduled:
    """A request scheduled this step: its full pages computed once the step ran, and its blocks."""

    request_id: str
    done: int
    blocks: tuple[int, ...]


@attrs.define
class _Request:
    pages: tuple[PageHash, ...]
    lookup: Future[int]
    state: RequestState = CONNECTOR_REQUEST.initial
    l3_hit: int | None = None
    load: tuple[PageMove, ...] = ()
    saved: int = 0
    staging: list[int] = attrs.Factory(list)  # staging slots reserved for the planned load
    stored: tuple[tuple[int, PageMove], ...] = ()  # its saves in the last two plans, by plan


class ConnectorIndex:
    """The scheduler side: ``capacity`` L2 slots and ``staging`` staging slots of one host pool."""

    def __init__(
        self, capacity: int, staging: int, start_lookup: Callable[[Sequence[PageHash]], Future[int]]
    ) -> None:
        if capacity < 1 or staging < 0:
            raise MisuseError(f"ConnectorIndex: capacity {capacity}, staging {staging}")
        self.capacity, self.staging = capacity, staging
        self.start_lookup = start_lookup
        self.l2: collections.OrderedDict[PageHash, int] = collections.OrderedDict()
        self.free = list(range(capacity - 1, -1, -1))
        self.staging_free = list(range(capacity + staging - 1, capacity - 1, -1))
        self._staging_held: collections.deque[list[int]] = collections.deque([[], []])
        self.requests: dict[str, _Request] = {}
        self.plans = 0  # plans made (the last plan's number)
        self.reported_through = 0  # the newest plan whose failed loads were reported
        #: the blocks the last two plans load into, by plan number (which plan a report is of)
        self._loaded: collections.deque[tuple[int, frozenset[int]]] = collections.deque(maxlen=2)

    def _request(self, request_id: str) -> _Request:
        try:
            return self.requests[request_id]
        except KeyError:
            raise MisuseError(f"connector: unknown request {request_id!r}") from None

    def new_request(self, request_id: str, pages: Sequence[PageHash]) -> None:
        if request_id in self.requests:
            raise MisuseError(f"connector: request {request_id!r} is already known")
        pages = tuple(pages)
        self.requests[request_id] = _Request(pages, self.start_lookup(pages))

    def _answered(self, request: _Request) -> bool:
        if request.state is RequestState.LOOKING_UP:
            if not request.lookup.done():
                return False
            try:
                hit = request.lookup.result()
            except Exception:  # a failed lookup is a miss, never an error of the engine
                hit = 0
            request.state = CONNECTOR_REQUEST.next(request.state, RequestEvent.ANSWERED)
            request.l3_hit = hit
        return True

    def sources(self, request_id: str, computed: int, limit: int) -> tuple[PageSource, ...] | None:
        """Where each page from ``computed`` on would come from; ``None`` while the lookup runs."""
        request = self._request(request_id)
        if not self._answered(request):
            return None
        if request.state not in MATCHABLE:
            raise MisuseError(f"connector: request {request_id!r} is {request.state.value}")
        found: list[PageSource] = []
        room = len(self.staging_free) + len(request.staging)  # staging slots for L3 pages
        for index in range(computed, min(limit, len(request.pages))):
            if request.pages[index] in self.l2:
                found.append(PageSource.L2)
            elif index < (request.l3_hit or 0) and room > 0:
                found.append(PageSource.L3)
                room -= 1
            else:
                break
        return tuple(found)

    def match(self, request_id: str, computed: int, limit: int) -> int | None:
        found = self.sources(request_id, computed, limit)
        return None if found is None else len(found)

    def alloc(self, request_id: str, computed: int, blocks: Sequence[int], limit: int) -> None:
        """The engine gave ``blocks`` to the external pages after ``computed`` (none: no load)."""
        request = self._request(request_id)
        event = RequestEvent.ALLOC_LOAD if blocks else RequestEvent.ALLOC_NONE
        state = CONNECTOR_REQUEST.next(request.state, event)
        found = self.sources(request_id, computed, limit) or ()
        if len(blocks) > len(found):
            raise MisuseError(f"connector: {len(blocks)} blocks for {len(found)} matched pages")
        request.state = state
        self.staging_free.extend(reversed(request.staging))
        request.staging = []
        moves = []
        for k, (block, source) in enumerate(zip(blocks, found, strict=False)):
            slot = NO_SLOT
            if source is PageSource.L3:  # match counted a free staging slot for it
                slot = self.staging_free.pop()
                request.staging.append(slot)
            moves.append(PageMove(computed + k, request.pages[computed + k], slot, block, source))
        request.load = tuple(moves)
        request.saved = max(request.saved, computed + len(blocks))

    def plan(self, scheduled: Sequence[Scheduled]) -> Plan:
        """The step's plan: the planned loads (L2 slots refreshed, L3 pages given staging slots),
        then the saves of ``scheduled``."""
        self.staging_free.extend(self._staging_held.popleft())
        held: list[int] = []
        loads = []
        self.plans += 1
        for request in self.requests.values():  # a report names this plan or the one before
            request.stored = tuple(item for item in request.stored if item[0] == self.plans - 1)
        for request_id, request in self.requests.items():
            if request.state is not RequestState.LOAD_PLANNED:
                continue
            request.state = CONNECTOR_REQUEST.next(request.state, RequestEvent.PLANNED)
            held.extend(request.staging)
            request.staging = []
            moves = []
            for move in request.load:
                if move.source is PageSource.L2 and move.page in self.l2:
                    self.l2.move_to_end(move.page)
                    moves.append(attrs.evolve(move, slot=self.l2[move.page]))
                elif move.source is PageSource.L3:
                    moves.append(move)  # its staging slot, reserved by alloc
                else:
                    moves.append(attrs.evolve(move, slot=NO_SLOT))  # a load error, reported
            request.load = tuple(moves)
            loads.append((request_id, tuple(moves)))
        self._staging_held.append(held)
        self._loaded.append(
            (self.plans, frozenset(move.block for _rid, moves in loads for move in moves))
        )
        saves, attends = [], []
        for item in scheduled:
            request = self._request(item.request_id)
            if request.state is not RequestState.RUNNING:
                raise MisuseError(
                    f"connector: {item.request_id!r} scheduled while {request.state.value}"
                )
            done = min(item.done, len(request.pages), len(item.blocks))
            stored = []
            for index in range(request.saved, done):
                page = request.pages[index]
                if page in self.l2:
                    continue
                slot = self.free.pop() if self.free else self.l2.popitem(last=False)[1]
                self.l2[page] = slot
                stored.append(PageMove(index, page, slot, item.blocks[index]))
            request.saved = max(request.saved, done)
            if stored:
                request.stored += tuple((self.plans, move) for move in stored)
                saves.append((item.request_id, tuple(stored)))
                attends.append((item.request_id, tuple(item.blocks[: stored[0].index])))
        return Plan(tuple(loads), tuple(saves), tuple(attends), self.plans, self.reported_through)

    def failed_plan(self, blocks: set[int]) -> int:
        """Which plan a report of failed ``blocks`` is of: the newer of the last two plans that
        loads into one of them (the last plan if neither does)."""
        for number, loaded in reversed(self._loaded):
            if loaded & blocks:
                return number
        return self.plans

    def load_failures(self, failed: Mapping[str, int], plan: int) -> None:
        """The engine's report of plan ``plan``'s failed loads (the last plan, or the one before
        it): per request its first page that held bad KV (:meth:`load_failed`). Later plans tell
        the worker the failure was reported (``Plan.reported_through``)."""
        if not (self.plans - 1 <= plan <= self.plans and plan >= 1):
            raise MisuseError(f"connector: a report of plan {plan}; the last plan is {self.plans}")
        for request_id, index in failed.items():
            self.load_failed(request_id, index, since=plan)
        self.reported_through = max(self.reported_through, plan)

    def load_failed(self, request_id: str, index: int, since: int | None = None) -> None:
        """Page ``index`` of the request held bad KV in plan ``since``'s step (default: the last
        plan): its own load of it failed on some rank, or a block it shares with another
        request's failed load (the engine reports the blocks). The worker dropped the request's
        saves from page ``index`` on in that plan and every later one, so their pages leave the
        index (each whose slot still holds it) and the saved mark goes back to ``index``, for a
        later step to save them."""
        since = self.plans if since is None else since
        request = self._request(request_id)
        if request.state is not RequestState.RUNNING:
            raise MisuseError(
                f"connector: {request_id!r} reported a failed load while {request.state.value}"
            )
        if not 0 <= index < len(request.pages):
            raise MisuseError(f"connector: {request_id!r} has no page {index}")
        dropped = [item for item in request.stored if item[0] >= since and item[1].index >= index]
        for _plan, move in dropped:
            if self.l2.get(move.page) == move.slot:
                del self.l2[move.page]
                self.free.append(move.slot)
        request.stored = tuple(item for item in request.stored if item not in dropped)
        request.saved = min(request.saved, index)

    def finish(self, request_id: str) -> None:
        request = self._request(request_id)
        CONNECTOR_REQUEST.next(request.state, RequestEvent.FINISH)
        request.lookup.cancel()
        self.staging_free.extend(reversed(request.staging))
        del self.requests[request_id]


class BlockIO(Protocol):
    """An engine's KV blocks as kvstrata pages: ``read(blocks)`` gives canonical KV of those blocks,
    ``write(blocks, kv)`` puts canonical KV into them."""

    def read(self, blocks: Sequence[int]) -> torch.Tensor: ...

    def write(self, blocks: Sequence[int], kv: torch.Tensor) -> None: ...


class ConnectorWorker:
    """The worker side: the host pool (L2 and staging slots), the store (L3), the engine's blocks."""

    def __init__(
        self,
        host: HostKVPool,
        backend: StorageBackend | None,
        namespace: Namespace,
        blocks: BlockIO,
    ) -> None:
        self.host, self.backend, self.namespace, self.blocks = host, backend, namespace, blocks
        if backend is not None:
            backend.attach(host)
        self.written: dict[int, PageHash] = {}
        self.loaded_pages = 0
        self.failed_blocks: set[int] = set()
        self.failed_from: dict[str, int] = {}  # request -> its first failed page, this step
        #: failed loads not reported yet (plan number, failed blocks, each request's first failed
        #: page): a plan made before the report saves nothing computed over them
        self.poisoned: list[tuple[int, frozenset[int], dict[str, int]]] = []
        self.unbacked: dict[int, PageHash] = {}  # slot -> its page, whose backup put failed
        self.failed_puts: list[PageHash] = []  # the pages whose put failed in the last save

    def load(self, plan: Plan, agree: Callable[[list[int]], list[int]] | None = None) -> set[int]:
        """Run the plan's loads; the blocks that failed (each failed page and every later page of
        its request). Nothing failed is written to a block. ``agree`` (tensor parallel: every
        rank runs the same plan) takes each load's first failed page index on this rank
        (``NO_FAILURE`` if none) and returns the least over the ranks; every rank then fails
        from there, so no rank saves a page computed over another rank's failed load."""
        fetched = [(request_id, moves, self._fetch(moves)) for request_id, moves in plan.loads]
        cuts = [
            moves[ok.index(False)].index if False in ok else NO_FAILURE
            for _request_id, moves, ok in fetched
        ]
        if agree is not None and cuts:
            cuts = agree(cuts)
        failed: set[int] = set()
        self.failed_from = {}
        self._forget_reported(plan)
        for (request_id, moves, _ok), cut in zip(fetched, cuts, strict=True):
            good = [move for move in moves if move.index < cut]
            if good:
                kv = self.host.read_pages([move.slot for move in good])
                self.blocks.write([move.block for move in good], kv)
                self.loaded_pages += len(good)
            if cut != NO_FAILURE:
                self.failed_from[request_id] = cut
                failed.update(move.block for move in moves if move.index >= cut)
        self.failed_blocks = failed
        if failed:
            self.poisoned.append((plan.number, frozenset(failed), dict(self.failed_from)))
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
            statuses = (
                self.backend.get(
                    self.namespace, [moves[k].page for k in remote], [moves[k].slot for k in remote]
                )
                if self.backend is not None
                else [GetStatus.FAILED] * len(remote)
            )
            for k, status in zip(remote, statuses, strict=True):
                ok[k] = status is GetStatus.LOADED
        cut = ok.index(False) if False in ok else len(ok)
        return [True] * cut + [False] * (len(ok) - cut)

    def save(self, plan: Plan) -> None:
        """Put again the pages whose backup failed before (their slots still hold them; at most
        ``RETRY_PAGES``, oldest first), then copy the plan's saved blocks to their L2 slots and
        back them up to L3. A page whose put fails waits in ``unbacked`` for the next save."""
        self.failed_puts = []
        waiting = [(s, p) for s, p in self.unbacked.items() if self.written.get(s) == p]
        self.unbacked = dict(waiting[RETRY_PAGES:])
        if waiting[:RETRY_PAGES]:
            self._put(
                [p for _s, p in waiting[:RETRY_PAGES]], [s for s, _p in waiting[:RETRY_PAGES]]
            )
        moves = [move for _rid, batch in plan.saves for move in batch]
        for move in moves:
            self.written.pop(move.slot, None)  # the slot is being reused
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
        # a full L2 reuses a slot within one plan: each run of distinct slots is written and backed
        # up before the next run overwrites any of them (else L3 would get the later page's bytes)
        while moves:
            seen: set[int] = set()
            run = []
            for move in moves:
                if move.slot in seen:
                    break
                seen.add(move.slot)
                run.append(move)
            moves = moves[len(run) :]
            self.host.write_pages([m.slot for m in run], self.blocks.read([m.block for m in run]))
            for move in run:
                self.written[move.slot] = move.page
                self.unbacked.pop(move.slot, None)  # the slot holds another page now
            self._put([m.page for m in run], [m.slot for m in run])

    def _put(self, pages: Sequence[PageHash], slots: Sequence[int]) -> None:
        if self.backend is None:
            return
        for page, slot, status in zip(
            pages, slots, self.backend.put(self.namespace, pages, slots), strict=True
        ):
            if not status.ok:
                self.unbacked[slot] = page
                self.failed_puts.append(page)

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()
