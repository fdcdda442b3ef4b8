"""The file L3 backend's on-disk format (version 1; see :mod:`kvstrata.impl.storage.file`): object
names, the header, and the checks a reader runs on a file before trusting its payload."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import struct
import zlib

from kvstrata.impl.errors import MisuseError
from kvstrata.impl.storage.objects import Payload
from kvstrata.model.keys import StoreKey

__all__ = [
    "FORMAT_VERSION",
    "FULL_ERRNOS",
    "NAME_RE",
    "SHARD_RE",
    "SUFFIX",
    "TEMP_RE",
    "decode",
    "encode_header",
    "file_size",
    "object_name",
    "same_file",
]

FORMAT_VERSION = 1
_MAGIC = b"KVSF"
_HEADER = struct.Struct("<4sB3xIQI")
SUFFIX = ".kvs"
_DIGEST_BYTES = 20
SHARD_RE = re.compile(r"[0-9a-f]{2}")
NAME_RE = re.compile(rf"[0-9a-f]{{{2 * _DIGEST_BYTES}}}\.kvs")
TEMP_RE = re.compile(rf"\.[0-9a-f]{{{2 * _DIGEST_BYTES}}}\..*\.tmp")
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def object_name(key: StoreKey) -> str:
    """The fixed-length file name stem of ``key``'s object (40 hex digits)."""
    if not isinstance(key, StoreKey):
        raise MisuseError(f"object_name takes a StoreKey, got {key!r}")
    return hashlib.blake2b(key.text.encode(), digest_size=_DIGEST_BYTES).hexdigest()


def file_size(key_bytes: bytes, nbytes: int) -> int:
    return _HEADER.size + len(key_bytes) + nbytes


def encode_header(key_bytes: bytes, payload: Payload) -> bytes:
    crc = zlib.crc32(payload, zlib.crc32(key_bytes))
    return _HEADER.pack(_MAGIC, FORMAT_VERSION, len(key_bytes), len(payload), crc)


def decode(data: bytes, key_bytes: bytes, nbytes: int) -> memoryview | None:
    """The payload of a complete, intact object file of key ``key_bytes`` and ``nbytes`` payload
    bytes (a view into ``data``), or ``None`` for anything else."""
    if len(data) != file_size(key_bytes, nbytes):
        return None
    magic, version, key_length, payload_length, crc = _HEADER.unpack_from(data)
    start = _HEADER.size + key_length
    if (
        magic != _MAGIC
        or version != FORMAT_VERSION
        or key_length != len(key_bytes)
        or payload_length != nbytes
        or data[_HEADER.size : start] != key_bytes
    ):
        return None
    payload = memoryview(data)[start:]
    return payload if zlib.crc32(payload, zlib.crc32(key_bytes)) == crc else None


def same_file(a: os.stat_result, b: os.stat_result) -> bool:
    """Whether two stats describe the same file version (inode numbers are reused at once after an
    unlink, so the times take part too)."""
    fields = ("st_dev", "st_ino", "st_size", "st_mtime_ns", "st_ctime_ns")
    return all(getattr(a, field) == getattr(b, field) for field in fields)
