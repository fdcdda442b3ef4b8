"""Moving page objects between a host pool and Mooncake: zero-copy where the layout allows it, through
a registered staging buffer where it does not.

A store object holds one plane of one page in **canonical order** ``[layers, page_size, heads,
head_dim]``, whatever the host layout (the rule every kvstrata backend keeps: the object's bytes are
fixed by its key alone, so instances with different host layouts share objects bit for bit, SPEC §10).

- ``page_first_direct`` (``[planes, P, L, page, H, D]``): a page slab *is* the canonical object, so
  :class:`DirectSlabs` hands Mooncake pointers into the host buffer (registered once);
- ``page_first`` (``[planes, N, L, H, D]``): a slab is ``[page, L, H, D]``, the transpose of the object,
  so :class:`StagedSlabs` gathers objects into a registered staging buffer before a put and scatters
  them out of it after a get, in chunks of at most the staging capacity (one vectorised copy per plane
  per chunk).

Both answer with the native per-object codes of the batch (``>= 0`` bytes / success, negative
``ErrorCode``); a client that became unusable answers ``RPC_FAIL`` for the objects it did not move.
A get writes a host slot only through the calls the caller makes: :class:`DirectSlabs` lets Mooncake
write the slots directly (bytes of a page that misses are unspecified, as the contract allows);
:class:`StagedSlabs` copies a page into its slot only when every component arrived whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Protocol

import torch

from kvstrata.impl.errors import ConfigError, StoreUnavailable
from kvstrata.impl.pools.host import HostKVPool
from kvstrata.impl.pools.shape import HostLayout
from kvstrata.impl.storage.mooncake.client import MooncakeClient
from kvstrata.model.keys import StoreKey

__all__ = ["RPC_FAIL", "DirectSlabs", "SlabIO", "StagedSlabs", "slab_io"]

RPC_FAIL: Final = -900
"""The code for objects a call could not move because the client is closed or failed."""

Obj = tuple[int, int]
"""One object: (host page index, plane)."""


class SlabIO(Protocol):
    """How one attached host pool's objects reach the store."""

    size: int
    """Bytes of one object."""

    def put(self, keys: Sequence[StoreKey], objects: Sequence[Obj]) -> list[int]:
        """``batch_put_from`` of each object under its key; one code per object."""

    def get(self, keys: Sequence[StoreKey], objects: Sequence[Obj], width: int) -> list[int]:
        """``batch_get_into`` of each object; ``objects`` are whole pages of ``width`` components
        each, page-major. One code per object."""

    def release(self) -> None:
        """Drop the registrations (idempotent; deferred, so safe from a finalizer)."""


class DirectSlabs:
    """Zero-copy: the host buffer is registered once; an object is its page slab."""

    def __init__(self, host: HostKVPool, client: MooncakeClient) -> None:
        native = host.native()  # [planes, P, inner], contiguous
        itemsize = native.element_size()
        self.client = client
        self.base = host.buffer.data_ptr()
        self.nbytes = host.buffer.numel() * host.buffer.element_size()
        self.plane_stride = native.stride(0) * itemsize
        self.page_stride = native.stride(1) * itemsize
        self.size = host.page_slab(0, 0).numel() * itemsize
        for plane in range(host.shape.planes):
            for page in {0, host.num_pages - 1}:
                slab = host.page_slab(plane, page)
                canonical = host.canonical()[plane, :, page]
                if (
                    not slab.is_contiguous()
                    or slab.data_ptr() != self.pointer(plane, page)
                    or slab.numel() * itemsize != self.size
                    or canonical.data_ptr() != slab.data_ptr()
                    or not canonical.is_contiguous()
                ):
                    raise ConfigError(
                        "MooncakeBackend.attach: the host pool's page slabs are not its canonical "
                        "page objects laid out as [planes, pages, bytes]"
                    )
        client.register_buffer(self.base, self.nbytes)
        self._registered = True

    def pointer(self, plane: int, page: int) -> int:
        return self.base + plane * self.plane_stride + page * self.page_stride

    def put(self, keys: Sequence[StoreKey], objects: Sequence[Obj]) -> list[int]:
        ptrs = [self.pointer(plane, index) for index, plane in objects]
        try:
            return self.client.batch_put_from(keys, ptrs, [self.size] * len(ptrs))
        except StoreUnavailable:
            return [RPC_FAIL] * len(ptrs)

    def get(self, keys: Sequence[StoreKey], objects: Sequence[Obj], width: int) -> list[int]:
        ptrs = [self.pointer(plane, index) for index, plane in objects]
        try:
            return self.client.batch_get_into(keys, ptrs, [self.size] * len(ptrs))
        except StoreUnavailable:
            return [RPC_FAIL] * len(ptrs)

    def release(self) -> None:
        if self._registered:
            self._registered = False
            self.client.release_buffer_later(self.base)


