"""The file L3 backend: one file per object under a root directory that several processes may share.

Names
    An object of key ``k`` lives at ``<root>/<n[:2]>/<n>.kvs`` where ``n`` is the 40-hex-digit BLAKE2b
    digest of ``k``'s rendered text: fixed length (a rendered key can exceed ``NAME_MAX``) and spread
    over 256 shard directories. The full key text is inside the file.

Format (version 1)
    a 24-byte header ``<4sB3xIQI``: magic ``b"KVSF"``, version ``1``, key length, payload length and
    the CRC-32 of key bytes followed by payload; then the key text (UTF-8); then the payload. A reader
    checks all of it, so a foreign, truncated or corrupt file is a miss, and ``get`` removes it
    (only if the path still names the file version it read, so a concurrent rewrite is not lost). ``exists``
    only compares the file's size with the exact size the object must have: one ``stat`` per object.
    CRC-32 (``zlib``, several GB/s) detects accidental damage; nothing here defends against an
    adversary who can write the directory.

Atomic writes
    A put writes ``.<n>.<random>.tmp`` in the object's own directory, optionally ``fsync`` s it, stamps
    its mtime and ``os.replace`` s it onto the final name, so a visible file is always complete. A
    crash leaves at most a temp file: readers never look at one, and a scan removes those older than
    ``stale_temp_s``. ``fsync=False`` (the default) survives a process crash, which is what a cache
    needs; ``fsync=True`` also flushes data and directory so a ``STORED`` object survives power loss.

Size cap and recency
    With ``capacity_bytes``, an in-memory index (file name → size, least recently used first), built by
    scanning the root at construction in mtime order, is kept under the cap: a put evicts least
    recently used files (never one of the page being written) until the page's new files fit, or
    answers ``FULL`` without evicting anything if they cannot. Writes and successful reads stamp the
    file's mtime from the injected ``clock``, so recency survives restarts and is shared by processes.
    A scan evicts down to the cap at once (the cap may have shrunk since the last run).

Free space
    Whatever the cap, a put keeps ``min_free_bytes`` free on the file system (default: 5 % of it,
    at most 1 GiB): it evicts least recently used files first, or answers ``FULL`` (counted, nothing
    stored evicted) when its files cannot fit above the reserve. So a full disk is a smaller cache,
    never a disk the rest of the machine cannot write.

Sharing
    Existence is the file system's truth: another process's files are hits, and files that another
    process evicted are misses. The index only steers eviction: it learns files that ``exists``/``get``
    find and forgets files found gone; :meth:`FileBackend.rescan` rebuilds it. With several writers
    each keeps the cap by its own view, so the total can exceed it by what the others wrote since.

Errors
    Misuse raises (see ``base``). File-system errors never do: ``ENOSPC``/``EDQUOT`` make a put
    ``FULL``, any other ``OSError`` makes it ``FAILED`` (a get ``FAILED``, ``exists`` stop counting),
    and each is counted in ``counters.io_errors``.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvstrata.impl.errors import ConfigError
from kvstrata.impl.pools.sizes import parse_size
from kvstrata.impl.storage.base import GetStatus, PutStatus
from kvstrata.impl.storage.file_format import (
    FORMAT_VERSION,
    FULL_ERRNOS,
    NAME_RE,
    SHARD_RE,
    SUFFIX,
    TEMP_RE,
    decode,
    encode_header,
    file_size,
    object_name,
    same_file,
)
from kvstrata.impl.storage.objects import ObjectBackend, Payload
from kvstrata.model.keys import KeySpace, Namespace, PageHash, StoreKey

__all__ = ["FORMAT_VERSION", "FileBackend", "object_name"]


class FileBackend(ObjectBackend):
    """An L3 backend storing one file per object under ``root`` (see the module docstring).

    ``capacity_bytes`` (an int or a size string) caps the bytes of object files, headers included;
    ``None`` means no cap; ``min_free_bytes`` is the file system's free space puts never use
    (``free_bytes`` reads it; injectable for tests). ``writer=False`` makes every put
    ``SKIPPED``. ``fsync`` makes stored objects durable across power loss. ``clock`` (nanoseconds
    since the epoch) stamps recency; inject one to make LRU order deterministic in tests.
    Thread-safe: one lock guards the index.
    """

    name = "file"
    root: Path
    capacity_bytes: int | None
    fsync: bool

    def __init__(
        self,
        keyspace: KeySpace,
        root: str | os.PathLike[str],
        *,
        capacity_bytes: int | str | None = None,
        writer: bool = True,
        fsync: bool = False,
        clock: Callable[[], int] = time.time_ns,
        stale_temp_s: float = 3600.0,
        min_free_bytes: int | str | None = None,
        free_bytes: Callable[[], int] | None = None,
    ) -> None:
        super().__init__(keyspace, writer=writer)
        if not isinstance(root, str | os.PathLike):
            raise ConfigError(f"FileBackend.root: expected a path, got {root!r}")
        if not isinstance(fsync, bool):
            raise ConfigError(f"FileBackend.fsync: expected a bool, got {fsync!r}")
        if not callable(clock):
            raise ConfigError(f"FileBackend.clock: expected a callable, got {clock!r}")
        if (
            isinstance(stale_temp_s, bool)
            or not isinstance(stale_temp_s, int | float)
            or not (stale_temp_s > 0)
        ):
            raise ConfigError(
                f"FileBackend.stale_temp_s: expected a positive number, got {stale_temp_s!r}"
            )
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(
                f"FileBackend.root: cannot create {str(self.root)!r}: {error}"
            ) from error
        self.capacity_bytes = (
            None
            if capacity_bytes is None
            else parse_size(capacity_bytes, what="FileBackend.capacity_bytes")
        )
        self.fsync = fsync
        self._free = free_bytes or (lambda: shutil.disk_usage(self.root).free)
        self.min_free_bytes = (
            min(1 << 30, shutil.disk_usage(self.root).total // 20)
            if min_free_bytes is None
            else parse_size(min_free_bytes, what="FileBackend.min_free_bytes")
        )
        self._clock = clock
        self._stale_temp_ns = int(stale_temp_s * 1e9)
        self._lock = threading.Lock()
        self._index: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._used = 0
        try:
            os.scandir(self.root).close()
        except OSError as error:
            raise ConfigError(
                f"FileBackend.root: cannot read {str(self.root)!r}: {error}"
            ) from error
        self.rescan()

    # ------------------------------------------------------------------------------------ public extras
    def rescan(self) -> None:
        """Rebuild the index from the files under ``root`` (mtime order), remove stale temp files and
        evict down to the cap."""
        now = self._clock()
        found: list[tuple[int, str, int]] = []
        stale: list[str] = []
        errors = 0
        try:
            shards = [
                entry
                for entry in os.scandir(self.root)
                if SHARD_RE.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)
            ]
        except OSError:
            shards, errors = [], 1
        for shard in shards:
            try:
                entries = list(os.scandir(shard.path))
            except OSError:  # vanished or unreadable
                errors += 1
                continue
            for entry in entries:
                try:
                    if NAME_RE.fullmatch(entry.name) and entry.name.startswith(shard.name):
                        stat = entry.stat()
                        found.append((stat.st_mtime_ns, entry.name[: -len(SUFFIX)], stat.st_size))
                    elif (
                        TEMP_RE.fullmatch(entry.name)
                        and now - entry.stat().st_mtime_ns > self._stale_temp_ns
                    ):
                        stale.append(entry.path)
                except OSError:
                    errors += 1
        for path in stale:
            with contextlib.suppress(OSError):
                os.unlink(path)
        found.sort()
        with self._lock:
            self._index = collections.OrderedDict((name, size) for _, name, size in found)
            self._used = sum(size for _, _, size in found)
            cap = self.capacity_bytes
            evicted = self._evict_locked(self._used - cap, frozenset()) if cap is not None else 0
        self.counters.add(objects_evicted=evicted or 0, io_errors=errors)

    @property
    def used_bytes(self) -> int:
        """Bytes of the object files the index knows."""
        with self._lock:
            return self._used

    def indexed(self) -> tuple[str, ...]:
        """The object names the index knows, least recently used first."""
        with self._lock:
            return tuple(self._index)

    def path_of(self, key: StoreKey) -> Path:
        """Where ``key``'s object file lives."""
        name = object_name(key)
        return self.root / name[:2] / (name + SUFFIX)

    def evict(self, namespace: Namespace, page: PageHash, component: str | None = None) -> int:
        """Remove ``page``'s object files (only ``component``'s when given), as the cap's own
        eviction would; how many files were removed."""
        return self.drop(self._component_keys(namespace, page, component))

    def drop(self, keys: Sequence[StoreKey]) -> int:
        """Remove the object files of ``keys`` (any pool's), as the cap's own eviction would; how
        many files were removed."""
        removed = 0
        for key in keys:
            name = object_name(key)
            with self._lock:
                self._forget_locked(name)
            try:
                os.unlink(self.path_of(key))
            except FileNotFoundError:
                continue
            except OSError:
                self.counters.add(io_errors=1)
                continue
            removed += 1
        return removed

    # ---------------------------------------------------------------------------------- object layer
    def _present(self, keys: Sequence[StoreKey], nbytes: int) -> list[bool] | None:
        out = []
        for key in keys:
            name, expected = object_name(key), file_size(key.text.encode(), nbytes)
            try:
                size = self.path_of(key).stat().st_size
            except FileNotFoundError:
                with self._lock:
                    self._forget_locked(name)
                out.append(False)
                continue
            except OSError:
                self.counters.add(io_errors=1)
                return None
            if size == expected:
                with self._lock:
                    self._learn_locked(name, size)
            out.append(size == expected)
        return out

    def _write(
        self, objects: Sequence[tuple[StoreKey, Payload]], page_keys: Sequence[StoreKey]
    ) -> PutStatus:
        files = [(key, object_name(key), key.text.encode(), data) for key, data in objects]
        sizes = {name: file_size(key_bytes, len(data)) for _, name, key_bytes, data in files}
        with self._lock:
            need = sum(size - self._index.get(name, 0) for name, size in sizes.items())
            excess = self.min_free_bytes - (self._free_now() - need)  # below the reserve
            if self.capacity_bytes is not None:
                excess = max(excess, self._used + need - self.capacity_bytes)
            evicted = 0
            if excess > 0:
                protect = frozenset(object_name(key) for key in page_keys)
                evicted_or_none = self._evict_locked(excess, protect)
                if evicted_or_none is None:
                    return PutStatus.FULL
                evicted = evicted_or_none
            for name, size in sizes.items():  # reserve the room now; undone below on failure
                self._forget_locked(name)
                self._index[name] = size
                self._used += size
        self.counters.add(objects_evicted=evicted)
        for done, (key, name, key_bytes, data) in enumerate(files):
            try:
                self._write_file(self.path_of(key), name, key_bytes, data)
            except OSError as error:
                with self._lock:
                    for _, unwritten, _, _ in files[done:]:
                        self._forget_locked(unwritten)
                self.counters.add(io_errors=1)
                return PutStatus.FULL if error.errno in FULL_ERRNOS else PutStatus.FAILED
        return PutStatus.STORED

    def _read(self, keys: Sequence[StoreKey], nbytes: int) -> list[Payload] | GetStatus:
        payloads: list[Payload] = []
        for key in keys:
            path, name, key_bytes = self.path_of(key), object_name(key), key.text.encode()
            try:
                with open(path, "rb") as file:
                    data = file.read(file_size(key_bytes, nbytes) + 1)
                    identity = os.fstat(file.fileno())
            except FileNotFoundError:
                with self._lock:
                    self._forget_locked(name)
                return GetStatus.MISSING
            except OSError:
                self.counters.add(io_errors=1)
                return GetStatus.FAILED
            payload = decode(data, key_bytes, nbytes)
            if payload is None:
                self._discard(path, name, identity)
                return GetStatus.MISSING
            payloads.append(payload)
        now = self._clock()
        for key in keys:
            with contextlib.suppress(
                OSError
            ):  # evicted meanwhile: the bytes we hold are still good
                os.utime(self.path_of(key), ns=(now, now))
            with self._lock:
                name = object_name(key)
                if name in self._index:
                    self._index.move_to_end(name)
        return payloads

    # --------------------------------------------------------------------------------------- helpers
    def _write_file(self, path: Path, name: str, key_bytes: bytes, payload: Payload) -> None:
        """Write one object file atomically (temp file, then ``os.replace``)."""
        try:
            fd, temp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=path.parent)
        except FileNotFoundError:  # first object of this shard (or the shard was removed)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, temp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(encode_header(key_bytes, payload))
                file.write(key_bytes)
                file.write(payload)
                if self.fsync:
                    file.flush()
                    os.fsync(file.fileno())
            now = self._clock()
            os.utime(temp, ns=(now, now))
            os.replace(temp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
        if self.fsync:
            directory = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)

    def _discard(self, path: Path, name: str, identity: os.stat_result) -> None:
        """Remove an invalid object file, unless ``path`` now names another file."""
        with self._lock:
            self._forget_locked(name)
        try:
            now = path.stat()
            if same_file(now, identity):
                path.unlink()
                self.counters.add(objects_discarded=1)
        except FileNotFoundError:
            pass
        except OSError:
            self.counters.add(io_errors=1)

    def _learn_locked(self, name: str, size: int) -> None:
        """Index a file found on disk (another process wrote it) as most recently used."""
        if name not in self._index:
            self._index[name] = size
            self._used += size

    def _forget_locked(self, name: str) -> None:
        size = self._index.pop(name, None)
        if size is not None:
            self._used -= size

    def _free_now(self) -> int:
        try:
            return int(self._free())
        except OSError:  # cannot tell: do not block puts on it
            return 1 << 62

    def _evict_locked(self, excess: int, protect: frozenset[str]) -> int | None:
        """Remove least recently used files outside ``protect`` until ``excess`` bytes are freed:
        how many were removed, or ``None`` (and nothing removed) if they cannot be."""
        if excess <= 0:
            return 0
        victims, freed = [], 0
        for name, size in self._index.items():
            if freed >= excess:
                break
            if name not in protect:
                victims.append(name)
                freed += size
        if freed < excess:
            return None
        for name in victims:
            self._forget_locked(name)
            try:
                os.unlink(self.root / name[:2] / (name + SUFFIX))
            except FileNotFoundError:  # another process evicted it first
                pass
            except OSError:
                self.counters.add(io_errors=1)
        return len(victims)
