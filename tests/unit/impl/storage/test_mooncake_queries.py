"""MooncakeBackend.exists's native calls on the session's real master (issue 20): up to 2,048
objects are one ``batch_is_exist``, a longer query goes on chunk by chunk and stops at the chunk
that holds its first miss, and the keys asked are the key space's own texts (made by the C kernel
where it is built). A native answer that is not a list of ints is an internal error for every key."""

from __future__ import annotations

import logging

import pytest

from kvstrata.impl.pools import HostLayout
from kvstrata.impl.storage.base import PutStatus
from kvstrata.impl.storage.mooncake import MooncakeBackend, MooncakeClient
from kvstrata.impl.storage.mooncake.backend import QUERY_BATCH_OBJECTS
from kvstrata.impl.storage.mooncake.codes import INTERNAL_ERROR, native_codes
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
