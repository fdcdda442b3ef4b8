"""Moving a side pool's objects (indexer pages, Mamba states) between a host
:class:`~kvstrata.impl.pools.side.SideBuffer` and a store (SPEC §5).

One *entry* of a side pool (the indexer keys of one KV page, or one Mamba state) is one store object
per component of its :class:`~kvstrata.model.hybrid.SidePool`, keyed by
:func:`kvstrata.model.hybrid.side_page_keys` (the caller renders the keys; this module never builds a
key) and holding exactly the bytes of that component's entry in the host buffer
(:meth:`SideBuffer.describe`). The rules are the KV pages' (:mod:`kvstrata.impl.storage.base`):

- an entry *exists* only if every component object exists with its exact size;
- ``put`` is exists-then-put-missing per entry; ``STORED`` only once every object is visible;
- ``get`` reports ``LOADED`` only when every component arrived whole; a missing one is ``MISSING``;
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
from kvstrata.impl.storage.objects import ObjectBackend, Op
from kvstrata.model.keys import StoreKey

__all__ = ["MooncakeSideIO", "ObjectSideIO", "SideIO", "present_all", "side_io"]

EntryKeys = tuple[StoreKey, ...]
"""The store keys of one entry's components, in component order."""


class SideIO(Protocol):
    """One side pool's objects between its host buffer and one backend's store."""

    buffer: SideBuffer

    def present(self, keys: Sequence[EntryKeys]) -> list[bool]:
        """Per entry: does every component object exist with its size? ``False`` when unsure."""

    def put(self, keys: Sequence[EntryKeys], entries: Sequence[int]) -> list[PutStatus]:
        """Store each buffer entry under its keys (missing components only); one status each."""

    def get(self, keys: Sequence[EntryKeys], entries: Sequence[int]) -> list[GetStatus]:
        """Read each entry's objects into the buffer entry; one status each."""

    def release(self) -> None:
        """Drop registrations (idempotent)."""


def _check(buffer: SideBuffer, keys: Sequence[EntryKeys], entries: Sequence[int] | None) -> None:
    width = len(buffer.spec.components)
    for entry_keys in keys:
        if len(entry_keys) != width or not all(isinstance(k, StoreKey) for k in entry_keys):
            raise MisuseError(f"{buffer.name}: expected {width} StoreKey values per entry")
    if entries is not None:
        if len(entries) != len(keys):
            raise MisuseError(f"{buffer.name}: {len(keys)} key sets but {len(entries)} entries")
        buffer.indices(list(entries), "store I/O")


class ObjectSideIO:
    """Side objects through an :class:`ObjectBackend`'s object layer (in-memory, file store)."""

    def __init__(self, backend: ObjectBackend, buffer: SideBuffer) -> None:
        self.backend = backend
        self.buffer = buffer
        self.sizes = buffer.spec.component_bytes()

    def _raw(self, component: int, entry: int) -> npt.NDArray[np.uint8]:
        """The bytes of one entry of one component: a writable view of the buffer, no copy."""
        return self.buffer.tensors[component][entry].reshape(-1).view(torch.uint8).numpy()

    def present(self, keys: Sequence[EntryKeys]) -> list[bool]:
        _check(self.buffer, keys, None)
        answers = [True] * len(keys)
        for component, size in enumerate(self.sizes):
            found = self.backend._present([k[component] for k in keys], size)
            if found is None:
                return [False] * len(keys)
            answers = [a and f for a, f in zip(answers, found, strict=True)]
        return answers

    def put(self, keys: Sequence[EntryKeys], entries: Sequence[int]) -> list[PutStatus]:
        _check(self.buffer, keys, entries)
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
                (key, self._raw(c, entry).tobytes())
                for c, (key, here) in enumerate(zip(entry_keys, present, strict=True))
                if not (here and here[0])
            ]
            statuses.append(
                self.backend._write(missing, entry_keys) if missing else PutStatus.EXISTED
            )
        return statuses + [refusal] * (len(keys) - admitted)

    def get(self, keys: Sequence[EntryKeys], entries: Sequence[int]) -> list[GetStatus]:
        _check(self.buffer, keys, entries)
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
            if status is GetStatus.LOADED:  # every component arrived whole: only now write
                for component, payload in enumerate(payloads):
                    self._raw(component, entry)[...] = np.frombuffer(payload, dtype=np.uint8)
            statuses.append(status)
        return statuses + [GetStatus.FAILED] * (len(keys) - admitted)

    def release(self) -> None:
        """Nothing is registered with an object store."""


