"""Moving page objects between a host pool and Mooncake: zero-copy where the layout allows it, through
a registered staging buffer where it does not.

A store object holds its planes of one page in **canonical order** ``[planes, layers, page_size, heads,
head_dim]`` (:class:`~kvstrata.impl.storage.base.PageObject`: one plane under key schema 1, the whole
page under schema 2), whatever the host layout (the rule every kvstrata backend keeps: the object's
bytes are fixed by its key alone, so instances with different host layouts share objects bit for bit,
SPEC §10).

- ``page_first_direct`` (``[planes, P, L, page, H, D]``) and ``page_major`` (``[P, planes, L, page, H,
  D]``): each plane of a page is a contiguous run of the host buffer, so :class:`DirectSlabs` hands
  Mooncake pointers into it (registered once). An object whose runs are adjacent (a schema-1 object;
  a schema-2 page of ``page_major``) is one range (``batch_put_from`` / ``batch_get_into``); a
  schema-2 page of ``page_first_direct`` is its K and V runs, moved as one object by the native
  multi-buffer calls (``batch_put_parts`` / ``batch_get_parts``);
- ``page_first`` (``[planes, N, L, H, D]``): a slab is ``[page, L, H, D]``, the transpose of the object,
  so :class:`StagedSlabs` gathers objects into a registered staging buffer before a put and scatters
  them out of it after a get, in chunks of at most the staging capacity: one gather-and-transpose
  copy per object kind per chunk (``index_select`` from a permuted view of the pool straight into
  the staging slots; ``index_copy_`` back), issue 20 item 4.

Both answer with the native per-object codes of the batch (``>= 0`` bytes / success, negative
``ErrorCode``); a client that became unusable answers ``RPC_FAIL`` for the objects it did not move.
A get writes a host slot only through the calls the caller makes: :class:`DirectSlabs` lets Mooncake
write the slots directly (bytes of a page that misses are unspecified, as the contract allows);
:class:`StagedSlabs` copies a page into its slot only when every component arrived whole.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Final, Protocol

import attrs
import torch

from kvstrata.impl.errors import ConfigError, StoreUnavailable
from kvstrata.impl.pools.host import HostKVPool
from kvstrata.impl.pools.shape import HostLayout
from kvstrata.impl.storage.base import PageObject
from kvstrata.impl.storage.mooncake.client import Keys, MooncakeClient

__all__ = ["RPC_FAIL", "DirectSlabs", "SlabIO", "StagedSlabs", "slab_io"]

RPC_FAIL: Final = -900
"""The code for objects a call could not move because the client is closed or failed."""

Obj = tuple[int, int]
"""One object: (host page index, the object's position among the page's objects)."""


class SlabIO(Protocol):
    """How one attached host pool's objects reach the store."""

    size: int
    """Bytes of one object."""

    def put(self, keys: Keys, objects: Sequence[Obj]) -> list[int]:
        """``batch_put_from`` of each object under its key; one code per object."""

    def get(self, keys: Keys, objects: Sequence[Obj], width: int) -> list[int]:
        """``batch_get_into`` of each object; ``objects`` are whole pages of ``width`` components
        each, page-major. One code per object."""

    def release(self) -> None:
        """Drop the registrations (idempotent; deferred, so safe from a finalizer)."""


