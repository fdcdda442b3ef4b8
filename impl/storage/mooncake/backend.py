"""The L3 backend on a real Mooncake store: :class:`MooncakeBackend` (SPEC §4, §10; issue 4).

A page is the store objects of its key space (one per plane under key schema 1, one per page under
schema 2), in canonical order whatever the host layout (:mod:`.slabs`): with a ``page_first_direct``
or ``page_major`` host pool they are runs of the host buffer, moved zero-copy (the buffer is
registered once at :meth:`~MooncakeBackend.attach`); with ``page_first`` they pass through a
registered staging buffer of ``staging_bytes``.

Per batch (keys rendered as one :class:`RenderedKeys` batch), in Mooncake calls:

- ``exists``: one ``batch_is_exist`` over every object key of the pages;
- ``put``: one put of every object, then ``batch_is_exist`` of the pages just written (rc 0 does not
  mean readable: a put overlapping another writer's unfinished put of the key returns 0 at once,
  MOONCAKE.md §3.4); a page that cannot be confirmed is ``FAILED`` (retryable), never ``STORED``;
- ``get``: one ``batch_get_into`` (per staging chunk); ``LOADED`` only if every object arrived whole.

Replicated KV (MLA, ``Shard.replicated()``) is written by one rank: a backend built with
``writer=False`` answers ``SKIPPED`` for every page of a put without calling the store. Sharded KV is
written by every rank under its own shard in the key, so every rank's backend is a writer there (the
caller's choice, as for every backend: a non-writer's shard would simply never be written).

A page repeated in one put batch is written once, from its first occurrence; the later ones are
``EXISTED`` (or share its failure).

Store failures never raise: they are statuses, counted per page in :attr:`MooncakeBackend.counters`
(the :class:`~kvstrata.impl.storage.counters.BackendCounters` every backend keeps; ``io_errors`` is one
per failed object or call) and by kind in :attr:`MooncakeBackend.errors`, and logged once per burst.
Misuse raises :class:`MisuseError` before any store call (:func:`~kvstrata.impl.storage.base.check_batch`,
non-sequence arguments, any call after :meth:`~MooncakeBackend.close`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Final, TypeVar

from kvstrata.impl.errors import ConfigError, MisuseError, StoreUnavailable
from kvstrata.impl.kernels import join_keys
from kvstrata.impl.pools.host import HostKVPool
from kvstrata.impl.storage.base import (
    GetStatus,
    PutStatus,
    check_attachable,
    check_batch,
    page_objects,
)
from kvstrata.impl.storage.counters import BackendCounters
from kvstrata.impl.storage.mooncake.accounts import CallAccounts
from kvstrata.impl.storage.mooncake.client import ClientState, Keys, MooncakeClient
from kvstrata.impl.storage.mooncake.codes import ErrorKind, classify
from kvstrata.impl.storage.mooncake.config import MooncakeConfig, to_bytes
from kvstrata.impl.storage.mooncake.counters import ErrorCounters
from kvstrata.impl.storage.mooncake.slabs import RPC_FAIL, SlabIO, slab_io
from kvstrata.model.keys import KeySpace, KVKind, Namespace, PageHash, RenderedKeys

__all__ = ["MooncakeBackend"]

T = TypeVar("T")

EXISTS: Final = 1
DEFAULT_STAGING = 64 << 20


MAX_BATCH_OBJECTS = 1024
"""Objects per native batch call that moves bytes (see :meth:`MooncakeBackend._chunk`)."""
QUERY_BATCH_OBJECTS = 2048
"""Objects per ``batch_is_exist`` of :meth:`MooncakeBackend.exists`: a query moves no bytes (one
answered 16,384 keys right), so 1,024 two-object pages are one call, as a raw client's would be."""


