"""The connector worker's L3 puts behind the step (``BackupLane``, invariant C4), with real bytes.

One :class:`ConnectorWorker` saves plans into four L2 slots of a host pool and queues each put on a
:class:`ManualJoinableExecutor`: a put stays queued until the machine lets some land, or until the
worker itself waits for it (a save about to overwrite a slot a pending put reads; a load's L3 get,
which runs behind every put queued before it). So puts stay pending across any number of saves and
loads, a slot is handed to another page while the put of its old page waits, the store goes down
under queued puts, and the store loses pages.

Checked after every step: every page the store holds has its own bytes (a put that read a slot
after it was written again would store the later page's bytes under the earlier key, and a
content-addressed key keeps its first bytes: the stale-offset bug); every slot a pending put reads
still holds the page it was written with (C4); every L2 slot holds the page the worker says it
wrote; a load reported good put the page's own bytes into the engine's block. And once every put
landed: each page an L2 slot holds is in the store, waits in ``unbacked`` for a retry, or was lost
by the store since it was last put; and a page that leaves L2 (its slot reused) is in the store
unless a put of it, or its retry before the reuse, failed meanwhile (``next_put_fails`` makes one
put fail, so a late failure is put again, and must land, before its slot is reused).
"""

from __future__ import annotations

import hashlib

import hypothesis.strategies as st
import torch
from hypothesis import event, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from support.backends import FlakyBackend
from support.blocks import CanonicalBlocks

from kvstrata.impl.executors import ManualJoinableExecutor
from kvstrata.impl.pools.host import HostKVPool
from kvstrata.impl.pools.shape import KVShape
from kvstrata.impl.storage.base import GetStatus
from kvstrata.impl.storage.memory import MemoryBackend, MemoryStore
from kvstrata.integrations.connector import PageMove, Plan
from kvstrata.integrations.connector_worker import ConnectorWorker
from kvstrata.model.connector import PageSource
from kvstrata.model.keys import KeySpace, KVKind, ModelIdentity, Namespace, PageHash

PAGE, L2_SLOTS, STAGING = 2, 4, 2
SHAPE = KVShape(KVKind.MHA, layers=2, heads=1, head_dim=2, dtype=torch.float32, page_size=PAGE)
KEYS = KeySpace(ModelIdentity("connector_backup_test", "float32", KVKind.MHA, PAGE))
NAMESPACE = Namespace(extra_key="vllm-block")
PAGES = [PageHash(hashlib.sha256(f"backup/{i}".encode()).digest()) for i in range(8)]
SCRATCH = len(PAGES)  # the engine block a load writes into


def kv_of(page: PageHash) -> torch.Tensor:
    """The canonical KV of one page, ``[2, L, 1, page, H, D]``, bytes derived from its hash."""
    values = torch.frombuffer(bytearray(page.digest), dtype=torch.int16).float()
    return values[: 2 * SHAPE.layers * PAGE * SHAPE.head_dim].reshape(
        2, SHAPE.layers, 1, PAGE, 1, SHAPE.head_dim
    )