class DirectSlabs:
    """Zero-copy: the host buffer is registered once; an object is its planes' runs of its page."""

    def __init__(
        self, host: HostKVPool, client: MooncakeClient, objects: Sequence[PageObject]
    ) -> None:
        canonical = host.canonical()  # [planes, L, P, page, H, D], a view of the buffer
        itemsize = host.buffer.element_size()
        self.client = client
        self.base = host.buffer.data_ptr()
        self.nbytes = host.buffer.numel() * itemsize
        run = canonical[0, :, 0].numel() * itemsize  # one plane of one page
        last = host.num_pages - 1
        first_run = canonical[0, :, 0].data_ptr()
        self.page_stride = (canonical[0, :, last].data_ptr() - first_run) // max(last, 1)
        self.parts: list[list[tuple[int, int]]] = []  # per object: (offset at page 0, bytes)
        for obj in objects:
            runs: list[tuple[int, int]] = []
            for plane in obj.planes:
                for page in {0, last}:
                    slab = canonical[plane, :, page]
                    if not slab.is_contiguous() or slab.data_ptr() != (
                        canonical[plane, :, 0].data_ptr() + page * self.page_stride
                    ):
                        raise ConfigError(
                            "MooncakeBackend.attach: a page of one plane is not one contiguous run "
                            "of the host pool at a fixed page stride"
                        )
                offset = canonical[plane, :, 0].data_ptr() - self.base
                if runs and runs[-1][0] + runs[-1][1] == offset:  # adjacent: one range
                    runs[-1] = (runs[-1][0], runs[-1][1] + run)
                else:
                    runs.append((offset, run))
            self.parts.append(runs)
        self.size = run * len(objects[0].planes)
        self.single = all(len(runs) == 1 for runs in self.parts)
        self.first_offsets = [runs[0][0] for runs in self.parts]  # per object, at page 0
        client.register_buffer(self.base, self.nbytes)
        self._registered = True

    def _ranges(self, objects: Sequence[Obj]) -> tuple[list[list[int]], list[list[int]]]:
        """Per object, the pointers and sizes of its runs."""
        ptrs, sizes = [], []
        for index, number in objects:
            runs = self.parts[number]
            at = self.base + index * self.page_stride
            ptrs.append([at + offset for offset, _ in runs])
            sizes.append([size for _, size in runs])
        return ptrs, sizes

    def _move(self, keys: Keys, objects: Sequence[Obj], put: bool) -> list[int]:
        try:
            if self.single:
                base, stride, first = self.base, self.page_stride, self.first_offsets
                ptrs = [base + index * stride + first[n] for index, n in objects]
                move = self.client.batch_put_from if put else self.client.batch_get_into
                return move(keys, ptrs, [self.size] * len(ptrs))
            ptr_lists, size_lists = self._ranges(objects)
            parts = self.client.batch_put_parts if put else self.client.batch_get_parts
            return parts(keys, ptr_lists, size_lists)
        except StoreUnavailable:
            return [RPC_FAIL] * len(objects)

    def put(self, keys: Keys, objects: Sequence[Obj]) -> list[int]:
        return self._move(keys, objects, put=True)

    def get(self, keys: Keys, objects: Sequence[Obj], width: int) -> list[int]:
        return self._move(keys, objects, put=False)

    def release(self) -> None:
        if self._registered:
            self._registered = False
            self.client.release_buffer_later(self.base)


@attrs.define(eq=False)
class _StagingArea:
    """One registered staging buffer of ``capacity`` object slots and the lock its user holds
    from the first copy into it to the last copy out of it (one transfer at a time)."""

    buffer: torch.Tensor  # uint8, capacity * object size bytes
    slots: torch.Tensor  # the same bytes as [slot, planes, L, page, H, D]
    capacity: int
    lock: threading.Lock = attrs.Factory(threading.Lock)

    @property
    def base(self) -> int:
        return int(self.buffer.data_ptr())


