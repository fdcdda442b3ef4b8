"""A real model's prompt KV through every kvstrata tier and into a second process, bit for bit.

    python examples/hf_prefix_reuse.py                 # a tiny Llama built here (random weights, seed 0)
    python examples/hf_prefix_reuse.py --model DIR     # any local Hugging Face causal LM directory

Process A (this one) prefills a prompt with the model, writes the prefix KV into kvstrata's L1 device
pool, inserts it (write-through to the L2 host pool, backup to L3) and waits until the pages are in a
real Mooncake store: a local master that this script starts and stops (or ``--master host:port``).
Process B (a second interpreter) builds its own cache on the same store, finds nothing locally,
prefetches the prefix from L3 into L2, loads it back to L1, reads it out and decodes from it. B checks:

1. the served KV equals A's prefix KV byte for byte (``torch.equal``): a logits check alone misses
   page swaps, because RoPE is applied before caching and attention does not care about the order
   of whole K/V pages (a swap moves the logits by about 1e-7);
2. decoding from the served KV gives logits ``torch.equal`` to decoding from the model's own cache
   of the same prefix, step by step;
3. those logits are ``allclose`` to a full recompute without any cache.

It prints the time to first token with and without the L3 hit and exits non-zero on any mismatch.
``--fault`` corrupts the served KV on purpose (for the tests that show each check catches it).
Needs ``transformers`` (``pip install transformers``); no hub access.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvstrata import (
    DeviceKVPool,
    HierarchicalRadixCache,
    HostKVPool,
    HostLayout,
    KeySpace,
    KVKind,
    KVShape,
    LocalCluster,
    ModelIdentity,
    MooncakeBackend,
    MooncakeConfig,
    RadixCacheConfig,
    StorageConfig,
)

PAGE = 16
FAULTS = ("none", "swap-pages", "wrong-page", "drop-page")


def load_model(model_dir: str | None) -> Any:
    """The model in float32 eval mode: ``model_dir`` from disk, or a tiny Llama with seeded weights."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    if model_dir:
        return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def kv_shape(model: Any) -> KVShape:
    config = model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return KVShape(
        KVKind.MHA, layers=config.num_hidden_layers, heads=heads, head_dim=head_dim,
        dtype=torch.float32, page_size=PAGE,
    )  # fmt: skip


def model_keys(model: Any, model_dir: str | None) -> KeySpace:
    name = Path(model_dir).name if model_dir else "tiny-llama-seed0"
    name = "m_" + re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    return KeySpace(ModelIdentity(name, "float32", KVKind.MHA, PAGE))


def build_cache(
    shape: KVShape, keys: KeySpace, master: str, pages: int
) -> tuple[Any, DeviceKVPool]:
    device = DeviceKVPool(shape, num_pages=pages + 8)
    host = HostKVPool(shape, pages + 8, HostLayout.PAGE_FIRST_DIRECT)
    cache = HierarchicalRadixCache.build(
        RadixCacheConfig(page_size=PAGE, write_policy="write_through"),
        device,
        host,
        storage=MooncakeBackend(MooncakeConfig.load(master=master), keys),
        storage_config=StorageConfig(prefetch_policy="wait_complete", prefetch_threshold=PAGE),
    )
    return cache, device


