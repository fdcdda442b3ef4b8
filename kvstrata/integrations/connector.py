"""An engine KV connector's scheduler side without the engine: :class:`ConnectorIndex`, and the
step plan it hands the worker side (:mod:`kvstrata.integrations.connector_worker`). The vLLM adapter
converts vLLM's types and delegates here.

The index is the model's :class:`~kvstrata.model.connector.ConnectorModel` with host slots attached
(``tests/stateful/test_connector_differential.py`` holds the two together): an L2 index of page hash
to host slot (LRU), the requests in :data:`~kvstrata.model.lifecycles.CONNECTOR_REQUEST`, and the
step plans. The L3 lookup of a new request runs in the background (``start_lookup``, a future); until
it lands the request's match is ``None``.

Slots: ``[0, capacity)`` hold L2 pages; ``[capacity, capacity + staging)`` are staging slots that L3
reads land in before they are copied to the engine's blocks. ``alloc`` reserves a staging slot for
each L3 page of its load and ``match`` never answers more L3 pages than there are free unreserved
slots (a hit is a load the worker can run); a staging slot is reused only ``lag + 1`` plans after
the plan that took it (an engine may build the next ``lag`` plans before a step ran). A page read
from L3 is not indexed in L2: had its read failed, the index would name bad bytes.

A failed load (:meth:`ConnectorIndex.load_failures`, reported by the engine for one of the last
``lag + 1`` plans) takes back the saves the worker dropped over it and moves the request's saved
mark back to the first page the engine computes again.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future

import attrs

from kvstrata.impl.errors import MisuseError
from kvstrata.model.connector import PageSource
from kvstrata.model.keys import PageHash
from kvstrata.model.lifecycles import CONNECTOR_REQUEST, MATCHABLE, RequestEvent, RequestState

__all__ = [
    "NO_FAILURE",
    "NO_SLOT",
    "ConnectorIndex",
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
    #: its saves in the last lag + 1 plans: plan number, the save, the L2 insertion it made
    stored: tuple[tuple[int, PageMove, int], ...] = ()
    load_plan: int = 0  # the plan that ran its load
    load_insertions: dict[int, int] = attrs.Factory(dict)  # page its load read from L2 -> insertion


class ConnectorIndex:
    """The scheduler side: ``capacity`` L2 slots and ``staging`` staging slots of one host pool;
    ``lag``: how many plans the engine builds after a plan before it reports that plan's failed
    loads (the model's ``lag``)."""

    def __init__(
        self,
        capacity: int,
        staging: int,
        start_lookup: Callable[[Sequence[PageHash]], Future[int]],
        *,
        lag: int = 1,
    ) -> None:
        if capacity < 1 or staging < 0:
            raise MisuseError(f"ConnectorIndex: capacity {capacity}, staging {staging}")
        if isinstance(lag, bool) or not isinstance(lag, int) or lag < 1:
            raise MisuseError(f"ConnectorIndex: lag is an int >= 1, got {lag!r}")
        self.capacity, self.staging, self.lag = capacity, staging, lag
        self.start_lookup = start_lookup
        self.l2: collections.OrderedDict[PageHash, int] = collections.OrderedDict()
        self.free = list(range(capacity - 1, -1, -1))
        self.staging_free = list(range(capacity + staging - 1, capacity - 1, -1))
        self._staging_held: collections.deque[list[int]] = collections.deque(
            [] for _ in range(lag + 1)
        )
        self.requests: dict[str, _Request] = {}
        self.plans = 0  # plans made (the last plan's number)
        self.reported_through = 0  # the newest plan whose failed loads were reported
        #: the blocks the last lag + 1 plans load into, by plan number (which plan a report is of)
        self._loaded: collections.deque[tuple[int, frozenset[int]]] = collections.deque(
            maxlen=lag + 1
        )
        #: each page L2 holds -> the number of the save that put it there (as the model's)
        self._inserted: dict[PageHash, int] = {}
        self._insertions = 0

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
        for request in self.requests.values():  # a report names one of the last lag + 1 plans
            request.stored = tuple(i for i in request.stored if i[0] >= self.plans - self.lag)
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
            request.load_plan = self.plans
            request.load_insertions = {
                m.index: self._inserted[m.page] for m in moves if m.page in self._inserted
            }
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
                slot, insertion = self._insert(page)
                stored.append(PageMove(index, page, slot, item.blocks[index]))
                request.stored += ((self.plans, stored[-1], insertion),)
            request.saved = max(request.saved, done)
            if stored:
                saves.append((item.request_id, tuple(stored)))
                attends.append((item.request_id, tuple(item.blocks[: stored[0].index])))
        return Plan(tuple(loads), tuple(saves), tuple(attends), self.plans, self.reported_through)

    def _insert(self, page: PageHash) -> tuple[int, int]:
        """``page`` into L2 (the least recently used page out when full): its slot, and the
        number of this insertion."""
        if self.free:
            slot = self.free.pop()
        else:
            evicted, slot = self.l2.popitem(last=False)
            del self._inserted[evicted]
        self.l2[page] = slot
        self._insertions += 1
        self._inserted[page] = self._insertions
        return slot, self._insertions

    def failed_plan(self, blocks: set[int]) -> int:
        """Which plan a report of failed ``blocks`` is of: the newest of the last ``lag + 1`` plans
        that loads into one of them (the last plan if none does)."""
        for number, loaded in reversed(self._loaded):
            if loaded & blocks:
                return number
        return self.plans

    def load_failures(
        self, failed: Mapping[str, int], plan: int, recompute: Mapping[str, int] | None = None
    ) -> None:
        """The engine's report of plan ``plan``'s failed loads (one of the last ``lag + 1``
        plans): per request its first page that held bad KV and the first page the engine
        computes again (``recompute``; default: that page), as the model's. Later plans tell the
        worker the failure was reported (``Plan.reported_through``)."""
        if not (self.plans - self.lag <= plan <= self.plans and plan >= 1):
            raise MisuseError(
                f"connector: a report of plan {plan}; the last plan is {self.plans}, lag {self.lag}"
            )
        for request_id, index in failed.items():
            resume = (recompute or {}).get(request_id, index)
            self.load_failed(request_id, index, since=plan, resume=resume)
        self.reported_through = max(self.reported_through, plan)

    def load_failed(
        self, request_id: str, index: int, since: int | None = None, resume: int | None = None
    ) -> None:
        """Page ``index`` of the request held bad KV in plan ``since``'s step (the model's
        ``load_failed``): the saves the worker dropped (page ``index`` on, that plan and later)
        leave the index unless saved again since, as does the page its own load read from L2 at
        ``index``; the saved mark becomes ``resume`` (at least ``index``)."""
        since = self.plans if since is None else since
        resume = index if resume is None else max(index, resume)
        request = self._request(request_id)
        if request.state is not RequestState.RUNNING:
            raise MisuseError(
                f"connector: {request_id!r} reported a failed load while {request.state.value}"
            )
        if not 0 <= index < len(request.pages):
            raise MisuseError(f"connector: {request_id!r} has no page {index}")
        dropped = [item for item in request.stored if item[0] >= since and item[1].index >= index]
        for _plan, move, insertion in dropped:
            self._take_back(move.page, insertion)
        if request.load_plan >= since and index in request.load_insertions:
            self._take_back(request.pages[index], request.load_insertions[index])
        request.stored = tuple(item for item in request.stored if item not in dropped)
        request.saved = max(min(request.saved, index), resume)

    def _take_back(self, page: PageHash, insertion: int) -> None:
        if self._inserted.get(page) == insertion:  # L2 holds it from that save still
            self.free.append(self.l2.pop(page))
            del self._inserted[page]

    def finish(self, request_id: str) -> None:
        request = self._request(request_id)
        CONNECTOR_REQUEST.next(request.state, RequestEvent.FINISH)
        request.lookup.cancel()
        self.staging_free.extend(reversed(request.staging))
        del self.requests[request_id]
