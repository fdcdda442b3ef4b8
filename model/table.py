"""Lifecycles as data: a transition table ``state x event -> state`` declared once.

Theory of operation
-------------------
Every lifecycle in kvstrata (a write-through op, a backup op, a prefetch op, an embedding entry, a page's
residency) is a :class:`Lifecycle`: an immutable table from ``(state, event)`` to the next state. The
model and the implementation both advance through :meth:`Lifecycle.next`, a plain dictionary lookup (the
implementation's hot paths cannot afford ``transitions``' ~20 us per trigger). An event the table does not
list raises :class:`~kvstrata.model.errors.IllegalTransition` and changes nothing: callers compute the next
state *before* they mutate anything.

The same table also builds a ``transitions.Machine`` (:meth:`Lifecycle.build_machine`), which checks that
the table is well formed (every state known, every event named) and lets the docs draw it, so the drawing
can never drift from the code.
"""

from __future__ import annotations

import enum
import types
from collections.abc import Iterable, Mapping
from typing import Any, Generic, TypeVar

import attrs
from transitions import Machine

from kvstrata.model.errors import IllegalTransition

__all__ = ["Lifecycle"]

S = TypeVar("S", bound=enum.Enum)
E = TypeVar("E", bound=enum.Enum)


def _freeze_table(table: Mapping[tuple[Any, Any], Any]) -> Mapping[tuple[Any, Any], Any]:
    return types.MappingProxyType(dict(table))


def _freeze_states(states: Iterable[Any]) -> frozenset[Any]:
    return frozenset(states)


@attrs.frozen(eq=False)
class Lifecycle(Generic[S, E]):
    """An immutable transition table.

    Compared by identity (each table is declared once). Invariants: the table cannot be changed
    after construction; a final state has no outgoing transitions; every target is a state of the
    same enum as ``initial``.
    """

    name: str
    initial: S
    table: Mapping[tuple[S, E], S] = attrs.field(converter=_freeze_table)
    final: frozenset[S] = attrs.field(factory=frozenset, converter=_freeze_states)
    _moves: dict[tuple[int, int], S] = attrs.field(init=False, repr=False)
    """``table`` keyed by the members' ``id``: an enum member is a singleton that lives as long as
    its class, so the two keys name the same transitions, and this one is hashed in C (an enum's
    own ``__hash__`` is Python code; :meth:`next` runs several times per page and per item)."""

    def __attrs_post_init__(self) -> None:
        for (state, _event), target in self.table.items():
            if state in self.final:
                raise ValueError(f"{self.name}: final state {state} has an outgoing transition")
            if type(target) is not type(self.initial):
                raise TypeError(f"{self.name}: target {target!r} is not a {type(self.initial)}")
        moves = {(id(state), id(event)): target for (state, event), target in self.table.items()}
        object.__setattr__(self, "_moves", moves)

    def next(self, state: S, event: E) -> S:
        """The state after ``event`` in ``state``; raises :class:`IllegalTransition` if not allowed."""
        try:
            return self._moves[(id(state), id(event))]
        except KeyError:
            raise IllegalTransition(self.name, state, event) from None

    def allows(self, state: S, event: E) -> bool:
        return (state, event) in self.table

    def sources(self, *events: E) -> frozenset[S]:
        """The states in which at least one of ``events`` is legal: the guard set of those events,
        derived from the table (guards are never spelled out by hand elsewhere)."""
        wanted = frozenset(events)
        return frozenset(state for state, event in self.table if event in wanted)

    @property
    def states(self) -> tuple[S, ...]:
        return tuple(type(self.initial))

    @property
    def events(self) -> tuple[E, ...]:
        seen: dict[E, None] = {}
        for _state, event in self.table:
            seen.setdefault(event, None)
        return tuple(seen)

    def reachable(self) -> frozenset[S]:
        """States reachable from ``initial`` through the table."""
        found = {self.initial}
        frontier = [self.initial]
        while frontier:
            state = frontier.pop()
            for (source, _event), target in self.table.items():
                if source is state and target not in found:
                    found.add(target)
                    frontier.append(target)
        return frozenset(found)

    def rows(self) -> Iterable[tuple[S, E, S]]:
        for (state, event), target in self.table.items():
            yield state, event, target

    def build_machine(self, model: object | None = None) -> Any:
        """A ``transitions.Machine`` built from this very table (for checks and diagrams).

        ``model`` is the object that carries the ``state`` attribute (``transitions`` cannot decorate
        slotted attrs classes, so pass a plain object or nothing).
        """
        machine_transitions = [
            {"trigger": event.name, "source": state.name, "dest": target.name}
            for (state, event), target in self.table.items()
        ]
        return Machine(
            model=model if model is not None else "self",
            states=[state.name for state in self.states],
            transitions=machine_transitions,
            initial=self.initial.name,
            auto_transitions=False,
            ignore_invalid_triggers=False,
        )

    def markdown(self) -> str:
        """The table as Markdown rows (state | event | next state), as in ``docs/model.md``."""
        lines = [
            f"**{self.name}** (initial `{self.initial.name}`)",
            "",
            "| state | event | next |",
            "|---|---|---|",
        ]
        for state, event, target in self.rows():
            lines.append(f"| `{state.name}` | `{event.name}` | `{target.name}` |")
        return "\n".join(lines)
