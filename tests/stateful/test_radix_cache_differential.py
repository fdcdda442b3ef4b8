"""The real L1/L2 radix cache against the reference model, side by side, under each write policy
and without L2 (the machine lives in ``tests/support/differential.py``)."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from support.differential import DifferentialMachine

from kvstrata.model.cache import WritePolicy


class WriteThroughDifferential(DifferentialMachine):
    policy = WritePolicy.WRITE_THROUGH


class SelectiveDifferential(DifferentialMachine):
    policy = WritePolicy.WRITE_THROUGH_SELECTIVE


class WriteBackDifferential(DifferentialMachine):
    policy = WritePolicy.WRITE_BACK


class L1OnlyDifferential(DifferentialMachine):
    host_sizes = st.just(0)


STEPS = settings(stateful_step_count=50)
TestWriteThroughDifferential = WriteThroughDifferential.TestCase
TestWriteThroughDifferential.settings = STEPS
TestSelectiveDifferential = SelectiveDifferential.TestCase
TestSelectiveDifferential.settings = STEPS
TestWriteBackDifferential = WriteBackDifferential.TestCase
TestWriteBackDifferential.settings = STEPS
TestL1OnlyDifferential = L1OnlyDifferential.TestCase
TestL1OnlyDifferential.settings = settings(
    STEPS, max_examples=max(10, settings().max_examples // 5)
)
