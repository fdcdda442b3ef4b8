"""Moving a side pool's objects (indexer pages, Mamba states) between a host
:class:`~kvstrata.impl.pools.side.SideBuffer` and a store (SPEC §5).

One *entry* of a side pool (the indexer keys of one KV page, or one Mamba state) is stored as the
objects :func:`kvstrata.model.hybrid.side_components` names for the key space's schema version, keyed
by :func:`kvstrata.model.hybrid.side_page_keys` (the caller renders the keys; this module never builds
a key):

- key schema 1: one object per component, holding exactly that component's bytes of the entry in the
  host buffer (:meth:`SideBuffer.describe`);
- key schema 2 (*whole entries*): one object per entry, holding every component's bytes of the entry
  concatenated in component order. On Mooncake it is moved straight from and into the buffer's
  component tensors as several ranges of one object (the multi-buffer calls), never through a
  staging copy; the object layer of the memory and file stores joins and splits bytes.

The rules are the KV pages' (:mod:`kvstrata.impl.storage.base`):

- an entry *exists* only if every object of it exists with its exact size;
- ``put`` is exists-then-put-missing per entry; ``STORED`` only once every object is visible;
- ``get`` reports ``LOADED`` only when every object arrived whole, and writes the buffer entry only
  then (object layer) or leaves it unspecified but unused (a failed entry is never marked loaded);
  a missing one is ``MISSING``;
- store trouble never raises: it comes back as statuses (and ``False`` from ``present``).

:func:`side_io` picks the mover for a backend: :class:`ObjectSideIO` over the object layer of the
in-memory and file backends, :class:`MooncakeSideIO` over a Mooncake client, zero-copy (the buffer's
component tensors are registered once, like a ``page_first_direct`` host pool).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.impl.errors import MisuseError, StoreUnavailable
from kvstrata.impl.pools.side import SideBuffer
from kvstrata.impl.storage.base import GetStatus, PutStatus
from kvstrata.impl.storage.mooncake.backend import MooncakeBackend
from kvstrata.impl.storage.mooncake.client import MooncakeClient
from kvstrata.impl.storage.mooncake.slabs import RPC_FAIL
from kvstrata.impl.storage.objects import ObjectBackend, Op, Payload
from kvstrata.model.hybrid import side_components, side_page_keys, side_rendered
from kvstrata.model.keys import KeySpace, Namespace, PageHash, RenderedKeys, StoreKey

__all__ = ["MooncakeSideIO", "ObjectSideIO", "SideIO", "present_all", "side_io"]

EntryKeys = tuple[StoreKey, ...]
"""The store keys of one entry's objects, in :func:`~kvstrata.model.hybrid.side_components` order."""


def _object_sizes(buffer: SideBuffer, whole: bool) -> tuple[int, ...]:
    """Bytes of each object of one entry: the components' sizes, or their sum for whole entries."""
    sizes = buffer.spec.component_bytes()
    return (sum(sizes),) if whole else sizes


class SideIO(Protocol):
    """One side pool's objects between its host buffer and one backend's store.

    Invariant: ``sizes`` has one entry per object of an entry (``len(sizes)`` keys per entry): the
    components' sizes, or their sum when ``whole`` (key schema 2)."""

    buffer: SideBuffer
    keys: KeySpace
    whole: bool
    sizes: tuple[int, ...]

    def present(self, keys: Sequence[EntryKeys]) -> list[bool]:
        """Per entry: does every object of it exist with its size? ``False`` when unsure."""

    def present_pages(self, namespace: Namespace, pages: Sequence[PageHash]) -> list[bool]:
        """:meth:`present` of the entries of ``pages`` (keys rendered here, each once, through
        the model's :func:`~kvstrata.model.hybrid.side_page_keys` or its batch twin)."""

    def put(self, keys: Sequence[EntryKeys], entries: Sequence[int]) -> list[PutStatus]:
        """Store each buffer entry under its keys (missing objects only); one status each."""

    def get(self, keys: Sequence[EntryKeys], entries: Sequence[int]) -> list[GetStatus]:
        """Read each entry's objects into the buffer entry; one status each."""

    def release(self) -> None:
        """Drop registrations (idempotent)."""


