"""The push and GET ops in flight of the embedding cache model, and the requests that started GETs
(SPEC §6).

Owned here: every pending op (a handle and the offsets it handed to the store), the request ids of
``prefetch`` and the op sequence. An op completes item by item, as a real batch call answers (one
code per key): :meth:`Ops.ack_push` / :meth:`Ops.ack_get`. Entry states change only through
:class:`~kvstrata.model.embedding.entries.Entries`.

Invariants upheld here alone:

* an entry is PUSHING (LOADING) exactly while one pending push (GET) op holds its offset, and every
  offset a pending op holds belongs to its entry's *current* generation and slots (no stale
  offset: the store reads and writes only what the entry owns now);
* the store reads a pushed buffer *at* the ack (pessimistic), so a slot reused while its offset is
  with the store would show up as wrong bytes in the store;
* a failed GET item frees and forgets its entry; a failed push item is READY again, its write
  aborted; every key a pending push began is reserved (invisible) in the store (I2); a push item
  that began nothing (the store held or was writing its key) writes at its ack only if the store
  has lost the key by then (the store reads its slots then, so they are pinned like the others);
* ``failed`` must name items of the op, checked before anything changes.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence

import attrs

from kvstrata.model.embedding.entries import (
    HELD_BY_GET,
    HELD_BY_PUSH,
    PINNED,
    Entries,
    check_hashes,
)
from kvstrata.model.errors import InvariantViolation, MisuseError
from kvstrata.model.keys import PageHash, StoreKey
from kvstrata.model.lifecycles import EntryEvent
from kvstrata.model.store import StoreModel

__all__ = ["Offset", "OpHandle", "OpKind", "Ops", "PendingOp"]


class OpKind(enum.Enum):
    PUSH = "push"  # one batch PUT
    GET = "get"  # one batch GET


#: The states an op holds its entries in (derived from ``EMBEDDING_ENTRY`` in :mod:`.entries`).
_HELD_IN = {OpKind.PUSH: HELD_BY_PUSH, OpKind.GET: HELD_BY_GET}


@attrs.frozen
class OpHandle:
    """Names one pending op of one node."""

    node: str
    kind: OpKind
    seq: int


@attrs.frozen
class Offset:
    """What an op hands to the store: a key and the slots of one entry of one generation.
    ``reserved`` (pushes): this push began the key's write; one that did not (the store held or
    was writing the key) writes at its ack only if the store has lost the key by then."""

    key: StoreKey
    media: PageHash
    generation: int
    slots: tuple[int, ...]
    reserved: bool = True


@attrs.frozen
class PendingOp:
    handle: OpHandle
    items: tuple[Offset, ...]


@attrs.define
class Ops:
    """One node's pending ops and requests. See the module docstring for the rules."""

    name: str
    entries: Entries = attrs.field(repr=False)
    store: StoreModel = attrs.field(repr=False)
    _ops: dict[OpHandle, PendingOp] = attrs.field(init=False, factory=dict)
    _requests: dict[str, OpHandle | None] = attrs.field(init=False, factory=dict)
    _next_op: int = attrs.field(init=False, default=0)

    # ----------------------------------------------------------------------------- queries

    def handles(self) -> tuple[OpHandle, ...]:
        return tuple(sorted(self._ops, key=lambda handle: handle.seq))

    def media(self, handle: OpHandle, kind: OpKind | None = None) -> tuple[PageHash, ...]:
        """The media items a pending op covers."""
        return tuple(item.media for item in self.pending(handle, kind).items)

    def pending(self, handle: OpHandle, kind: OpKind | None = None) -> PendingOp:
        op = self._ops.get(handle) if isinstance(handle, OpHandle) else None
        if op is None or (kind is not None and handle.kind is not kind):
            raise MisuseError(f"{self.name}: no pending {kind or 'op'} {handle!r}")
        return op

    def is_ready(self, request_id: str) -> bool:
        return self.request(request_id) not in self._ops

    def request(self, request_id: str) -> OpHandle | None:
        if not isinstance(request_id, str) or request_id not in self._requests:
            raise MisuseError(f"{self.name}: unknown request {request_id!r}")
        return self._requests[request_id]

    def check_new_request(self, request_id: str) -> None:
        if not isinstance(request_id, str) or request_id in self._requests:
            raise MisuseError(f"{self.name}: request id must be a new string, got {request_id!r}")

    # ----------------------------------------------------------------------------- changes

    def open(self, kind: OpKind, offsets: Sequence[Offset]) -> OpHandle | None:
        if not offsets:
            return None
        handle = OpHandle(self.name, kind, self._next_op)
        self._next_op += 1
        self._ops[handle] = PendingOp(handle, tuple(offsets))
        return handle

    def start_request(self, request_id: str, handle: OpHandle | None) -> None:
        self._requests[request_id] = handle

    def release(self, request_id: str) -> None:
        self.request(request_id)
        del self._requests[request_id]

    def ack_push(self, handle: OpHandle, failed: Iterable[PageHash]) -> tuple[int, int]:
        """Complete a push item by item (see ``EmbeddingCacheModel.ack_push``); returns the number
        of objects written and of items failed."""
        op = self.pending(handle, OpKind.PUSH)
        lost = self._check_failed(op, failed)
        del self._ops[handle]
        for item in op.items:
            if item.media in lost:
                if item.reserved:
                    self.store.abort_put(item.key)
                self.entries.advance(item.media, EntryEvent.PUSH_FAILED)
                continue
            # An item that began nothing writes only if the store lost the key meanwhile: the
            # real put runs late, and the store skips a key only while it holds or writes it.
            if item.reserved or self.store.begin_put(item.key):
                self.store.end_put(item.key, self.entries.read(item.slots))
            self.entries.advance(item.media, EntryEvent.PUSH_ACK)
        return len(op.items) - len(lost), len(lost)

    def ack_get(self, handle: OpHandle, failed: Iterable[PageHash]) -> tuple[int, int]:
        """Complete a GET item by item (see ``EmbeddingCacheModel.ack_get``); returns the number of
        entries loaded and of entries freed."""
        op = self.pending(handle, OpKind.GET)
        lost = self._check_failed(op, failed)
        del self._ops[handle]
        loaded = 0
        for item in op.items:
            entry = self.entries[item.media]
            content = None if item.media in lost else self.store.get(item.key)
            if not isinstance(content, tuple) or len(content) != entry.size:
                self.entries.forget(entry, EntryEvent.LOAD_FAILED)
                continue
            self.entries.loaded(item.media, item.slots, content)
            loaded += 1
        return loaded, len(op.items) - loaded

    def _check_failed(self, op: PendingOp, failed: Iterable[PageHash]) -> frozenset[PageHash]:
        """The failed items of a per-item completion of ``op``; :class:`MisuseError` unless each
        is a media item of ``op`` (checked before anything changes)."""
        lost = frozenset(check_hashes(failed))
        unknown = lost - {item.media for item in op.items}
        if unknown:
            raise MisuseError(
                f"{self.name}: {sorted(m.digest.hex()[:8] for m in unknown)} "
                f"are not items of {op.handle!r}"
            )
        return lost

    # ----------------------------------------------------------------------------- invariants

    def check(self) -> None:
        """I5: pins are exactly the pending ops' entries, offsets of the current generation; I2:
        every pending push key is reserved in the store."""
        held: set[PageHash] = set()
        writing = self.store.writing_keys()
        for handle, op in self._ops.items():
            for item in op.items:
                entry = self.entries.get(item.media)
                if (
                    entry is None
                    or entry.state not in _HELD_IN[handle.kind]
                    or entry.generation != item.generation
                    or entry.slots != item.slots
                    or item.media in held
                ):
                    raise InvariantViolation(
                        "I5", f"{self.name}: stale offset {item!r} in {handle!r}; entry {entry!r}"
                    )
                if handle.kind is OpKind.PUSH and item.reserved and item.key not in writing:
                    raise InvariantViolation("I2", f"{self.name}: {item.key} is not reserved")
                held.add(item.media)
        for entry in self.entries:
            if entry.state in PINNED and entry.media not in held:
                raise InvariantViolation("I5", f"{self.name}: {entry!r} is pinned by no op")
