"""The real L1/L2 radix cache with side pools (an indexer pool and a Mamba state pool) against the
reference model, side by side, under each write policy and without L2 (the machine lives in
``tests/support/differential.py``)."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from support.differential import HybridDifferentialMachine

from kvstrata.model.cache import WritePolicy


class HybridWriteThroughDifferential(HybridDifferentialMachine):
    policy = WritePolicy.WRITE_THROUGH


class HybridSelectiveDifferential(HybridDifferentialMachine):
    policy = WritePolicy.WRITE_THROUGH_SELECTIVE


class HybridWriteBackDifferential(HybridDifferentialMachine):
    policy = WritePolicy.WRITE_BACK


class HybridL1OnlyDifferential(HybridDifferentialMachine):
    host_sizes = st.just(0)


STEPS = settings(stateful_step_count=80)
TestHybridWriteThroughDifferential = HybridWriteThroughDifferential.TestCase
TestHybridWriteThroughDifferential.settings = STEPS
TestHybridSelectiveDifferential = HybridSelectiveDifferential.TestCase
TestHybridSelectiveDifferential.settings = STEPS
TestHybridWriteBackDifferential = HybridWriteBackDifferential.TestCase
TestHybridWriteBackDifferential.settings = STEPS
TestHybridL1OnlyDifferential = HybridL1OnlyDifferential.TestCase
TestHybridL1OnlyDifferential.settings = settings(
    STEPS, max_examples=max(10, settings().max_examples // 5)
)
