"""Byte sizes from configuration strings, and sizing of the host pool against the machine's memory.

Units (case-insensitive, optional space, an optional trailing ``b``/``B``):

- decimal (SI), like disk and most serving configs: ``k``/``kb`` = 1000, ``m``/``mb`` = 1000², ``g``/
  ``gb`` = 1000³, ``t``/``tb`` = 1000⁴;
- binary (IEC): ``ki``/``kib`` = 1024, ``mi``/``mib`` = 1024², ``gi``/``gib`` = 1024³, ``ti``/``tib`` =
  1024⁴;
- no unit (or ``b``): bytes.

So ``"4gb" == 4_000_000_000``, ``"512MiB" == 536_870_912``, ``"1.5G" == 1_500_000_000``. Fractions are
computed exactly and rounded down to whole bytes. A size must come to at least one byte.

A host pool that the machine cannot hold is refused here with :class:`ConfigError`: an unpinned
``torch.empty`` would succeed under Linux overcommit and be killed by the OOM killer once written, far
from the configuration mistake. "Can hold" means: at most the available memory (the smaller of
``/proc/meminfo`` ``MemAvailable`` and the cgroup limit minus usage; ``os.sysconf`` where there is no
``/proc``) minus a reserve (default: the larger of 256 MiB and 10 % of what is available, so small
pools still fit on small CI machines while a large pool leaves the process room to run).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from decimal import Decimal, InvalidOperation
from pathlib import Path

from kvstrata.impl.errors import ConfigError
from kvstrata.impl.pools.shape import KVShape

__all__ = [
    "DEFAULT_MIN_RESERVE",
    "DEFAULT_RESERVE_FRACTION",
    "available_host_memory",
    "check_host_fits",
    "host_pages_for",
    "parse_size",
]

DEFAULT_MIN_RESERVE = 256 << 20
"""At least this much host memory stays free after a host pool is allocated."""
DEFAULT_RESERVE_FRACTION = 0.10
"""... or this fraction of the available memory, whichever is larger."""

_SIZE_RE = re.compile(
    r"(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>(?:[kmgtp]i?)?)b?", re.IGNORECASE
)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(value: int | str, *, what: str = "size") -> int:
    """``value`` in bytes (see the module docstring for units); :class:`ConfigError` naming ``what``
    for anything else, and for sizes below one byte."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(f"{what}: expected an int of bytes or a string like '4gb', got {value!r}")
    if isinstance(value, int):
        result = value
    else:
        match = _SIZE_RE.fullmatch(value.strip())
        if match is None:
            raise ConfigError(
                f"{what}: expected a size like '4gb', '512MiB', '1.5G' or '1024', got {value!r}"
            )
        unit = match["unit"].lower()
        base = 1024 if unit.endswith("i") else 1000
        try:
            number = Decimal(match["number"])
        except InvalidOperation as error:  # pragma: no cover - the pattern only admits decimals
            raise ConfigError(f"{what}: cannot read the number in {value!r}") from error
        result = int(
            number * base ** _POWERS[unit[:1]]
        )  # int() truncates: whole bytes, rounded down
    if result < 1:
        raise ConfigError(f"{what}: expected at least 1 byte, got {value!r}")
    return result


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def _cgroup_headroom(
    root: Path = Path("/sys/fs/cgroup"), self_cgroup: Path = Path("/proc/self/cgroup")
) -> int | None:
    """Bytes this process's memory cgroup (and its ancestors) may still allocate: the smallest
    ``limit - usage`` over cgroup v2 ``memory.max`` / v1 ``memory.limit_in_bytes``; None without a
    limit we can read."""
    try:
        lines = self_cgroup.read_text(encoding="utf-8").splitlines()
    except OSError:
        lines = []
    places: list[tuple[Path, Path, str, str]] = []  # (directory, top, limit file, usage file)
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        relative = path.strip().lstrip("/")
        if hierarchy == "0" and not controllers:
            places.append((root / relative, root, "memory.max", "memory.current"))
        elif "memory" in controllers.split(","):
            top = root / "memory"
            places.append((top / relative, top, "memory.limit_in_bytes", "memory.usage_in_bytes"))
    best: int | None = None
    for directory, top, limit_file, usage_file in places:
        current = directory
        while True:
            limit, usage = _read_int(current / limit_file), _read_int(current / usage_file)
            if limit is not None and usage is not None and limit < 1 << 60:
                headroom = max(0, limit - usage)
                best = headroom if best is None else min(best, headroom)
            if current in (top, current.parent):
                break
            current = current.parent
    return best


