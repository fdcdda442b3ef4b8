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


class WidePagesDifferential(DifferentialMachine):
    """Pages of 8 and 9 tokens (the others use 1-2): the tree's page fingerprints then run their
    8-token blocks (the AVX2 loop on x86) and an odd tail, and requests differ from cached ones in
    one token anywhere in a page (mutant native_nh_odd_tokens_ignored)."""

    wide_pages = st.sampled_from([8, 9])


STEPS = settings(stateful_step_count=50)
TestWriteThroughDifferential = WriteThroughDifferential.TestCase
TestWriteThroughDifferential.settings = STEPS
TestSelectiveDifferential = SelectiveDifferential.TestCase
TestSelectiveDifferential.settings = STEPS
TestWriteBackDifferential = WriteBackDifferential.TestCase
TestWriteBackDifferential.settings = STEPS
TestWidePagesDifferential = WidePagesDifferential.TestCase
TestWidePagesDifferential.settings = STEPS
TestL1OnlyDifferential = L1OnlyDifferential.TestCase
TestL1OnlyDifferential.settings = settings(
    STEPS, max_examples=max(10, settings().max_examples // 5)
)
