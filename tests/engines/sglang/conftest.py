"""sglang 0.5.23 on a CPU: the torchvision stand-in sglang's model configs need, sglang's own host
pool classes built the way sglang's storage tests build them, and a real Mooncake cluster."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
from support.engines import require

HOW = "run scripts/engines (it builds .venv-sglang) and use .venv-sglang/bin/python -m pytest"


def _install_torchvision_stand_in() -> None:
    """No torchvision wheel matches the CPU torch 2.13.0; sglang imports it only for multimodal
    preprocessing, which these tests never run. Installed after transformers, which probes for
    torchvision and must find it absent."""
    require("transformers", HOW)
    if "torchvision" in sys.modules:
        return

    class Anything:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def __call__(self, *args: object, **kwargs: object) -> Anything:
            return self

        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return Anything()

    def stand_in(name: str) -> types.ModuleType:
        module = types.ModuleType(name)

        def missing(attr: str) -> Any:
            if attr.startswith("__"):
                raise AttributeError(attr)
            return Anything()

        module.__getattr__ = missing  # type: ignore[method-assign]
        module.__path__ = []
        sys.modules[name] = module
        return module

    root = stand_in("torchvision")
    for name in ("transforms", "transforms.functional", "transforms.v2", "io", "ops"):
        child = stand_in(f"torchvision.{name}")
        parent_name, _, leaf = f"torchvision.{name}".rpartition(".")
        setattr(sys.modules.get(parent_name, root), leaf, child)


_install_torchvision_stand_in()
require("sglang.srt.mem_cache.hicache_storage", HOW)

from kvstrata.impl.storage.mooncake import LocalCluster  # noqa: E402


@pytest.fixture(scope="session")
def mooncake_cluster() -> Iterator[LocalCluster]:
    """A real ``mooncake_master`` and storage node on free loopback ports, for the session."""
    with LocalCluster(segment_size="128mib") as cluster:
        yield cluster


@pytest.fixture(autouse=True)
def _no_fault_injection(monkeypatch: pytest.MonkeyPatch) -> None:
    """sglang wraps every backend in its fault injector when these are set; tests opt in."""
    monkeypatch.delenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", raising=False)
    monkeypatch.delenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", raising=False)