class MooncakeSideIO:
    """Side objects through a :class:`MooncakeBackend`'s client, zero-copy: each component tensor of
    the host buffer is registered once; an object is one entry's run of bytes in it."""

    def __init__(self, backend: MooncakeBackend, buffer: SideBuffer) -> None:
        self.backend = backend
        self.buffer = buffer
        self.sizes = buffer.spec.component_bytes()
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
        ptrs = [
            base + entry * size
            for entry in entries
            for base, size in zip(self._bases, self.sizes, strict=True)
        ]
        return ptrs, list(self.sizes) * len(entries)

    def present(self, keys: Sequence[EntryKeys]) -> list[bool]:
        _check(self.buffer, keys, None)
        if not keys:
            return []
        width = len(self.sizes)
        codes = self.backend._is_exist(self._flat(keys))
        self.backend._count_errors("exists", codes)
        return [
            all(code == 1 for code in codes[i * width : (i + 1) * width]) for i in range(len(keys))
        ]

    def put(self, keys: Sequence[EntryKeys], entries: Sequence[int]) -> list[PutStatus]:
        _check(self.buffer, keys, entries)
        if not self.backend.writer:
            return [PutStatus.SKIPPED] * len(keys)
        flat = self._flat(keys)
        ptrs, sizes = self._regions(entries)

        def write(todo: list[int]) -> list[int]:
            try:
                return self.backend.client.batch_put_from(
                    [flat[i] for i in todo], [ptrs[i] for i in todo], [sizes[i] for i in todo]
                )
            except StoreUnavailable:
                return [RPC_FAIL] * len(todo)

        statuses, _ = self.backend.put_objects(flat, len(self.sizes), write)
        return statuses

    def get(self, keys: Sequence[EntryKeys], entries: Sequence[int]) -> list[GetStatus]:
        _check(self.buffer, keys, entries)
        if not keys:
            return []
        ptrs, sizes = self._regions(entries)
        try:
            codes = self.backend.client.batch_get_into(self._flat(keys), ptrs, sizes)
        except StoreUnavailable:
            codes = [RPC_FAIL] * len(ptrs)
        return self.backend.settle_gets(codes, self.sizes)

    def release(self) -> None:
        self._release()


def _release_all(client: MooncakeClient, bases: list[int]) -> None:
    """Drop the registrations of ``bases`` (deferred to the client's next call: finalizer-safe)."""
    while bases:
        client.release_buffer_later(bases.pop())


def side_io(backend: object, buffer: SideBuffer) -> SideIO:
    """The side-object mover of ``backend`` for ``buffer`` (a host buffer)."""
    if buffer.device.type != "cpu":
        raise MisuseError(f"side_io: {buffer.name!r} is not a host buffer")
    if isinstance(backend, MooncakeBackend):
        return MooncakeSideIO(backend, buffer)
    if isinstance(backend, ObjectBackend):
        return ObjectSideIO(backend, buffer)
    raise MisuseError(f"side_io: no side-object support for {type(backend).__name__}")


def present_all(asks: Sequence[tuple[SideIO, Sequence[EntryKeys]]]) -> list[list[bool]]:
    """:meth:`SideIO.present` for several pools at once: one answer list per ``(io, keys)``. Pools
    on the same Mooncake backend are asked in **one** ``batch_is_exist`` (one round trip for every
    side pool instead of one each); others pool by pool."""
    answers: list[list[bool] | None] = [None] * len(asks)
    shared: dict[int, list[int]] = {}
    for index, (io, _keys) in enumerate(asks):
        if isinstance(io, MooncakeSideIO):
            shared.setdefault(id(io.backend), []).append(index)
        else:
            answers[index] = io.present(asks[index][1])
    for indices in shared.values():
        flat: list[StoreKey] = []
        for index in indices:
            io, keys = asks[index]
            _check(io.buffer, keys, None)
            flat += [key for entry_keys in keys for key in entry_keys]
        first = asks[indices[0]][0]
        assert isinstance(first, MooncakeSideIO)
        codes = first.backend._is_exist(flat) if flat else []
        first.backend._count_errors("exists", codes)
        offset = 0
        for index in indices:
            io, keys = asks[index]
            width = len(io.buffer.spec.components)
            answers[index] = [
                all(code == 1 for code in codes[offset + i * width : offset + (i + 1) * width])
                for i in range(len(keys))
            ]
            offset += width * len(keys)
    return [answer if answer is not None else [] for answer in answers]
