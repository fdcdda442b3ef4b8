"""Every lifecycle of kvstrata, declared once as data (SPEC §7).

The model and the implementation advance through these tables with :meth:`Lifecycle.next`;
``docs/model.md`` shows them and ``transitions`` builds checked machines from them
(``tests/unit/model/test_slots_store_lifecycles.py``). Change a lifecycle here first, then the docs, then
the code.

Guard sets (which states allow a step) are derived here, from the tables and the two validity sets,
and imported by both sides; no other module spells a set of residencies out by hand
(``tests/unit/model/test_slots_store_lifecycles.py`` checks the derivations).
"""

from __future__ import annotations

import enum

from kvstrata.model.table import Lifecycle

__all__ = [
    "ALL_LIFECYCLES",
    "BACKUP_OP",
    "CONNECTOR_REQUEST",
    "MATCHABLE",
    "EMBEDDING_ENTRY",
    "LOAD_OP",
    "PAGE_RESIDENCY",
    "PREFETCH_OP",
    "STATE_RESIDENCY",
    "STORE_HEALTH",
    "SERVING",
    "PROBED",
    "Health",
    "HealthEvent",
    "WRITE_OP",
    "DEVICE_CLAIMED",
    "DEVICE_VALID",
    "HOST_CLAIMED",
    "HOST_VALID",
    "L1_DROPPABLE",
    "L2_DROPPABLE",
    "L1_WITH_L2",
    "BackupEvent",
    "BackupState",
    "EntryEvent",
    "EntryState",
    "OpEvent",
    "OpState",
    "PrefetchEvent",
    "PrefetchState",
    "RequestEvent",
    "RequestState",
    "Residency",
    "ResidencyEvent",
    "StateEvent",
]


class OpState(enum.Enum):
    """A device<->host copy (write-through L1->L2 or load-back L2->L1)."""

    PENDING = "pending"  # copy started, source pinned, not acked yet
    DONE = "done"
    FAILED = "failed"  # the copy raised: the destination pages are given back


class OpEvent(enum.Enum):
    ACK = "ack"
    FAIL = "fail"


#: Write-through L1->L2: acked strictly in FIFO order of enqueue.
WRITE_OP: Lifecycle[OpState, OpEvent] = Lifecycle(
    name="write-through op",
    initial=OpState.PENDING,
    table={
        (OpState.PENDING, OpEvent.ACK): OpState.DONE,
        (OpState.PENDING, OpEvent.FAIL): OpState.FAILED,
    },
    final={OpState.DONE, OpState.FAILED},
)

#: Load-back L2->L1: the loaded nodes stay pinned until the ack.
LOAD_OP: Lifecycle[OpState, OpEvent] = Lifecycle(
    name="load-back op",
    initial=OpState.PENDING,
    table={
        (OpState.PENDING, OpEvent.ACK): OpState.DONE,
        (OpState.PENDING, OpEvent.FAIL): OpState.FAILED,
    },
    final={OpState.DONE, OpState.FAILED},
)


class BackupState(enum.Enum):
    QUEUED = "queued"  # waiting for the store worker; host pages pinned
    IN_FLIGHT = "in_flight"  # puts begun (keys reserved, invisible)
    DONE = "done"  # puts ended: objects visible; host pages unpinned


class BackupEvent(enum.Enum):
    START = "start"
    ACK = "ack"
    FAIL = "fail"  # the batch failed: puts aborted, op queued again (retried, never dropped)
    RETRY = "retry"  # acked, but some pages are not visible (another writer's put of the same key
    # was in flight and did not complete): those pages are queued again


