"""Faults against a real master (a cluster of this module's own, with a 16 MiB segment): a full store,
calls on a closed client (in a subprocess: a wrapper bug there would be a segfault), and the master
killed while pages are being backed up and prefetched, then restarted.

Whatever happens, no call raises, no page is reported LOADED with bytes other than the ones written
(I2), and failures are counted by kind. Waits are bounded retry loops, never timing assertions.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kvstrata.impl.pools import HostKVPool, HostLayout, KVShape
from kvstrata.impl.storage.base import GetStatus, PutStatus
from kvstrata.impl.storage.mooncake import (
    ErrorKind,
    LocalCluster,
    MooncakeBackend,
    MooncakeClient,
)
from kvstrata.model.keys import KeySpace, KVKind, ModelIdentity, chain_page_hashes

SEGMENT = 16 << 20  # the smallest segment Mooncake mounts


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(segment_size=SEGMENT) as started:
        yield started


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> Iterator[MooncakeClient]:
    with MooncakeClient(cluster.config) as connected:
        yield connected


@pytest.fixture
def store(client: MooncakeClient) -> MooncakeClient:
    client.remove_all(force=True)
    return client


def test_a_full_store_gives_counted_full_statuses_and_never_wrong_bytes(
    store: MooncakeClient, page_kit
) -> None:
    shape = KVShape(KVKind.MHA, layers=8, heads=4, head_dim=64, dtype=torch.bfloat16, page_size=16)
    count = 192  # 128 KiB pages: 24 MiB into a 16 MiB segment
    host = HostKVPool(shape, count, HostLayout.PAGE_FIRST, pin_memory=False)
    model = ModelIdentity(name="big", dtype="bfloat16", kind=KVKind.MHA, page_size=16)
    backend = MooncakeBackend(store, KeySpace(model=model, tag=page_kit.TAG))
    backend.attach(host)
    ns = page_kit.NS
    pages = list(chain_page_hashes(list(range(count * shape.page_size)), shape.page_size, ns))
    page_kit.fill(host, range(count), pages)
    try:
        statuses = backend.put(ns, pages, list(range(count)))
        assert set(statuses) <= {PutStatus.STORED, PutStatus.FULL, PutStatus.FAILED}
        assert PutStatus.FULL in statuses
        counters = backend.counters.snapshot()
        assert counters.puts_full == statuses.count(PutStatus.FULL)
        assert counters.puts_stored == statuses.count(PutStatus.STORED) > 0
        assert backend.errors.count(ErrorKind.FULL, "put") > 0

        host.buffer.zero_()
        got = backend.get(ns, pages, list(range(count)))
        loaded = [i for i, status in enumerate(got) if status is GetStatus.LOADED]
        assert loaded, got
        assert page_kit.holds(host, loaded, [pages[i] for i in loaded])

        assert store.remove_all(force=True) > 0
        page_kit.fill(host, range(4), pages[:4])
        assert backend.put(ns, pages[:4], [0, 1, 2, 3]) == [PutStatus.STORED] * 4
    finally:
        backend.close()


AFTER_CLOSE = """
import ctypes, sys
from kvstrata.impl.errors import StoreUnavailable
from kvstrata.impl.storage.mooncake import ClientHealth, MooncakeClient, MooncakeConfig
from kvstrata.model.keys import KeySpace, KVKind, ModelIdentity, Namespace, chain_page_hashes

page = chain_page_hashes([1, 2], 2)[0]
model = ModelIdentity(name="m", dtype="uint8", kind=KVKind.MLA, page_size=2)
key = KeySpace(model=model).page_keys(Namespace(), page)[0]
buffer = ctypes.create_string_buffer(4096)
ptr = ctypes.addressof(buffer)

client = MooncakeClient(MooncakeConfig(master=sys.argv[1])).setup()
client.register_buffer(ptr, 4096)
assert client.batch_put_from([key], [ptr], [64]) == [0]
client.close()
client.close()
calls = {
    "batch_is_exist": lambda: client.batch_is_exist([key]),
    "batch_put_from": lambda: client.batch_put_from([key], [ptr], [64]),
    "batch_get_into": lambda: client.batch_get_into([key], [ptr], [64]),
    "batch_remove": lambda: client.batch_remove([key], force=True),
    "remove_all": lambda: client.remove_all(force=True),
    "register_buffer": lambda: client.register_buffer(ptr, 4096),
    "unregister_buffer": lambda: client.unregister_buffer(ptr),
    "setup": client.setup,
}
refused = []
for name, call in calls.items():
    try:
        call()
    except StoreUnavailable:
        refused.append(name)