def available_host_memory() -> int | None:
    """Bytes of host memory a new allocation can use now, or None if the platform does not say."""
    candidates: list[int] = []
    with (
        contextlib.suppress(OSError, ValueError),
        open("/proc/meminfo", encoding="ascii") as meminfo,
    ):
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                candidates.append(int(line.split()[1]) * 1024)  # the unit is kB (KiB)
                break
    if not candidates:
        with contextlib.suppress(AttributeError, OSError, ValueError):
            candidates.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    headroom = _cgroup_headroom()
    if headroom is not None:
        candidates.append(headroom)
    return min(candidates) if candidates else None


def check_host_fits(
    nbytes: int,
    *,
    what: str = "host pool",
    available: int | None = None,
    reserve: int | str | None = None,
) -> None:
    """:class:`ConfigError` unless ``nbytes`` of host memory fit in ``available`` (default:
    :func:`available_host_memory`; unknown means no check) minus ``reserve`` (default: the larger of
    :data:`DEFAULT_MIN_RESERVE` and :data:`DEFAULT_RESERVE_FRACTION` of ``available``)."""
    if available is None:
        available = available_host_memory()
        if available is None:
            return
    if reserve is None:
        keep = max(DEFAULT_MIN_RESERVE, int(available * DEFAULT_RESERVE_FRACTION))
    else:
        keep = parse_size(reserve, what="reserve")
    limit = available - keep
    if nbytes > limit:
        raise ConfigError(
            f"{what}: {nbytes} bytes ({nbytes / 2**30:.2f} GiB) do not fit in host memory: "
            f"{available / 2**30:.2f} GiB available, {keep / 2**30:.2f} GiB kept in reserve, so at "
            f"most {max(limit, 0) / 2**30:.2f} GiB; choose a smaller size or ratio"
        )


def host_pages_for(
    shape: KVShape,
    device_pages: int,
    ratio: float | None = None,
    size: int | str | None = None,
    *,
    available: int | None = None,
    reserve: int | str | None = None,
) -> int:
    """Pages of a host pool sized either as ``ratio`` times the device pool's ``device_pages`` or as
    ``size`` bytes (rounded down to whole pages); exactly one of the two must be given.

    :class:`ConfigError` when neither or both are given, when the result is less than one page, and
    when the machine cannot hold it (:func:`check_host_fits` with ``available`` and ``reserve``).
    """
    if not isinstance(shape, KVShape):
        raise ConfigError(f"host_pages_for.shape: expected a KVShape, got {shape!r}")
    if isinstance(device_pages, bool) or not isinstance(device_pages, int) or device_pages < 1:
        raise ConfigError(
            f"host_pages_for.device_pages: expected a positive int, got {device_pages!r}"
        )
    if (ratio is None) == (size is None):
        raise ConfigError(
            f"host_pages_for: give exactly one of ratio and size, got ratio={ratio!r}, size={size!r}"
        )
    if ratio is not None:
        if (
            isinstance(ratio, bool)
            or not isinstance(ratio, int | float)
            or not math.isfinite(ratio)
            or ratio <= 0
        ):
            raise ConfigError(f"host_pages_for.ratio: expected a positive number, got {ratio!r}")
        pages = math.floor(device_pages * ratio)
        origin = f"ratio {ratio} of {device_pages} device pages"
    else:
        assert size is not None
        nbytes = parse_size(size, what="host_pages_for.size")
        pages = nbytes // shape.bytes_per_page
        origin = f"size {size!r} ({nbytes} bytes)"
    if pages < 1:
        raise ConfigError(
            f"host_pages_for: {origin} is less than one page of {shape.bytes_per_page} bytes"
        )
    check_host_fits(
        shape.nbytes(pages),
        what=f"host pool of {pages} pages",
        available=available,
        reserve=reserve,
    )
    return pages