BACKUP_OP: Lifecycle[BackupState, BackupEvent] = Lifecycle(
    name="backup op",
    initial=BackupState.QUEUED,
    table={
        (BackupState.QUEUED, BackupEvent.START): BackupState.IN_FLIGHT,
        (BackupState.IN_FLIGHT, BackupEvent.ACK): BackupState.DONE,
        (BackupState.IN_FLIGHT, BackupEvent.FAIL): BackupState.QUEUED,
        (BackupState.IN_FLIGHT, BackupEvent.RETRY): BackupState.QUEUED,
    },
    final={BackupState.DONE},
)


class PrefetchState(enum.Enum):
    LOADING = "loading"  # host pages reserved; reads arriving in order
    COMPLETE = "complete"  # every page arrived, or the store lost one (the rest is a miss)
    CANCELLING = "cancelling"  # committed or aborted while reads may still land: slots held
    DONE = "done"  # every reserved slot committed to the tree or freed


class PrefetchEvent(enum.Enum):
    ARRIVE = "arrive"
    COMPLETE = "complete"
    COMMIT = "commit"
    ABORT = "abort"
    DRAIN = "drain"  # the I/O worker confirmed it will not write into the op's slots again


PREFETCH_OP: Lifecycle[PrefetchState, PrefetchEvent] = Lifecycle(
    name="prefetch op",
    initial=PrefetchState.LOADING,
    table={
        (PrefetchState.LOADING, PrefetchEvent.ARRIVE): PrefetchState.LOADING,
        (PrefetchState.LOADING, PrefetchEvent.COMPLETE): PrefetchState.COMPLETE,
        (PrefetchState.LOADING, PrefetchEvent.COMMIT): PrefetchState.CANCELLING,
        (PrefetchState.LOADING, PrefetchEvent.ABORT): PrefetchState.CANCELLING,
        (PrefetchState.COMPLETE, PrefetchEvent.COMMIT): PrefetchState.DONE,
        (PrefetchState.COMPLETE, PrefetchEvent.ABORT): PrefetchState.DONE,
        (PrefetchState.CANCELLING, PrefetchEvent.DRAIN): PrefetchState.DONE,
    },
    final={PrefetchState.DONE},
)


class Residency(enum.Enum):
    """Where the bytes of one page (and so of its node) are valid."""

    NEW = "new"
    DEVICE = "device"  # L1 only
    WRITING = "writing"  # L1 valid; L2 slot allocated, write-through in flight
    BOTH = "both"  # L1 and L2 valid
    HOST = "host"  # L2 only (evicted from L1, or committed by a prefetch)
    LOADING = "loading"  # L2 valid; L1 slot allocated, load-back in flight
    GONE = "gone"


class ResidencyEvent(enum.Enum):
    INSERT = "insert"
    COMMIT_PREFETCH = "commit_prefetch"
    WRITE_START = "write_start"
    WRITE_ACK = "write_ack"
    WRITE_FAIL = "write_fail"  # the L1 -> L2 copy failed: the host slot is given back
    DEMOTE = "demote"  # L1 eviction of a page with a host copy
    STAGE = "stage"  # write_back: L1 eviction copies to L2 first (blocking)
    REVIVE = "revive"  # insert of freshly computed KV for a host-only page
    LOAD_START = "load_start"
    LOAD_ACK = "load_ack"
    LOAD_FAIL = "load_fail"  # the L2 -> L1 copy failed: the device slot is given back
    DELETE = "delete"


PAGE_RESIDENCY: Lifecycle[Residency, ResidencyEvent] = Lifecycle(
    name="page residency",
    initial=Residency.NEW,
    table={
        (Residency.NEW, ResidencyEvent.INSERT): Residency.DEVICE,
        (Residency.NEW, ResidencyEvent.COMMIT_PREFETCH): Residency.HOST,
        (Residency.DEVICE, ResidencyEvent.WRITE_START): Residency.WRITING,
        (Residency.WRITING, ResidencyEvent.WRITE_ACK): Residency.BOTH,
        (Residency.WRITING, ResidencyEvent.WRITE_FAIL): Residency.DEVICE,
        (Residency.BOTH, ResidencyEvent.DEMOTE): Residency.HOST,
        (Residency.DEVICE, ResidencyEvent.STAGE): Residency.HOST,
        (Residency.HOST, ResidencyEvent.REVIVE): Residency.BOTH,
        (Residency.HOST, ResidencyEvent.LOAD_START): Residency.LOADING,
        (Residency.LOADING, ResidencyEvent.LOAD_ACK): Residency.BOTH,
        (Residency.LOADING, ResidencyEvent.LOAD_FAIL): Residency.HOST,
        (Residency.DEVICE, ResidencyEvent.DELETE): Residency.GONE,
        (Residency.HOST, ResidencyEvent.DELETE): Residency.GONE,
    },
    final={Residency.GONE},
)


