"""``StagedSlabs`` (the ``page_first`` path to Mooncake) when the read and write lanes overlap: a get
landing while a put is in flight must not share its staging slots (the put would store the get's
bytes under its keys for good; the get would scatter the put's bytes into its page).

The client is a stand-in that orders the two calls with events (a real store cannot be made to
interleave them on demand); the real master's round trips of this path are in
``test_mooncake_backend.py``."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence

import pytest
import torch

from kvstrata.impl.pools import HostKVPool, HostLayout, KVShape
from kvstrata.impl.storage.base import page_objects
from kvstrata.impl.storage.mooncake.slabs import StagedSlabs, slab_io
from kvstrata.model.keys import KeySpace, KVKind, ModelIdentity

SHAPE = KVShape(KVKind.MHA, layers=2, heads=2, head_dim=4, dtype=torch.float16, page_size=4)
KEYSPACE = KeySpace(ModelIdentity(name="m", dtype="float16", kind=KVKind.MHA, page_size=4))
WAIT_S = 10.0
LANDED = 0xAB  # every byte the stand-in store returns


class InterleavedClient:
    """A get writes its bytes into its slots at once and returns only after the put has read
    its slots; a put reads its slots only after the get's bytes have landed."""

    def __init__(self) -> None:
        self.stored: dict[str, bytes] = {}
        self.put_entered = threading.Event()
        self.landed = threading.Event()
        self.sent = threading.Event()

    def register_buffer(self, ptr: int, size: int) -> None:
        """Nothing to register."""

    def release_buffer_later(self, ptr: int) -> None:
        """Nothing to release."""

    def batch_get_into(self, keys: Sequence[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        for ptr, size in zip(ptrs, sizes, strict=True):
            ctypes.memset(ptr, LANDED, size)
        self.landed.set()
        assert self.sent.wait(WAIT_S), "the put never read its slots"
        return list(sizes)

    def batch_put_from(self, keys: Sequence[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        self.put_entered.set()
        assert self.landed.wait(WAIT_S), "the get never landed"
        for key, ptr, size in zip(keys, ptrs, sizes, strict=True):
            self.stored[key] = ctypes.string_at(ptr, size)
        self.sent.set()
        return [0] * len(keys)


def _slabs(client: InterleavedClient) -> tuple[HostKVPool, StagedSlabs]:
    host = HostKVPool(SHAPE, 8, HostLayout.PAGE_FIRST, pin_memory=False)
    host.buffer.fill_(1.0)  # every page to back up holds 1.0
    slabs = slab_io(host, client, 64 << 20, page_objects(KEYSPACE))  # type: ignore[arg-type]
    assert isinstance(slabs, StagedSlabs)
    return host, slabs


def _check(host: HostKVPool, client: InterleavedClient, size: int) -> None:
    ones = torch.ones(size // 2, dtype=torch.float16).view(torch.uint8).numpy().tobytes()
    assert client.stored == {"p0": ones, "p1": ones}, "the put stored bytes it did not gather"
    page = host.canonical()[:, :, 5].contiguous().view(torch.uint8)
    assert bool((page == LANDED).all()), "the get scattered bytes it did not receive"
    others = host.canonical()[:, :, [0, 1, 2, 3, 4, 6, 7]]
    assert bool((others == 1.0).all()), "a page the get did not name changed"


@pytest.mark.parametrize("first", ["get", "put"])
def test_a_get_and_a_put_in_flight_together_keep_their_own_bytes(first: str) -> None:
    client = InterleavedClient()
    host, slabs = _slabs(client)

    def get() -> None:
        slabs.get(["g0", "g1"], [(5, 0), (5, 1)], 2)

    def put() -> None:
        slabs.put(["p0", "p1"], [(0, 0), (0, 1)])

    if first == "get":  # the get's bytes are in its slots before the put gathers
        lane = threading.Thread(target=get)
        lane.start()
        assert client.landed.wait(WAIT_S)
        put()
    else:  # the put gathered and is sending when the get's bytes land
        lane = threading.Thread(target=put)
        lane.start()
        assert client.put_entered.wait(WAIT_S)
        get()
    lane.join(WAIT_S)
    assert not lane.is_alive()
    _check(host, client, slabs.size)


def test_each_direction_stages_in_half_the_budget_at_least_one_page() -> None:
    client = InterleavedClient()
    host = HostKVPool(SHAPE, 8, HostLayout.PAGE_FIRST, pin_memory=False)
    objects = page_objects(KEYSPACE)
    size = SHAPE.bytes_per_page // len(objects)
    roomy = StagedSlabs(host, client, 40 * size, objects)  # type: ignore[arg-type]
    assert roomy.capacity == 20
    tight = StagedSlabs(host, client, size, objects)  # type: ignore[arg-type]
    assert tight.capacity == len(objects)  # one page's objects, whatever the budget