assert client.health() is ClientHealth.NOT_READY
print(" ".join(refused))
"""


def test_calls_after_close_raise_and_do_not_crash(cluster: LocalCluster) -> None:
    done = subprocess.run(
        [sys.executable, "-c", AFTER_CLOSE, cluster.master_address],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, (done.returncode, done.stderr)  # -11 would be a segfault
    assert done.stdout.split() == [
        "batch_is_exist",
        "batch_put_from",
        "batch_get_into",
        "batch_remove",
        "remove_all",
        "register_buffer",
        "unregister_buffer",
        "setup",
    ]


class Traffic(threading.Thread):
    """Backs up and prefetches fresh pages in rounds until told to stop; records every status and
    whether every LOADED page held its bytes. A round that starts after ``killed`` is set is an
    *outage round*; the thread ends after one of them (or after ``rounds``)."""

    def __init__(self, backend: MooncakeBackend, host: HostKVPool, page_kit, rounds: int) -> None:
        super().__init__(daemon=True)
        self.backend, self.host, self.kit, self.rounds = backend, host, page_kit, rounds
        self.first_round = threading.Event()
        self.killed = threading.Event()
        self.records: list[tuple[bool, list[PutStatus], list[GetStatus], int, bool]] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for round_ in range(self.rounds):
                outage = self.killed.is_set()
                pages = self.kit.pages(KVKind.MHA, 2, first_token=10_000 * (round_ + 1))
                self.kit.fill(self.host, [0, 1], pages)
                put = self.backend.put(self.kit.NS, pages, [0, 1])
                got = self.backend.get(self.kit.NS, pages, [4, 5])
                found = self.backend.exists(self.kit.NS, pages)
                loaded = [i for i, status in enumerate(got) if status is GetStatus.LOADED]
                intact = self.kit.holds(
                    self.host, [4 + i for i in loaded], [pages[i] for i in loaded]
                )
                self.records.append((outage, put, got, found, intact))
                self.first_round.set()
                if outage:
                    return
        except BaseException as error:  # reported by the test
            self.error = error
            self.first_round.set()


def test_master_killed_during_backup_and_prefetch_then_restarted(
    cluster: LocalCluster, store: MooncakeClient, page_kit
) -> None:
    host = page_kit.host(KVKind.MHA)
    backend = MooncakeBackend(store, page_kit.keyspace(KVKind.MHA))
    backend.attach(host)
    try:
        traffic = Traffic(backend, host, page_kit, rounds=50)
        traffic.start()
        assert traffic.first_round.wait(60)
        cluster.kill_master()
        traffic.killed.set()
        traffic.join(120)
        assert not traffic.is_alive()
        assert traffic.error is None, traffic.error

        for outage, put, got, found, intact in traffic.records:
            assert intact  # no wrong bytes, before or during the outage
            if outage:
                assert put == [PutStatus.FAILED] * 2
                assert GetStatus.LOADED not in got
                assert found == 0
        assert traffic.records[-1][0], "the traffic never ran a round during the outage"
        assert backend.errors.count(ErrorKind.UNAVAILABLE) > 0
        # the store link's probe: one single-key call, an outage counted (fast: -900 at once)
        outages = backend.outages
        assert backend.probe(page_kit.NS, page_kit.pages(KVKind.MHA, 1)[0]) is False
        assert backend.outages == outages + 1
        assert backend.errors.in_burst("put")
        assert backend.counters.puts_failed >= 2

        cluster.restart_master()
        deadline = time.monotonic() + 60
        attempt = 0
        while True:  # the client and the storage node reconnect by themselves
            attempt += 1
            pages = page_kit.pages(KVKind.MHA, 2, first_token=1_000_000 + 10 * attempt)
            page_kit.fill(host, [2, 3], pages)
            put = backend.put(page_kit.NS, pages, [2, 3])
            got = backend.get(page_kit.NS, pages, [6, 7])
            if put == [PutStatus.STORED] * 2 and got == [GetStatus.LOADED] * 2:
                break
            assert time.monotonic() < deadline, (attempt, put, got)
            time.sleep(0.2)
        assert page_kit.holds(host, [6, 7], pages)
        assert not backend.errors.in_burst("put")
        assert backend.probe(page_kit.NS, pages[0]) is True
        assert backend.probe(page_kit.NS, page_kit.pages(KVKind.MHA, 1, first_token=7)[0]) is False
    finally:
        backend.close()