class StateEvent(enum.Enum):
    """Events of one Mamba / linear-attention state (a ``TRAILING_PAGES`` side pool, SPEC §5).

    The state of a node end lives in its own L1 and L2 slot pools and moves with its page's KV,
    so it shares the page events; ``DROP_HOST`` (``evict_state`` on L2 of a state also on L1) is
    its own: a page never loses its L2 copy while keeping L1."""

    INSERT = "insert"  # the scheduler hands a freshly computed state to insert
    COMMIT_PREFETCH = "commit_prefetch"
    WRITE_START = "write_start"
    WRITE_ACK = "write_ack"
    WRITE_FAIL = "write_fail"
    DEMOTE = "demote"  # L1 copy freed, L2 copy kept (L1 eviction or evict_state on L1)
    STAGE = "stage"
    REVIVE = "revive"  # a fresh L1 state for a state that is on L2 only
    LOAD_START = "load_start"
    LOAD_ACK = "load_ack"
    LOAD_FAIL = "load_fail"
    DROP_HOST = "drop_host"  # evict_state on L2 of a state also on L1: L1 copy kept
    DELETE = "delete"


#: The residency of one state (same states as a page; see ``docs/model.md`` for how it follows its
#: page: a state is valid in a tier only where its page is).
STATE_RESIDENCY: Lifecycle[Residency, StateEvent] = Lifecycle(
    name="state residency",
    initial=Residency.NEW,
    table={
        (Residency.NEW, StateEvent.INSERT): Residency.DEVICE,
        (Residency.NEW, StateEvent.COMMIT_PREFETCH): Residency.HOST,
        (Residency.DEVICE, StateEvent.WRITE_START): Residency.WRITING,
        (Residency.WRITING, StateEvent.WRITE_ACK): Residency.BOTH,
        (Residency.WRITING, StateEvent.WRITE_FAIL): Residency.DEVICE,
        (Residency.BOTH, StateEvent.DEMOTE): Residency.HOST,
        (Residency.DEVICE, StateEvent.STAGE): Residency.HOST,
        (Residency.HOST, StateEvent.REVIVE): Residency.BOTH,
        (Residency.HOST, StateEvent.LOAD_START): Residency.LOADING,
        (Residency.LOADING, StateEvent.LOAD_ACK): Residency.BOTH,
        (Residency.LOADING, StateEvent.LOAD_FAIL): Residency.HOST,
        (Residency.BOTH, StateEvent.DROP_HOST): Residency.DEVICE,
        (Residency.DEVICE, StateEvent.DELETE): Residency.GONE,
        (Residency.HOST, StateEvent.DELETE): Residency.GONE,
    },
    final={Residency.GONE},
)


class EntryState(enum.Enum):
    """One embedding entry of the multimodal cache (SPEC §6)."""

    FREE = "free"
    FILLING = "filling"  # slot handed out, local bytes being written
    LOADING = "loading"  # slot handed out, a GET from the store is writing it (pinned)
    READY = "ready"  # complete: may be read or pushed
    PUSHING = "pushing"  # its address is with the store (pinned until the store acks)


