"""The L3 store an engine plug-in talks to, chosen by the engine's extra config (issue 16).

Both adapters take their options as a flat mapping (sglang's
``--hicache-storage-backend-extra-config``, vLLM's ``kv_connector_extra_config``), parsed here once
into :class:`StoreOptions`:

``store``
    ``"mooncake"`` (the default), ``"memory"`` (this process only: tests) or ``"file"``.
``master``
    the Mooncake master ``host:port``; default ``$KVSTRATA_MOONCAKE_MASTER``. Required for
    ``mooncake`` (from one or the other).
``mooncake``
    a mapping of further :class:`~kvstrata.impl.storage.mooncake.MooncakeConfig` fields
    (``protocol``, ``device_name``, ``local_hostname``, ``global_segment_size``, ...); environment
    variables ``KVSTRATA_MOONCAKE_*`` fill what it leaves out.
``path``
    the directory of the ``file`` store (required for it).
``capacity``
    the byte budget of a ``memory`` or ``file`` store (``"4gib"`` or an int); default unbounded.
``tag``, ``tenant``
    the deployment tag and tenant namespace of every key (instances share pages only when both are
    equal; see :mod:`kvstrata.model.engines`).
``key_schema``
    ``1`` (the default: one object per K and V plane, what running deployments hold) or ``2`` (one
    object per page, issue 20); part of the key space, so instances share pages only under the same
    one.
``memory_store``
    a :class:`~kvstrata.impl.storage.memory.MemoryStore` object to share between instances of one
    process (tests build two instances on one store this way).

Any other key is refused with a :class:`ConfigError` that names it (a typo is not a default), except
the keys the engine itself reads from the same mapping (``ENGINE_KEYS``).

Opening: :func:`open_backend` builds the backend for a key space. A Mooncake master that cannot be
reached is not an error of the engine: the backend is ``None`` and the caller serves no L3 (every
lookup misses, every store is refused) after logging why, once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import attrs

from kvstrata.impl.errors import ConfigError, StoreUnavailable
from kvstrata.impl.storage.base import StorageBackend
from kvstrata.impl.storage.file import FileBackend
from kvstrata.impl.storage.memory import MemoryBackend, MemoryStore
from kvstrata.impl.storage.mooncake import MooncakeBackend, MooncakeConfig
from kvstrata.model.keys import KeySpace

__all__ = ["ENGINE_KEYS", "STORES", "StoreOptions", "open_backend"]

log = logging.getLogger("kvstrata.integrations")

STORES = ("mooncake", "memory", "file")

ENGINE_KEYS = frozenset(
    {
        # sglang: the dynamic backend's loader and the keys its cache controller reads
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "tp_lcm_size",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
    }
)
"""Keys of the engine's own that may share the mapping; kvstrata ignores them."""

_OWN_KEYS = (
    "store",
    "master",
    "mooncake",
    "path",
    "capacity",
    "tag",
    "tenant",
    "key_schema",
    "memory_store",
)


def _optional_text(values: Mapping[str, Any], key: str, where: str) -> str | None:
    value = values.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where}: key {key!r} expects a non-empty string, got {value!r}")
    return value.strip()


@attrs.frozen
class StoreOptions:
    """The parsed store options. Invariants: ``store`` is one of :data:`STORES`; a ``mooncake``
    store has a valid :attr:`mooncake` config; a ``file`` store has a ``path``."""

    store: str
    mooncake: MooncakeConfig | None = None
    path: str | None = None
    capacity: int | str | None = None
    tag: str | None = None
    tenant: str = ""
    memory_store: MemoryStore | None = None
    key_schema: int = 1

    @classmethod
    def parse(
        cls,
        values: Mapping[str, Any] | None,
        *,
        where: str,
        env: Mapping[str, str] | None = None,
        own: frozenset[str] = frozenset(),
    ) -> StoreOptions:
        """Options from an engine's extra-config mapping; :class:`ConfigError` naming the key for
        anything unknown or malformed. ``own`` names the keys the calling adapter reads itself;
        ``env`` defaults to ``os.environ``."""
        values = {} if values is None else values
        if not isinstance(values, Mapping):
            raise ConfigError(f"{where}: the extra config must be a mapping, got {values!r}")
        unknown = sorted(
            str(key) for key in values if key not in _OWN_KEYS and key not in ENGINE_KEYS | own
        )
        if unknown:
            raise ConfigError(
                f"{where}: unknown key {unknown[0]!r} in the extra config "
                f"(kvstrata reads {', '.join(sorted({*_OWN_KEYS, *own}))})"
            )
        store = (_optional_text(values, "store", where) or "mooncake").lower()
        if store not in STORES:
            raise ConfigError(f"{where}: key 'store' expects one of {STORES}, got {store!r}")
        tag = _optional_text(values, "tag", where)
        tenant = _optional_text(values, "tenant", where) or ""
        capacity = values.get("capacity")
        if capacity is not None and (
            isinstance(capacity, bool) or not isinstance(capacity, int | str)
        ):
            raise ConfigError(
                f"{where}: key 'capacity' expects bytes or a size string, got {capacity!r}"
            )
        shared = values.get("memory_store")
        if shared is not None and not isinstance(shared, MemoryStore):
            raise ConfigError(f"{where}: key 'memory_store' expects a MemoryStore, got {shared!r}")
        path = _optional_text(values, "path", where)
        key_schema = values.get("key_schema", 1)
        if key_schema not in (1, 2, "1", "2") or isinstance(key_schema, bool):
            raise ConfigError(f"{where}: key 'key_schema' expects 1 or 2, got {key_schema!r}")
        if store == "memory" and shared is None:
            # one store for every backend these options open in this process (an adapter opens
            # several: sglang's page and flat paths must see each other's pages)
            shared, capacity = MemoryStore(capacity), None
        mooncake = None
        if store == "mooncake":
            mooncake = _mooncake_config(values, where, os.environ if env is None else env)
        elif store == "file" and path is None:
            raise ConfigError(f"{where}: key 'path' is required for store 'file'")
        return cls(store, mooncake, path, capacity, tag, tenant, shared, int(key_schema))


def _mooncake_config(
    values: Mapping[str, Any], where: str, env: Mapping[str, str]
) -> MooncakeConfig:
    fields = values.get("mooncake") or {}
    if not isinstance(fields, Mapping):
        raise ConfigError(f"{where}: key 'mooncake' expects a mapping of MooncakeConfig fields")
    overrides = {str(name): value for name, value in fields.items()}
    master = _optional_text(values, "master", where)
    if master is not None:
        overrides["master"] = master
    try:
        return MooncakeConfig.load(env=env, **overrides)
    except ConfigError as error:
        raise ConfigError(f"{where}: key 'master' / 'mooncake': {error}") from error


def open_backend(
    options: StoreOptions, keyspace: KeySpace, *, writer: bool
) -> StorageBackend | None:
    """The backend ``options`` names for ``keyspace``; ``None`` (logged) when a Mooncake master
    cannot be reached, so the engine runs without L3 rather than failing."""
    if options.store == "memory":
        return MemoryBackend(
            keyspace, store=options.memory_store, capacity_bytes=options.capacity, writer=writer
        )
    if options.store == "file":
        assert options.path is not None  # parse() guarantees it
        return FileBackend(keyspace, options.path, capacity_bytes=options.capacity, writer=writer)
    assert options.mooncake is not None  # parse() guarantees it
    try:
        return MooncakeBackend(options.mooncake, keyspace, writer=writer)
    except StoreUnavailable as error:
        log.error("kvstrata: no L3 (Mooncake master %s): %s", options.mooncake.master, error)
        return None
