"""MooncakeBackend.exists's native calls on the session's real master (issue 20): up to 2,048
objects are one ``batch_is_exist``, a longer query goes on chunk by chunk and stops at the chunk
that holds its first miss, and the keys asked are the key space's own texts (made by the C kernel
where it is built). A native answer that is not a list of ints is an internal error for every key.
The one-pass settling of a batch get and the counters' one count per status kind give what the
page-by-page rules give, for any codes."""

from __future__ import annotations

import logging
from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import given

from kvstrata.impl.pools import HostLayout
from kvstrata.impl.storage.base import GetStatus, PutStatus
from kvstrata.impl.storage.counters import BackendCounters
from kvstrata.impl.storage.mooncake import MooncakeBackend, MooncakeClient
from kvstrata.impl.storage.mooncake.accounts import CallAccounts
from kvstrata.impl.storage.mooncake.backend import QUERY_BATCH_OBJECTS
from kvstrata.impl.storage.mooncake.codes import INTERNAL_ERROR, ErrorKind, classify, native_codes
from kvstrata.impl.storage.mooncake.counters import ErrorCounters
from kvstrata.model.keys import KVKind, RenderedKeys


def test_a_query_is_one_call_per_chunk_and_stops_at_the_chunk_of_its_first_miss(
    mooncake_store: MooncakeClient, page_kit, monkeypatch: pytest.MonkeyPatch
) -> None:
    count, missing = 1100, 1050
    host = page_kit.host(KVKind.MHA, count, HostLayout.PAGE_FIRST_DIRECT)
    backend = MooncakeBackend(mooncake_store, page_kit.keyspace(KVKind.MHA))
    try:
        backend.attach(host)
        ns = page_kit.NS
        pages = page_kit.pages(KVKind.MHA, count)
        stored = [i for i in range(count) if i != missing]
        page_kit.fill(host, stored, [pages[i] for i in stored])
        statuses = backend.put(ns, [pages[i] for i in stored], stored)
        assert statuses == [PutStatus.STORED] * len(stored)
        asked: list[list[str]] = []
        real = mooncake_store.batch_is_exist

        def spy(keys: RenderedKeys) -> list[int]:
            asked.append(list(keys.texts))
            return real(keys)

        monkeypatch.setattr(mooncake_store, "batch_is_exist", spy)
        per_call = QUERY_BATCH_OBJECTS // 2  # two objects (K and V) per page
        assert backend.exists(ns, pages[:per_call]) == per_call
        assert [len(keys) for keys in asked] == [QUERY_BATCH_OBJECTS]
        want = [
            key.text for page in pages[:per_call] for key in backend.keyspace.page_keys(ns, page)
        ]
        assert asked[0] == want
        asked.clear()
        assert backend.exists(ns, pages) == missing
        assert [len(keys) for keys in asked] == [QUERY_BATCH_OBJECTS, 2 * (count - per_call)]
        asked.clear()
        assert backend.exists(ns, [pages[missing], *pages[: per_call + 10]]) == 0
        assert [len(keys) for keys in asked] == [QUERY_BATCH_OBJECTS]  # stopped after the first
    finally:
        backend.close()


@pytest.mark.parametrize(
    "answer",
    [[0, None], [0, 1.5], [0, 2**70], [0], (0, 0), "ab", None],
    ids=["none", "float", "overflow", "short", "tuple", "text", "nothing"],
)
def test_a_malformed_native_answer_is_an_internal_error_per_key(
    answer: object, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="kvstrata.storage.mooncake"):
        assert (
            native_codes("batch_is_exist", 2, lambda native: answer, None) == [INTERNAL_ERROR] * 2
        )
    assert "batch_is_exist returned" in caplog.text


def test_a_native_list_of_ints_is_returned_as_it_is_and_a_raise_is_an_internal_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    codes = [0, -704, 1, 2**40]
    assert native_codes("batch_get_into", 4, lambda native: codes, None) is codes
    assert native_codes("batch_get_into", 0, lambda native: [], None) == []

    def boom(native: object) -> list[int]:
        raise RuntimeError("native failure")

    with caplog.at_level(logging.ERROR, logger="kvstrata.storage.mooncake"):
        assert native_codes("batch_put_from", 3, boom, None) == [INTERNAL_ERROR] * 3
    assert "batch_put_from raised" in caplog.text


def settled_page_by_page(codes: list[int], sizes: list[int]) -> tuple[list[GetStatus], int]:
    """The rule, one page at a time: LOADED if every object came back at its size, MISSING if one
    is missing (and none failed otherwise), FAILED else; and how many objects were errors."""
    width, out, errors = len(sizes), [], 0
    for page in range(len(codes) // width):
        mine = codes[page * width : (page + 1) * width]
        missing = any(c < 0 and classify(c) is ErrorKind.MISSING for c in mine)
        bad = [c for c, size in zip(mine, sizes, strict=True) if c != size]
        errors += sum(1 for c in bad if c >= 0 or classify(c) is not ErrorKind.MISSING)
        out.append(GetStatus.MISSING if missing else GetStatus.FAILED if bad else GetStatus.LOADED)
    return out, errors


@given(
    sizes=st.lists(st.sampled_from([4096, 8192]), min_size=1, max_size=3),
    pages=st.integers(0, 6),
    data=st.data(),
)
def test_a_batch_get_settles_as_page_by_page(
    sizes: list[int], pages: int, data: st.DataObject
) -> None:
    codes = [
        data.draw(st.sampled_from([size, size, size, size // 2, -704, -800]))
        for _ in range(pages)
        for size in sizes
    ]
    counters = BackendCounters()
    accounts = CallAccounts(ErrorCounters(), counters)
    want, errors = settled_page_by_page(codes, sizes)
    assert accounts.settle_gets(codes, sizes) == want
    assert counters.as_dict()["io_errors"] == errors


@given(st.lists(st.sampled_from(list(PutStatus)), max_size=20), st.integers(0, 10**6))
def test_counters_count_each_status_once(statuses: list[PutStatus], nbytes: int) -> None:
    counters = BackendCounters()
    counters.record_puts(statuses, nbytes)
    counters.record_gets([GetStatus.LOADED, GetStatus.MISSING, GetStatus.LOADED], 7)
    snap = counters.as_dict()
    counted = Counter(statuses)
    for status in PutStatus:
        assert snap[f"puts_{status.name.lower()}"] == counted[status]
    assert (snap["gets_loaded"], snap["gets_missing"], snap["gets_failed"]) == (2, 1, 0)
    assert (snap["bytes_written"], snap["bytes_read"]) == (nbytes, 7)
    with pytest.raises(KeyError):
        counters.record_puts([PutStatus.STORED, GetStatus.LOADED])  # type: ignore[list-item]
    assert counters.as_dict()["puts_stored"] == counted[PutStatus.STORED]  # nothing counted