class ConnectorBackup(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        store = MemoryStore()
        self.backend = FlakyBackend(KEYS, store)
        self.io = ManualJoinableExecutor()
        blocks = torch.zeros(2, SHAPE.layers, len(PAGES) + 1, PAGE, 1, SHAPE.head_dim)
        for block, page in enumerate(PAGES):  # block b holds page b, computed once
            blocks[:, :, block : block + 1] = kv_of(page)
        self.engine = CanonicalBlocks(blocks)
        host = HostKVPool(SHAPE, L2_SLOTS + STAGING, "page_first_direct")
        self.worker = ConnectorWorker(host, self.backend, NAMESPACE, self.engine, self.io)
        self.probe_host = HostKVPool(SHAPE, 1, "page_first_direct")
        self.probe = MemoryBackend(KEYS, store=store)
        self.probe.attach(self.probe_host)
        self.plans = 0
        self.lost: set[PageHash] = set()  # lost by the store since the page was last put

    def _plan(self, **parts: object) -> Plan:
        self.plans += 1
        return Plan(number=self.plans, reported_through=self.plans - 1, **parts)  # type: ignore[arg-type]

    def _stored(self, page: PageHash) -> torch.Tensor | None:
        if self.probe.get(NAMESPACE, [page], [0]) != [GetStatus.LOADED]:
            return None
        return self.probe_host.read_pages([0])

    @rule(data=st.data())
    def save(self, data: st.DataObject) -> None:
        """One plan's saves: distinct pages L2 does not hold (as the index plans them) into L2
        slots, a slot possibly named twice (a full L2 in one plan) or holding a page whose put is
        still queued."""
        in_l2 = set(self.worker.written.values())
        fresh = [page for page in PAGES if page not in in_l2]  # 4 slots: at least 4 of 8 pages
        pages = data.draw(st.lists(st.sampled_from(fresh), min_size=1, max_size=4, unique=True))
        slots = data.draw(
            st.lists(st.integers(0, L2_SLOTS - 1), min_size=len(pages), max_size=len(pages)),
            label="slots",
        )
        pinned = self.worker.lane.pinned if self.worker.lane is not None else {}
        if pinned.keys() & set(slots):
            event("a save overwrites a slot a queued put reads")
        moves = tuple(
            PageMove(k, page, slot, PAGES.index(page))
            for k, (page, slot) in enumerate(zip(pages, slots, strict=True))
        )
        before = dict(self.worker.written)
        for page in pages:  # a new put of each: count its failures afresh
            self.backend.failures[page] = 0
        self.worker.save(self._plan(saves=(("r", moves),)))
        held = set(self.worker.written.values())
        for slot in set(slots) & before.keys():  # a page leaving L2 reached L3, unless its put
            page = before[slot]  # and the retry before its slot was reused both failed
            if page in held or page in self.lost or self.backend.failures[page] >= 2:
                continue
            assert self._stored(page) is not None, "a page left L2 without reaching L3"
        self.lost -= set(pages)

    @precondition(lambda self: self.io.jobs)
    @rule(count=st.integers(1, 3))
    def land(self, count: int) -> None:
        """Some queued puts land (the I/O thread ran them)."""
        for _ in range(count):
            self.io.run_next()

    @rule(down=st.booleans())
    def store_reachable(self, down: bool) -> None:
        self.backend.down = down

    @rule()
    def next_put_fails(self) -> None:
        """The store's next put fails (a timeout); the retry may then succeed."""
        self.backend.fail_next += 1

    @rule(page=st.sampled_from(PAGES))
    def store_loses(self, page: PageHash) -> None:
        self.probe.evict(NAMESPACE, page)
        self.lost.add(page)

    @rule(page=st.sampled_from(PAGES), staging=st.integers(0, STAGING - 1))
    def load_from_l3(self, page: PageHash, staging: int) -> None:
        """A load reads ``page`` from L3 into a staging slot, behind every queued put."""
        if self.io.jobs:
            event("an L3 read behind queued puts")
        move = PageMove(0, page, L2_SLOTS + staging, SCRATCH, PageSource.L3)
        failed = self.worker.load(self._plan(loads=(("r", (move,)),)))
        if not failed:
            got = self.engine.read([SCRATCH])
            assert torch.equal(got, kv_of(page)), "a load served another page's bytes"

    @rule()
    def flush(self) -> None:
        """Every queued put lands: each page an L2 slot holds is stored, waits for a retry, or was
        lost since it was last put."""
        self.worker.flush()
        waiting = set(self.worker.unbacked.values())  # a page may sit in two slots
        for page in self.worker.written.values():
            if page in self.lost or page in waiting:
                continue
            assert self._stored(page) is not None, "a saved page neither stored nor retried"

    @invariant()
    def nothing_wrong_anywhere(self) -> None:
        for page in PAGES:  # the shared store is never poisoned
            got = self._stored(page)
            assert got is None or torch.equal(got, kv_of(page)), "L3 has another page's bytes"
        lane = self.worker.lane
        assert lane is not None
        for slot, page in lane.pinned.items():  # C4: a slot a pending put reads still holds
            held = self.worker.host.read_pages([slot])  # the page that put stores from it
            assert torch.equal(held, kv_of(page)), "a slot written under a pending put"
        for slot, page in self.worker.written.items():
            assert torch.equal(self.worker.host.read_pages([slot]), kv_of(page))


TestConnectorBackup = ConnectorBackup.TestCase
TestConnectorBackup.settings = settings(stateful_step_count=40)
