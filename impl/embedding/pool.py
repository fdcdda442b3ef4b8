"""The host pool of the embedding cache: ``units`` fixed-size units of ``unit_tokens`` rows of
``dim`` elements, in one contiguous host tensor that a store may register for zero-copy.

An embedding of ``tokens`` rows takes ``ceil(tokens / unit_tokens)`` units: the lowest run of
adjacent free units when there is one (then the entry is one in-place view of the pool), else any
free units (paged allocation: fragmentation never refuses room, it only costs the single view).
Unit ``i`` of an entry holds rows ``[i * unit_tokens, (i + 1) * unit_tokens)``; the last unit may
be partly used.

Invariants: a unit is free or allocated, never both; :meth:`alloc` hands out only free units and
:meth:`free` takes back only allocated ones (anything else is a :class:`MisuseError`). The pool
knows nothing of entries, pins or LRU: the cache owns those.
"""

from __future__ import annotations

import attrs
import torch

from kvstrata.impl.errors import ConfigError, MisuseError

__all__ = ["EmbeddingPool", "PoolShape"]

_FREE, _USED = b"\x01", b"\x00"


def _positive(_instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"PoolShape.{attribute.name} must be an int > 0, got {value!r}")


def _dtype(_instance: object, _attribute: object, value: torch.dtype) -> None:
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ConfigError(f"PoolShape.dtype must be a floating torch dtype, got {value!r}")


@attrs.frozen
class PoolShape:
    """The geometry of an embedding pool."""

    units: int = attrs.field(validator=_positive)
    unit_tokens: int = attrs.field(validator=_positive)
    dim: int = attrs.field(validator=_positive)
    dtype: torch.dtype = attrs.field(validator=_dtype)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def unit_nbytes(self) -> int:
        return self.unit_tokens * self.dim * self.itemsize

    def units_for(self, tokens: int) -> int:
        """How many units an embedding of ``tokens`` rows takes."""
        return -(-tokens // self.unit_tokens)

    def rows(self, tokens: int, index: int) -> int:
        """How many rows unit ``index`` of an embedding of ``tokens`` rows holds."""
        return min(self.unit_tokens, tokens - index * self.unit_tokens)


class EmbeddingPool:
    """Fixed-size units in one host tensor (see the module docstring)."""

    def __init__(self, shape: PoolShape, *, pin_memory: bool = False) -> None:
        if not isinstance(shape, PoolShape):
            raise ConfigError(f"EmbeddingPool takes a PoolShape, got {shape!r}")
        self.shape = shape
        self.buffer = torch.zeros(
            (shape.units, shape.unit_tokens, shape.dim), dtype=shape.dtype, pin_memory=pin_memory
        )
        self._rows = self.buffer.view(-1, shape.dim)  # every unit's rows, end to end
        # One byte per unit, FREE or USED: a run of free units is found by a C-speed search.
        self._map = bytearray(_FREE * shape.units)
        self._free_count = shape.units
        self._ptr = int(self.buffer.data_ptr())  # the buffer is never replaced
        self.row_nbytes = shape.dim * shape.itemsize
        """The bytes of one row (one token's embedding)."""
        self._unit_nbytes = shape.unit_nbytes

    @property
    def ptr(self) -> int:
        return self._ptr

    @property
    def nbytes(self) -> int:
        return self.shape.units * self.shape.unit_nbytes

    @property
    def free_count(self) -> int:
        return self._free_count

    @property
    def used_count(self) -> int:
        return self.shape.units - self._free_count

    def alloc(self, count: int) -> tuple[int, ...]:
        """``count`` free units (the caller planned room: too few free units is misuse): the
        lowest run of adjacent free units when there is one (so the entry is one view of the
        pool, :meth:`view`), else the lowest free units."""
        if count > self._free_count:
            raise MisuseError(f"embedding pool: {count} units asked, {self._free_count} free")
        if count == 1:  # the common case (an embedding in one unit): any free unit is a run
            at = self._map.find(_FREE)
            self._map[at] = _USED[0]
            self._free_count -= 1
            return (at,)
        at = self._map.find(_FREE * count)
        if at >= 0:
            units = tuple(range(at, at + count))
        else:
            found: list[int] = []
            at = -1
            while len(found) < count:
                at = self._map.find(_FREE, at + 1)
                found.append(at)
            units = tuple(found)
        for unit in units:
            self._map[unit] = _USED[0]
        self._free_count -= count
        return units

    def free(self, units: tuple[int, ...]) -> None:
        size, used = self.shape.units, _USED[0]
        if len(units) == 1:  # the common case, checked the same way
            (unit,) = units
            if not (0 <= unit < size and self._map[unit] == used):
                raise MisuseError(f"embedding pool: freeing units {units} that are not allocated")
            self._map[unit] = _FREE[0]
            self._free_count += 1
            return
        if len(set(units)) != len(units) or any(
            not 0 <= unit < size or self._map[unit] != used for unit in units
        ):
            raise MisuseError(f"embedding pool: freeing units {units} that are not allocated")
        for unit in units:
            self._map[unit] = _FREE[0]
        self._free_count += len(units)

    def view(self, units: tuple[int, ...], tokens: int) -> torch.Tensor | None:
        """The ``[tokens, dim]`` embedding held in ``units``, in place (no copy), when they are
        adjacent and in order; ``None`` otherwise (:meth:`segments`)."""
        first = units[0]
        if len(units) > 1 and (
            units[-1] - first != len(units) - 1 or units != tuple(range(first, first + len(units)))
        ):
            return None
        row = first * self.shape.unit_tokens
        return self._rows[row : row + tokens]

    def segments(self, units: tuple[int, ...], tokens: int) -> tuple[torch.Tensor, ...]:
        """The ``[rows, dim]`` piece of the embedding each unit holds, in place, in order."""
        return tuple(
            self.buffer[unit, : self.shape.rows(tokens, index)] for index, unit in enumerate(units)
        )

    def unit_ptr(self, unit: int) -> int:
        return self._ptr + unit * self._unit_nbytes

    def write(self, units: tuple[int, ...], tensor: torch.Tensor) -> None:
        """Copy ``tensor`` (``[tokens, dim]``, the pool's dtype) into ``units``, row by row."""
        view = self.view(units, int(tensor.shape[0]))
        if view is not None:
            view.copy_(tensor)
            return
        step = self.shape.unit_tokens
        for index, unit in enumerate(units):
            rows = tensor[index * step : (index + 1) * step]
            self.buffer[unit, : rows.shape[0]].copy_(rows)

    def read(self, units: tuple[int, ...], tokens: int) -> torch.Tensor:
        """A copy of the ``[tokens, dim]`` embedding held in ``units``."""
        view = self.view(units, tokens)
        if view is not None:
            return view.clone()
        out = torch.empty((tokens, self.shape.dim), dtype=self.shape.dtype)
        step = self.shape.unit_tokens
        for index, unit in enumerate(units):
            rows = self.shape.rows(tokens, index)
            out[index * step : index * step + rows].copy_(self.buffer[unit, :rows])
        return out