class MooncakeBackend:
    """A :class:`~kvstrata.impl.storage.base.StorageBackend` on a Mooncake cluster.

    ``store`` is either a set-up :class:`MooncakeClient` (shared, not closed by :meth:`close`) or a
    :class:`MooncakeConfig` (the backend connects now, owns the client and closes it). ``pool`` names
    the key's pool (``"kv"``). ``staging_bytes`` bounds the staging buffers of a ``page_first`` host
    pool (half for puts, half for gets, each at least one page; a larger batch moves in chunks).

    ``exists_before_put`` (issue 20): ask ``batch_is_exist`` before a put and write only the objects
    the store lacks; a page all of whose objects were there is ``EXISTED``. Off by default: the
    master deduplicates a put of a key it holds without moving its bytes (about 0.05 ms for one key,
    0.13 to 0.18 ms for 16, ../shared/MOONCAKE.md §3.4), so one put of every object costs less than the
    extra round trip before each put. Without it a page is ``STORED`` whether or not the store held it
    already (``EXISTED`` is then never reported, and ``bytes_written`` counts what the store accepted,
    a deduplicated object included); the confirm after the put stays either way (a key another
    writer is still putting also answers 0: it is ``FAILED`` until a reader can see it).
    """

    name = "mooncake"

    def __init__(
        self,
        store: MooncakeClient | MooncakeConfig,
        keyspace: KeySpace,
        *,
        writer: bool = True,
        pool: str = "kv",
        staging_bytes: int | str = DEFAULT_STAGING,
        exists_before_put: bool = False,
    ) -> None:
        if not isinstance(keyspace, KeySpace):
            raise MisuseError(f"MooncakeBackend: expected a KeySpace, got {keyspace!r}")
        if keyspace.model.kind is KVKind.EMBEDDING:
            raise ConfigError("MooncakeBackend.keyspace: expected an MHA or MLA model identity")
        for name, flag in (("writer", writer), ("exists_before_put", exists_before_put)):
            if not isinstance(flag, bool):
                raise ConfigError(f"MooncakeBackend.{name}: expected a bool, got {flag!r}")
        if isinstance(store, MooncakeConfig):
            self.client = MooncakeClient(store).setup()
            self._owns_client = True
        elif isinstance(store, MooncakeClient):
            if store.state is not ClientState.READY:
                raise StoreUnavailable(f"MooncakeBackend: the client is {store.state.value}")
            self.client = store
            self._owns_client = False
        else:
            raise MisuseError(
                f"MooncakeBackend: expected a MooncakeClient or MooncakeConfig, got {store!r}"
            )
        self.staging_bytes = to_bytes(staging_bytes, "MooncakeBackend.staging_bytes")
        self.keyspace = keyspace
        self.writer = writer
        self.exists_before_put = exists_before_put
        self.pool = pool
        self.counters = BackendCounters()
        self.errors = ErrorCounters()
        self.accounts = CallAccounts(self.errors, self.counters)
        self._objects = page_objects(keyspace)
        self._host: HostKVPool | None = None
        self._slabs: SlabIO | None = None
        self._release: weakref.finalize[[], MooncakeBackend] | None = None
        self._closed = False

    # ------------------------------------------------------------------------------ lifecycle
    def attach(self, host: HostKVPool) -> None:
        """Register ``host``'s buffer with the client (once; attaching the same pool again is a
        no-op, another pool a :class:`MisuseError`)."""
        self._check_open("attach")
        host = check_attachable(host, "MooncakeBackend.attach")
        model = self.keyspace.model
        if host.shape.kind is not model.kind or host.shape.page_size != model.page_size:
            raise ConfigError(
                f"MooncakeBackend.attach: the host pool holds {host.shape.kind.value} pages of "
                f"{host.shape.page_size} tokens, the key space names {model.kind.value} pages of "
                f"{model.page_size}"
            )
        if self._host is host:
            return
        if self._host is not None:
            raise MisuseError("MooncakeBackend.attach: already attached to another host pool")
        slabs = slab_io(host, self.client, self.staging_bytes, self._objects)
        self._host, self._slabs = host, slabs
        # a backend dropped without close() must not leave its (soon freed) memory registered
        self._release = weakref.finalize(self, slabs.release)
        self._release.atexit = False

    def close(self) -> None:
        """Release the host buffer's registration and close an owned client (objects stay in the
        store: they live in the storage node's segment). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._release is not None:
            self._release()  # the registrations go at the client's next call (or its close)
        if self._owns_client:
            self.client.close()

    def __repr__(self) -> str:
        role = "writer" if self.writer else "reader"
        return f"MooncakeBackend({self.client!r}, {self.keyspace!r}, {role})"

    @property
    def outages(self) -> int:
        """Objects or calls that failed because the store was unreachable or timed out (only
        grows): the store link judges a call that raised it as a fault."""
        return self.errors.count(ErrorKind.UNAVAILABLE) + self.errors.count(ErrorKind.TIMEOUT)

    # ------------------------------------------------------------------------------- helpers
    def _check_open(self, operation: str) -> None:
        if self._closed:
            raise MisuseError(f"MooncakeBackend.{operation}: the backend is closed")

    def _checked(
        self,
        operation: str,
        namespace: Namespace,
        pages: Sequence[PageHash],
        host_indices: Sequence[int] | None,
    ) -> SlabIO:
        """Every misuse check, before any store call; the attached pool's object mover."""
        self._check_open(operation)
        who = f"MooncakeBackend.{operation}"
        for what, value in (("pages", pages), ("host_indices", host_indices)):
            if value is not None and (not isinstance(value, Sequence) or isinstance(value, str)):
                raise MisuseError(f"{who}: {what} must be a sequence, got {type(value).__name__}")
        check_batch(self._host, namespace, pages, host_indices, who)
        assert self._slabs is not None  # check_batch refuses an unattached backend
        return self._slabs

    def _keys(self, namespace: Namespace, pages: Sequence[PageHash]) -> RenderedKeys:
        """Every object key of every page, page-major, rendered as one batch."""
        return self.keyspace.rendered(namespace, pages, self.pool, join=join_keys)

    def _is_exist(self, keys: Keys) -> list[int]:
        """``batch_is_exist``; a client that is no longer usable answers -900 for every key."""
        try:
            return self.client.batch_is_exist(keys)
        except StoreUnavailable:
            return [RPC_FAIL] * len(keys)

    # ------------------------------------------------------------------------------- exists
    def _chunk(self, objects: int = MAX_BATCH_OBJECTS) -> int:
        """Pages per native batch call: Mooncake's batch transfers fail partly (TRANSFER_FAIL,
        some after a 60 s stall) beyond about 2,048 objects, measured with 0.3.13.post1."""
        return max(1, objects // len(self._objects))

    def exists(self, namespace: Namespace, pages: Sequence[PageHash]) -> int:
        """How many pages, from the first, have every component in the store; counting stops at
        the first page that is incomplete or that the store could not confirm."""
        chunk = self._chunk(QUERY_BATCH_OBJECTS)
        if not isinstance(pages, Sequence) or len(pages) <= chunk:
            return self._exists_chunk(namespace, pages)
        found = 0
        for start in range(0, len(pages), chunk):
            part = pages[start : start + chunk]
            hit = self._exists_chunk(namespace, part)
            found += hit
            if hit < len(part):
                break
        return found

    def _exists_chunk(self, namespace: Namespace, pages: Sequence[PageHash]) -> int:
        self._checked("exists", namespace, pages, None)
        if not pages:
            return 0
        codes = self._is_exist(self._keys(namespace, pages))
        hits = codes.count(EXISTS)  # counting small ints is about 1 µs; min() would be 17
        whole = hits == len(codes)
        if (
            whole
            or hits + codes.count(0) == len(codes)
            or not self.accounts.count_errors("exists", codes)  # no negative code among them
        ):
            self.errors.success("exists")
        if whole:
            return len(pages)
        first_miss = next(i for i, code in enumerate(codes) if code != EXISTS)
        return first_miss // len(self._objects)

    def probe(self, namespace: Namespace, page: PageHash) -> bool:
        """Whether the first object of ``page`` is in the store, in one single-key call (fast
        also against a dead master); an unreachable store counts as an outage and answers False."""
        self._checked("probe", namespace, [page], None)
        try:
            code = self.client.is_exist(self.keyspace.page_keys(namespace, page, self.pool)[0])
        except StoreUnavailable:
            code = RPC_FAIL
        if code < 0:
            self.accounts.count_errors("exists", [code])
            return False
        self.errors.success("exists")
        return code == EXISTS

    # ---------------------------------------------------------------------------------- put
    def put(
        self, namespace: Namespace, pages: Sequence[PageHash], host_indices: Sequence[int]
    ) -> list[PutStatus]:
        """Store each page from its host slot: put, confirm (``exists_before_put``: exists, put the
        missing components, confirm), in native batches of at most ``MAX_BATCH_OBJECTS`` objects."""
        return self._chunked("put", self._put_chunk, namespace, pages, host_indices)

    def _chunked(
        self,
        operation: str,
        run: Callable[[Namespace, Sequence[PageHash], Sequence[int]], list[T]],
        namespace: Namespace,
        pages: Sequence[PageHash],
        host_indices: Sequence[int],
    ) -> list[T]:
        """``run`` on native-batch-sized runs of the pages (everything checked first)."""
        chunk = self._chunk()
        if not isinstance(pages, Sequence) or len(pages) <= chunk:
            return run(namespace, pages, host_indices)
        self._checked(operation, namespace, pages, host_indices)
        return [
            status
            for start in range(0, len(pages), chunk)
            for status in run(
                namespace, pages[start : start + chunk], host_indices[start : start + chunk]
            )
        ]

    def _put_chunk(
        self, namespace: Namespace, pages: Sequence[PageHash], host_indices: Sequence[int]
    ) -> list[PutStatus]:
        slabs = self._checked("put", namespace, pages, host_indices)
        if not self.writer:
            statuses = [PutStatus.SKIPPED] * len(pages)
            self.counters.record_puts(statuses)
            return statuses
        first: dict[PageHash, int] = {}
        if len({page.digest for page in pages}) < len(pages):  # a page twice: written once
            for position, page in enumerate(pages):
                first.setdefault(page, position)
        unique = list(first.values()) if first else range(len(pages))
        keys = self._keys(namespace, [pages[i] for i in unique] if first else pages)
        indices = [host_indices[i] for i in unique] if first else host_indices
        width = len(self._objects)

        def write(todo: list[int]) -> list[int]:
            if len(todo) == len(keys):  # every object: no selection
                return slabs.put(keys, [(index, c) for index in indices for c in range(width)])
            return slabs.put(keys.select(todo), [(indices[i // width], i % width) for i in todo])

        statuses, written = self.put_objects(keys, width, write)
        if first:
            by_page = dict(zip(unique, statuses, strict=True))
            statuses = []
            for position, page in enumerate(pages):
                status = by_page[first[page]]
                if position != first[page] and status in (PutStatus.STORED, PutStatus.EXISTED):
                    status = PutStatus.EXISTED
                statuses.append(status)
        self.counters.record_puts(statuses, written * slabs.size)
        return statuses

    def put_objects(
        self,
        keys: Keys,
        width: int,
        write: Callable[[list[int]], list[int]],
    ) -> tuple[list[PutStatus], int]:
        """Put-then-confirm (with ``exists_before_put``: exists-then-put-missing-then-confirm) for
        distinct pages of ``width`` objects each (``keys`` page-major); ``write(flat object
        indices)`` puts those objects and returns one native code per object. The statuses per page
        and the number of objects the store accepted. Shared by the KV pages and the side pools'
        objects (:mod:`kvstrata.impl.storage.side`)."""
        count = len(keys) // width
        if not count:
            return [], 0
        status: list[PutStatus | None] = [None] * count
        failed = False
        todo: list[int] = []  # flat object indices (page * width + component) to write
        if not self.exists_before_put:  # the master deduplicates what it holds
            todo = list(range(count * width))
        else:
            present = self._is_exist(keys)
            failed = self.accounts.count_errors("put", present)
            for page in range(count):
                codes = present[page * width : (page + 1) * width]
                if any(code < 0 for code in codes):
                    status[page] = PutStatus.FAILED
                elif all(code == EXISTS for code in codes):
                    status[page] = PutStatus.EXISTED
                else:
                    todo.extend(page * width + c for c, code in enumerate(codes) if code != EXISTS)
        written = 0
        if todo and (codes := write(todo)).count(0) == len(todo) == len(codes):  # all accepted
            written = len(todo)
        elif todo:
            failed |= self.accounts.count_errors("put", codes)
            refused: dict[int, set[ErrorKind]] = {}
            for flat, code in zip(todo, codes, strict=True):
                if code < 0:
                    refused.setdefault(flat // width, set()).add(classify(code))
                else:
                    written += 1
            for page, kinds in refused.items():
                status[page] = PutStatus.FULL if kinds == {ErrorKind.FULL} else PutStatus.FAILED
        to_confirm = [page for page in range(count) if status[page] is None]
        if to_confirm:
            failed |= self._confirm(keys, width, to_confirm, status)
        if not failed:
            self.errors.success("put")
        return [PutStatus.FAILED if s is None else s for s in status], written

    def _confirm(
        self, keys: Keys, width: int, pages: Sequence[int], status: list[PutStatus | None]
    ) -> bool:
        """Settle ``pages`` (each component just written or already present): STORED if every
        component is now visible, FAILED (counted NOT_VISIBLE) if not. Whether anything failed."""
        if len(pages) * width == len(keys):  # every page: the whole batch
            codes = self._is_exist(keys)
        else:
            at = [p * width + c for p in pages for c in range(width)]
            subset = keys.select(at) if isinstance(keys, RenderedKeys) else [keys[i] for i in at]
            codes = self._is_exist(subset)
        if codes.count(EXISTS) == len(codes):  # all visible: the common case, one C pass
            for page in pages:
                status[page] = PutStatus.STORED
            return False
        failed = self.accounts.count_errors("put", codes)
        unseen = 0
        for n, page in enumerate(pages):
            answers = codes[n * width : (n + 1) * width]
            visible = all(code == EXISTS for code in answers)
            status[page] = PutStatus.STORED if visible else PutStatus.FAILED
            unseen += not visible and all(code >= 0 for code in answers)
        if unseen:
            self.accounts.error(
                "put", ErrorKind.NOT_VISIBLE, unseen, "written but not readable yet"
            )
        return failed or bool(unseen)

    # ---------------------------------------------------------------------------------- get
    def get(
        self, namespace: Namespace, pages: Sequence[PageHash], host_indices: Sequence[int]
    ) -> list[GetStatus]:
        """Read each page into its host slot; LOADED only when every component arrived whole (in
        native batches of at most ``MAX_BATCH_OBJECTS`` objects)."""
        return self._chunked("get", self._get_chunk, namespace, pages, host_indices)

    def _get_chunk(
        self, namespace: Namespace, pages: Sequence[PageHash], host_indices: Sequence[int]
    ) -> list[GetStatus]:
        slabs = self._checked("get", namespace, pages, host_indices)
        if not pages:
            return []
        keys = self._keys(namespace, pages)
        width = len(self._objects)
        objects = [(index, number) for index in host_indices for number in range(width)]
        statuses = self.accounts.settle_gets(slabs.get(keys, objects, width), [slabs.size] * width)
        loaded = statuses.count(GetStatus.LOADED)
        self.counters.record_gets(statuses, loaded * width * slabs.size)  # bytes of whole pages
        return statuses
