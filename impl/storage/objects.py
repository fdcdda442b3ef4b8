"""A :class:`~kvstrata.impl.storage.base.StorageBackend` over a store of whole objects: the page ↔
object plumbing shared by the in-memory and the file backends.

A page of the host pool is stored as one object per component of its key space
(:func:`~kvstrata.impl.storage.base.page_objects`: ``k`` and ``v`` for MHA, ``latent`` for MLA under key
schema 1; one ``page`` object under schema 2), keyed by ``KeySpace.page_keys`` and holding its planes of
the page in **canonical order** ``[planes, layers, page_size, heads, head_dim]`` (that slice of
:meth:`KVPool.canonical`), whatever the host layout. The byte order of an object is thus fixed by its key
alone, so instances with different host layouts share objects bit for bit (SPEC §10: sharing depends
on model identity and shard only). For ``page_first_direct`` this is exactly
:meth:`HostKVPool.page_slab` (no copy); a ``page_first`` pool, whose slab is ``[page_size, layers,
heads, head_dim]``, pays one strided copy per object in each direction.

A subclass supplies three object-level operations on its store and nothing else:

- ``_present(keys, nbytes)``: which keys are visible, complete objects of ``nbytes`` bytes (``None``
  when the store cannot say);
- ``_write(objects, page_keys)``: write the missing objects of one page: ``STORED`` once the store
  accepted every one of them; room is made for all of them at once, never by evicting one of
  ``page_keys``, or the answer is ``FULL`` with nothing evicted;
- ``_read(keys, nbytes)``: every object's bytes, or the :class:`GetStatus` of the miss.

This class owns the contract of ``base``: misuse checks before any store access (so misuse stores
nothing); exists-then-put-missing-then-confirm (an accepted write counts as ``STORED`` only if a
reader sees every object of the page right after: a store may accept a put and show it later, or
never; such a page is ``FAILED``, counted in ``puts_unconfirmed``); ``writer=False`` → ``SKIPPED``; a
host slot written only when every component of its page arrived complete (a page that misses leaves
its slot untouched, which is stronger than the contract's "unspecified"); and the counters.

Design: page-at-a-time calls keep a page's objects together (room is made for all of them at once and a
read verifies all of them before any byte reaches the slot). That suits stores whose calls are cheap (a
dict, a file system); a networked store wants many pages per round trip and is better off implementing
the ``StorageBackend`` protocol directly.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Sequence
from typing import TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.impl.errors import ConfigError, MisuseError
from kvstrata.impl.pools.host import HostKVPool
from kvstrata.impl.storage.base import (
    GetStatus,
    PageObject,
    PutStatus,
    check_attachable,
    check_batch,
    page_objects,
)
from kvstrata.impl.storage.counters import BackendCounters
from kvstrata.model.keys import KeySpace, KVKind, Namespace, PageHash, StoreKey

__all__ = ["ObjectBackend", "Op", "Payload"]

Payload: TypeAlias = "bytes | bytearray | memoryview"
"""The bytes of one object as a store hands them over (``len`` is the byte count)."""


class Op(enum.Enum):
    """The three store calls of a backend (named by fault injection)."""

    EXISTS = "exists"
    PUT = "put"
    GET = "get"


class ObjectBackend(abc.ABC):
    """A backend whose store holds one object per page component.

    Invariants: store keys come only from ``keyspace.page_keys``; every public call either raises a
    :class:`MisuseError` before touching the store or returns statuses (store trouble never raises);
    ``counters`` counts every page a ``put``/``get`` returned.
    """

    name: str
    """The backend kind ("memory", "file"): set by each subclass."""
    keyspace: KeySpace
    writer: bool
    counters: BackendCounters

    def __init__(self, keyspace: KeySpace, *, writer: bool = True) -> None:
        who = type(self).__name__
        if not isinstance(keyspace, KeySpace):
            raise MisuseError(f"{who}.keyspace: expected a KeySpace, got {keyspace!r}")
        if keyspace.model.kind not in (KVKind.MHA, KVKind.MLA):
            raise ConfigError(
                f"{who}.keyspace: a page backend stores KV pages (MHA or MLA), "
                f"got kind {keyspace.model.kind.value!r}"
            )
        if not isinstance(writer, bool):
            raise ConfigError(f"{who}.writer: expected a bool, got {writer!r}")
        self.keyspace = keyspace
        self.writer = writer
        self.counters = BackendCounters()
        self._objects: tuple[PageObject, ...] = page_objects(keyspace)
        self._host: HostKVPool | None = None
        self._object_nbytes = 0
        self._closed = False

    # ------------------------------------------------------------------------------- store operations
    @abc.abstractmethod
    def _present(self, keys: Sequence[StoreKey], nbytes: int) -> list[bool] | None:
        """Per key: is it a visible object of exactly ``nbytes`` payload bytes? ``None``: unsure."""

    @abc.abstractmethod
    def _write(
        self, objects: Sequence[tuple[StoreKey, Payload]], page_keys: Sequence[StoreKey]
    ) -> PutStatus:
        """Write ``objects`` (the missing ones of one page): ``STORED``, ``FULL`` or ``FAILED``."""

    @abc.abstractmethod
    def _read(self, keys: Sequence[StoreKey], nbytes: int) -> list[Payload] | GetStatus:
        """The payload of every key (each ``nbytes`` long), or why the page is a miss."""

    def _admit(self, op: Op, pages: int) -> tuple[int, PutStatus]:
        """How many of a call's ``pages``, from the first, reach the store, and what a put of each of
        the others returns (a get of one is ``FAILED``; ``exists`` stops before it).

        Real stores admit everything; a test backend overrides this to inject faults."""
        return pages, PutStatus.FAILED

    def _close_store(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release what the store holds for this client (called once by :meth:`close`)."""

    # --------------------------------------------------------------------------------------- interface
    def attach(self, host: HostKVPool) -> None:
        """Bind to ``host``. :class:`ConfigError` for a ``layer_first`` pool or one whose pages are not
        this key space's (kind, page size); :class:`MisuseError` when already bound to another pool."""
        self._check_open("attach")
        host = check_attachable(host, self.name)
        model, shape = self.keyspace.model, host.shape
        if shape.kind is not model.kind or shape.page_size != model.page_size:
            raise ConfigError(
                f"{self.name}: the host pool holds {shape.kind.value} pages of {shape.page_size} "
                f"tokens but the key space names {model.kind.value} pages of {model.page_size}"
            )
        if self._host is not None and self._host is not host:
            raise MisuseError(f"{self.name}: already attached to another host pool")
        self._host = host
        self._object_nbytes = shape.bytes_per_page // len(self._objects)

    def exists(self, namespace: Namespace, pages: Sequence[PageHash]) -> int:
        """How many pages, from the first, have every component object in the store."""
        self._checked(namespace, pages, None, Op.EXISTS)
        admitted, _ = self._admit(Op.EXISTS, len(pages))
        count = 0
        for page in pages[:admitted]:
            present = self._present(self.keyspace.page_keys(namespace, page), self._object_nbytes)
            if present is None or not all(present):
                break
            count += 1
        return count

    def put(
        self, namespace: Namespace, pages: Sequence[PageHash], host_indices: Sequence[int]
    ) -> list[PutStatus]:
        """Store each page from its host slot, writing only its missing component objects."""
        host = self._checked(namespace, pages, host_indices, Op.PUT)
        if not self.writer:
            statuses = [PutStatus.SKIPPED] * len(pages)
            self.counters.record_puts(statuses)
            return statuses
        admitted, refusal = self._admit(Op.PUT, len(pages))
        statuses, written = [], 0
        for page, index in zip(pages[:admitted], host_indices[:admitted], strict=True):
            status, nbytes = self._put_page(host, namespace, page, index)
            statuses.append(status)
            written += nbytes
        statuses += [refusal] * (len(pages) - admitted)
        self.counters.record_puts(statuses, written)
        return statuses

    def get(
        self, namespace: Namespace, pages: Sequence[PageHash], host_indices: Sequence[int]
    ) -> list[GetStatus]:
        """Read each page into its host slot; a slot is written only for a ``LOADED`` page."""
        host = self._checked(namespace, pages, host_indices, Op.GET)
        admitted, _ = self._admit(Op.GET, len(pages))
        statuses, read = [], 0
        for page, index in zip(pages[:admitted], host_indices[:admitted], strict=True):
            loaded = self._read(self.keyspace.page_keys(namespace, page), self._object_nbytes)
            if isinstance(loaded, GetStatus):
                statuses.append(loaded)
                continue
            for obj, payload in zip(self._objects, loaded, strict=True):
                target = _object_view(host, obj, index)
                target[...] = np.frombuffer(payload, dtype=np.uint8).reshape(target.shape)
                read += self._object_nbytes
            statuses.append(GetStatus.LOADED)
        statuses += [GetStatus.FAILED] * (len(pages) - admitted)
        self.counters.record_gets(statuses, read)
        return statuses

    def close(self) -> None:
        """Stop serving calls (every later call is a :class:`MisuseError`). Idempotent; objects in
        the store stay."""
        if not self._closed:
            self._closed = True
            self._host = None
            self._close_store()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def host(self) -> HostKVPool | None:
        """The attached host pool (``None`` before :meth:`attach` and after :meth:`close`)."""
        return self._host

    # ---------------------------------------------------------------------------------------- helpers
    def _put_page(
        self, host: HostKVPool, namespace: Namespace, page: PageHash, index: int
    ) -> tuple[PutStatus, int]:
        keys = self.keyspace.page_keys(namespace, page)
        present = self._present(keys, self._object_nbytes)
        if present is None:
            return PutStatus.FAILED, 0
        missing = [
            (key, np.ascontiguousarray(_object_view(host, obj, index)).reshape(-1).data)
            for key, obj, here in zip(keys, self._objects, present, strict=True)
            if not here
        ]
        if not missing:
            return PutStatus.EXISTED, 0
        status = self._write(missing, keys)
        if status is not PutStatus.STORED:
            return status, 0
        confirmed = self._present(keys, self._object_nbytes)
        if confirmed is None or not all(confirmed):  # accepted, but no reader sees it (yet)
            self.counters.add(puts_unconfirmed=1)
            return PutStatus.FAILED, 0
        return status, len(missing) * self._object_nbytes

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise MisuseError(f"{self.name}.{op}: the backend is closed")

    def _checked(
        self,
        namespace: Namespace,
        pages: Sequence[PageHash],
        host_indices: Sequence[int] | None,
        op: Op,
    ) -> HostKVPool:
        """The attached host pool, after every misuse check of ``base.check_batch``."""
        self._check_open(op.value)
        who = f"{self.name}.{op.value}"
        for what, value in (("pages", pages), ("host_indices", host_indices)):
            if value is not None and (not isinstance(value, Sequence) or isinstance(value, str)):
                raise MisuseError(f"{who}: {what} must be a sequence, got {type(value).__name__}")
        check_batch(self._host, namespace, pages, host_indices, who)
        assert self._host is not None  # check_batch refuses an unattached backend
        return self._host

    @property
    def object_names(self) -> tuple[str, ...]:
        """The component names of one page, in plane order."""
        return tuple(obj.component for obj in self._objects)

    def _component_keys(
        self, namespace: Namespace, page: PageHash, component: str | None
    ) -> tuple[StoreKey, ...]:
        """The keys of ``page`` (only ``component``'s when given), for the test hooks."""
        if not isinstance(namespace, Namespace) or not isinstance(page, PageHash):
            raise MisuseError(f"{self.name}: expected a Namespace and a PageHash")
        keys = self.keyspace.page_keys(namespace, page)
        if component is None:
            return keys
        if component not in self.object_names:
            raise MisuseError(
                f"{self.name}: no component {component!r} in a page of {self.object_names}"
            )
        return (keys[self.object_names.index(component)],)


def _object_view(host: HostKVPool, obj: PageObject, index: int) -> npt.NDArray[np.uint8]:
    """The bytes of one store object of one page of ``host`` in canonical order ``[planes, L,
    page_size, H, D * itemsize]`` (its planes only), as a (possibly strided) uint8 array over the
    pool's memory: no copy, writable."""
    planes = obj.planes
    return host.canonical()[planes.start : planes.stop, :, index].view(torch.uint8).numpy()