def wait_until(cache: Any, done: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        cache.check_events()
        time.sleep(0.0005)


# ---------------------------------------------------------------------------------- KV <-> HF cache
def to_canonical(past: Any, pages: int) -> torch.Tensor:
    """The first ``pages`` pages of an HF cache as kvstrata's canonical ``[2, L, P, page, H, D]``."""
    planes = []
    for plane in ("keys", "values"):
        layers = []
        for layer in past.layers:
            tensor = getattr(layer, plane)[0]  # [H, T, D]
            heads, _, dim = tensor.shape
            layers.append(
                tensor[:, : pages * PAGE].reshape(heads, pages, PAGE, dim).permute(1, 2, 0, 3)
            )
        planes.append(torch.stack(layers))
    return torch.stack(planes).contiguous()


def to_hf_cache(kv: torch.Tensor) -> Any:
    from transformers import DynamicCache  # noqa: PLC0415

    cache = DynamicCache()
    _, layers, pages, page, heads, dim = kv.shape
    for layer in range(layers):
        keys, values = (
            kv[p, layer].reshape(pages * page, heads, dim).permute(1, 0, 2)[None] for p in (0, 1)
        )
        cache.update(keys.contiguous(), values.contiguous(), layer)
    return cache


@torch.no_grad()
def decode(model: Any, past: Any, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Feed ``tokens`` after ``past``, then decode greedily; the logits of every step."""
    out = model(input_ids=tokens[None], past_key_values=past, use_cache=True)
    logits = [out.logits[0, -1]]
    for _ in range(steps - 1):
        nxt = logits[-1].argmax().view(1, 1)
        out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
        logits.append(out.logits[0, -1])
    return logits


@torch.no_grad()
def recompute(model: Any, prompt: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The same greedy decode with no cache at all: the full sequence every step."""
    sequence, logits = prompt, []
    for _ in range(steps):
        logits.append(model(input_ids=sequence[None], use_cache=False).logits[0, -1])
        sequence = torch.cat([sequence, logits[-1].argmax().view(1)])
    return logits


# ---------------------------------------------------------------------------------- the two roles
def writer(args: argparse.Namespace, prompt: torch.Tensor, pages: int) -> torch.Tensor:
    """Process A: prefill, insert, wait until the pages are backed up to L3."""
    model = load_model(args.model)
    with torch.no_grad():
        past = model(input_ids=prompt[None], use_cache=True).past_key_values
    kv = to_canonical(past, pages)
    cache, device = build_cache(kv_shape(model), model_keys(model, args.model), args.master, pages)
    tokens = prompt[: pages * PAGE].tolist()
    fresh = cache.alloc_device(pages)
    device.write_pages(fresh, kv)
    cache.insert(tokens, fresh)
    wait_until(cache, cache.idle, "the write-through and the L3 backup")
    cache.close()
    return kv


def corrupt(kv: torch.Tensor, fault: str) -> torch.Tensor:
    kv = kv.clone()
    if fault == "swap-pages":
        kv[:, :, [0, 1]] = kv[:, :, [1, 0]]
    elif fault == "wrong-page":
        kv[:, :, 1] = torch.randn_like(kv[:, :, 1])
    elif fault == "drop-page":
        kv[:, :, -1] = 0
    return kv


def reader(args: argparse.Namespace, prompt: torch.Tensor, pages: int) -> int:
    """Process B: serve the prefix from L3 through L2 and L1, decode, check. Returns the exit code."""
    model = load_model(args.model)
    cache, device = build_cache(kv_shape(model), model_keys(model, args.model), args.master, pages)
    tokens, rest = prompt[: pages * PAGE].tolist(), prompt[pages * PAGE :]

    with torch.no_grad():  # warm the model up, so neither timing pays for first-call set-up
        model(input_ids=prompt[None, :PAGE], use_cache=True)
    start = time.perf_counter()  # cold: prefill everything
    with torch.no_grad():
        cold = model(input_ids=prompt[None], use_cache=True).logits[0, -1].argmax()
    ttft_cold = time.perf_counter() - start

    start = time.perf_counter()  # warm: L3 -> L2 -> L1, then only the uncached tail
    assert cache.match_prefix(tokens).device_pages == 0
    op = cache.prefetch(tokens)
    if op is None:
        raise SystemExit("the cache declined the prefetch")
    wait_until(cache, lambda: cache.prefetch_ready(op), "the prefetch")
    gained = cache.prefetch_commit(op)
    match = cache.match_prefix(tokens)
    load = cache.load_back(match.host_node)
    if load is None:
        raise SystemExit("the cache declined the load-back")
    wait_until(cache, lambda: cache.pending().load == 0, "the load-back")
    match = cache.match_prefix(tokens)
    cache.lock(match.device_node)
    served = corrupt(device.read_pages(match.device_indices), args.fault)
    warm_logits = decode(model, to_hf_cache(served), rest, args.steps)
    ttft_warm = time.perf_counter() - start
    cache.unlock(match.device_node)
    cache.close()

    with torch.no_grad():
        own = model(input_ids=prompt[None, : pages * PAGE], use_cache=True).past_key_values
    own_kv = to_canonical(own, pages)
    own_logits = decode(model, own, rest, args.steps)
    full = recompute(model, prompt, args.steps)
    reference = torch.load(args.reference) if args.reference else own_kv
    checks = {
        "pages_from_l3": gained == pages and match.device_pages == pages,
        "served_kv_bytes_equal_writer": torch.equal(served, reference),
        "served_kv_bytes_equal_own_prefill": torch.equal(served, own_kv),
        "logits_bitwise_equal_own_cache": all(
            torch.equal(a, b) for a, b in zip(warm_logits, own_logits, strict=True)
        ),
        "logits_allclose_recompute": all(
            torch.allclose(a, b, atol=1e-4, rtol=1e-4)
            for a, b in zip(warm_logits, full, strict=True)
        ),
        "first_token_equal_cold": bool(warm_logits[0].argmax() == cold),
    }
    report = {
        "checks": checks,
        "pages": pages,
        "max_abs_diff_recompute": max(
            float((a - b).abs().max()) for a, b in zip(warm_logits, full, strict=True)
        ),
        "ttft_cold_ms": round(ttft_cold * 1e3, 3),
        "ttft_l3_hit_ms": round(ttft_warm * 1e3, 3),
    }
    print(json.dumps(report))
    return 0 if all(checks.values()) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", help="a local Hugging Face causal LM directory (default: tiny Llama)"
    )
    parser.add_argument("--master", help="a running Mooncake master host:port (default: start one)")
    parser.add_argument("--prompt-tokens", type=int, default=8 * PAGE + 5)
    parser.add_argument("--steps", type=int, default=6, help="decode steps to compare")
    parser.add_argument(
        "--fault", choices=FAULTS, default="none", help="corrupt the served KV (tests)"
    )
    parser.add_argument(
        "--role", choices=("both", "reader"), default="both", help=argparse.SUPPRESS
    )
    parser.add_argument("--reference", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # Both checks marked "bitwise" compare two prefills made in two processes. A multi-threaded CPU
    # kernel may split its sums differently from call to call on a loaded machine (seen in CI: 1 run
    # in 6 under two busy cores), so both processes run torch on one thread: same shapes, same order.
    torch.set_num_threads(1)
    pages = (args.prompt_tokens - 1) // PAGE
    if pages < 2:
        raise SystemExit(f"--prompt-tokens must be at least {2 * PAGE + 1}")
    vocab = load_model(args.model).config.vocab_size if args.model else 512
    prompt = torch.randint(
        0, vocab, (args.prompt_tokens,), generator=torch.Generator().manual_seed(1)
    )
    if args.role == "reader":
        return reader(args, prompt, pages)

    cluster = None if args.master else LocalCluster(segment_size="64mib").start()
    try:
        args.master = args.master or cluster.config.master
        kv = writer(args, prompt, pages)
        with tempfile.TemporaryDirectory() as scratch:
            reference = Path(scratch) / "prefix_kv.pt"
            torch.save(kv, reference)
            command = [sys.executable, __file__, "--role", "reader", "--master", args.master,
                       "--reference", str(reference), "--prompt-tokens", str(args.prompt_tokens),
                       "--steps", str(args.steps), "--fault", args.fault]  # fmt: skip
            if args.model:
                command += ["--model", args.model]
            result = subprocess.run(command, capture_output=True, text=True, check=False)
    finally:
        if cluster is not None:
            cluster.stop()
    sys.stderr.write(result.stderr[-4000:] if result.returncode else "")
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if not lines:
        print(f"the reader process failed (exit {result.returncode})")
        return result.returncode or 1
    report = json.loads(lines[-1])
    for name, ok in report["checks"].items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    print(
        f"{report['pages']} pages of {PAGE} tokens through L1 -> L2 -> Mooncake L3 -> process B -> L1"
    )
    print(f"max |logit - recompute| = {report['max_abs_diff_recompute']:.2e}")
    cold, warm = report["ttft_cold_ms"], report["ttft_l3_hit_ms"]
    print(f"time to first token: {cold} ms cold, {warm} ms with the L3 hit")
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
