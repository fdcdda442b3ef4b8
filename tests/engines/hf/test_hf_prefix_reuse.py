"""examples/hf_prefix_reuse.py, run as a user runs it: a tiny Llama's prompt KV through L1, L2 and a
real Mooncake L3 (a master the example starts), read back by a second process, and decoded.

Each ``--fault`` corrupts the served KV in one way and must make the example fail, naming the checks
that caught it: a page swap is caught only by the byte comparisons (RoPE is applied before caching,
so attention does not see the order of whole pages and the logits stay within 1e-6)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support.engines import require

require("transformers", "run scripts/engines (it installs transformers in .venv-sglang)")

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "hf_prefix_reuse.py"
CHECKS = (
    "pages_from_l3",
    "served_kv_bytes_equal_writer",
    "served_kv_bytes_equal_own_prefill",
    "logits_bitwise_equal_own_cache",
    "logits_allclose_recompute",
    "first_token_equal_cold",
)


def run(*args: str) -> tuple[int, dict[str, bool], str]:
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    verdicts = {}
    for line in result.stdout.splitlines():
        head, _, name = line.partition(" ")
        if head in ("ok", "FAIL") or line.startswith("ok  "):
            verdicts[name.strip()] = head == "ok"
    return result.returncode, verdicts, result.stdout + result.stderr[-3000:]


def test_the_example_serves_the_prefix_bit_for_bit_and_prints_both_ttfts() -> None:
    code, verdicts, output = run()
    assert code == 0, output
    assert verdicts == dict.fromkeys(CHECKS, True), output
    assert "ms cold" in output and "ms with the L3 hit" in output


@pytest.mark.parametrize(
    ("fault", "caught_by"),
    [
        ("swap-pages", {"served_kv_bytes_equal_writer", "served_kv_bytes_equal_own_prefill",
                        "logits_bitwise_equal_own_cache"}),
        ("wrong-page", set(CHECKS) - {"pages_from_l3"}),
        ("drop-page", {"served_kv_bytes_equal_writer", "served_kv_bytes_equal_own_prefill",
                       "logits_bitwise_equal_own_cache", "logits_allclose_recompute"}),
    ],
)  # fmt: skip
def test_each_corruption_fails_the_example(fault: str, caught_by: set[str]) -> None:
    code, verdicts, output = run("--fault", fault)
    assert code != 0, output
    failed = {name for name, ok in verdicts.items() if not ok}
    assert caught_by <= failed, output
    if fault == "swap-pages":  # the reason for the byte checks: logits alone would pass
        assert verdicts["logits_allclose_recompute"], output


def test_model_dir_takes_a_saved_hugging_face_model(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    config = LlamaConfig(
        vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path / "saved-llama")
    code, verdicts, output = run("--model", str(tmp_path / "saved-llama"), "--prompt-tokens", "70")
    assert code == 0, output
    assert verdicts == dict.fromkeys(CHECKS, True), output
    assert "4 pages" in output
