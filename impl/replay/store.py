"""The replay's L3: a storage backend of the chosen kind, sized from the L3 capacity, opened and closed
as one context (SPEC §8, §11).

- ``mooncake`` (the default): a :class:`~kvstrata.impl.storage.mooncake.LocalCluster` (a
  ``mooncake_master`` and a storage node on loopback) whose segment holds the L3 capacity, or, with
  ``master``, a configured cluster (its own segments decide the capacity). The scheduler-side client
  contributes no memory.
- ``memory``: a private in-process store of exactly the L3 capacity (objects are a page's bytes).
- ``file``: one file per object under ``l3_dir`` (a temporary directory, removed afterwards, when
  not given), capped at the L3 capacity plus the files' headers.

Batch size: Mooncake's batch calls fail beyond about 2,048 objects; the cache's L3 tier cuts backups
into ``StorageConfig.backup_batch_pages`` pages and the Mooncake backend cuts every native call into
at most ``MAX_BATCH_OBJECTS`` objects, so the replay uses the backend as it is.

Segment sizing: Mooncake's master starts evicting when a segment is 90 % full
(``eviction_high_watermark_ratio``), so the segment is ``ceil(pages * page bytes / 0.9)`` bytes, at
least Mooncake's 16 MiB minimum. Small objects carry allocation overhead, so the store holds a little
less than asked (98 % measured with 1 KiB pages); the result reports the segment size.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from collections.abc import Iterator

import attrs

from kvstrata.impl.replay.config import L3Backend, ReplayConfig
from kvstrata.impl.storage.base import StorageBackend
from kvstrata.model.keys import KeySpace, Namespace, PageHash, Shard

__all__ = [
    "WATERMARK",
    "L3Store",
    "open_l3",
    "segment_bytes",
]

WATERMARK = 0.9
"""Mooncake's default ``eviction_high_watermark_ratio``."""
_FILE_HEADER_BYTES = 24  # the file backend's fixed header per object (format version 1)


@attrs.frozen
class L3Store:
    """An open L3: the backend the cache uses and what to report about it."""

    backend: StorageBackend
    kind: str
    capacity_bytes: int | None  # what the store was sized to (None: a configured cluster's own)
    where: str  # the master address, the directory, or "in-process"


def segment_bytes(pages: int, page_nbytes: int) -> int:
    """The storage node's segment for ``pages`` pages: below the eviction watermark, >= 16 MiB."""
    from kvstrata.impl.storage.mooncake.config import MIN_SEGMENT_SIZE  # noqa: PLC0415

    return max(MIN_SEGMENT_SIZE, math.ceil(pages * page_nbytes / WATERMARK))


@contextlib.contextmanager
def _quiet_native_stderr() -> Iterator[None]:
    """Hide what native code writes to file descriptor 2 meanwhile: Mooncake's client logs an
    ``E... Local segment descriptor not found`` line on every setup of a client without a segment
    (harmless: that client has no segment by design). Python-level errors are still raised."""
    try:
        saved = os.dup(2)
    except OSError:  # no usable stderr: nothing to hide
        yield
        return
    try:
        with open(os.devnull, "wb") as sink:
            os.dup2(sink.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)


def _mooncake(
    stack: contextlib.ExitStack, config: ReplayConfig, keyspace: KeySpace, pages: int, nbytes: int
) -> L3Store:
    """The one place that drives the Mooncake pieces: start (or reach) a cluster, connect a client
    without a segment, and wrap it in the page backend. Everything opened is closed by ``stack``."""
    from kvstrata.impl.storage.mooncake import (  # noqa: PLC0415 (heavy; only when used)
        LocalCluster,
        MooncakeBackend,
        MooncakeClient,
        MooncakeConfig,
    )

    if config.master is not None:
        client_config = MooncakeConfig.load(master=config.master)
        capacity: int | None = None
        where = config.master
    else:
        capacity = segment_bytes(pages, nbytes)
        cluster = stack.enter_context(LocalCluster(segment_size=capacity))
        client_config = cluster.config
        where = cluster.master_address
    client = MooncakeClient(client_config)
    with _quiet_native_stderr():
        client.setup()
    stack.callback(client.close)  # after the backend (LIFO): the backend does not own the client
    backend = MooncakeBackend(client, keyspace)
    return L3Store(backend, "mooncake", capacity, where)


@contextlib.contextmanager
def open_l3(
    config: ReplayConfig, pages: int, page_nbytes: int, shard: Shard | None = None
) -> Iterator[L3Store | None]:
    """The L3 of ``config`` sized for ``pages`` pages of ``page_nbytes`` bytes (``None`` when L3 is
    off), keyed for ``shard`` (a TP rank's; the whole model by default). The backend itself is
    closed by the cache that uses it; whatever else was started (a cluster, a client, a temporary
    directory) is stopped when the context exits."""
    if not config.has_l3:
        yield None
        return
    identity = config.shape.identity(config.page_size, config.seed)
    keyspace = KeySpace(identity, shard=shard or Shard(), tag="replay", schema=config.key_schema)
    with contextlib.ExitStack() as stack:
        if config.l3_backend is L3Backend.MOONCAKE:
            yield _mooncake(stack, config, keyspace, pages, page_nbytes)
        elif config.l3_backend is L3Backend.MEMORY:
            from kvstrata.impl.storage.memory import MemoryBackend  # noqa: PLC0415

            capacity = pages * page_nbytes
            yield L3Store(
                MemoryBackend(keyspace, capacity_bytes=capacity), "memory", capacity, "in-process"
            )
        else:
            from kvstrata.impl.storage.file import FileBackend  # noqa: PLC0415

            root = config.l3_dir
            if root is None:
                root = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvstrata-l3-"))
            per_object = sum(
                _FILE_HEADER_BYTES + len(str(key).encode()) for key in _sample_keys(keyspace)
            )
            capacity = pages * (page_nbytes + per_object)
            yield L3Store(
                FileBackend(keyspace, root, capacity_bytes=capacity), "file", capacity, str(root)
            )


def _sample_keys(keyspace: KeySpace) -> tuple[object, ...]:
    """The keys of one page (their length is the same for every page)."""

    return keyspace.page_keys(Namespace(), PageHash(bytes(32)))
