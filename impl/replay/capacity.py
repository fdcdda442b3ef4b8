"""Tier capacities as a user writes them: tokens (``3M``, ``12m``, ``500k``, ``4096``), bytes (``4gb``,
``512MiB``, ``1024b``), ``inf`` (room for the whole trace) or ``0`` / ``off`` (no such tier).

Rules, case-insensitive:

- a number with an optional ``k`` / ``m`` / ``g`` / ``t`` suffix counts **tokens** (decimal: ``3M`` is
  3,000,000 tokens);
- a number with a unit ending in ``b`` counts **bytes**, with the units of
  :func:`kvstrata.impl.pools.sizes.parse_size` (``kb`` = 1000, ``kib`` = 1024, ...);
- ``inf`` / ``infinity`` / ``unbounded``: as many pages as the replayed trace has full pages (nothing is
  ever evicted);
- ``0`` / ``off`` / ``none``: the tier is off (only where a tier may be off: L2 and L3).

A capacity becomes whole pages with :meth:`Capacity.pages` (rounded down); one that cannot hold a
single page is a :class:`~kvstrata.impl.errors.ConfigError` naming the flag.
"""

from __future__ import annotations

import enum
import re
from decimal import Decimal

import attrs

from kvstrata.impl.errors import ConfigError

__all__ = ["Capacity", "CapacityKind"]

_TOKENS_RE = re.compile(r"(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[kmgt]?)", re.IGNORECASE)
_BYTES_RE = re.compile(r"(?:\d+(?:\.\d*)?|\.\d+)\s*(?:[kmgtp]i?)?b", re.IGNORECASE)
_TOKEN_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_UNBOUNDED = frozenset({"inf", "infinity", "unbounded"})
_OFF = frozenset({"off", "none"})


class CapacityKind(enum.Enum):
    TOKENS = "tokens"
    BYTES = "bytes"
    UNBOUNDED = "inf"
    OFF = "off"


@attrs.frozen
class Capacity:
    """A tier's capacity as given. ``amount`` is tokens or bytes (0 for ``inf`` and ``off``);
    ``text`` is what the user wrote (for messages and the JSON result)."""

    kind: CapacityKind
    amount: int = 0
    text: str = ""

    @classmethod
    def parse(cls, text: str | int, *, flag: str = "capacity", allow_off: bool = True) -> Capacity:
        """The capacity ``text`` names (see the module docstring); :class:`ConfigError` naming
        ``flag`` otherwise."""
        raw = str(text).strip()
        word = raw.lower()
        if word in _UNBOUNDED:
            return cls(CapacityKind.UNBOUNDED, 0, raw)
        if word in _OFF or (_TOKENS_RE.fullmatch(word) and Decimal(_number(word)) == 0):
            if not allow_off:
                raise ConfigError(f"{flag}: this tier cannot be off, got {raw!r}")
            return cls(CapacityKind.OFF, 0, raw)
        tokens = _TOKENS_RE.fullmatch(word)
        if tokens is not None:
            amount = int(Decimal(tokens["number"]) * _TOKEN_UNITS[tokens["unit"].lower()])
            if amount < 1:
                raise ConfigError(f"{flag}: {raw!r} is less than one token")
            return cls(CapacityKind.TOKENS, amount, raw)
        if _BYTES_RE.fullmatch(word):
            from kvstrata.impl.pools.sizes import parse_size  # noqa: PLC0415 (imports torch)

            return cls(CapacityKind.BYTES, parse_size(raw, what=flag), raw)
        raise ConfigError(
            f"{flag}: expected tokens like '3M' or '500k', bytes like '4gb' or '512MiB', 'inf'"
            + (" or 0" if allow_off else "")
            + f", got {raw!r}"
        )

    @property
    def is_off(self) -> bool:
        return self.kind is CapacityKind.OFF

    def pages(
        self, page_size: int, bytes_per_token: int, unbounded_pages: int, *, flag: str
    ) -> int:
        """Whole pages of ``page_size`` tokens of ``bytes_per_token`` bytes each (0 when off;
        ``unbounded_pages`` for ``inf``). :class:`ConfigError` naming ``flag`` when the capacity is
        less than one page."""
        if self.kind is CapacityKind.OFF:
            return 0
        if self.kind is CapacityKind.UNBOUNDED:
            return max(1, unbounded_pages)
        page_bytes = page_size * bytes_per_token
        if self.kind is CapacityKind.TOKENS:
            pages = self.amount // page_size
            given = f"{self.amount} tokens"
        else:
            pages = self.amount // page_bytes
            given = f"{self.amount} bytes"
        if pages < 1:
            raise ConfigError(
                f"{flag} {self.text}: {given} cannot hold one page ({page_size} tokens of "
                f"{bytes_per_token} bytes = {page_bytes} bytes)"
            )
        return pages

    def __str__(self) -> str:
        return self.text or self.kind.value


def _number(word: str) -> str:
    match = _TOKENS_RE.fullmatch(word)
    assert match is not None
    return match["number"]
