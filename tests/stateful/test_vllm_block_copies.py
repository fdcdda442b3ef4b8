"""vLLM's KV blocks and the connector's host pages, copied both ways (issue 20, part 20).

:class:`~kvstrata.integrations.vllm_blocks.BlockViews` copies blocks of vLLM's per-layer
``[B, H, N, C]`` views into host pool pages (``save``) and back (``load``), view to view: one
strided copy per run of consecutive blocks and slots, or (``gather_below``, drawn) a gather and a
scatter per layer when runs are short. The
views are built here as vLLM builds them (one allocation in a physical order, a logical view per
layer; kernel blocks of half a block where the order allows them), without vLLM; the engine tests
check the same class on vLLM's own ``allocate_kv_cache``.

Model: which token content each block and each host page holds (an id). Rules: the engine
computes a block (fills it with the content of a fresh id); ``save`` of distinct blocks into
distinct pages, paired in order (runs, runs with a slot out of place, scattered pairs); ``load``
the same way back. After every step every block and page holds exactly its id's content, in
logical order, K and V apart: a copy to the wrong slot, of the wrong block, or of half a run, fails.
"""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvstrata.impl.pools import HostKVPool
from kvstrata.integrations.vllm_blocks import BlockViews, page_shape

LAYERS, BLOCKS, SLOTS, HEADS, TOKENS, HEAD = 2, 12, 10, 2, 4, 3
#: physical orders of [L, B, H, N, C] (vLLM's KVCacheLayout LBNHC, LBHNC, BLNHC)
ORDERS = [(0, 1, 3, 2, 4), (0, 1, 2, 3, 4), (1, 0, 3, 2, 4)]


class _Spec:
    block_size, num_heads, head_size, head_size_v = TOKENS, HEADS, HEAD, HEAD
    dtype, tokens_per_state = torch.float32, 1
    state_content_size_bytes = 2 * HEAD * 4


def content(ident: int) -> torch.Tensor:
    """A block's logical ``[L, H, N, C]`` for content ``ident`` (0: empty)."""
    if ident == 0:
        return torch.zeros(LAYERS, HEADS, TOKENS, 2 * HEAD)
    generator = torch.Generator().manual_seed(ident)
    return torch.randn(LAYERS, HEADS, TOKENS, 2 * HEAD, generator=generator)


def vllm_views(order: tuple[int, ...], kernel_split: int) -> dict[str, torch.Tensor]:
    """Zeroed views as vLLM's ``allocate_kv_cache`` makes them: ``[B * k, H, N / k, C]`` per
    layer over one allocation in ``order``."""
    logical = (LAYERS, BLOCKS * kernel_split, HEADS, TOKENS // kernel_split, 2 * HEAD)
    physical = torch.zeros([logical[d] for d in order])
    view = physical.permute([order.index(d) for d in range(5)])
    return {f"model.layers.{n}.attn": view[n] for n in reversed(range(LAYERS))}


@st.composite
def pairs(draw: st.DrawFn, count: int) -> tuple[list[int], list[int]]:
    """Distinct blocks and distinct slots, ``count`` of each: ascending runs, or runs with a
    slot out of place, or scattered."""
    shape = draw(st.sampled_from(["run", "run, a slot moved", "scattered"]))
    if shape == "scattered":
        blocks = draw(st.permutations(range(BLOCKS)))[:count]
        slots = draw(st.permutations(range(SLOTS)))[:count]
        return list(blocks), list(slots)
    first_block = draw(st.integers(0, BLOCKS - count))
    first_slot = draw(st.integers(0, SLOTS - count))
    blocks = list(range(first_block, first_block + count))
    slots = list(range(first_slot, first_slot + count))
    if shape != "run" and count > 1:
        i, j = draw(st.lists(st.integers(0, count - 1), min_size=2, max_size=2, unique=True))
        slots[i], slots[j] = slots[j], slots[i]
    return blocks, slots


class VllmBlockCopies(RuleBasedStateMachine):
    @initialize(
        order=st.sampled_from(ORDERS),
        split=st.sampled_from([1, 2]),
        gather_below=st.sampled_from([0, 4]),  # strided copies per run only, or gathers too
    )
    def start(self, order: tuple[int, ...], split: int, gather_below: int) -> None:
        split = split if order[0] == 0 else 1  # vLLM splits blocks only in layer-compact orders
        self.caches = vllm_views(order, split)
        shape, heads, head_size = page_shape(_Spec(), LAYERS, False, "test")
        self.views = BlockViews(
            self.caches, BLOCKS, shape, heads, head_size, gather_below=gather_below
        )
        self.host = HostKVPool(shape, SLOTS, "page_first_direct")
        self.host.canonical().zero_()
        self.block_ids = [0] * BLOCKS
        self.slot_ids = [0] * SLOTS
        self.next_id = 1

    def block(self, block: int) -> torch.Tensor:
        """Block ``block`` of every layer as logical ``[L, H, N, C]`` (kernel blocks joined)."""
        layers = []
        for n in range(LAYERS):
            view = self.caches[f"model.layers.{n}.attn"]
            split = view.shape[0] // BLOCKS
            kernels = view[block * split : (block + 1) * split]  # [k, H, N/k, C]
            layers.append(kernels.permute(1, 0, 2, 3).reshape(HEADS, TOKENS, 2 * HEAD))
        return torch.stack(layers)

    @rule(block=st.integers(0, BLOCKS - 1))
    def compute(self, block: int) -> None:
        data = content(self.next_id)
        for n in range(LAYERS):
            view = self.caches[f"model.layers.{n}.attn"]
            split = view.shape[0] // BLOCKS
            shaped = data[n].view(HEADS, split, TOKENS // split, 2 * HEAD).permute(1, 0, 2, 3)
            view[block * split : (block + 1) * split] = shaped
        self.block_ids[block] = self.next_id
        self.next_id += 1

    @rule(data=st.data(), count=st.integers(1, 8))
    def save(self, data: st.DataObject, count: int) -> None:
        blocks, slots = data.draw(pairs(count))
        self.views.save(blocks, self.host, slots)
        for block, slot in zip(blocks, slots, strict=True):
            self.slot_ids[slot] = self.block_ids[block]

    @rule(data=st.data(), count=st.integers(1, 8))
    def load(self, data: st.DataObject, count: int) -> None:
        blocks, slots = data.draw(pairs(count))
        self.views.load(self.host, slots, blocks)
        for block, slot in zip(blocks, slots, strict=True):
            self.block_ids[block] = self.slot_ids[slot]

    @invariant()
    def every_block_and_page_holds_its_content(self) -> None:
        if not hasattr(self, "views"):
            return
        for block, ident in enumerate(self.block_ids):
            assert torch.equal(self.block(block), content(ident)), f"block {block}"
        pages = self.host.canonical()  # [planes, L, P, page, 1, X]
        for slot, ident in enumerate(self.slot_ids):
            expected = content(ident).view(LAYERS, HEADS, TOKENS, 2, HEAD).permute(3, 0, 1, 2, 4)
            got = pages[:, :, slot].reshape(2, LAYERS, HEADS, TOKENS, HEAD)
            assert torch.equal(got, expected), f"page {slot}: K then V, each [H, N, D]"


TestVllmBlockCopies = VllmBlockCopies.TestCase
TestVllmBlockCopies.settings = settings(stateful_step_count=25)