def _check(io: SideIO, keys: Sequence[EntryKeys], entries: Sequence[int] | None) -> None:
    width, buffer = len(io.sizes), io.buffer
    for entry_keys in keys:
        if len(entry_keys) != width or not all(isinstance(k, StoreKey) for k in entry_keys):
            raise MisuseError(f"{buffer.name}: expected {width} StoreKey values per entry")
    if entries is not None:
        if len(entries) != len(keys):
            raise MisuseError(f"{buffer.name}: {len(keys)} key sets but {len(entries)} entries")
        buffer.indices(list(entries), "store I/O")


class ObjectSideIO:
    """Side objects through an :class:`ObjectBackend`'s object layer (in-memory, file store)."""

    def __init__(self, backend: ObjectBackend, buffer: SideBuffer, keys: KeySpace) -> None:
        self.backend = backend
        self.buffer = buffer
        self.keys = keys
        self.whole = _whole(buffer, keys)
        self.sizes = _object_sizes(buffer, self.whole)

    def _raw(self, component: int, entry: int) -> npt.NDArray[np.uint8]:
        """The bytes of one entry of one component: a writable view of the buffer, no copy."""
        return self.buffer.tensors[component][entry].reshape(-1).view(torch.uint8).numpy()

    def _payload(self, number: int, entry: int) -> bytes:
        """The bytes of object ``number`` of ``entry``: one component's, or all of them in order."""
        if not self.whole:
            return self._raw(number, entry).tobytes()
        return b"".join(
            self._raw(c, entry).tobytes() for c in range(len(self.buffer.spec.components))
        )

    def _fill(self, entry: int, payloads: Sequence[bytes | bytearray | memoryview]) -> None:
        """Write every object of ``entry`` (each exactly its size) into the buffer's components."""
        if not self.whole:
            for component, payload in enumerate(payloads):
                self._raw(component, entry)[...] = np.frombuffer(payload, dtype=np.uint8)
            return
        whole, offset = np.frombuffer(payloads[0], dtype=np.uint8), 0
        for component, size in enumerate(self.buffer.spec.component_bytes()):
            self._raw(component, entry)[...] = whole[offset : offset + size]
            offset += size

    def present(self, keys: Sequence[EntryKeys]) -> list[bool]:
        _check(self, keys, None)
        answers = [True] * len(keys)
        for component, size in enumerate(self.sizes):
            found = self.backend._present([k[component] for k in keys], size)
            if found is None:
                return [False] * len(keys)
            answers = [a and f for a, f in zip(answers, found, strict=True)]
        return answers

    def present_pages(self, namespace: Namespace, pages: Sequence[PageHash]) -> list[bool]:
        pool = self.buffer.spec.pool
        return self.present([side_page_keys(self.keys, namespace, pool, page) for page in pages])

    def put(self, keys: Sequence[EntryKeys], entries: Sequence[int]) -> list[PutStatus]:
        _check(self, keys, entries)
        if not self.backend.writer:
            return [PutStatus.SKIPPED] * len(keys)
        admitted, refusal = self.backend._admit(Op.PUT, len(keys))
        statuses: list[PutStatus] = []
        for entry_keys, entry in zip(keys[:admitted], entries[:admitted], strict=True):
            present = [
                self.backend._present([key], size)
                for key, size in zip(entry_keys, self.sizes, strict=True)
            ]
            if any(p is None for p in present):
                statuses.append(PutStatus.FAILED)
                continue
            missing = [
                (key, self._payload(number, entry))
                for number, (key, here) in enumerate(zip(entry_keys, present, strict=True))
                if not (here and here[0])
            ]
            statuses.append(self._write(missing, entry_keys) if missing else PutStatus.EXISTED)
        return statuses + [refusal] * (len(keys) - admitted)

    def _write(
        self, missing: Sequence[tuple[StoreKey, Payload]], entry_keys: EntryKeys
    ) -> PutStatus:
        """Write ``missing`` and confirm the whole entry is visible, as the KV path does: STORED
        only once every object is (a two-phase store may accept a put no reader sees yet)."""
        status = self.backend._write(missing, entry_keys)
        if status is not PutStatus.STORED:
            return status
        for key, size in zip(entry_keys, self.sizes, strict=True):
            confirmed = self.backend._present([key], size)
            if not confirmed or not confirmed[0]:
                self.backend.counters.add(puts_unconfirmed=1)
                return PutStatus.FAILED
        return status

    def get(self, keys: Sequence[EntryKeys], entries: Sequence[int]) -> list[GetStatus]:
        _check(self, keys, entries)
        admitted, _ = self.backend._admit(Op.GET, len(keys))
        statuses: list[GetStatus] = []
        for entry_keys, entry in zip(keys[:admitted], entries[:admitted], strict=True):
            status, payloads = GetStatus.LOADED, []
            for key, size in zip(entry_keys, self.sizes, strict=True):
                loaded = self.backend._read([key], size)
                if isinstance(loaded, GetStatus):
                    status = loaded
                    break
                payloads.append(loaded[0])
            if status is GetStatus.LOADED:  # every object arrived whole: only now write
                self._fill(entry, payloads)
            statuses.append(status)
        return statuses + [GetStatus.FAILED] * (len(keys) - admitted)

    def release(self) -> None:
        """Nothing is registered with an object store."""


