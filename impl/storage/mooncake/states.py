"""The :class:`~kvstrata.impl.storage.mooncake.client.MooncakeClient`'s lifecycle: its states, the
events that move it and the one table of transitions (re-exported by ``client``)."""

from __future__ import annotations

import enum
from typing import Final

__all__ = ["TRANSITIONS", "ClientEvent", "ClientHealth", "ClientState"]


class ClientState(enum.Enum):
    NEW = "new"
    READY = "ready"
    FAILED = "failed"
    CLOSED = "closed"


class ClientEvent(enum.Enum):
    SETUP_OK = "setup_ok"
    SETUP_FAILED = "setup_failed"
    CLOSE = "close"


TRANSITIONS: Final[dict[tuple[ClientState, ClientEvent], ClientState]] = {
    (ClientState.NEW, ClientEvent.SETUP_OK): ClientState.READY,
    (ClientState.NEW, ClientEvent.SETUP_FAILED): ClientState.FAILED,
    (ClientState.FAILED, ClientEvent.SETUP_OK): ClientState.READY,
    (ClientState.FAILED, ClientEvent.SETUP_FAILED): ClientState.FAILED,
    (ClientState.NEW, ClientEvent.CLOSE): ClientState.CLOSED,
    (ClientState.READY, ClientEvent.CLOSE): ClientState.CLOSED,
    (ClientState.FAILED, ClientEvent.CLOSE): ClientState.CLOSED,
    (ClientState.CLOSED, ClientEvent.CLOSE): ClientState.CLOSED,
}
"""The client's lifecycle, state x event -> state. Nothing else changes ``state``."""


class ClientHealth(enum.Enum):
    """What :meth:`MooncakeClient.health` can tell. A client that contributes no segment keeps
    reporting ``HEALTHY`` for a while after its master died (MOONCAKE.md §3.2): a hint, not a
    guarantee."""

    HEALTHY = "healthy"
    UNREACHABLE = "unreachable"
    NOT_READY = "not_ready"
