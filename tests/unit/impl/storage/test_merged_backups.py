"""Backups queued on the write lane go to the store as one call (issue 20: a lane with a backlog
makes fewer, larger calls; ``kvstrata.impl.executors``, ``StoreLink``'s ``Merge``,
``StorageWorker.backup``). Each op still gets exactly the result its own call would have given."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from support.l3_rig import PAGE, Rig, kv

from kvstrata.impl.config import StorageConfig
from kvstrata.impl.executors import ManualExecutor, Mergeable, ThreadExecutor
from kvstrata.impl.storage.base import GetStatus, PutStatus
from kvstrata.impl.storage.memory import MemoryBackend, MemoryStore
from kvstrata.impl.storage.worker import BackupResult, FetchResult, StorageWorker
from kvstrata.model.keys import Namespace, PageHash
from kvstrata.model.l3.health import Lane
from kvstrata.model.lifecycles import Health


class Job:
    """A Mergeable test job that records how it ran into ``log``."""

    def __init__(self, name: str, log: list[tuple[str, ...]], key: object, pages: int) -> None:
        self.name, self.log = name, log
        self.merge_key, self.merge_pages, self.merge_limit = key, pages, 6

    def __call__(self) -> None:
        self.log.append((self.name,))

    def run_merged(self, others: list[Mergeable]) -> None:
        self.log.append((self.name, *(job.name for job in others)))  # type: ignore[attr-defined]


def plain(name: str, log: list[tuple[str, ...]]) -> Any:
    return lambda: log.append((name,))


def queue_of(log: list[tuple[str, ...]]) -> list[Any]:
    """a b (key 1, 2 + 3 pages) join; c (key 2) does not; d e (key 1, 4 + 3 pages) exceed 6
    together; f is no Mergeable; g h (key 1, 1 + 1) join."""
    return [
        Job("a", log, 1, 2),
        Job("b", log, 1, 3),
        Job("c", log, 2, 1),
        Job("d", log, 1, 4),
        Job("e", log, 1, 3),
        plain("f", log),
        Job("g", log, 1, 1),
        Job("h", log, 1, 1),
    ]


GROUPS = [("a", "b"), ("c",), ("d",), ("e",), ("f",), ("g", "h")]


def test_manual_executor_merges_what_is_queued_behind() -> None:
    log: list[tuple[str, ...]] = []
    executor = ManualExecutor()
    for job in queue_of(log):
        executor.submit(job)
    ran = []
    while executor.jobs:
        ran.append(executor.run_merged())
    assert log == GROUPS
    assert ran == [2, 1, 1, 1, 1, 2]


class Hold:
    """A job that keeps the lane busy until :meth:`release` (everything after it queues)."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    def __call__(self) -> None:
        self.gate.wait(10)

    def release(self) -> None:
        self.gate.set()


@pytest.mark.parametrize("merge", [True, False])
def test_thread_executor_merges_only_when_asked_and_keeps_order(merge: bool) -> None:
    log: list[tuple[str, ...]] = []
    executor = ThreadExecutor("test-merge", merge=merge)
    hold = Hold()
    executor.submit(hold)
    for job in queue_of(log):
        executor.submit(job)
    hold.release()
    assert executor.wait_drained(10)
    executor.close()  # the stop marker is never swallowed by a merge
    assert log == (GROUPS if merge else [(name,) for name in "abcdefgh"])


# ------------------------------------------------------------------------------ worker and link
NS, OTHER = Namespace(), Namespace(extra_key="other")