class EntryEvent(enum.Enum):
    FILL = "fill"
    FILLED = "filled"
    FILL_FAILED = "fill_failed"
    LOAD = "load"
    LOADED = "loaded"
    LOAD_FAILED = "load_failed"
    PUSH = "push"
    PUSH_ACK = "push_ack"
    PUSH_FAILED = "push_failed"
    EVICT = "evict"


EMBEDDING_ENTRY: Lifecycle[EntryState, EntryEvent] = Lifecycle(
    name="embedding entry",
    initial=EntryState.FREE,
    table={
        (EntryState.FREE, EntryEvent.FILL): EntryState.FILLING,
        (EntryState.FILLING, EntryEvent.FILLED): EntryState.READY,
        (EntryState.FILLING, EntryEvent.FILL_FAILED): EntryState.FREE,
        (EntryState.FREE, EntryEvent.LOAD): EntryState.LOADING,
        (EntryState.LOADING, EntryEvent.LOADED): EntryState.READY,
        (EntryState.LOADING, EntryEvent.LOAD_FAILED): EntryState.FREE,
        (EntryState.READY, EntryEvent.PUSH): EntryState.PUSHING,
        (EntryState.PUSHING, EntryEvent.PUSH_ACK): EntryState.READY,
        (EntryState.PUSHING, EntryEvent.PUSH_FAILED): EntryState.READY,
        (EntryState.READY, EntryEvent.EVICT): EntryState.FREE,
    },
)

#: Residency groups: where a page's bytes are valid, and where a slot is held for it.
DEVICE_VALID = frozenset({Residency.DEVICE, Residency.WRITING, Residency.BOTH})
DEVICE_CLAIMED = DEVICE_VALID | {Residency.LOADING}
HOST_VALID = frozenset({Residency.BOTH, Residency.HOST, Residency.LOADING})
HOST_CLAIMED = HOST_VALID | {Residency.WRITING}
#: States whose idle L1 (L2) copy may be dropped: the valid states from which a drop of that tier's
#: copy is legal in ``STATE_RESIDENCY`` (a copy being written or loaded is never dropped).
L1_DROPPABLE = DEVICE_VALID & STATE_RESIDENCY.sources(StateEvent.DEMOTE, StateEvent.DELETE)
L2_DROPPABLE = HOST_VALID & STATE_RESIDENCY.sources(StateEvent.DROP_HOST, StateEvent.DELETE)
#: Valid on L1 with an L2 copy held (written or being written): a state attached there later needs a
#: state-only write-through.
L1_WITH_L2 = DEVICE_VALID & HOST_CLAIMED


class RequestState(enum.Enum):
    """A request as an engine connector's scheduler side sees it (vLLM; docs/engines.md)."""

    LOOKING_UP = "looking_up"
    """The L3 lookup of its pages is in flight: the connector answers "ask again" (``None``)."""
    READY = "ready"
    """The lookup answered: matches are answered from L2 and that answer, without side effects."""
    LOAD_PLANNED = "load_planned"
    """The engine allocated blocks for an external hit; the load goes into the next step's plan."""
    RUNNING = "running"
    """Scheduled; its newly computed full pages are saved (L2, then L3) as the steps go."""
    FINISHED = "finished"


class RequestEvent(enum.Enum):
    ANSWERED = "answered"
    ALLOC_LOAD = "alloc_load"
    ALLOC_NONE = "alloc_none"
    PLANNED = "planned"
    FINISH = "finish"


