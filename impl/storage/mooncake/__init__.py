"""L3 on a real Mooncake store (SPEC §4, §8; issue 4).

- :class:`MooncakeConfig` (:mod:`.config`): how to reach a cluster, from arguments, a file or the
  environment;
- :class:`MooncakeClient` (:mod:`.client`): the native client behind a state machine, so that it can
  never crash the process; native return codes become :class:`ErrorKind` values (:mod:`.codes`);
- :class:`LocalCluster` (:mod:`.cluster`): a ``mooncake_master`` plus a storage node (:mod:`.node`)
  on loopback, for tests, the replay command and trying kvstrata on one machine;
- :class:`MooncakeBackend` (:mod:`.backend`): the page-level
  :class:`~kvstrata.impl.storage.base.StorageBackend`, zero-copy from the host pool.

The backend is imported on first use: it needs torch (through the host pool), and the storage node
and the cluster launcher, which import this package, must start without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstrata.impl.storage.mooncake.client import ClientHealth, ClientState, MooncakeClient
from kvstrata.impl.storage.mooncake.cluster import LocalCluster, LocalClusterConfig
from kvstrata.impl.storage.mooncake.codes import ErrorKind, classify
from kvstrata.impl.storage.mooncake.config import ENV_VARS, MooncakeConfig
from kvstrata.impl.storage.mooncake.counters import ErrorCounters

if TYPE_CHECKING:
    from kvstrata.impl.storage.mooncake.backend import MooncakeBackend

__all__ = [
    "ENV_VARS",
    "ClientHealth",
    "ClientState",
    "ErrorCounters",
    "ErrorKind",
    "LocalCluster",
    "LocalClusterConfig",
    "MooncakeBackend",
    "MooncakeClient",
    "MooncakeConfig",
    "classify",
]


def __getattr__(name: str) -> Any:
    if name == "MooncakeBackend":
        from kvstrata.impl.storage.mooncake.backend import (  # noqa: PLC0415 (lazy: torch)
            MooncakeBackend,
        )

        return MooncakeBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
