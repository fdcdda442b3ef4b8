"""Tests against the engines' real code (issue 16), each engine in its own venv built by
``scripts/engines``: ``tests/engines/sglang`` in ``.venv-sglang``, ``tests/engines/vllm`` in
``.venv-vllm``. Every test here carries the ``engines`` marker. An engine that is not installed fails
the run with the reason (``support.engines.require``); nothing here skips."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/engines/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.engines)