CONNECTOR_REQUEST: Lifecycle[RequestState, RequestEvent] = Lifecycle(
    name="connector request",
    initial=RequestState.LOOKING_UP,
    table={
        (RequestState.LOOKING_UP, RequestEvent.ANSWERED): RequestState.READY,
        (RequestState.READY, RequestEvent.ALLOC_LOAD): RequestState.LOAD_PLANNED,
        (RequestState.READY, RequestEvent.ALLOC_NONE): RequestState.RUNNING,
        # a preempted request is matched and allocated again
        (RequestState.RUNNING, RequestEvent.ALLOC_LOAD): RequestState.LOAD_PLANNED,
        (RequestState.RUNNING, RequestEvent.ALLOC_NONE): RequestState.RUNNING,
        (RequestState.LOAD_PLANNED, RequestEvent.PLANNED): RequestState.RUNNING,
        (RequestState.LOOKING_UP, RequestEvent.FINISH): RequestState.FINISHED,
        (RequestState.READY, RequestEvent.FINISH): RequestState.FINISHED,
        (RequestState.LOAD_PLANNED, RequestEvent.FINISH): RequestState.FINISHED,
        (RequestState.RUNNING, RequestEvent.FINISH): RequestState.FINISHED,
    },
    final={RequestState.FINISHED},
)
#: States in which a request's match is answered (not "ask again").
MATCHABLE = CONNECTOR_REQUEST.sources(RequestEvent.ALLOC_LOAD, RequestEvent.ALLOC_NONE)


class Health(enum.Enum):
    """What kvstrata believes about its L3 store (issue 17)."""

    HEALTHY = "healthy"  # every call is issued
    SUSPECT = "suspect"  # one call failed or overran: still served, one probe in flight decides
    DOWN = "down"  # reads answer "nothing" at once, backups wait in a bounded queue
    PROBING = "probing"  # DOWN, with the next back-off probe in flight


class HealthEvent(enum.Enum):
    OK = "ok"  # a call returned in time without a sign of an outage
    FAULT = "fault"  # a call raised, met an unreachable store, timed out, or overran its deadline
    LATE = "late"  # a call issued before the store went down returned (it proves nothing)
    PROBE_DUE = "probe_due"  # the back-off since the last failed probe has passed
    PROBE_OK = "probe_ok"
    PROBE_FAIL = "probe_fail"


#: The store's health, one machine per cache (``kvstrata.model.l3.health``,
#: ``kvstrata.impl.storage.link``). Each returned or overrun call is judged once; only probes
#: bring a suspect or down store back.
STORE_HEALTH: Lifecycle[Health, HealthEvent] = Lifecycle(
    name="store health",
    initial=Health.HEALTHY,
    table={
        (Health.HEALTHY, HealthEvent.OK): Health.HEALTHY,
        (Health.HEALTHY, HealthEvent.FAULT): Health.SUSPECT,
        (Health.SUSPECT, HealthEvent.OK): Health.SUSPECT,
        (Health.SUSPECT, HealthEvent.FAULT): Health.DOWN,
        (Health.SUSPECT, HealthEvent.PROBE_OK): Health.HEALTHY,
        (Health.SUSPECT, HealthEvent.PROBE_FAIL): Health.DOWN,
        (Health.DOWN, HealthEvent.LATE): Health.DOWN,
        (Health.DOWN, HealthEvent.PROBE_DUE): Health.PROBING,
        (Health.PROBING, HealthEvent.LATE): Health.PROBING,
        (Health.PROBING, HealthEvent.PROBE_OK): Health.HEALTHY,
        (Health.PROBING, HealthEvent.PROBE_FAIL): Health.DOWN,
    },
)

#: Where reads and backups are issued (a returned call is judged OK or FAULT there; elsewhere LATE).
SERVING = STORE_HEALTH.sources(HealthEvent.OK)
#: Where a probe may be in flight and decides.
PROBED = STORE_HEALTH.sources(HealthEvent.PROBE_OK)


ALL_LIFECYCLES: tuple[Lifecycle, ...] = (  # type: ignore[type-arg]
    WRITE_OP,
    LOAD_OP,
    BACKUP_OP,
    PREFETCH_OP,
    PAGE_RESIDENCY,
    STATE_RESIDENCY,
    EMBEDDING_ENTRY,
    CONNECTOR_REQUEST,
    STORE_HEALTH,
)
