"""KV pages and their side pools through one L3 backend: :class:`HybridStorage` (SPEC §5, issue 6).

A hybrid page set is a run of KV pages (the anchor, through the backend's own ``exists`` / ``put`` /
``get``) plus, per side pool, the objects of those pages: every page for an ``ALL_PAGES`` pool
(indexer keys, at the KV page's host index), and the states of chosen positions for a
``TRAILING_PAGES`` pool (a Mamba state, keyed by the hash of the last page of the prefix it
ends, in a slot of its own). Every side key is rendered once by
:func:`kvstrata.model.hybrid.side_page_keys`, or for a presence batch by its batch twin
:func:`~kvstrata.model.hybrid.side_rendered` (never derived from another key: the "tagged twice"
bug).

``exists`` answers the **usable prefix** the model's :func:`~kvstrata.model.hybrid.hybrid_exists`
defines, with the same policy code (:func:`~kvstrata.model.hybrid.usable_prefix`): the KV hit first
(one backend ``exists``), then the side objects of the pages below the KV hit, every side pool in
one presence batch (:func:`~kvstrata.impl.storage.side.present_all`: one more round trip on Mooncake,
whatever the number of side pools). No side key of a page at or beyond the KV hit is ever asked
(SPEC §5), and each key asked is rendered exactly once.

``put`` writes the KV pages, then the ``ALL_PAGES`` objects of the pages whose KV is in the store, and
the states asked for; a page is ``STORED``/``EXISTED`` only when its KV and every ``ALL_PAGES`` object
are. ``get`` reads the KV pages and the ``ALL_PAGES`` objects of the same pages (one prefetch batch),
then the states, which the caller asks for once it knows the KV range; :attr:`HybridGet.usable` is
the prefix that arrived usable in every pool (I6): a page whose side object is missing is no hit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from kvstrata.impl.errors import MisuseError
from kvstrata.impl.pools.host import HostKVPool
from kvstrata.impl.pools.side import SideBuffer
from kvstrata.impl.storage.base import GetStatus, PutStatus, StorageBackend
from kvstrata.impl.storage.side import EntryKeys, SideIO, present_all, side_io
from kvstrata.model.hybrid import HitPolicy, Probe, side_page_keys, usable_prefix
from kvstrata.model.keys import Namespace, PageHash

__all__ = ["HybridGet", "HybridHit", "HybridPut", "HybridStorage"]

StateSlots = Mapping[str, Mapping[int, int]]
"""Per ``TRAILING_PAGES`` pool: page position in the batch -> state slot of the host buffer."""


@attrs.frozen
class HybridHit:
    """What ``exists`` found: the KV hit and the prefix usable in every pool (``usable <= kv``)."""

    kv: int
    usable: int


@attrs.frozen
class HybridPut:
    """One status per page (KV and every ``ALL_PAGES`` object together) and per state asked."""

    pages: list[PutStatus]
    states: dict[str, dict[int, PutStatus]]


@attrs.frozen
class HybridGet:
    """One status per page (KV and ``ALL_PAGES`` together), per state asked, and the usable prefix
    of what arrived (every page ``LOADED``, each ``TRAILING_PAGES`` pool's state at its end)."""

    pages: list[GetStatus]
    states: dict[str, dict[int, GetStatus]]
    usable: int


_PUT_RANK = {
    PutStatus.FAILED: 0,
    PutStatus.FULL: 1,
    PutStatus.SKIPPED: 2,
    PutStatus.STORED: 3,
    PutStatus.EXISTED: 4,
}


def _worst_put(statuses: Sequence[PutStatus]) -> PutStatus:
    """The status of a page from its objects' statuses: any failure wins, then FULL; EXISTED only
    if every part existed (a page with one part written is STORED)."""
    return min(statuses, key=_PUT_RANK.__getitem__)


class HybridStorage:
    """A backend's KV pages with the side pools ``side`` (host buffers, distinct names).

    Attach it to the KV host pool (it attaches the backend and registers the side buffers with
    the store). Thread model: like a backend, driven by one storage worker at a time.
    """

    def __init__(self, backend: StorageBackend, side: Sequence[SideBuffer] = ()) -> None:
        self.backend = backend
        self.keyspace = backend.keyspace
        self.side: dict[str, SideBuffer] = {}
        for buffer in side:
            if not isinstance(buffer, SideBuffer):
                raise MisuseError(f"HybridStorage: expected SideBuffer values, got {buffer!r}")
            if buffer.name in self.side:
                raise MisuseError(f"HybridStorage: two side pools named {buffer.name!r}")
            if buffer.device.type != "cpu":
                raise MisuseError(f"HybridStorage: {buffer.name!r} is not a host buffer")
            self.side[buffer.name] = buffer
        self._io: dict[str, SideIO] = {}

    def attach(self, host: HostKVPool) -> None:
        """Attach the backend to the KV host pool and the side buffers to the store (once)."""
        self.backend.attach(host)
        for name, buffer in self.side.items():
            if name not in self._io:
                self._io[name] = side_io(self.backend, buffer, self.keyspace)

    def close(self) -> None:
        """Release the side registrations and close the backend. Idempotent."""
        for io in self._io.values():
            io.release()
        self._io.clear()
        self.backend.close()

    # ------------------------------------------------------------------------------------ helpers
    def _side_io(self, name: str) -> SideIO:
        try:
            return self._io[name]
        except KeyError:
            raise MisuseError(f"HybridStorage: side pool {name!r} is not attached") from None

    def _keys(self, namespace: Namespace, name: str, pages: Sequence[PageHash]) -> list[EntryKeys]:
        pool = self.side[name].spec.pool
        return [side_page_keys(self.keyspace, namespace, pool, page) for page in pages]

    def _paged(self) -> list[str]:
        return [n for n, b in self.side.items() if b.spec.policy is HitPolicy.ALL_PAGES]

    def _trailing(self) -> list[str]:
        return [n for n, b in self.side.items() if b.spec.policy is HitPolicy.TRAILING_PAGES]

    def _states(self, states: StateSlots | None, pages: int) -> dict[str, dict[int, int]]:
        out: dict[str, dict[int, int]] = {}
        for name, slots in (states or {}).items():
            if name not in self.side or self.side[name].spec.policy is not HitPolicy.TRAILING_PAGES:
                raise MisuseError(f"HybridStorage: {name!r} is not a TRAILING_PAGES side pool")
            checked = dict(slots)
            for position in checked:
                if isinstance(position, bool) or not isinstance(position, int):
                    raise MisuseError(f"HybridStorage: state position {position!r} is not an int")
                if not 0 <= position < pages:
                    raise MisuseError(
                        f"HybridStorage: state position {position} is not a page of the batch"
                    )
            self._side_io(name)
            self.side[name].indices(list(checked.values()), "state slots")
            out[name] = checked
        return out

    # ------------------------------------------------------------------------------------- exists
    def exists(self, namespace: Namespace, pages: Sequence[PageHash]) -> HybridHit:
        """The KV hit and the prefix usable in every pool (see the module docstring)."""
        kv_hit = self.backend.exists(namespace, pages)
        if kv_hit == 0 or not self.side:
            return HybridHit(kv_hit, kv_hit)
        below = pages[:kv_hit]
        names = [*self._paged(), *self._trailing()]  # ALL_PAGES first, as usable_prefix takes them
        found = present_all([(self._side_io(name), namespace, below) for name in names])
        probes: list[tuple[HitPolicy, Probe]] = [
            (self.side[name].spec.policy, answers.__getitem__)
            for name, answers in zip(names, found, strict=True)
        ]
        return HybridHit(kv_hit, usable_prefix(kv_hit, probes))

    # ---------------------------------------------------------------------------------------- put
    def put(
        self,
        namespace: Namespace,
        pages: Sequence[PageHash],
        host_indices: Sequence[int],
        states: StateSlots | None = None,
    ) -> HybridPut:
        """Back up ``pages`` from their host slots with their ``ALL_PAGES`` objects, and the states
        of ``states`` (position -> slot per ``TRAILING_PAGES`` pool, keyed by that page's hash)."""
        wanted = self._states(states, len(pages))
        statuses = list(self.backend.put(namespace, pages, host_indices))
        stored = [i for i, status in enumerate(statuses) if status.ok]
        for name in self._paged():
            if not stored:
                break
            side = self._side_io(name).put(
                self._keys(namespace, name, [pages[i] for i in stored]),
                [host_indices[i] for i in stored],
            )
            for position, status in zip(stored, side, strict=True):
                statuses[position] = _worst_put([statuses[position], status])
        state_statuses: dict[str, dict[int, PutStatus]] = {}
        for name, slots in wanted.items():
            positions = list(slots)
            result = self._side_io(name).put(
                self._keys(namespace, name, [pages[p] for p in positions]),
                [slots[p] for p in positions],
            )
            state_statuses[name] = dict(zip(positions, result, strict=True))
        return HybridPut(statuses, state_statuses)

    # ---------------------------------------------------------------------------------------- get
    def get(
        self,
        namespace: Namespace,
        pages: Sequence[PageHash],
        host_indices: Sequence[int],
        states: StateSlots | None = None,
    ) -> HybridGet:
        """Read ``pages`` into their host slots with their ``ALL_PAGES`` objects, then the states
        of ``states``; host slots of pages that are not ``LOADED`` hold unspecified bytes."""
        wanted = self._states(states, len(pages))
        statuses = list(self.backend.get(namespace, pages, host_indices))
        for name in self._paged():
            loaded = [i for i, status in enumerate(statuses) if status is GetStatus.LOADED]
            if not loaded:
                break
            side = self._side_io(name).get(
                self._keys(namespace, name, [pages[i] for i in loaded]),
                [host_indices[i] for i in loaded],
            )
            for position, status in zip(loaded, side, strict=True):
                statuses[position] = status
        whole = next((i for i, s in enumerate(statuses) if s is not GetStatus.LOADED), len(pages))
        state_statuses: dict[str, dict[int, GetStatus]] = {}
        for name, slots in wanted.items():
            positions = list(slots)
            result = self._side_io(name).get(
                self._keys(namespace, name, [pages[p] for p in positions]),
                [slots[p] for p in positions],
            )
            state_statuses[name] = dict(zip(positions, result, strict=True))
        probes: list[tuple[HitPolicy, Probe]] = [
            (HitPolicy.TRAILING_PAGES, _arrived(state_statuses.get(name, {})))
            for name in self._trailing()
        ]
        return HybridGet(statuses, state_statuses, usable_prefix(whole, probes))

    # ------------------------------------------------------------------------- states on their own
    def put_states(
        self, namespace: Namespace, pages: Sequence[PageHash], slots: Sequence[int]
    ) -> list[PutStatus]:
        """Back up the state at the end of each of ``pages`` from host state slot ``slots[i]``, in
        every ``TRAILING_PAGES`` pool (exists-then-put-missing). One status per state: the worst
        over the pools (a state is stored only when every pool's entry is)."""
        if len(pages) != len(slots):
            raise MisuseError(f"HybridStorage: {len(pages)} state pages for {len(slots)} slots")
        names = self._trailing()
        if not pages or not names:
            return [PutStatus.EXISTED] * len(pages) if not names else []
        per_pool = []
        for name in names:
            self.side[name].indices(list(slots), "state slots")
            per_pool.append(
                self._side_io(name).put(self._keys(namespace, name, pages), list(slots))
            )
        return [_worst_put(list(column)) for column in zip(*per_pool, strict=True)]

    def read_state(
        self, namespace: Namespace, pages: Sequence[PageHash], upto: int, slot: int
    ) -> int:
        """The KV range ``pages[:upto]`` is known: read into state slot ``slot`` the state of the
        deepest of those pages whose state is in the store in every ``TRAILING_PAGES`` pool (the
        model's ``_read_state``: one presence batch, then one read). Returns how many pages are
        usable (the position of that page + 1), 0 when none has a state. A state that vanishes
        between presence and read makes the next deeper-to-shallower candidate be tried, so the
        slot holds the returned page's state whole, or the answer is 0 (never wrong bytes)."""
        names = self._trailing()
        if not names or upto <= 0:
            return upto if not names else 0
        below = pages[:upto]
        self.side[names[0]].indices([slot], "state slot")
        found = present_all([(self._side_io(n), namespace, below) for n in names])
        candidates = [i for i in range(upto) if all(answers[i] for answers in found)]
        for position in reversed(candidates):
            page = [below[position]]
            statuses = [
                self._side_io(name).get(self._keys(namespace, name, page), [slot])[0]
                for name in names
            ]
            if all(status is GetStatus.LOADED for status in statuses):
                return position + 1
        return 0


def _arrived(states: Mapping[int, GetStatus]) -> Probe:
    """A probe for the states one ``get`` read: the state ending page ``i`` arrived whole."""
    return lambda position: states.get(position) is GetStatus.LOADED
