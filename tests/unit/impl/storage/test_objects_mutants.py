"""What ``ObjectBackend`` (``kvstrata.impl.storage.objects``) promises that the contract suite did not
pin down: found by mutation testing (``scripts/mutation_score.py``), one test per surviving mutant.

The defaults and the ``closed`` / ``host`` properties, the exact misuse and configuration messages
(each names the backend and the call, so a log line says who was misused), the attach check on page
size and kind taken separately, the byte counters of pages that wrote nothing, and the store layer's
answers checked for length: a ``_present`` or ``_read`` that answers for the wrong number of objects
is a loud error, never a page half written or half loaded.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import pytest
import torch

from kvstrata.impl.errors import ConfigError, MisuseError
from kvstrata.impl.pools import HostKVPool, KVShape
from kvstrata.impl.storage.base import GetStatus, PutStatus
from kvstrata.impl.storage.memory import MemoryBackend
from kvstrata.impl.storage.objects import ObjectBackend, Payload
from kvstrata.model.keys import (
    KeySpace,
    KVKind,
    ModelIdentity,
    Namespace,
    PageHash,
    StoreKey,
    chain_page_hashes,
)

NS = Namespace(extra_key="lora-2")
MHA = KVShape(kind=KVKind.MHA, layers=2, heads=2, head_dim=4, dtype=torch.float16, page_size=4)
SLOTS = 4


def space(kind: KVKind = KVKind.MHA, page_size: int = 4) -> KeySpace:
    return KeySpace(ModelIdentity("tiny", "float16", kind, page_size=page_size))


def host(shape: KVShape = MHA) -> HostKVPool:
    pool = HostKVPool(shape, SLOTS, "page_first_direct", pin_memory=False)
    for slot in range(SLOTS):
        generator = torch.Generator().manual_seed(slot)
        raw = torch.randint(0, 256, (shape.nbytes(1),), dtype=torch.uint8, generator=generator)
        pool.write_pages([slot], raw.view(shape.dtype).reshape(shape.canonical(1)))
    return pool


def pages(count: int) -> list[PageHash]:
    return list(chain_page_hashes(list(range(count * MHA.page_size)), MHA.page_size, NS))


def attached(backend: MemoryBackend | None = None) -> MemoryBackend:
    made = MemoryBackend(space()) if backend is None else backend
    made.attach(host())
    return made


def exactly(message: str) -> str:
    """A ``pytest.raises(match=...)`` pattern for the whole message, nothing around it."""
    return "^" + re.escape(message) + "$"


# ------------------------------------------------------------------------- defaults and properties
class BareBackend(ObjectBackend):
    """The least subclass: the three store operations, and ``ObjectBackend``'s own defaults."""

    name = "bare"

    def __init__(self, keyspace: KeySpace) -> None:
        super().__init__(keyspace)
        self.objects: dict[StoreKey, bytes] = {}

    def _present(self, keys: Sequence[StoreKey], nbytes: int) -> list[bool] | None:
        return [len(self.objects.get(key, b"")) == nbytes for key in keys]

    def _write(
        self, objects: Sequence[tuple[StoreKey, Payload]], page_keys: Sequence[StoreKey]
    ) -> PutStatus:
        self.objects.update((key, bytes(data)) for key, data in objects)
        return PutStatus.STORED

    def _read(self, keys: Sequence[StoreKey], nbytes: int) -> list[Payload] | GetStatus:
        if not all(self._present(keys, nbytes) or [False]):
            return GetStatus.MISSING
        return [self.objects[key] for key in keys]


def test_a_backend_writes_by_default() -> None:
    bare = BareBackend(space())
    assert bare.writer is True
    bare.attach(host())
    assert bare.put(NS, pages(1), [0]) == [PutStatus.STORED]
    assert bare.get(NS, pages(1), [1]) == [GetStatus.LOADED]
    backend = MemoryBackend(space())
    assert backend.writer is True
    backend.attach(host())
    assert backend.put(NS, pages(1), [0]) == [PutStatus.STORED]


def test_closed_and_host_before_attach_after_attach_and_after_close() -> None:
    backend = MemoryBackend(space())
    assert backend.closed is False
    assert backend.host is None
    pool = host()
    backend.attach(pool)
    assert backend.host is pool
    assert backend.closed is False
    backend.close()
    assert backend.closed is True
    assert backend.host is None


# ------------------------------------------------------------------------------------------ messages
def test_constructor_messages_name_the_backend_class() -> None:
    with pytest.raises(
        MisuseError, match=exactly("MemoryBackend.keyspace: expected a KeySpace, got 'x'")
    ):
        MemoryBackend("x")  # type: ignore[arg-type]
    embedding = KeySpace(ModelIdentity("tiny", "float16", KVKind.EMBEDDING, dim=8))
    with pytest.raises(
        ConfigError,
        match=exactly(
            "MemoryBackend.keyspace: a page backend stores KV pages (MHA or MLA), got kind 'emb'"
        ),
    ):
        MemoryBackend(embedding)
    with pytest.raises(
        ConfigError, match=exactly("MemoryBackend.writer: expected a bool, got 'yes'")
    ):
        MemoryBackend(space(), writer="yes")  # type: ignore[arg-type]


