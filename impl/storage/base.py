"""The L3 backend interface (SPEC §4, issue 4): batches of whole pages between the host pool and a
store, named by page hash.

A backend is bound to one :class:`~kvstrata.model.keys.KeySpace` (model identity, shard, deployment
tag) and, once :meth:`StorageBackend.attach` ed, to one host pool whose pages it reads from (``put``)
and writes into (``get``). Store keys are made **only** by ``KeySpace.page_keys`` (the model's one
rendering function) inside the backend, at the I/O boundary; callers pass :class:`PageHash` values
and never see or build key strings.

Object format: one object per component (plane) of a page, holding that plane's page in canonical
order ``[L, page_size, H, D]`` whatever the host layout, so instances with different host layouts
share pages bit for bit (the key does not name the layout). For ``page_first_direct`` that is the
page slab itself (zero-copy); ``page_first`` is transposed on the way (a staging copy).

Semantics every backend keeps (the contract tests in ``tests/unit/impl/storage`` check them):

- a page **exists** only if every component object of it exists and is complete;
  :meth:`StorageBackend.exists` returns the number of consecutive existing pages from the start;
- :meth:`StorageBackend.put` is exists-then-put-missing: a page already stored is not written again
  (``EXISTED``); the store keeps the first bytes written for a key (content addressing makes them equal);
- :meth:`StorageBackend.get` writes a page's host slot only with bytes that arrived completely for
  every component; a page with any component missing or short is ``MISSING`` or ``FAILED`` and its
  host slot's bytes are unspecified (the caller frees it; it is never reported as a hit);
- store failures (down, full, timeouts, lease expiry) never raise: they come back as per-page
  statuses, and :meth:`exists` reports 0 for what it cannot confirm. Only misuse (wrong types,
  indices out of range, not attached, closed) raises, typed, from :mod:`kvstrata.impl.errors`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol, cast, runtime_checkable

import attrs

from kvstrata.impl.errors import ConfigError, MisuseError
from kvstrata.impl.pools.host import HostKVPool
from kvstrata.model.keys import KeySpace, Namespace, PageHash

__all__ = [
    "GetStatus",
    "PutStatus",
    "StorageBackend",
    "check_batch",
    "check_attachable",
    "page_objects",
    "PageObject",
]


class PutStatus(enum.Enum):
    """What :meth:`StorageBackend.put` did with one page."""

    STORED = "stored"
    """Every missing component was written; the page is now visible."""
    EXISTED = "existed"
    """Every component already existed; nothing was written."""
    SKIPPED = "skipped"
    """Not written by this instance on purpose (replicated KV on a non-writer rank)."""
    FULL = "full"
    """The store had no room; a counted miss, retried later or dropped by policy."""
    FAILED = "failed"
    """A retryable failure (store unreachable, timeout, another writer mid-put)."""

    @property
    def ok(self) -> bool:
        """Whether the page is (or, for SKIPPED, is someone else's duty to be) in the store."""
        return self in (PutStatus.STORED, PutStatus.EXISTED, PutStatus.SKIPPED)


class GetStatus(enum.Enum):
    """What :meth:`StorageBackend.get` did with one page."""

    LOADED = "loaded"
    """Every component arrived complete; the host slot holds the page."""
    MISSING = "missing"
    """At least one component is not in the store (evicted, never written): a miss."""
    FAILED = "failed"
    """A failure (unreachable, short read, lease expired): a miss, possibly transient."""


@runtime_checkable
class StorageBackend(Protocol):
    """A store of pages shared by every instance with the same :attr:`keyspace`.

    Thread model: one instance is driven by one storage worker thread at a time; the scheduler
    thread never calls it.
    """

    keyspace: KeySpace
    name: str

    def attach(self, host: HostKVPool) -> None:
        """Bind to the host pool (registering its memory for zero-copy where the store needs it).
        :class:`ConfigError` for a host layout whose pages are not contiguous (``layer_first``)."""

    def exists(self, namespace: Namespace, pages: Sequence[PageHash]) -> int:
        """How many pages, from the first, exist with every component. 0 when unsure."""

    def put(
        self, namespace: Namespace, pages: Sequence[PageHash], host_indices: Sequence[int]
    ) -> list[PutStatus]:
        """Store each page from its host slot; one status per page, in order."""

    def get(
        self, namespace: Namespace, pages: Sequence[PageHash], host_indices: Sequence[int]
    ) -> list[GetStatus]:
        """Read each page into its host slot; one status per page, in order."""

    def close(self) -> None:
        """Release the store connection and registrations. Idempotent."""


def check_batch(
    host: HostKVPool | None,
    namespace: object,
    pages: Sequence[object],
    host_indices: Sequence[object] | None,
    who: str,
) -> None:
    """The misuse checks every backend runs before touching the store: attached, a namespace,
    :class:`PageHash` values, and host indices of equal length, each a page of the pool."""
    if host is None:
        raise MisuseError(f"{who}: not attached to a host pool")
    if not isinstance(namespace, Namespace):
        raise MisuseError(f"{who}: expected a Namespace, got {namespace!r}")
    if {*map(type, pages)} - {PageHash}:  # one C pass on the common path; else page by page
        for page in pages:
            if not isinstance(page, PageHash):
                raise MisuseError(f"{who}: expected PageHash values, got {page!r}")
    if host_indices is None:
        return
    if len(host_indices) != len(pages):
        raise MisuseError(f"{who}: {len(pages)} pages but {len(host_indices)} host indices")
    ints = cast("Sequence[int]", host_indices)  # if plain ints (a bool is not one), in range:
    if not ints or ({*map(type, ints)} == {int} and 0 <= min(ints) <= max(ints) < host.num_pages):
        return
    for index in host_indices:
        if (
            isinstance(index, bool)
            or not isinstance(index, int)
            or not (0 <= index < host.num_pages)
        ):
            raise MisuseError(f"{who}: host index {index!r} is not a page of the pool")


def check_attachable(host: object, who: str) -> HostKVPool:
    """:class:`ConfigError` unless ``host`` is a host pool with page-contiguous layout."""
    if not isinstance(host, HostKVPool):
        raise MisuseError(f"{who}: attach() takes a HostKVPool, got {host!r}")
    if not host.page_contiguous:
        raise ConfigError(
            f"{who}: L3 needs a page-first host layout (page_first, page_first_direct or "
            "page_major), "
            f"got {host.layout.value!r}: a layer_first page is not one contiguous object"
        )
    return host


@attrs.frozen
class PageObject:
    """One store object of one page: its key's component name and the host planes it holds, in
    canonical order ``[planes, layers, page_size, heads, head_dim]`` (one plane under key schema 1,
    every plane of the page under schema 2)."""

    component: str
    planes: range


def page_objects(keyspace: KeySpace) -> tuple[PageObject, ...]:
    """The store objects of one KV page, in key order (:attr:`KeySpace.components`): plane ``i`` of
    the host pool is ``components[i]`` under schema 1 (``k``/``v`` for MHA, ``latent`` for MLA);
    under schema 2 the one ``page`` object holds every plane."""
    components = keyspace.components
    if len(components) == 1:
        return (PageObject(component=components[0], planes=range(len(keyspace.model.components))),)
    return tuple(
        PageObject(component=name, planes=range(plane, plane + 1))
        for plane, name in enumerate(components)
    )
