"""The vLLM connector's copies from a device (issue 20, part 21): pages staged on the device in the
host pool's native order, one transfer per run of slots into the pinned pool.

On a CUDA machine the staged path is the default and must move exactly the bytes the CPU's
view-to-view copies move; without CUDA that test is skipped, and the same staged code runs on the
CPU here (forced with ``stage_bytes``) and in the ``VllmBlockCopies`` machine."""

from __future__ import annotations

import pytest
import torch

from kvstrata.impl.pools import HostKVPool
from kvstrata.integrations.vllm_blocks import STAGE_BYTES, BlockViews, page_shape

LAYERS, BLOCKS, SLOTS, HEADS, TOKENS, HEAD = 3, 16, 12, 2, 8, 16
BLOCK_PAIRS = ([3, 4, 5, 9, 0, 15, 14], [2, 3, 4, 11, 7, 0, 1])  # runs and strays, slot runs cut


class _Spec:
    block_size, num_heads, head_size, head_size_v = TOKENS, HEADS, HEAD, HEAD
    dtype, tokens_per_state = torch.bfloat16, 1
    state_content_size_bytes = 2 * HEAD * 2


def caches(device: str) -> dict[str, torch.Tensor]:
    """vLLM's ``[B, H, N, C]`` views (FlashAttention's LBNHC order) holding random KV."""
    generator = torch.Generator().manual_seed(7)
    physical = torch.randn(LAYERS, BLOCKS, TOKENS, HEADS, 2 * HEAD, generator=generator)
    view = physical.to(_Spec.dtype).to(device).permute(0, 1, 3, 2, 4)
    return {f"model.layers.{n}.self_attn.attn": view[n] for n in range(LAYERS)}


def copied(
    device: str, stage_bytes: int | None, layout: str = "page_first_direct"
) -> tuple[BlockViews, torch.Tensor, torch.Tensor]:
    """The views on ``device``; the host pages (a ``layout`` pool) after a save of
    :data:`BLOCK_PAIRS`; the views' tensors after a load of those pages into other blocks (the
    pairs reversed)."""
    shape, heads, head_size = page_shape(_Spec(), LAYERS, False, "test")
    views = BlockViews(
        caches(device), BLOCKS, shape, heads, head_size, split="cell", stage_bytes=stage_bytes
    )
    host = HostKVPool(shape, SLOTS, layout)
    host.canonical().zero_()
    blocks, slots = BLOCK_PAIRS
    views.save(blocks, host, slots)
    pages = host.canonical().clone()
    views.load(host, slots, blocks[::-1])
    loaded = torch.stack([layer[0][1] for layer in views.views]).cpu()
    return views, pages, loaded


PAGE_BYTES = 2 * LAYERS * TOKENS * HEADS * HEAD * 2
LAYOUTS = ["page_first_direct", "page_major", "layer_first"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_staged_copy_moves_what_view_to_view_copies_move(layout: str) -> None:
    _views, direct_pages, direct_loaded = copied("cpu", 0, layout)
    for stage in (1, 3, 64):  # a page per chunk, chunks that cut runs, one chunk
        views, pages, loaded = copied("cpu", stage * PAGE_BYTES, layout)
        assert views.stage_pages == stage
        assert torch.equal(pages, direct_pages) and torch.equal(loaded, direct_loaded)
    assert direct_pages.any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the device path)")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_on_a_gpu_pages_are_staged_and_carry_the_cpu_paths_bytes(layout: str) -> None:
    """The device default, and chunks of 1 and 3 pages (the staging tensor reused on the stream,
    asynchronous copies to and from the pinned pool), against the CPU's view-to-view copies."""
    views, pages, loaded = copied("cuda", None, layout)
    assert views.stage_pages == STAGE_BYTES // views.shape.bytes_per_page
    assert views.staging.device.type == "cuda"
    _cpu, cpu_pages, cpu_loaded = copied("cpu", 0, layout)
    assert torch.equal(pages, cpu_pages) and torch.equal(loaded, cpu_loaded)
    for stage in (1, 3):
        _views, pages, loaded = copied("cuda", stage * PAGE_BYTES, layout)
        assert torch.equal(pages, cpu_pages) and torch.equal(loaded, cpu_loaded)
