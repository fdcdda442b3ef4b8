"""vLLM's KV blocks and the connector's host pages, copied both ways (issue 20, part 20).

:class:`~kvstrata.integrations.vllm_blocks.BlockViews` copies blocks of vLLM's per-layer ``[B, H, N,
C]`` views into host pool pages (``save``) and back (``load``), view to view: one strided copy per
run of consecutive blocks and slots, or (``gather_below``, drawn) a gather and a scatter per layer
when runs are short; or (``stage_pages``, drawn: a device's path, run here on the CPU) through a
staging tensor in the host pool's native page order, chunk by chunk, one copy per run of slots. The
host pool's layout is drawn too. The views are built here as vLLM builds them (one allocation in a
physical order, a logical view per layer; kernel blocks of half a block where the order allows
them), without vLLM; the engine tests check the same class on vLLM's own ``allocate_kv_cache``.

Each example draws the backend's K/V split too: a cell's halves (FlashAttention, FlashInfer,
Triton) or a head's halves with K column-major (vLLM's CPU vec kernels, in the orders that keep a
head's ``[N, C]`` contiguous). Model: which token content each block and each host page holds (an
id). Rules: the engine computes a block (writes the K and V of a fresh id where its backend keeps
them); ``save`` of distinct blocks into distinct pages, paired in order (runs, runs with a slot out
of place, scattered pairs); ``load`` the same way back. After every step every block holds its id's
K and V where its backend finds them, and every page its id's K then V, each heads x tokens x head
dim: a copy to the wrong slot, of the wrong block, or of half a run, fails.
"""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvstrata.impl.pools import HostKVPool
from kvstrata.integrations.vllm_blocks import BlockViews, page_shape

LAYERS, BLOCKS, SLOTS, HEADS, TOKENS, HEAD = 2, 12, 10, 2, 4, 3
#: physical orders of [L, B, H, N, C] (vLLM's KVCacheLayout LBNHC, BLNHC, LBHNC, BLHNC); the CPU
#: backend's split (``cpu_vec``) needs each head's [N, C] contiguous: the last two
ORDERS = [(0, 1, 3, 2, 4), (1, 0, 3, 2, 4), (0, 1, 2, 3, 4), (1, 0, 2, 3, 4)]
HEAD_ORDERS = ORDERS[2:]


class _Spec:
    block_size, num_heads, head_size, head_size_v = TOKENS, HEADS, HEAD, HEAD
    dtype, tokens_per_state = torch.float32, 1
    state_content_size_bytes = 2 * HEAD * 4


def content(ident: int) -> torch.Tensor:
    """A block's K and V, ``[L, 2, H, N, D]``, for content ``ident`` (0: empty)."""
    if ident == 0:
        return torch.zeros(LAYERS, 2, HEADS, TOKENS, HEAD)
    generator = torch.Generator().manual_seed(ident)
    return torch.randn(LAYERS, 2, HEADS, TOKENS, HEAD, generator=generator)


def kv_of(kernels: torch.Tensor, split: str) -> list[torch.Tensor]:
    """K and V (each ``[H, k, N/k, D]``) of one block's kernel blocks ``[k, H, N/k, C]``, found
    as the backend finds them: a cell's halves (``cell``), or a head's halves with K column-major
    (``cpu_vec``, vLLM's CPU vec kernels). Views: writing them writes the block."""
    k, heads, tokens, _ = kernels.shape
    if split == "cell":
        cells = kernels.view(k, heads, tokens, 2, HEAD)
        return [cells[..., p, :].permute(1, 0, 2, 3) for p in range(2)]
    halves = kernels.view(k, heads, 2, tokens * HEAD)
    key = halves[:, :, 0].view(k, heads, HEAD, tokens).transpose(-1, -2)
    value = halves[:, :, 1].view(k, heads, tokens, HEAD)
    return [key.permute(1, 0, 2, 3), value.permute(1, 0, 2, 3)]


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
        kernel_split=st.sampled_from([1, 2]),
        kv_split=st.sampled_from(["cell", "cpu_vec"]),
        gather_below=st.sampled_from([0, 4]),  # strided copies per run only, or gathers too
        stage_pages=st.sampled_from([0, 1, 3]),  # view to view, or staged in chunks of pages
        layout=st.sampled_from(["page_first_direct", "page_major", "layer_first"]),
    )
    def start(  # noqa: PLR0917 (Hypothesis passes the draws by name)
        self,
        order: tuple[int, ...],
        kernel_split: int,
        kv_split: str,
        gather_below: int,
        stage_pages: int,
        layout: str,
    ) -> None:
        if kv_split == "cpu_vec" and order not in HEAD_ORDERS:
            order = HEAD_ORDERS[0]
        kernel_split = kernel_split if order[0] == 0 else 1  # vLLM splits layer-compact orders
        self.caches = vllm_views(order, kernel_split)
        self.kv_split = kv_split
        shape, heads, head_size = page_shape(_Spec(), LAYERS, False, "test")
        self.views = BlockViews(
            self.caches,
            BLOCKS,
            shape,
            heads,
            head_size,
            split=kv_split,
            gather_below=gather_below,
            stage_bytes=stage_pages * shape.bytes_per_page,
        )
        assert self.views.stage_pages == stage_pages
        self.host = HostKVPool(shape, SLOTS, layout)
        self.host.canonical().zero_()
        self.block_ids = [0] * BLOCKS
        self.slot_ids = [0] * SLOTS
        self.next_id = 1

    def kv(self, layer: int, block: int) -> list[torch.Tensor]:
        """K and V of block ``block`` of ``layer`` as the backend finds them, each ``[H, k, N/k,
        D]`` (views of the engine's tensor)."""
        view = self.caches[f"model.layers.{layer}.attn"]
        k = view.shape[0] // BLOCKS
        return kv_of(view[block * k : (block + 1) * k], self.kv_split)

    @rule(block=st.integers(0, BLOCKS - 1))
    def compute(self, block: int) -> None:
        """The engine writes a block's K and V where its backend keeps them."""
        data = content(self.next_id)
        for n in range(LAYERS):
            for plane, target in enumerate(self.kv(n, block)):
                target.copy_(data[n, plane].view(target.shape))
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
            for n in range(LAYERS):
                for plane, found in enumerate(self.kv(n, block)):
                    want = content(ident)[n, plane].view(found.shape)
                    assert torch.equal(found, want), f"block {block}"
        pages = self.host.canonical()  # [planes, L, P, page, 1, X]
        for slot, ident in enumerate(self.slot_ids):
            expected = content(ident).transpose(0, 1)  # [2, L, H, N, D]
            got = pages[:, :, slot].reshape(2, LAYERS, HEADS, TOKENS, HEAD)
            assert torch.equal(got, expected), f"page {slot}: K then V, each [H, N, D]"


TestVllmBlockCopies = VllmBlockCopies.TestCase
TestVllmBlockCopies.settings = settings(stateful_step_count=25)
