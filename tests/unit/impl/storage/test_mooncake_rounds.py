"""Batch gets that name a key twice go to the native client in rounds of distinct keys (issue 20):
the split itself, checked against a stand-in native call with the measured behaviour (only the
last buffer of a repeated key is filled), and the real client against a real master."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvstrata.impl.errors import MisuseError
from kvstrata.impl.storage.mooncake import MooncakeClient
from kvstrata.impl.storage.mooncake.rounds import in_rounds, rounds
from kvstrata.model.keys import StoreKey

keys = st.lists(st.sampled_from(["a", "b", "c", "d"]), max_size=12)


@given(keys)
def test_rounds_hold_every_position_once_and_no_key_twice(texts: list[str]) -> None:
    split = rounds(texts)
    if len(set(texts)) == len(texts):
        assert split is None
        return
    assert split is not None
    assert sorted(p for positions in split for p in positions) == list(range(len(texts)))
    for number, positions in enumerate(split):
        assert positions == sorted(positions)
        assert len({texts[p] for p in positions}) == len(positions)
        for p in positions:  # round k holds each key's k-th occurrence
            assert texts[:p].count(texts[p]) == number


@given(keys)
def test_in_rounds_fills_every_buffer_of_a_native_call_that_fills_only_the_last(
    texts: list[str],
) -> None:
    """The stand-in native call has Mooncake's measured behaviour: every occurrence of a key
    reports success, only the last one's buffer gets the bytes."""
    buffers: dict[int, str] = {}
    calls = 0

    def native(names: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        nonlocal calls
        calls += 1
        last = {name: ptr for name, ptr in zip(names, ptrs, strict=True)}
        buffers.update({ptr: name for name, ptr in last.items()})
        return list(sizes)

    ptrs = list(range(100, 100 + len(texts)))
    sizes = [7] * len(texts)
    assert in_rounds(native, texts, ptrs, sizes) == sizes
    assert buffers == dict(zip(ptrs, texts, strict=True))
    assert calls == max((texts.count(t) for t in texts), default=1)  # one call per round


def test_the_client_fills_every_buffer_of_a_key_named_twice(mooncake_store: MooncakeClient) -> None:
    client = mooncake_store
    size = 1024
    buffer = torch.arange(8 * size // 4, dtype=torch.int32).view(torch.uint8)  # distinct bytes
    base = buffer.data_ptr()
    client.register_buffer(base, buffer.numel())
    try:
        a, b, lost = StoreKey("kvs1/rounds/a"), StoreKey("kvs1/rounds/b"), StoreKey("kvs1/rounds/x")
        assert client.batch_put_from([a, b], [base, base + size], [size, size]) == [0, 0]
        order = [a, b, a, lost, a, lost]
        slots = [base + (2 + i) * size for i in range(len(order))]
        got = client.batch_get_into(order, slots, [size] * len(order))
        assert got == [size, size, size, -704, size, -704]
        for i, key in enumerate(order):
            if key is not lost:
                start = (2 + i) * size
                source = (0 if key is a else 1) * size
                assert torch.equal(buffer[start : start + size], buffer[source : source + size])
        buffer[2 * size :].zero_()
        half = size // 2
        parts = [[base + 2 * size, base + 3 * size], [base + 4 * size, base + 5 * size]]
        got = client.batch_get_parts([a, a], parts, [[half, half], [half, half]])
        assert got == [size, size]
        for first, second in parts:  # each occurrence's ranges hold the object, split in two
            for ptr, offset in ((first, 0), (second, half)):
                start = ptr - base
                want = buffer[offset : offset + half]
                assert torch.equal(buffer[start : start + half], want)
    finally:
        client.unregister_buffer(base)


def test_every_round_is_checked_before_any_byte_moves(mooncake_store: MooncakeClient) -> None:
    """A bad range in a later round refuses the whole batch: the first round read nothing."""
    client = mooncake_store
    size = 1024
    buffer = torch.arange(4 * size // 4, dtype=torch.int32).view(torch.uint8)
    base = buffer.data_ptr()
    client.register_buffer(base, buffer.numel())
    try:
        a = StoreKey("kvs1/rounds/checked")
        assert client.batch_put_from([a], [base], [size]) == [0]
        buffer[size:].zero_()
        outside = base + buffer.numel()  # past the registered buffer
        with pytest.raises(MisuseError):
            client.batch_get_into([a, a], [base + size, outside], [size, size])
        assert not buffer[size:].any()
    finally:
        client.unregister_buffer(base)