class StagedSlabs:
    """Objects pass through registered staging buffers, copied to and from the host pool's
    canonical view. Puts and gets have a staging area each (half of ``staging_bytes``, at least one
    page's worth), since the read and write lanes run on threads of their own: a get landing in the
    slots a put is sending from would store another page's bytes under the put's keys, which no
    later put can replace (the first bytes of a key stay). Invariant: a staging slot holds the
    bytes of one transfer, from the gather before the call to the scatter after it (the area's
    lock is held throughout)."""

    def __init__(
        self,
        host: HostKVPool,
        client: MooncakeClient,
        staging_bytes: int,
        objects: Sequence[PageObject],
    ) -> None:
        shape = host.shape
        self.client = client
        self.canonical = host.canonical()  # [planes, L, P, page, H, D], a view of the pool
        self.planes = [obj.planes for obj in objects]
        self.size = shape.bytes_per_page // len(objects)
        capacity = max(len(objects), staging_bytes // 2 // self.size)
        object_shape = (len(self.planes[0]), shape.layers, shape.page_size, shape.heads)
        self._areas: list[_StagingArea] = []
        for _ in ("put", "get"):
            buffer = torch.empty(capacity * self.size, dtype=torch.uint8)
            slots = buffer.view(shape.dtype).view(capacity, *object_shape, shape.head_dim)
            area = _StagingArea(buffer, slots, capacity)
            client.register_buffer(area.base, capacity * self.size)
            self._areas.append(area)
        self._put_area, self._get_area = self._areas
        self._registered = True

    @property
    def capacity(self) -> int:
        """Objects one call moves at most (each direction's staging slots)."""
        return self._put_area.capacity

    def _pool(self, number: int) -> torch.Tensor:
        """Object ``number``'s planes of every page of the pool, as a view ``[P, planes, L, page,
        H, D]``: one index along dimension 0 is that object of one page."""
        planes = self.planes[number]
        return self.canonical[planes.start : planes.stop].permute(2, 0, 1, 3, 4, 5)

    def _slots(
        self, area: _StagingArea, chunk: Sequence[Obj]
    ) -> tuple[list[int], list[tuple[int, int, list[int]]]]:
        """Slots of ``area`` for ``chunk``: the objects of one kind take consecutive slots, so
        that one ``index_select`` (put) or ``index_copy_`` (get) moves all of them. Per entry its
        slot's pointer, and per kind ``(number, first slot, positions in chunk)``."""
        kinds: dict[int, list[int]] = {}
        for position, (_, number) in enumerate(chunk):
            kinds.setdefault(number, []).append(position)
        ptrs, runs, first = [0] * len(chunk), [], 0
        base = area.base
        for number, positions in sorted(kinds.items()):
            for offset, position in enumerate(positions):
                ptrs[position] = base + (first + offset) * self.size
            runs.append((number, first, positions))
            first += len(positions)
        return ptrs, runs

    def put(self, keys: Keys, objects: Sequence[Obj]) -> list[int]:
        area = self._put_area
        codes: list[int] = []
        with area.lock:
            for start in range(0, len(objects), area.capacity):
                chunk = objects[start : start + area.capacity]
                ptrs, runs = self._slots(area, chunk)
                for number, first, positions in runs:  # one gather-transpose copy per kind
                    pages = torch.tensor([chunk[p][0] for p in positions])
                    out = area.slots[first : first + len(positions)]
                    torch.index_select(self._pool(number), 0, pages, out=out)
                try:
                    codes += self.client.batch_put_from(
                        keys[start : start + len(chunk)], ptrs, [self.size] * len(chunk)
                    )
                except StoreUnavailable:
                    codes += [RPC_FAIL] * (len(objects) - start)
                    break
        return codes

    def get(self, keys: Keys, objects: Sequence[Obj], width: int) -> list[int]:
        area = self._get_area
        codes: list[int] = []
        step = area.capacity // width * width  # whole pages per chunk
        with area.lock:
            for start in range(0, len(objects), step):
                chunk = objects[start : start + step]
                ptrs, runs = self._slots(area, chunk)
                try:
                    got = self.client.batch_get_into(
                        keys[start : start + len(chunk)], ptrs, [self.size] * len(chunk)
                    )
                except StoreUnavailable:
                    codes += [RPC_FAIL] * (len(objects) - start)
                    break
                self._scatter(area, chunk, runs, got, width)
                codes += got
        return codes

    def _scatter(
        self,
        area: _StagingArea,
        chunk: Sequence[Obj],
        runs: list[tuple[int, int, list[int]]],
        got: list[int],
        width: int,
    ) -> None:
        """Copy into the pool the pages of ``chunk`` whose every object arrived whole."""
        whole = {
            position
            for first in range(0, len(chunk), width)
            if all(code == self.size for code in got[first : first + width])
            for position in range(first, first + width)
        }
        for number, first, positions in runs:  # only pages whose every object arrived
            keep = [k for k, position in enumerate(positions) if position in whole]
            if not keep:
                continue
            if len(keep) == len(positions):
                staged = area.slots[first : first + len(positions)]
            else:
                staged = area.slots[torch.tensor([first + k for k in keep])]
            pages = torch.tensor([chunk[positions[k]][0] for k in keep])
            self._pool(number).index_copy_(0, pages, staged)

    def release(self) -> None:
        if self._registered:
            self._registered = False
            for area in self._areas:
                self.client.release_buffer_later(area.base)


def slab_io(
    host: HostKVPool, client: MooncakeClient, staging_bytes: int, objects: Sequence[PageObject]
) -> SlabIO:
    """The object mover for ``host``'s layout (registering what it needs with ``client``)."""
    if host.layout in (HostLayout.PAGE_FIRST_DIRECT, HostLayout.PAGE_MAJOR):
        return DirectSlabs(host, client, objects)
    return StagedSlabs(host, client, staging_bytes, objects)