def test_a_closed_backend_names_the_refused_call() -> None:
    backend = attached()
    backend.close()
    with pytest.raises(MisuseError, match=exactly("memory.attach: the backend is closed")):
        backend.attach(host())
    for call, args in (
        ("exists", (NS, pages(1))),
        ("put", (NS, pages(1), [0])),
        ("get", (NS, pages(1), [0])),
    ):
        with pytest.raises(MisuseError, match=exactly(f"memory.{call}: the backend is closed")):
            getattr(backend, call)(*args)


def test_attach_of_a_non_pool_names_the_backend() -> None:
    with pytest.raises(MisuseError, match=r"^memory: attach\(\) takes a HostKVPool, got 42$"):
        MemoryBackend(space()).attach(42)  # type: ignore[arg-type]


def test_batch_messages_name_the_call_and_the_argument() -> None:
    with pytest.raises(MisuseError, match=exactly("memory.exists: not attached to a host pool")):
        MemoryBackend(space()).exists(NS, pages(1))
    backend = attached()
    with pytest.raises(MisuseError, match=exactly("memory.put: pages must be a sequence, got str")):
        backend.put(NS, "page", [0])  # type: ignore[arg-type]
    with pytest.raises(
        MisuseError, match=exactly("memory.get: host_indices must be a sequence, got int")
    ):
        backend.get(NS, pages(1), 0)  # type: ignore[arg-type]
    with pytest.raises(
        MisuseError, match=exactly("memory.get: host_indices must be a sequence, got str")
    ):
        backend.get(NS, pages(1), "0")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------- attach
@pytest.mark.parametrize(
    ("kind", "page_size"),
    [(KVKind.MHA, 2), (KVKind.MLA, 4)],
    ids=["same-kind-other-page-size", "other-kind-same-page-size"],
)
def test_attach_refuses_a_pool_that_differs_in_page_size_or_kind_alone(
    kind: KVKind, page_size: int
) -> None:
    backend = MemoryBackend(space(kind, page_size))
    with pytest.raises(
        ConfigError,
        match=exactly(
            f"memory: the host pool holds mha pages of 4 tokens but the key space names "
            f"{kind.value} pages of {page_size}"
        ),
    ):
        backend.attach(host())
    assert backend.host is None


# ------------------------------------------------------------------------------------ byte counters
def test_a_put_that_finds_its_page_stored_writes_no_bytes() -> None:
    backend = attached()
    assert backend.put(NS, pages(1), [0]) == [PutStatus.STORED]
    written = backend.counters.snapshot().bytes_written
    assert written == MHA.bytes_per_page
    assert backend.put(NS, pages(1), [1]) == [PutStatus.EXISTED]
    assert backend.counters.snapshot().bytes_written == written


class UnsureBackend(MemoryBackend):
    """A store that cannot say which objects it holds."""

    def _present(self, keys: Sequence[StoreKey], nbytes: int) -> list[bool] | None:
        return None


def test_a_put_the_store_cannot_check_fails_and_writes_no_bytes() -> None:
    backend = attached(UnsureBackend(space()))
    assert backend.put(NS, pages(2), [0, 1]) == [PutStatus.FAILED, PutStatus.FAILED]
    snapshot = backend.counters.snapshot()
    assert (snapshot.puts_failed, snapshot.bytes_written) == (2, 0)
    assert len(backend.store) == 0


# ------------------------------------------------------------------- store answers checked for length
class ShortPresentBackend(MemoryBackend):
    """A broken store layer: answers ``_present`` for one object fewer than asked."""

    def _present(self, keys: Sequence[StoreKey], nbytes: int) -> list[bool] | None:
        return [False] * (len(keys) - 1)


class ShortReadBackend(MemoryBackend):
    """A broken store layer: ``_read`` returns one payload fewer than asked."""

    def _read(self, keys: Sequence[StoreKey], nbytes: int) -> list[Payload] | GetStatus:
        found = super()._read(keys, nbytes)
        return found if isinstance(found, GetStatus) else found[:-1]


def test_a_present_answer_of_the_wrong_length_is_an_error_not_a_partial_put() -> None:
    backend = attached(ShortPresentBackend(space()))
    with pytest.raises(ValueError, match="zip"):
        backend.put(NS, pages(1), [0])
    assert len(backend.store) == 0


def test_a_read_of_the_wrong_length_is_an_error_not_a_loaded_page() -> None:
    backend = attached(ShortReadBackend(space()))
    assert backend.put(NS, pages(1), [0]) == [PutStatus.STORED]
    with pytest.raises(ValueError, match="zip"):
        backend.get(NS, pages(1), [1])
    assert backend.counters.snapshot().gets_loaded == 0


# ------------------------------------------------------------------------------------ test hooks
def test_component_keys_refuse_a_wrong_namespace_or_page_each_alone() -> None:
    backend = attached()
    (page,) = pages(1)
    message = exactly("memory: expected a Namespace and a PageHash")
    with pytest.raises(MisuseError, match=message):
        backend.evict("ns", page)  # type: ignore[arg-type]
    with pytest.raises(MisuseError, match=message):
        backend.evict(NS, page.hex())  # type: ignore[arg-type]
    with pytest.raises(
        MisuseError, match=exactly("memory: no component 'latent' in a page of ('k', 'v')")
    ):
        backend.evict(NS, page, "latent")
