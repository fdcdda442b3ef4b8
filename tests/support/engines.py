"""Shared by the engine tests (tests/engines): import an engine or fail the run with the reason."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest


def require(module: str, how: str) -> ModuleType:
    """Import ``module`` or stop the run (a usage error, never a skip), saying how to get it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise pytest.UsageError(f"{module} is not importable here ({error}); {how}") from error
