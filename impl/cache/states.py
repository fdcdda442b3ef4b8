"""Trailing side-pool states (Mamba / linear attention, SPEC §5): one state per node end.

Owned here: every :class:`~kvstrata.impl.cache.node.StateInfo` (keyed by the node whose *end* it sits
at), the L1 and L2 state-slot allocators and the slots the scheduler holds. A state's residency moves
only here, through the model's ``STATE_RESIDENCY`` table, and follows its node's pages (tiers calls
in when it moves them). Invariants (the model's): a slot is held in a tier exactly where the
residency claims one; a state is valid in a tier only where its node's pages are; an L2 copy read by
a backup (``host_pins``) is never dropped; a split never moves or loses a state (the node object, and
so the node end, stays on the suffix). With no ``TRAILING_PAGES`` pool nothing here runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstrata.impl.cache.clock import StepClock
from kvstrata.impl.cache.node import Allocator, Node, StateInfo
from kvstrata.impl.errors import CapacityError, MisuseError
from kvstrata.impl.transfer import PoolTransfer
from kvstrata.model.lifecycles import (
    DEVICE_VALID,
    HOST_VALID,
    L1_DROPPABLE,
    L1_WITH_L2,
    L2_DROPPABLE,
    STATE_RESIDENCY,
    Residency,
    StateEvent,
)

__all__ = ["StateBook"]

_DEVICE_VALID_T = tuple(DEVICE_VALID)
_HOST_VALID_T = tuple(HOST_VALID)
_L1_DROPPABLE_T = tuple(L1_DROPPABLE)
_L2_DROPPABLE_T = tuple(L2_DROPPABLE)
_L1_WITH_L2_T = tuple(L1_WITH_L2)


class StateBook:
    """See the module docstring. ``pools`` names the trailing pools (one :class:`PoolTransfer`
    each per state copy); ``device`` / ``host`` are the state-slot allocators (``host`` is ``None``
    without an L2)."""

    def __init__(
        self,
        clock: StepClock,
        pools: Sequence[str],
        device: Allocator | None,
        host: Allocator | None,
    ) -> None:
        self._clock = clock
        self.enabled = bool(pools)
        self.pools = tuple(pools)
        self.device = device
        self.host = host
        self.info: dict[Node, StateInfo] = {}  # node -> the state at its end
        self.held: set[int] = set()  # L1 state slots the scheduler owns

    # ------------------------------------------------------------------ basics
    def of(self, node: Node) -> Residency | None:
        """The residency of the state at ``node``'s end (``None``: it has none)."""
        info = self.info.get(node)
        return None if info is None else info.residency

    def advance(self, node: Node, info: StateInfo, event: StateEvent) -> None:
        info.residency = STATE_RESIDENCY.next(info.residency, event)
        if info.residency is Residency.GONE:
            del self.info[node]

    def alloc(self, *, host: bool) -> int:
        pool = self.host if host else self.device
        assert pool is not None
        return int(pool.alloc(1)[0])

    def free(self, slot: int, *, host: bool) -> None:
        pool = self.host if host else self.device
        assert pool is not None
        pool.free(np.array([slot], dtype=np.int64))

    def transfers(self, src: int, dst: int) -> tuple[PoolTransfer, ...]:
        """One state's copy, as one :class:`PoolTransfer` per trailing pool (fixed at enqueue)."""
        return tuple(PoolTransfer(name, [src], [dst]) for name in self.pools)

    @property
    def device_free(self) -> int:
        """Free L1 state slots (0 without a ``TRAILING_PAGES`` pool)."""
        return 0 if self.device is None else self.device.free_count

    @property
    def host_free(self) -> int:
        """Free L2 state slots (0 without a ``TRAILING_PAGES`` pool or without an L2)."""
        return 0 if self.host is None else self.host.free_count

    def along(self, path: Sequence[Node]) -> tuple[Residency | None, ...]:
        """The residency of the state at the end of each page of ``path`` (``None``: none)."""
        out: list[Residency | None] = []
        for node in path:
            out.extend([None] * (node.num_pages - 1))
            out.append(self.of(node))
        return tuple(out)

    def require(self) -> None:
        if not self.enabled:
            raise MisuseError("no TRAILING_PAGES side pool: this cache keeps no states")

    # ------------------------------------------------------------------ dropping copies
    def drop(self, node: Node, *, host: bool) -> None:
        """Free the L1 (or L2) copy of the state at ``node``'s end; forgotten when none is left."""
        info = self.info[node]
        if host:
            slot, info.host = info.host, None
            event = StateEvent.DROP_HOST if info.residency is Residency.BOTH else StateEvent.DELETE
        else:
            slot, info.device = info.device, None
            event = StateEvent.DEMOTE if info.residency is Residency.BOTH else StateEvent.DELETE
        assert slot is not None
        self.free(slot, host=host)
        self.advance(node, info, event)

    def drop_device_copy(self, node: Node) -> None:
        """``node`` lost its L1 pages (demoted): its end state loses its idle L1 copy too."""
        if self.of(node) in _L1_DROPPABLE_T:
            self.drop(node, host=False)

    def forget(self, node: Node) -> None:
        """``node`` is being deleted: the state at its end goes with it."""
        info = self.info.get(node)
        if info is not None:
            self.drop(node, host=info.residency is Residency.HOST)

    def victim(self, *, host: bool) -> Node | None:
        """The least recently used node whose end state may lose its L1 (or L2) copy: not in
        flight, on an unlocked node (the model's ``_state_victims`` order)."""
        allowed = _L2_DROPPABLE_T if host else _L1_DROPPABLE_T
        best: tuple[int, int] | None = None
        found = None
        for node, info in self.info.items():
            if node.lock_ref or info.residency not in allowed or (host and info.host_pins):
                continue
            key = (node.last_access, node.id)
            if best is None or key < best:
                best, found = key, node
        return found

    def make_room(self, *, host: bool) -> bool:
        """Make sure one L1 (or L2) state slot is free, dropping the LRU state copy if needed."""
        pool = self.host if host else self.device
        assert pool is not None
        if pool.free_count == 0:
            node = self.victim(host=host)
            if node is not None:
                self.drop(node, host=host)
        return pool.free_count > 0

    def host_pinned(self, node: Node) -> bool:
        """Whether a backup still reads the L2 state at ``node``'s end."""
        info = self.info.get(node)
        return info is not None and info.host_pins > 0

    # ------------------------------------------------------------------ states that move with pages
    def moving(self, node: Node) -> StateInfo | None:
        """The state that moves L1 -> L2 with ``node``: its end state, if on L1 only."""
        info = self.info.get(node)
        return info if info is not None and info.residency is Residency.DEVICE else None

    def alone(self, node: Node) -> bool:
        """Whether ``node``'s end state is on L1 only while its KV has (or is getting) an L2 copy:
        a state attached after the node was written through."""
        return not node.is_root and node.state in _L1_WITH_L2_T and self.moving(node) is not None

    def loadable(self, node: Node) -> StateInfo | None:
        """The state at ``node``'s end if it is on L2 only (a load-back brings it along)."""
        info = self.info.get(node)
        return info if info is not None and info.residency is Residency.HOST else None

    def start_copy(self, node: Node, *, write: bool) -> tuple[PoolTransfer, ...]:
        """A copy of the state at ``node``'s end starts (L1 -> L2 with ``write``, else L2 -> L1;
        both slots held): WRITE_START / LOAD_START, and the transfers it moves."""
        info = self.info[node]
        assert info.device is not None and info.host is not None
        event = StateEvent.WRITE_START if write else StateEvent.LOAD_START
        self.advance(node, info, event)
        if write:
            return self.transfers(info.device, info.host)
        return self.transfers(info.host, info.device)

    def end_copy(self, node: Node, *, write: bool, ok: bool) -> None:
        """The copy of ``node``'s end state finished: acked, or failed (its destination slot given
        back, the state where it was)."""
        info = self.info[node]
        if ok:
            self.advance(node, info, StateEvent.WRITE_ACK if write else StateEvent.LOAD_ACK)
            return
        if write:
            assert info.host is not None
            self.free(info.host, host=True)
            info.host = None
            self.advance(node, info, StateEvent.WRITE_FAIL)
        else:
            assert info.device is not None
            self.free(info.device, host=False)
            info.device = None
            self.advance(node, info, StateEvent.LOAD_FAIL)

    def staging(self, node: Node) -> tuple[PoolTransfer, ...]:
        """The blocking copy of ``node``'s L1-only end state to its reserved L2 slot (write_back)."""
        info = self.info[node]
        assert info.device is not None and info.host is not None
        return self.transfers(info.device, info.host)

    def unstage(self, node: Node) -> None:
        """A failed staging copy: the reserved L2 state slot goes back."""
        info = self.info[node]
        if info.host is not None:
            self.free(info.host, host=True)
            info.host = None

    def staged(self, node: Node) -> None:
        """A staging copy landed: the L1 copy is freed, the state is on L2 only (STAGE)."""
        info = self.info[node]
        assert info.device is not None
        self.free(info.device, host=False)
        info.device = None
        self.advance(node, info, StateEvent.STAGE)

    def attach(self, node: Node, slot: int) -> bool:
        """Make ``slot`` the L1 state at the end of ``node`` (whose pages are valid on L1); False if
        that end already has a state on L1 (or one being loaded there)."""
        assert node.state in _DEVICE_VALID_T
        info = self.info.get(node)
        if info is None:
            info = self.info[node] = StateInfo(Residency.NEW, device=slot)
            self.advance(node, info, StateEvent.INSERT)
            return True
        if info.residency is Residency.HOST:
            info.device = slot
            self.advance(node, info, StateEvent.REVIVE)
            return True
        return False

    def keep(self, node: Node, slot: int, *, loading: bool) -> bool:
        """The scheduler hands L1 state ``slot`` to ``insert`` with pages ending at ``node``: it
        becomes that node end's L1 state unless the end has one on L1 already (or the insert
        stopped below a node that is loading back); else it goes back to the pool."""
        self.held.discard(slot)
        kept = not loading and self.attach(node, slot)
        if not kept:
            self.free(slot, host=False)
        return kept

    def commit_prefetched(self, end: Node | None, slot: int) -> bool:
        """A prefetched state read into L2 ``slot`` becomes the state at ``end``'s end if that node
        is valid on L2 and has none (the model's ``_commit_state``); else the slot is freed."""
        if end is not None and end.state in _HOST_VALID_T and end not in self.info:
            info = self.info[end] = StateInfo(Residency.NEW)
            info.host = slot
            self._clock.version += 1
            self.advance(end, info, StateEvent.COMMIT_PREFETCH)
            return True
        self.free(slot, host=True)
        return False

    def usable(self, device: list[Node], host: list[Node]) -> tuple[list[Node], list[Node]]:
        """Cut the L1 prefix back to the deepest node end whose state is valid on L1; the L2
        continuation is then the nodes after that cut whose KV is valid on L2, cut back to the
        deepest node end whose state is valid on L2 (the model's rule, I6)."""
        cut = len(device)
        while cut and self.of(device[cut - 1]) not in _DEVICE_VALID_T:
            cut -= 1
        rest: list[Node] = []
        for node in [*device[cut:], *host]:
            if node.state not in _HOST_VALID_T:
                break
            rest.append(node)
        end = len(rest)
        while end and self.of(rest[end - 1]) not in _HOST_VALID_T:
            end -= 1
        return device[:cut], rest[:end]

    # ------------------------------------------------------------------ the scheduler's slots
    def take_device_slot(self) -> int:
        """A fresh L1 state slot for the scheduler (dropping the LRU idle L1 copy if none is
        free); :class:`CapacityError` if still none."""
        if not self.make_room(host=False):
            raise CapacityError("no L1 state slot is free and no L1 state can be dropped")
        slot = self.alloc(host=False)
        self.held.add(slot)
        return slot

    def check_held(self, slot: object) -> None:
        if slot not in self.held:
            raise MisuseError(f"L1 state slot {slot!r} is not held by the scheduler")

    def give_back_device_slot(self, slot: int) -> None:
        self.check_held(slot)
        self.held.discard(slot)
        self.free(slot, host=False)

    def check_evictable(self, node: Node, *, host: bool) -> None:
        """:class:`MisuseError` unless the state at ``node``'s end has an idle copy in that tier and
        the node is unlocked (and, on L2, no backup reads it)."""
        info = self.info.get(node)
        tier = "L2" if host else "L1"
        if info is None or info.residency not in (_L2_DROPPABLE_T if host else _L1_DROPPABLE_T):
            state = "none" if info is None else info.residency.value
            raise MisuseError(f"{node!r} has no idle {tier} state to drop (state: {state})")
        if node.lock_ref:
            raise MisuseError(f"{node!r} is locked: its state is in use")
        if host and info.host_pins:
            raise MisuseError(f"the L2 state of {node!r} is pinned by a backup")

    def reset(self) -> None:
        for info in self.info.values():
            if info.device is not None:
                self.free(info.device, host=False)
            if info.host is not None:
                self.free(info.host, host=True)
        self.info.clear()