class Recording(MemoryBackend):
    """A memory backend that records every put call's page count (or raises when told)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[int] = []
        self.gets: list[int] = []
        self.raising = False
        self.refused: set[PageHash] = set()  # answered FULL and not stored

    def get(self, namespace: Namespace, pages: Any, host_indices: Any) -> list[GetStatus]:
        self.gets.append(len(pages))
        return super().get(namespace, pages, host_indices)

    def put(self, namespace: Namespace, pages: Any, host_indices: Any) -> list[PutStatus]:
        self.calls.append(len(pages))
        if self.raising:
            raise RuntimeError("the store call raised")
        taken = [i for i, page in enumerate(pages) if page not in self.refused]
        statuses = super().put(
            namespace, [pages[i] for i in taken], [host_indices[i] for i in taken]
        )
        out = [PutStatus.FULL] * len(pages)
        for i, status in zip(taken, statuses, strict=True):
            out[i] = status
        return out


def worker_rig(merge_pages: int) -> tuple[StorageWorker, Recording, ManualExecutor, Rig]:
    rig = Rig()  # for its host pool and key space
    backend = Recording(rig.backend.keyspace, store=MemoryStore())
    backend.attach(rig.host)
    for slot in range(rig.host.num_pages):
        rig.host.write_pages(torch.tensor([slot]), kv(PageHash(bytes([slot]) * 32)))
    lanes = ManualExecutor()
    return StorageWorker(backend, lanes, merge_pages=merge_pages), backend, lanes, rig


def backup(worker: StorageWorker, op_id: int, namespace: Namespace, slots: list[int]) -> None:
    digests = b"".join(bytes([slot]) * 32 for slot in slots)
    assert worker.backup(op_id, namespace, digests, slots)


def test_queued_backups_of_one_namespace_share_one_put_up_to_the_limit() -> None:
    worker, backend, lanes, _ = worker_rig(merge_pages=6)
    backup(worker, 1, NS, [0, 1])
    backup(worker, 2, NS, [2, 3, 4])
    backup(worker, 3, NS, [5, 6])  # 2 + 3 + 2 > 6: the next call
    backup(worker, 4, OTHER, [7])  # another namespace: never in the same call
    while lanes.jobs:
        lanes.run_merged()
    assert backend.calls == [5, 2, 1]
    results, _ = worker.poll()
    assert [r.op_id for r in results] == [1, 2, 3, 4]
    assert all(isinstance(r, BackupResult) for r in results)
    assert [len(r.statuses) for r in results] == [2, 3, 2, 1]  # type: ignore[union-attr]
    assert all(s is PutStatus.STORED for r in results for s in r.statuses)  # type: ignore[union-attr]
    # each op's sentinel is its own last page, not the merged call's
    assert [r.sentinel for r in results] == [  # type: ignore[union-attr]
        (NS, PageHash(bytes([1]) * 32)),
        (NS, PageHash(bytes([4]) * 32)),
        (NS, PageHash(bytes([6]) * 32)),
        (OTHER, PageHash(bytes([7]) * 32)),
    ]
    assert backend.exists(NS, [PageHash(bytes([s]) * 32) for s in range(7)]) == 7


def test_each_op_gets_its_own_statuses_from_the_shared_call() -> None:
    worker, backend, lanes, _ = worker_rig(merge_pages=8)
    backend.refused = {PageHash(bytes([s]) * 32) for s in (1, 2)}
    backup(worker, 1, NS, [0, 1])
    backup(worker, 2, NS, [2, 3, 4])
    backup(worker, 3, NS, [5])
    assert lanes.run_merged() == 3 and backend.calls == [6]
    results, _ = worker.poll()
    stored, full = PutStatus.STORED, PutStatus.FULL
    assert [r.statuses for r in results] == [  # type: ignore[union-attr]
        (stored, full),
        (full, stored, stored),
        (stored,),
    ]
    assert [r.sentinel for r in results] == [  # type: ignore[union-attr]
        (NS, PageHash(bytes([0]) * 32)),
        (NS, PageHash(bytes([4]) * 32)),
        (NS, PageHash(bytes([5]) * 32)),
    ]


def test_queued_fetches_share_one_get_and_each_op_gets_its_own_statuses() -> None:
    rig = Rig()
    backend = Recording(rig.backend.keyspace, store=MemoryStore())
    backend.attach(rig.host)
    for slot in range(4):
        rig.host.write_pages(torch.tensor([slot]), kv(PageHash(bytes([slot]) * 32)))
    stored = [PageHash(bytes([s]) * 32) for s in range(4)]
    assert backend.put(NS, stored, [0, 1, 2, 3]) == [PutStatus.STORED] * 4
    lanes = ManualExecutor()
    worker = StorageWorker(backend, lanes, fetch_merge_pages=8)
    missing = PageHash(bytes([9]) * 32)
    # op 1 reads pages 0, 1 into slots 8, 9; op 2 reads 2, a page the store lacks, 3 into 10-12
    assert worker.fetch(1, NS, stored[0].digest + stored[1].digest, [8, 9])
    digests = stored[2].digest + missing.digest + stored[3].digest
    assert worker.fetch(2, NS, digests, [10, 11, 12])
    assert worker.fetch(3, OTHER, stored[0].digest, [13])  # another namespace: its own get
    assert lanes.run_merged() == 2 and lanes.run_merged() == 1
    assert backend.gets == [5, 1]
    results, _ = worker.poll()
    assert all(isinstance(r, FetchResult) for r in results)
    loaded, missed = GetStatus.LOADED, GetStatus.MISSING
    assert [r.statuses for r in results[:2]] == [  # type: ignore[union-attr]
        (loaded, loaded),
        (loaded, missed, loaded),
    ]
    for slot, page in ((8, 0), (9, 1), (10, 2), (12, 3)):
        got = rig.host.read_pages(torch.tensor([slot]))
        want = kv(stored[page])
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_no_merge_pages_means_one_call_per_backup() -> None:
    worker, backend, lanes, _ = worker_rig(merge_pages=0)
    for op_id in range(3):
        backup(worker, op_id, NS, [op_id])
    while lanes.jobs:
        assert lanes.run_merged() == 1
    assert backend.calls == [1, 1, 1]


def test_a_merged_call_that_raises_fails_every_member_and_faults_once() -> None:
    worker, backend, lanes, _ = worker_rig(merge_pages=8)
    backend.raising = True
    backup(worker, 1, NS, [0])
    backup(worker, 2, NS, [1, 2])
    assert lanes.run_merged() == 2
    results, _ = worker.poll()
    assert [r.statuses for r in results] == [  # type: ignore[union-attr]
        (PutStatus.FAILED,),
        (PutStatus.FAILED,) * 2,
    ]
    # one store call failed: one fault (the store is suspect and a probe decides), not one per op
    assert worker.link.faults == 1 and worker.link.state is Health.SUSPECT


def test_only_the_first_member_is_running_while_the_shared_call_runs() -> None:
    worker, backend, lanes, _ = worker_rig(merge_pages=8)
    seen: list[list[float | None]] = []
    real_put = backend.put

    def put(namespace: Namespace, pages: Any, host_indices: Any) -> list[PutStatus]:
        seen.append([call.started for call in worker.link.calls[Lane.WRITE]])
        return real_put(namespace, pages, host_indices)

    backend.put = put  # type: ignore[method-assign]
    for op_id in (1, 2, 3):
        backup(worker, op_id, NS, [op_id])
    assert lanes.run_merged() == 3
    (started,) = seen
    assert started[0] is not None and started[1:] == [None, None]  # never overdue on their own
    assert all(call.started is not None for call in worker.link.calls[Lane.WRITE])


def test_members_begun_while_the_store_is_down_are_skipped_without_a_call() -> None:
    worker, backend, lanes, _ = worker_rig(merge_pages=8)
    backup(worker, 1, NS, [0])
    backup(worker, 2, NS, [1])
    worker.link.state = Health.DOWN  # the store went down before the lane began them
    assert lanes.run_merged() == 2
    assert backend.calls == []
    results, _ = worker.poll()
    assert all(r.skipped for r in results)  # type: ignore[union-attr]


# ------------------------------------------------------------------------------ through the cache
@pytest.mark.parametrize("merge", [True, False])
def test_a_backlog_of_backups_is_one_store_call_and_every_page_reads_back(merge: bool) -> None:
    config = StorageConfig(
        prefetch_threshold=PAGE, backup_backoff_s=0, backup_merge_pages=8 if merge else 0
    )
    shared = MemoryStore()
    writer = Rig(shared, config=config, backend=Recording)
    requests = [list(range(1000 * n, 1000 * n + 2 * PAGE)) for n in range(1, 5)]
    for tokens in requests:  # four requests, four nodes: four write-throughs, four backups
        writer.insert(tokens)
    writer.copies.run_all()
    writer.cache.check_events()
    assert len(writer.io.jobs) == 4
    while writer.io.jobs:
        writer.io.run_merged()
    writer.cache.check_events()
    backend = writer.backend
    assert isinstance(backend, Recording)
    assert backend.calls == ([8] if merge else [2, 2, 2, 2])
    assert writer.counters.backup_pages["stored"] == 8
    assert writer.cache.l3 is not None and not writer.cache.l3.backups
    assert all(node.backup_pins == 0 for node in writer.cache.nodes())
    reader = Rig(shared, config=config)
    for tokens in requests:
        reader.read_back(tokens, 2)