class MooncakeSideIO:
    """Side objects through a :class:`MooncakeBackend`'s client, zero-copy: each component tensor of
    the host buffer is registered once; an object is one entry's run of bytes in one component, or
    (``whole``) the entry's runs in every component, moved as the ranges of one object."""

    def __init__(self, backend: MooncakeBackend, buffer: SideBuffer, keys: KeySpace) -> None:
        self.backend = backend
        self.buffer = buffer
        self.keys = keys
        self.whole = _whole(buffer, keys)
        self.sizes = _object_sizes(buffer, self.whole)
        self._component_sizes = buffer.spec.component_bytes()
        #: whole entries of several components go as several ranges per object
        self._multi = self.whole and len(self._component_sizes) > 1
        bases: list[int] = []
        try:
            for region in buffer.buffers():
                backend.client.register_buffer(region.ptr, region.nbytes)
                bases.append(region.ptr)
        finally:
            # an IO dropped without release() must not leave its (soon freed) memory registered
            self._release = weakref.finalize(self, _release_all, backend.client, bases)
            self._release.atexit = False
        self._bases = tuple(bases)

    def _flat(self, keys: Sequence[EntryKeys]) -> list[StoreKey]:
        return [key for entry_keys in keys for key in entry_keys]

    def _regions(self, entries: Sequence[int]) -> tuple[list[int], list[int]]:
        """Each component's range of each entry, entry-major (one object each unless ``_multi``)."""
        ptrs = [
            base + entry * size
            for entry in entries
            for base, size in zip(self._bases, self._component_sizes, strict=True)
        ]
        return ptrs, list(self._component_sizes) * len(entries)

    def _parts(self, entries: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
        """Per whole entry, its components' ranges in component order (the parts of one object)."""
        ptrs, sizes = self._regions(entries)
        width = len(self._component_sizes)
        return (
            [ptrs[i : i + width] for i in range(0, len(ptrs), width)],
            [sizes[i : i + width] for i in range(0, len(sizes), width)],
        )

    def present(self, keys: Sequence[EntryKeys]) -> list[bool]:
        _check(self, keys, None)
        if not keys:
            return []
        codes = self.backend._is_exist(self._flat(keys))
        self.backend.accounts.count_errors("exists", codes)
        return _entries_present(codes, len(self.sizes))

    def present_pages(self, namespace: Namespace, pages: Sequence[PageHash]) -> list[bool]:
        return present_all([(self, namespace, pages)])[0]

    def put(self, keys: Sequence[EntryKeys], entries: Sequence[int]) -> list[PutStatus]:
        _check(self, keys, entries)
        if not self.backend.writer:
            return [PutStatus.SKIPPED] * len(keys)
        flat = self._flat(keys)
        client = self.backend.client
        if self._multi:
            part_ptrs, part_sizes = self._parts(entries)

            def write(todo: list[int]) -> list[int]:
                try:
                    return client.batch_put_parts(
                        [flat[i] for i in todo],
                        [part_ptrs[i] for i in todo],
                        [part_sizes[i] for i in todo],
                    )
                except StoreUnavailable:
                    return [RPC_FAIL] * len(todo)

        else:
            ptrs, sizes = self._regions(entries)

            def write(todo: list[int]) -> list[int]:
                try:
                    return client.batch_put_from(
                        [flat[i] for i in todo], [ptrs[i] for i in todo], [sizes[i] for i in todo]
                    )
                except StoreUnavailable:
                    return [RPC_FAIL] * len(todo)

        statuses, _ = self.backend.put_objects(flat, len(self.sizes), write)
        return statuses

    def get(self, keys: Sequence[EntryKeys], entries: Sequence[int]) -> list[GetStatus]:
        _check(self, keys, entries)
        if not keys:
            return []
        flat = self._flat(keys)
        try:
            if self._multi:
                codes = self.backend.client.batch_get_parts(flat, *self._parts(entries))
            else:
                codes = self.backend.client.batch_get_into(flat, *self._regions(entries))
        except StoreUnavailable:
            codes = [RPC_FAIL] * len(flat)
        return self.backend.accounts.settle_gets(codes, self.sizes)

    def release(self) -> None:
        self._release()


def _release_all(client: MooncakeClient, bases: list[int]) -> None:
    """Drop the registrations of ``bases`` (deferred to the client's next call: finalizer-safe)."""
    while bases:
        client.release_buffer_later(bases.pop())


def _whole(buffer: SideBuffer, keys: KeySpace) -> bool:
    """Whether ``keys``' schema stores an entry of ``buffer`` as one object (the model's
    :func:`~kvstrata.model.hybrid.side_components` names one object, not the pool's components)."""
    return side_components(keys, buffer.spec.pool) != buffer.spec.pool.components


def _entries_present(codes: Sequence[int], width: int) -> list[bool]:
    """Per entry of ``width`` objects (entry-major ``batch_is_exist`` codes): all of them exist."""
    if width == 1:
        return [code == 1 for code in codes]
    return [codes[i : i + width].count(1) == width for i in range(0, len(codes), width)]


def side_io(backend: object, buffer: SideBuffer, keys: KeySpace) -> SideIO:
    """The side-object mover of ``backend`` for ``buffer`` (a host buffer), storing each entry as
    the objects ``keys``' schema version makes of it (:func:`~kvstrata.model.hybrid.side_components`:
    one per component, or one whole entry)."""
    if buffer.device.type != "cpu":
        raise MisuseError(f"side_io: {buffer.name!r} is not a host buffer")
    if isinstance(backend, MooncakeBackend):
        return MooncakeSideIO(backend, buffer, keys)
    if isinstance(backend, ObjectBackend):
        return ObjectSideIO(backend, buffer, keys)
    raise MisuseError(f"side_io: no side-object support for {type(backend).__name__}")


def present_all(asks: Sequence[tuple[SideIO, Namespace, Sequence[PageHash]]]) -> list[list[bool]]:
    """:meth:`SideIO.present_pages` for several pools at once: one answer list per
    ``(io, namespace, pages)``. Pools on the same Mooncake backend are asked in **one**
    ``batch_is_exist`` of keys rendered as one text batch each
    (:func:`~kvstrata.model.hybrid.side_rendered`: one round trip for every side pool, and no
    object per key); others pool by pool."""
    answers: list[list[bool] | None] = [None] * len(asks)
    shared: dict[int, list[int]] = {}
    for index, (io, namespace, pages) in enumerate(asks):
        if isinstance(io, MooncakeSideIO):
            shared.setdefault(id(io.backend), []).append(index)
        else:
            answers[index] = io.present_pages(namespace, pages)
    for indices in shared.values():
        batches = []
        for index in indices:
            io, namespace, pages = asks[index]
            batches.append(side_rendered(io.keys, namespace, io.buffer.spec.pool, pages))
        first = asks[indices[0]][0]
        assert isinstance(first, MooncakeSideIO)
        flat = RenderedKeys.join(batches)
        codes = first.backend._is_exist(flat) if len(flat) else []
        first.backend.accounts.count_errors("exists", codes)
        offset = 0
        for index, batch in zip(indices, batches, strict=True):
            answers[index] = _entries_present(
                codes[offset : offset + len(batch)], len(asks[index][0].sizes)
            )
            offset += len(batch)
    return [answer if answer is not None else [] for answer in answers]
