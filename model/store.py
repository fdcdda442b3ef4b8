"""The L3 store as the model sees it (SPEC §4): a map from :class:`StoreKey` to content identity.

Writes are two-phase, like Mooncake's put: :meth:`StoreModel.begin_put` reserves a key (invisible to
every reader), :meth:`StoreModel.end_put` makes it visible. ``exists`` and ``get`` see visible objects
only (I2: visible implies durable). Puts are content-addressed and idempotent: a key that is visible or
being written is not written again (exists-then-put-missing). The store may drop any visible object at
any time (:meth:`StoreModel.evict`), so a page is present only while *all* its component objects are.

A store may also **lag** (issue 19): while :attr:`StoreModel.hold_writes` is set, a completed write is
accepted (the writer sees success) but its object stays invisible, *lagging*, until the store
:meth:`publishes <StoreModel.publish>` it, or forever if the store :meth:`loses <StoreModel.lose>` it.
A lagging key is neither visible nor writable (a new put of it is refused, as a key mid-put is). So a
put's success alone never makes a page stored: a page counts as stored only once a reader would see
every object of it (``exists_pages``), which is what the backup checks after its puts.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import attrs

from kvstrata.model.errors import InvariantViolation, MisuseError
from kvstrata.model.keys import StoreKey

__all__ = ["StoreModel"]


def _check_key(key: object) -> StoreKey:
    if not isinstance(key, StoreKey):
        raise MisuseError(f"the store takes StoreKey values only, got {type(key).__name__}")
    return key


@attrs.define
class StoreModel:
    """Visible, in-flight and lagging objects, pairwise disjoint by construction."""

    _visible: dict[StoreKey, Hashable] = attrs.field(factory=dict)
    _writing: dict[StoreKey, Hashable] = attrs.field(factory=dict)
    _lagging: dict[StoreKey, Hashable] = attrs.field(factory=dict)
    #: While set, :meth:`end_put` leaves the object lagging instead of visible.
    hold_writes: bool = False

    def contains(self, key: StoreKey) -> bool:
        return _check_key(key) in self._visible

    def get(self, key: StoreKey) -> Hashable | None:
        """The content of a visible object, or ``None`` (never a partially written one)."""
        return self._visible.get(_check_key(key))

    def begin_put(self, key: StoreKey) -> bool:
        """Reserve ``key`` for a write; ``False`` (nothing to write) if it is visible or being written."""
        _check_key(key)
        if key in self._visible or key in self._writing or key in self._lagging:
            return False
        self._writing[key] = None
        return True

    def end_put(self, key: StoreKey, content: Hashable) -> None:
        """Complete a write begun with :meth:`begin_put`: the object becomes visible (lagging,
        while :attr:`hold_writes` is set)."""
        if _check_key(key) not in self._writing:
            raise InvariantViolation("I2", f"end_put of {key} without begin_put")
        del self._writing[key]
        (self._lagging if self.hold_writes else self._visible)[key] = content

    def publish(self, keys: Iterable[StoreKey]) -> int:
        """The store makes the lagging ``keys`` visible at last; how many were lagging."""
        published = 0
        for key in keys:
            if _check_key(key) in self._lagging:
                self._visible[key] = self._lagging.pop(key)
                published += 1
        return published

    def lose(self, keys: Iterable[StoreKey]) -> int:
        """The store loses the lagging ``keys``: success was returned, no reader will ever see
        them; how many were lagging."""
        return sum(self._lagging.pop(_check_key(key), None) is not None for key in keys)

    def abort_put(self, key: StoreKey) -> None:
        if _check_key(key) not in self._writing:
            raise InvariantViolation("I2", f"abort_put of {key} without begin_put")
        del self._writing[key]

    def evict(self, key: StoreKey) -> bool:
        """The store drops a visible object (its own eviction, a crash of the owner, ...)."""
        if _check_key(key) not in self._visible:
            return False
        del self._visible[key]
        return True

    def exists_pages(self, pages: Iterable[Sequence[StoreKey]]) -> int:
        """How many pages, from the first, have every one of their component keys visible."""
        count = 0
        for keys in pages:
            if not keys or not all(self.contains(key) for key in keys):
                break
            count += 1
        return count

    def visible_items(self) -> tuple[tuple[StoreKey, Hashable], ...]:
        return tuple(sorted(self._visible.items(), key=lambda item: item[0].text))

    def writing_keys(self) -> frozenset[StoreKey]:
        return frozenset(self._writing)

    def lagging_keys(self) -> frozenset[StoreKey]:
        return frozenset(self._lagging)

    def __len__(self) -> int:
        return len(self._visible)
