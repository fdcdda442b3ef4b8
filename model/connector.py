"""The scheduler side of an engine KV connector (vLLM's ``KVConnectorBase_V1``): the reference model.

Pure: page hashes in, answers and plans out; no engine, no torch, no I/O. The implementation
(:mod:`kvstrata.integrations.connector`) keeps the same state with host slots attached and is held to
this model by ``tests/stateful/test_connector_differential.py``.

Tiers, as a connector sees them: the engine's own blocks are L1 (the engine's prefix cache decides
what is local); kvstrata's host pool is **L2**, indexed here by page hash with LRU eviction and a
fixed capacity; the shared store is **L3**.

Per request (:data:`~kvstrata.model.lifecycles.CONNECTOR_REQUEST`):

- ``new_request`` starts the L3 lookup (``LOOKING_UP``); ``answer`` records how many pages, from the
  first, the store holds (``READY``). Until then :meth:`ConnectorModel.match` answers ``None``
  ("ask again"), never a guess.
- :meth:`ConnectorModel.match` is side-effect free: from the first page the engine lacks, each page is
  served from L2 if the index holds it, else from L3 if it lies below the lookup's answer; the first
  page in neither ends the hit. At most ``limit`` pages (the engine keeps at least one token to
  compute).
- ``alloc`` fixes the load plan (``LOAD_PLANNED``) as ``match`` answered it; :meth:`ConnectorModel.plan`
  puts it into the step's plan (``RUNNING``) and refreshes the L2 pages it reads.
- Saves: each step, every scheduled request's newly computed full pages that L2 does not hold are
  written to L2 (evicting the least recently used page when full) and backed up to L3. Pages the
  request *loaded* are never saved by it in that step (a failed load would otherwise be saved as if
  it were good); they are already in L2 or L3. The worker may let a step's puts land behind the
  step: this model's L3 is then the store once they landed, and ``backup_failed`` takes their
  failures when they land (the worker's rule **C4**: a host slot is written only when no pending
  put reads it; docs/model.md).
- Failed backups (:meth:`ConnectorModel.backup_failed`): a page whose put failed (store down,
  full, timed out) stays in L2 and waits in ``unbacked``; the next step retries it first, before
  its own saves, while L2 still holds it (at most ``RETRY_PAGES`` a step, oldest first), so a short
  outage loses no page from L3 for good (SPEC §9: retried later, never silently dropped).
- Staging: a page read from L3 lands in one of ``staging`` slots first. ``alloc`` reserves one slot
  per L3 page of its load; the step's plan takes them, and they are free again ``lag + 1`` plans
  later (an engine may build the next ``lag`` plans before the step ran). ``match`` therefore
  serves at most as many L3 pages as there are unreserved free slots: a hit it answers is a load
  the worker can run, never a load error made by the connector itself (under vLLM's default
  failure policy that fails the request).
- A failed load (:meth:`ConnectorModel.load_failed`): the engine's step ran as if every planned page
  had loaded, so the pages a request computed in that step attend over bad KV. The worker drops the
  request's saves at and after its first failed page (on every tensor-parallel rank, agreed: a
  rank whose own load went well computed its pages from the failed rank's hidden states; and on
  every later pipeline stage, told by the stage that failed: its layers take that stage's hidden
  states); they leave L2 and L3 again, and the request's saved mark goes back to that page, so the
  pages it computes again are saved by a later step.
- Reports behind the plans (:meth:`ConnectorModel.load_failures`): an engine that schedules ahead
  (vLLM's async scheduling, its pipeline's batch queue) builds plans N+1 .. N+``lag`` before it
  reports plan N's failed loads, and they save pages the request computed over the same bad KV.
  Each plan carries its ``number`` and ``reported_through`` (the newest plan whose failed loads
  had been reported when it was made): the worker keeps dropping a failed request's saves, and
  saves over a failed block, in every plan made before the report (``reported_through`` below the
  failed plan); the report takes back the saves of the failed plan and of every plan after it.
  ``lag`` bounds how far behind a report may come: it names one of the last ``lag + 1`` plans
  (vLLM: its ``max_concurrent_batches`` less one; 1 for async scheduling alone).

Invariants (:meth:`ConnectorModel.check`): L2 holds at most ``capacity`` distinct pages; a planned L2
read names a page L2 held when the plan was made; a planned L3 read lies below the request's lookup
answer; a request answers ``None`` only while its lookup is in flight; **C3** the staging slots
reserved, held by the last ``lag + 1`` plans and free add up to ``staging``, and every planned L3
read has a slot.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Mapping, Sequence

import attrs

from kvstrata.model.errors import InvariantViolation, MisuseError
from kvstrata.model.keys import PageHash
from kvstrata.model.lifecycles import CONNECTOR_REQUEST, MATCHABLE, RequestEvent, RequestState

__all__ = ["RETRY_PAGES", "ConnectorModel", "PageSource", "StepPlan"]

RETRY_PAGES = 64
"""The most pages whose backup failed that one step puts again."""


class PageSource(enum.Enum):
    """Where a loaded page comes from."""

    L2 = "l2"
    L3 = "l3"


@attrs.define
class _Request:
    pages: tuple[PageHash, ...]
    state: RequestState = CONNECTOR_REQUEST.initial
    l3_hit: int | None = None
    first: int = 0
    """The first page of the planned load."""
    load: tuple[PageSource, ...] = ()
    saved: int = 0
    """Pages below this index are stored (or were loaded, or are someone else's)."""
    staging: int = 0
    """Staging slots reserved for the planned load's L3 pages (``LOAD_PLANNED`` only)."""
    stored: tuple[tuple[int, int, bool, int], ...] = ()
    """This request's saves in the last ``lag + 1`` plans: plan number, page index, whether that
    save put the page in L3, and the L2 insertion it made."""
    load_plan: int = 0
    """The plan that ran this request's load."""
    load_insertions: dict[int, int] = attrs.Factory(dict)
    """Per page its load read from L2, the L2 insertion it read."""


@attrs.frozen
class StepPlan:
    """One step's plan: per request, the loaded pages (index, source) and the saved page indices."""

    loads: dict[str, tuple[tuple[int, PageSource], ...]]
    saves: dict[str, tuple[int, ...]]
    retried: tuple[PageHash, ...] = ()
    """Pages whose backup failed before, put again by this step ahead of its saves."""
    number: int = 0
    """This plan's number (the first plan is 1)."""
    reported_through: int = 0
    """The newest plan whose failed loads had been reported when this plan was made (0: none):
    the worker still drops the saves over a failed load of any later plan."""


@attrs.define
class ConnectorModel:
    """The scheduler side's state: the L2 index (LRU, oldest first), the L3 contents, the requests."""

    capacity: int
    staging: int = 0
    lag: int = attrs.field(default=1, kw_only=True)
    """How many plans an engine builds after plan N before it reports N's failed loads (1: one
    step ahead, vLLM's async scheduling; more with a pipeline's batch queue)."""
    l2: list[PageHash] = attrs.Factory(list)
    l3: set[PageHash] = attrs.Factory(set)
    requests: dict[str, _Request] = attrs.Factory(dict)
    staging_free: int = attrs.field(default=-1)
    """Staging slots neither reserved by an ``alloc`` nor held by one of the last ``lag + 1``
    plans."""
    staging_held: collections.deque[int] = attrs.Factory(collections.deque)
    """Staging slots each of the last ``lag + 1`` plans took (oldest first)."""
    unbacked: list[PageHash] = attrs.Factory(list)
    """Pages in L2 whose backup failed, oldest first: the next steps put them again."""
    put_by_last_plan: set[PageHash] = attrs.Factory(set)
    """Pages the last plan put into L3 that were not there before (its saves and retries)."""
    plans: int = 0
    """Plans made so far (the last plan's number)."""
    reported_through: int = 0
    """The newest plan whose failed loads were reported (:meth:`load_failures`)."""
    inserted: dict[PageHash, int] = attrs.Factory(dict)
    """Each page L2 holds, with the number of the save that put it there (a page evicted and saved
    again is another insertion: taking back one save never takes back another)."""
    insertions: int = 0

    def __attrs_post_init__(self) -> None:
        if isinstance(self.lag, bool) or not isinstance(self.lag, int) or self.lag < 1:
            raise MisuseError(f"ConnectorModel: lag is an int >= 1, got {self.lag!r}")
        if self.staging_free < 0:
            self.staging_free = self.staging
        if not self.staging_held:
            self.staging_held.extend([0] * (self.lag + 1))

    def _request(self, request_id: str) -> _Request:
        try:
            return self.requests[request_id]
        except KeyError:
            raise MisuseError(f"unknown request {request_id!r}") from None

    def new_request(self, request_id: str, pages: Sequence[PageHash]) -> None:
        if request_id in self.requests:
            raise MisuseError(f"request {request_id!r} is already known")
        self.requests[request_id] = _Request(tuple(pages))

    def answer(self, request_id: str) -> int:
        """The L3 lookup lands: the consecutive pages, from the first, in the store now."""
        request = self._request(request_id)
        state = CONNECTOR_REQUEST.next(request.state, RequestEvent.ANSWERED)
        hit = 0
        while hit < len(request.pages) and request.pages[hit] in self.l3:
            hit += 1
        request.state, request.l3_hit = state, hit
        return hit

    def sources(self, request_id: str, computed: int, limit: int) -> tuple[PageSource, ...] | None:
        """Where each page from ``computed`` on would be loaded from (``None``: ask again)."""
        request = self._request(request_id)
        if request.state not in MATCHABLE:
            if request.state is RequestState.LOOKING_UP:
                return None
            raise MisuseError(f"request {request_id!r} is {request.state.value}")
        assert request.l3_hit is not None
        found: list[PageSource] = []
        held = set(self.l2)
        room = self.staging_free + request.staging  # a request allocated again gives its own back
        for index in range(computed, min(limit, len(request.pages))):
            if request.pages[index] in held:
                found.append(PageSource.L2)
            elif index < request.l3_hit and room > 0:
                found.append(PageSource.L3)
                room -= 1
            else:
                break
        return tuple(found)

    def match(self, request_id: str, computed: int, limit: int) -> int | None:
        """How many pages after the ``computed`` local ones can be loaded; ``None``: ask again."""
        found = self.sources(request_id, computed, limit)
        return None if found is None else len(found)

    def alloc(self, request_id: str, computed: int, pages: int, limit: int) -> None:
        """The engine allocated blocks for ``pages`` external pages after ``computed``."""
        request = self._request(request_id)
        event = RequestEvent.ALLOC_LOAD if pages else RequestEvent.ALLOC_NONE
        state = CONNECTOR_REQUEST.next(request.state, event)
        found = self.sources(request_id, computed, limit) or ()
        if pages > len(found):
            raise MisuseError(
                f"request {request_id!r}: {pages} pages allocated, {len(found)} matched"
            )
        request.state, request.first, request.load = state, computed, found[:pages]
        request.saved = max(request.saved, computed + pages)
        self.staging_free += request.staging
        request.staging = request.load.count(PageSource.L3)
        self.staging_free -= request.staging

    def plan(self, scheduled: Sequence[tuple[str, int]]) -> StepPlan:
        """One step: every planned load, then the saves of ``scheduled`` (request id, full pages
        computed once this step has run)."""
        loads: dict[str, tuple[tuple[int, PageSource], ...]] = {}
        self.staging_free += self.staging_held.popleft()
        held = 0
        self.plans += 1
        for request in self.requests.values():  # a report names one of the last lag + 1 plans
            request.stored = tuple(i for i in request.stored if i[0] >= self.plans - self.lag)
        for request_id, request in self.requests.items():
            if request.state is not RequestState.LOAD_PLANNED:
                continue
            request.state = CONNECTOR_REQUEST.next(request.state, RequestEvent.PLANNED)
            held, request.staging = held + request.staging, 0
            loads[request_id] = tuple(
                (request.first + offset, source) for offset, source in enumerate(request.load)
            )
            request.load_plan, request.load_insertions = self.plans, {}
            for index, source in loads[request_id]:
                if source is PageSource.L2:
                    self._touch(request.pages[index])
                    request.load_insertions[index] = self.inserted[request.pages[index]]
        self.staging_held.append(held)
        held_now = set(self.l2)  # the worker retries before this step's saves reuse any slot
        waiting = [page for page in self.unbacked if page in held_now]
        retried, self.unbacked = tuple(waiting[:RETRY_PAGES]), waiting[RETRY_PAGES:]
        self.put_by_last_plan = {page for page in retried if page not in self.l3}
        self.l3.update(retried)
        saves: dict[str, tuple[int, ...]] = {}
        for request_id, done in scheduled:
            request = self._request(request_id)
            if request.state is not RequestState.RUNNING:
                raise MisuseError(
                    f"request {request_id!r} is scheduled while {request.state.value}"
                )
            stored = []
            for index in range(request.saved, min(done, len(request.pages))):
                page = request.pages[index]
                if page in self.l2:
                    continue
                if len(self.l2) == self.capacity:
                    del self.inserted[self.l2.pop(0)]
                self.l2.append(page)
                self.insertions += 1
                self.inserted[page] = self.insertions
                request.stored += ((self.plans, index, page not in self.l3, self.insertions),)
                if page not in self.l3:
                    self.put_by_last_plan.add(page)
                self.l3.add(page)
                stored.append(index)
            request.saved = max(request.saved, min(done, len(request.pages)))
            if stored:
                saves[request_id] = tuple(stored)
        return StepPlan(loads, saves, retried, self.plans, self.reported_through)

    def backup_failed(self, pages: Sequence[PageHash]) -> None:
        """The last step's puts of ``pages`` (saves or retries) failed: each leaves L3 where that
        step put it and, while L2 holds it, waits in ``unbacked`` for the next step, ordered by
        its last failed put (a full L2 may evict a page and take it back within one plan: its
        second put is the one L2 holds)."""
        for page in pages:
            if page in self.put_by_last_plan:
                self.l3.discard(page)
            if page in self.l2:
                if page in self.unbacked:
                    self.unbacked.remove(page)
                self.unbacked.append(page)

    def load_failures(
        self, failed: Mapping[str, int], plan: int, recompute: Mapping[str, int] | None = None
    ) -> None:
        """The engine's report of plan ``plan``'s failed loads (``plan`` is one of the last
        ``lag + 1`` plans: an engine that schedules ahead reports late): per request, its first
        page that held
        bad KV, and (``recompute``; default: that page) the first page the engine computes
        again for it (:meth:`load_failed`). Plans made from now on tell the worker that this
        failure is reported."""
        if not (self.plans - self.lag <= plan <= self.plans and plan >= 1):
            raise MisuseError(
                f"a report of plan {plan}: the last plan is {self.plans}, lag {self.lag}"
            )
        for request_id, index in failed.items():
            resume = (recompute or {}).get(request_id, index)
            self.load_failed(request_id, index, since=plan, resume=resume)
        self.reported_through = max(self.reported_through, plan)

    def load_failed(
        self, request_id: str, index: int, since: int | None = None, resume: int | None = None
    ) -> None:
        """Page ``index`` of the request held bad KV in plan ``since``'s step (default: the last
        plan): its own load of it (and of every later page) failed on some rank, or it shares
        that block with another request's failed load (an engine's prefix cache). The pages the
        request computed from then on attend over bad KV, so the worker drops its saves of them
        (page ``index`` on) in that plan and every later one; here each leaves L2 (unless saved
        again since) and L3 where that save put it. A page its own load of that plan read from
        L2 at ``index`` leaves L2 too (the slot did not hold it: a save dropped before its
        report). The saved mark becomes ``resume`` (default and at least ``index``): the first
        page the engine computes again for this request; the pages between are never saved by
        it (shared blocks another request computes again, or pages vLLM's async scheduling keeps
        as computed over bad KV: ``resume`` past the last page, and the request saves nothing
        more)."""
        since = self.plans if since is None else since
        resume = index if resume is None else max(index, resume)
        request = self._request(request_id)
        if request.state is not RequestState.RUNNING:
            raise MisuseError(
                f"request {request_id!r} reported a failed load while {request.state.value}"
            )
        if not 0 <= index < len(request.pages):
            raise MisuseError(f"request {request_id!r} has no page {index}")
        dropped = [item for item in request.stored if item[0] >= since and item[1] >= index]
        for _plan, stored, added, insertion in dropped:
            page = request.pages[stored]
            saved_again = self.inserted.get(page, insertion) != insertion
            self._take_back(page, insertion)
            if added and not saved_again:
                self.l3.discard(page)
                self.put_by_last_plan.discard(page)
        if request.load_plan >= since and index in request.load_insertions:
            self._take_back(request.pages[index], request.load_insertions[index])
        request.stored = tuple(item for item in request.stored if item not in dropped)
        request.saved = max(min(request.saved, index), resume)

    def _take_back(self, page: PageHash, insertion: int) -> None:
        """``page`` leaves L2 if L2 still holds it from that insertion."""
        if self.inserted.get(page) == insertion:
            self.l2.remove(page)
            del self.inserted[page]

    def _touch(self, page: PageHash) -> None:
        self.l2.remove(page)
        self.l2.append(page)

    def finish(self, request_id: str) -> None:
        request = self._request(request_id)
        CONNECTOR_REQUEST.next(request.state, RequestEvent.FINISH)
        self.staging_free += request.staging
        del self.requests[request_id]

    def evict_l3(self, page: PageHash) -> None:
        """The store dropped a page (its own eviction, another instance's, a restart)."""
        self.l3.discard(page)

    def check(self) -> None:
        if len(self.l2) > self.capacity or len(set(self.l2)) != len(self.l2):
            raise InvariantViolation(
                "C1", f"L2 holds {len(self.l2)} pages for {self.capacity} slots"
            )
        for request_id, request in self.requests.items():
            if request.state is RequestState.LOOKING_UP and request.l3_hit is not None:
                raise InvariantViolation("C2", f"{request_id}: answered but still looking up")
        reserved = sum(request.staging for request in self.requests.values())
        if self.staging_free < 0 or reserved + sum(self.staging_held) + self.staging_free != (
            self.staging
        ):
            raise InvariantViolation(
                "C3",
                f"staging: {reserved} reserved, {list(self.staging_held)} held, "
                f"{self.staging_free} free, of {self.staging}",
            )
