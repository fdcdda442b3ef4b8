"""The connector worker's L3 puts behind the step (``BackupLane``): the step does not wait for them,
they land and are counted later, and nothing is lost at shutdown. The stale-offset rule (C4) is the
stateful machine's (tests/stateful/test_connector_backup.py)."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence

import pytest
import torch
from support.backends import FlakyBackend
from support.blocks import CanonicalBlocks

from kvstrata.impl.errors import CacheClosed, MisuseError
from kvstrata.impl.executors import (
    InlineExecutor,
    ManualExecutor,
    ManualJoinableExecutor,
    ThreadExecutor,
)
from kvstrata.impl.pools.host import HostKVPool
from kvstrata.impl.pools.shape import KVShape
from kvstrata.impl.storage.base import GetStatus, PutStatus
from kvstrata.impl.storage.memory import MemoryBackend, MemoryStore
from kvstrata.integrations.connector import PageMove, Plan
from kvstrata.integrations.connector_backup import BackupLane
from kvstrata.integrations.connector_worker import ConnectorWorker
from kvstrata.model.connector import PageSource
from kvstrata.model.keys import KeySpace, KVKind, ModelIdentity, Namespace, PageHash

PAGE = 2
SHAPE = KVShape(KVKind.MHA, layers=1, heads=1, head_dim=2, dtype=torch.float32, page_size=PAGE)
KEYS = KeySpace(ModelIdentity("lane", "float32", KVKind.MHA, PAGE))
NAMESPACE = Namespace(extra_key="test")
PAGES = [PageHash(hashlib.sha256(f"lane/{i}".encode()).digest()) for i in range(4)]


class GatedBackend(MemoryBackend):
    """A memory backend whose puts wait until ``gate`` is set (a store call still in flight), or
    raise while ``broken``."""

    def __init__(self, store: MemoryStore) -> None:
        super().__init__(KEYS, store=store)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.broken = False

        self.in_put = False
        self.overlapped = False  # a get ran while a put was in the store

    def put(
        self, namespace: Namespace, pages: Sequence[PageHash], host_indices: Sequence[int]
    ) -> list[PutStatus]:
        self.entered.set()
        self.in_put = True
        try:
            assert self.gate.wait(10), "the test never opened the gate"
            if self.broken:
                raise RuntimeError("the store client broke")
            return super().put(namespace, pages, host_indices)
        finally:
            self.in_put = False

    def get(
        self, namespace: Namespace, pages: Sequence[PageHash], host_indices: Sequence[int]
    ) -> list[GetStatus]:
        self.overlapped |= self.in_put
        return super().get(namespace, pages, host_indices)


def _worker(backend: MemoryBackend, executor: object) -> ConnectorWorker:
    blocks = CanonicalBlocks(
        torch.arange(2 * 8 * PAGE * 2, dtype=torch.float32).reshape(2, 1, 8, PAGE, 1, 2)
    )
    host = HostKVPool(SHAPE, 4, "page_first_direct")
    return ConnectorWorker(host, backend, NAMESPACE, blocks, executor)  # type: ignore[arg-type]


def _held(store: MemoryStore, pages: Sequence[PageHash]) -> int:
    """How many of ``pages``, from the first, ``store`` holds."""
    probe = MemoryBackend(KEYS, store=store)
    probe.attach(HostKVPool(SHAPE, 1, "page_first_direct"))
    return probe.exists(NAMESPACE, pages)


def _save(pages: int, number: int = 1) -> Plan:
    moves = tuple(PageMove(k, PAGES[k], k, k) for k in range(pages))
    return Plan(saves=(("r", moves),), number=number, reported_through=number - 1)


def test_a_save_returns_while_its_put_is_in_flight_and_the_put_lands_later() -> None:
    store = MemoryStore()
    backend = GatedBackend(store)
    worker = _worker(backend, ThreadExecutor("test-lane"))
    try:
        worker.save(_save(3))  # returns although the put cannot finish
        assert backend.entered.wait(10)
        assert _held(store, PAGES[:3]) == 0
        assert worker.lane is not None and worker.lane.pinned == dict(enumerate(PAGES[:3]))
        assert worker.take_stats().backed_up_pages == 0  # not landed: nothing counted yet
        backend.gate.set()
        worker.flush()
        assert _held(store, PAGES[:3]) == 3
        assert worker.lane.pinned == {}
        stats = worker.take_stats()
        assert (stats.backed_up_pages, stats.failed_backup_pages) == (3, 0)
        assert stats.l3_write_seconds > 0
    finally:
        backend.gate.set()
        worker.close()


def test_a_put_that_raises_fails_its_pages_which_the_next_save_puts_again() -> None:
    store = MemoryStore()
    backend = GatedBackend(store)
    backend.gate.set()
    backend.broken = True
    worker = _worker(backend, ThreadExecutor("test-lane"))
    try:
        worker.save(_save(2))
        worker.flush()
        assert worker.failed_puts == PAGES[:2]
        assert worker.unbacked == {0: PAGES[0], 1: PAGES[1]}
        assert worker.take_stats().failed_backup_pages == 2
        backend.broken = False
        worker.save(Plan(number=2, reported_through=1))  # a step with no saves retries them
        worker.flush()
        assert worker.unbacked == {}
        assert _held(store, PAGES[:2]) == 2
    finally:
        worker.close()


def test_close_lets_every_queued_put_land() -> None:
    store = MemoryStore()
    backend = GatedBackend(store)
    worker = _worker(backend, ThreadExecutor("test-lane"))
    worker.save(_save(4))
    backend.gate.set()
    worker.close()
    assert _held(store, PAGES) == 4
    assert worker.take_stats().backed_up_pages == 4  # counted, although they landed at close
    worker.close()  # idempotent
    with pytest.raises(CacheClosed):
        worker.save(_save(1, number=2))


def test_an_inline_lane_is_synchronous_as_before() -> None:
    store = MemoryStore()
    worker = _worker(MemoryBackend(KEYS, store=store), InlineExecutor())
    worker.save(_save(2))
    assert worker.lane is not None and worker.lane.pending == 0
    assert _held(store, PAGES[:2]) == 2


def test_a_lane_refuses_an_executor_nobody_can_wait_on() -> None:
    with pytest.raises(MisuseError, match="wait on"):
        BackupLane(MemoryBackend(KEYS, store=MemoryStore()), NAMESPACE, ManualExecutor())


def test_a_loads_l3_read_waits_for_the_puts_queued_before_it() -> None:
    """One thread drives the store: a load's get runs after the put in flight, never beside it,
    and so finds the page that put stored."""
    store = MemoryStore()
    backend = GatedBackend(store)
    worker = _worker(backend, ThreadExecutor("test-lane"))
    try:
        worker.save(_save(1))
        assert backend.entered.wait(10)
        move = PageMove(0, PAGES[0], 3, 7, PageSource.L3)
        failed: list[set[int]] = []
        load = threading.Thread(
            target=lambda: failed.append(worker.load(Plan(loads=(("r", (move,)),), number=2)))
        )
        load.start()
        load.join(0.3)
        assert load.is_alive(), "the load's get did not wait for the put in flight"
        backend.gate.set()
        load.join(10)
        assert failed == [set()] and not backend.overlapped
        assert torch.equal(worker.blocks.read([7]), worker.blocks.read([0]))  # type: ignore[attr-defined]
    finally:
        backend.gate.set()
        worker.close()


def test_a_put_failing_after_the_next_save_began_is_put_again_before_its_slot_is_reused() -> None:
    """The review's find: page A's put is still queued when the next save hands A's slot to page
    B, and then fails. The save waits for the puts reading its slots before it picks the pages to
    put again, so A is put again (and stored) before B overwrites it, as when every save waited
    for its puts; otherwise A would leave L2 without ever reaching L3."""
    store = MemoryStore()
    io = ManualJoinableExecutor()
    worker = _worker(FlakyBackend(KEYS, store, fail_next=1), io)  # A's put fails
    worker.save(Plan(saves=(("r", (PageMove(0, PAGES[0], 0, 0),)),), number=1))
    assert io.jobs  # A's put is queued, not run
    worker.save(Plan(saves=(("r", (PageMove(0, PAGES[1], 0, 1),)),), number=2, reported_through=1))
    worker.flush()
    assert _held(store, PAGES[:1]) == 1 and _held(store, PAGES[1:2]) == 1
    assert worker.failed_puts == [PAGES[0]] and worker.unbacked == {}


def test_a_page_whose_slot_a_dropped_save_took_no_longer_waits_for_a_retry() -> None:
    """The second review's find (older than the lane): page A waits for a retry in slot 0; the
    next plan gives slot 0 to a page of a request whose load failed, so that save is dropped, and
    A's retry fails again. A has left L2 (the index gave its slot away), so it must not wait in
    ``unbacked`` under a slot the worker no longer says holds it, as the model says."""
    store = MemoryStore()
    backend = MemoryBackend(KEYS, store=store)
    worker = _worker(backend, InlineExecutor())
    backend.down = True
    worker.save(_save(1))
    assert worker.unbacked == {0: PAGES[0]}
    load = PageMove(0, PAGES[3], 3, 5, PageSource.L3)  # fails: the store is down
    plan = Plan(
        loads=(("r2", (load,)),),
        saves=(("r2", (PageMove(1, PAGES[1], 0, 1),)),),  # computed over the failed load
        number=2,
        reported_through=1,
    )
    assert worker.load(plan) == {5}
    worker.save(plan)
    assert worker.failed_puts == [PAGES[0]]  # retried, failed again
    assert worker.unbacked == {} and 0 not in worker.written


def test_backup_wait_seconds_count_what_the_step_waited_for_the_store() -> None:
    """Behind the step a save waits only when it reuses a slot a put still reads (the store fell
    behind): that wait is counted. An inline lane waits for every put, all counted."""
    store = MemoryStore()
    backend = GatedBackend(store)
    worker = _worker(backend, ThreadExecutor("test-lane"))
    try:
        worker.save(_save(1))  # the put is held in the store
        assert backend.entered.wait(10)
        threading.Timer(0.2, backend.gate.set).start()
        worker.save(Plan(saves=(("r", (PageMove(0, PAGES[1], 0, 1),)),), number=2))  # slot 0
        assert worker.take_stats().backup_wait_seconds >= 0.2
    finally:
        backend.gate.set()
        worker.close()
    inline = GatedBackend(MemoryStore())
    threading.Timer(0.1, inline.gate.set).start()
    synchronous = _worker(inline, InlineExecutor())
    synchronous.save(_save(1))
    assert synchronous.take_stats().backup_wait_seconds >= 0.1


def test_a_put_naming_more_pages_than_slots_is_refused_before_anything_is_pinned() -> None:
    lane = BackupLane(MemoryBackend(KEYS, store=MemoryStore()), NAMESPACE, InlineExecutor())
    with pytest.raises(MisuseError, match="2 pages for 1 slots"):
        lane.put(PAGES[:2], [0])
    assert lane.pending == 0 and lane.pinned == {}
    lane.flush()  # nothing left waiting
