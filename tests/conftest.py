"""Hypothesis profiles shared by every test.

ci     the deterministic gate: derandomized, no example database, no deadline (loaded when CI=true).
dev    the default on a workstation: random, with the local example database.
fuzz   a time-boxed exploration run (see scripts/fuzz.py): fresh random seed, many examples, prints the
       blob that reproduces a failure.
mutant used by tests/mutants/run.py: the gate's examples without the shrink phase (same verdicts, ~10x
       faster on a mutant that is caught).

HYPOTHESIS_PROFILE overrides the choice.

KVSTRATA_DEBUG=1 is set for the test process: pytest captures file descriptor 2 itself, so the native
log filter (which moves fd 2 onto a pipe) is tested in subprocesses of its own
(tests/unit/impl/storage/test_native_log.py), never inside pytest's capture.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

os.environ.setdefault("KVSTRATA_DEBUG", "1")

_COMMON = {"deadline": None, "print_blob": True}

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    max_examples=150,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow],
    **_COMMON,
)
settings.register_profile("dev", max_examples=100, **_COMMON)
settings.register_profile(
    "fuzz",
    derandomize=False,
    database=None,
    max_examples=int(os.environ.get("KVSTRATA_FUZZ_EXAMPLES", "1000")),
    suppress_health_check=[HealthCheck.too_slow],
    **_COMMON,
)
settings.register_profile(
    "mutant",
    derandomize=True,
    database=None,
    max_examples=150,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow],
    **_COMMON,
)


def _profile() -> str:
    chosen = os.environ.get("HYPOTHESIS_PROFILE")
    if chosen:
        return chosen
    return "ci" if os.environ.get("CI", "").lower() in {"1", "true", "yes"} else "dev"


settings.load_profile(_profile())