class StagedSlabs:
    """Objects pass through a registered staging buffer of ``capacity`` objects (at least one
    page's worth), copied to and from the host pool's canonical view."""

    def __init__(self, host: HostKVPool, client: MooncakeClient, staging_bytes: int) -> None:
        shape = host.shape
        self.client = client
        self.canonical = host.canonical()  # [planes, L, P, page, H, D], a view of the pool
        object_shape = (shape.layers, shape.page_size, shape.heads, shape.head_dim)
        self.size = shape.bytes_per_page // shape.planes
        self.capacity = max(shape.planes, staging_bytes // self.size)
        self.staging = torch.empty(self.capacity * self.size, dtype=torch.uint8)
        self.objects = self.staging.view(shape.dtype).view(self.capacity, *object_shape)
        self.base = self.staging.data_ptr()
        client.register_buffer(self.base, self.capacity * self.size)
        self._registered = True

    def _ptrs(self, count: int) -> list[int]:
        return [self.base + slot * self.size for slot in range(count)]

    def put(self, keys: Sequence[StoreKey], objects: Sequence[Obj]) -> list[int]:
        codes: list[int] = []
        for start in range(0, len(objects), self.capacity):
            chunk = objects[start : start + self.capacity]
            for plane, slots, pages in _by_plane(chunk):
                self.objects[slots] = self.canonical[plane][:, pages].transpose(0, 1)
            try:
                codes += self.client.batch_put_from(
                    keys[start : start + len(chunk)],
                    self._ptrs(len(chunk)),
                    [self.size] * len(chunk),
                )
            except StoreUnavailable:
                codes += [RPC_FAIL] * (len(objects) - start)
                break
        return codes

    def get(self, keys: Sequence[StoreKey], objects: Sequence[Obj], width: int) -> list[int]:
        codes: list[int] = []
        step = self.capacity // width * width  # whole pages per chunk
        for start in range(0, len(objects), step):
            chunk = objects[start : start + step]
            try:
                got = self.client.batch_get_into(
                    keys[start : start + len(chunk)],
                    self._ptrs(len(chunk)),
                    [self.size] * len(chunk),
                )
            except StoreUnavailable:
                codes += [RPC_FAIL] * (len(objects) - start)
                break
            whole = [
                slot
                for first in range(0, len(chunk), width)
                if all(code == self.size for code in got[first : first + width])
                for slot in range(first, first + width)
            ]
            for plane, slots, pages in _by_plane([chunk[slot] for slot in whole], whole):
                self.canonical[plane][:, pages] = self.objects[slots].transpose(0, 1)
            codes += got
        return codes

    def release(self) -> None:
        if self._registered:
            self._registered = False
            self.client.release_buffer_later(self.base)


def _by_plane(
    objects: Sequence[Obj], slots: Sequence[int] | None = None
) -> list[tuple[int, list[int], list[int]]]:
    """``(plane, staging slots, host pages)`` for each plane among ``objects`` (slot ``i`` holds
    ``objects[i]`` unless ``slots`` says otherwise)."""
    groups: dict[int, tuple[list[int], list[int]]] = {}
    for position, (index, plane) in enumerate(objects):
        slot_list, pages = groups.setdefault(plane, ([], []))
        slot_list.append(position if slots is None else slots[position])
        pages.append(index)
    return [(plane, s, p) for plane, (s, p) in sorted(groups.items())]


def slab_io(host: HostKVPool, client: MooncakeClient, staging_bytes: int) -> SlabIO:
    """The object mover for ``host``'s layout (registering what it needs with ``client``)."""
    if host.layout is HostLayout.PAGE_FIRST_DIRECT:
        return DirectSlabs(host, client)
    return StagedSlabs(host, client, staging_bytes)
