"""Page hashes and namespaces (SPEC §4). Pure functions, no state, no I/O.

SHA-256, chained: the hash of page ``i`` covers the digest of page ``i - 1`` followed by the page's
token ids as 4-byte little-endian unsigned integers. A page hash therefore names the whole prefix that
ends with that page. The default namespace starts the chain from the empty string; any other namespace
starts it from a domain-separated digest of ``(extra_key, salt)``, so equal tokens in different
namespaces never share a hash. Nothing here uses ``hash()`` or a random seed (I8).

:mod:`kvstrata.model.keys` re-exports everything here: it stays the one module an external router
imports to predict kvstrata's store keys.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import attrs

from kvstrata.model.errors import KeyParseError, MisuseError

__all__ = [
    "DEFAULT_NAMESPACE",
    "Namespace",
    "PageHash",
    "chain_page_hashes",
    "content_hash",
]

_NAMESPACE_DOMAIN = b"kvstrata.namespace.v1\x00"
_CONTENT_DOMAIN = b"kvstrata.content.v1\x00"
_MAX_TOKEN = 2**32 - 1


def _check_digest(_instance: object, _attribute: object, value: bytes) -> None:
    if not isinstance(value, bytes) or len(value) != 32:
        raise MisuseError(f"a page hash is 32 bytes of SHA-256, got {value!r}")


@attrs.frozen(repr=False, cache_hash=True)
class PageHash:
    """The SHA-256 digest naming one page *and* its whole prefix (or, for embeddings, one media item)."""

    digest: bytes = attrs.field(validator=_check_digest)

    def hex(self) -> str:
        return self.digest.hex()

    @classmethod
    def from_hex(cls, text: str) -> PageHash:
        try:
            return cls(bytes.fromhex(text))
        except ValueError as exc:
            raise KeyParseError(f"not a hex page hash: {text!r}") from exc

    def __repr__(self) -> str:
        return f"PageHash({self.digest.hex()[:12]}…)"


@attrs.frozen(cache_hash=True)
class Namespace:
    """A cache namespace (LoRA id, tenant salt, ...). Namespaces never share pages or keys."""

    extra_key: str | None = None
    salt: str = ""

    @property
    def is_default(self) -> bool:
        return self.extra_key is None and self.salt == ""

    def seed(self) -> bytes:
        """The chain seed: empty for the default namespace, a domain-separated digest otherwise."""
        if self.is_default:
            return b""
        extra = b"\x00" if self.extra_key is None else b"\x01" + self.extra_key.encode()
        salt = self.salt.encode()
        payload = (
            _NAMESPACE_DOMAIN
            + struct.pack("<Q", len(extra))
            + extra
            + struct.pack("<Q", len(salt))
            + salt
        )
        return hashlib.sha256(payload).digest()

    def key_id(self) -> str:
        """The namespace as it appears in a store key."""
        return "default" if self.is_default else "ns-" + self.seed().hex()[:32]


DEFAULT_NAMESPACE = Namespace()


def chain_page_hashes(
    tokens: Sequence[int],
    page_size: int,
    namespace: Namespace = DEFAULT_NAMESPACE,
    parent: PageHash | None = None,
) -> tuple[PageHash, ...]:
    """The page hashes of every *full* page of ``tokens`` (a trailing partial page is ignored).

    ``parent`` continues an existing chain (the hash of the page just before ``tokens``); without it the
    chain starts from ``namespace``'s seed.
    """
    if page_size <= 0:
        raise MisuseError(f"page_size must be > 0, got {page_size}")
    pages = len(tokens) // page_size
    page_format = f"<{page_size}I"
    previous = parent.digest if parent is not None else namespace.seed()
    out: list[PageHash] = []
    for index in range(pages):
        page = tokens[index * page_size : (index + 1) * page_size]
        try:
            payload = struct.pack(page_format, *page)
        except struct.error as exc:
            raise MisuseError(f"token ids must be ints in [0, {_MAX_TOKEN}]: {exc}") from exc
        previous = hashlib.sha256(previous + payload).digest()
        out.append(PageHash(previous))
    return tuple(out)


def content_hash(data: bytes) -> PageHash:
    """A content hash for a media item (multimodal embedding cache, SPEC §6)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise MisuseError(f"content_hash takes bytes, got {type(data).__name__}")
    return PageHash(hashlib.sha256(_CONTENT_DOMAIN + bytes(data)).digest())
