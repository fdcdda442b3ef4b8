"""The host pool of the embedding cache: ``units`` fixed-size units of ``unit_tokens`` rows of
``dim`` elements, in one contiguous host tensor that a store may register for zero-copy.

An embedding of ``tokens`` rows takes ``ceil(tokens / unit_tokens)`` units, not necessarily
adjacent (paged allocation: no fragmentation). Unit ``i`` of an entry holds rows
``[i * unit_tokens, (i + 1) * unit_tokens)``; the last unit may be partly used.

Invariants: a unit is free or allocated, never both; :meth:`alloc` hands out only free units and
:meth:`free` takes back only allocated ones (anything else is a :class:`MisuseError`). The pool
knows nothing of entries, pins or LRU: the cache owns those.
"""

from __future__ import annotations

import attrs
import torch

from kvstrata.impl.errors import ConfigError, MisuseError

__all__ = ["EmbeddingPool", "PoolShape"]


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
        return torch.empty((), dtype=self.dtype).element_size()

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
        self._free: list[int] = list(range(shape.units - 1, -1, -1))  # pop() gives the lowest
        self._used: set[int] = set()

    @property
    def ptr(self) -> int:
        return int(self.buffer.data_ptr())

    @property
    def nbytes(self) -> int:
        return self.shape.units * self.shape.unit_nbytes

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used_count(self) -> int:
        return len(self._used)

    def alloc(self, count: int) -> tuple[int, ...]:
        """``count`` free units (the caller planned room: too few free units is misuse)."""
        if count > len(self._free):
            raise MisuseError(f"embedding pool: {count} units asked, {len(self._free)} free")
        units = tuple(self._free.pop() for _ in range(count))
        self._used.update(units)
        return units

    def free(self, units: tuple[int, ...]) -> None:
        if any(unit not in self._used for unit in units) or len(set(units)) != len(units):
            raise MisuseError(f"embedding pool: freeing units {units} that are not allocated")
        self._used.difference_update(units)
        self._free.extend(sorted(units, reverse=True))
        self._free.sort(reverse=True)

    def unit_ptr(self, unit: int) -> int:
        return self.ptr + unit * self.shape.unit_nbytes

    def write(self, units: tuple[int, ...], tensor: torch.Tensor) -> None:
        """Copy ``tensor`` (``[tokens, dim]``, the pool's dtype) into ``units``, row by row."""
        step = self.shape.unit_tokens
        for index, unit in enumerate(units):
            rows = tensor[index * step : (index + 1) * step]
            self.buffer[unit, : rows.shape[0]].copy_(rows)

    def read(self, units: tuple[int, ...], tokens: int) -> torch.Tensor:
        """A copy of the ``[tokens, dim]`` embedding held in ``units``."""
        out = torch.empty((tokens, self.shape.dim), dtype=self.shape.dtype)
        step = self.shape.unit_tokens
        for index, unit in enumerate(units):
            rows = self.shape.rows(tokens, index)
            out[index * step : index * step + rows].copy_(self.buffer[unit, :rows])
        return out
