"""The TP agreement's rules (``kvstrata.model.tp``): the minimum is the agreed fact, and a layout
that differs between ranks is detected, never applied."""

from __future__ import annotations

import attrs
import pytest

from kvstrata.model.cache import CacheConfig, CacheModel, WritePolicy
from kvstrata.model.cluster import TpModel
from kvstrata.model.keys import (
    DEFAULT_NAMESPACE,
    KeySpace,
    KVKind,
    ModelIdentity,
    Shard,
    chain_page_hashes,
)
from kvstrata.model.lifecycles import BackupState
from kvstrata.model.store import StoreModel
from kvstrata.model.tp import (
    BackupFact,
    CopyFact,
    Diverged,
    FactKind,
    agree,
    frame,
    layout_digest,
    read_state_agreed,
    unframe,
)

LAYOUT = [(FactKind.WRITE, 7), (FactKind.BACKUP, 9), (FactKind.READ, 11)]


def test_the_minimum_is_the_agreed_fact() -> None:
    one = frame(LAYOUT, [CopyFact.LANDED, BackupFact.STORED, 1 + 5])
    two = frame(LAYOUT, [CopyFact.FAILED, BackupFact.RETRY, 1 + 3])
    three = frame(LAYOUT, [CopyFact.LANDED, BackupFact.GIVE_UP, 0])
    assert unframe(agree([one, two])) == [CopyFact.FAILED, BackupFact.RETRY, 4]
    assert unframe(agree([one, three])) == [CopyFact.LANDED, BackupFact.GIVE_UP, 0]
    assert unframe(agree([one])) == [CopyFact.LANDED, BackupFact.STORED, 6]


def test_a_different_layout_is_detected() -> None:
    ours = frame(LAYOUT, [2, 3, 1])
    theirs = frame([(FactKind.WRITE, 7), (FactKind.BACKUP, 10), (FactKind.READ, 11)], [2, 3, 1])
    with pytest.raises(Diverged, match="layout digests"):
        unframe(agree([ours, theirs]))
    shorter = frame(LAYOUT[:2], [2, 3])
    with pytest.raises(Diverged):
        agree([ours, shorter])
    with pytest.raises(Diverged):
        unframe([1, 2])


def test_layout_digests_depend_on_kind_order_and_op() -> None:
    digests = {
        layout_digest(LAYOUT),
        layout_digest(list(reversed(LAYOUT))),
        layout_digest([(FactKind.LOAD, 7), *LAYOUT[1:]]),
        layout_digest([(FactKind.QUERY, -1)]),
    }
    assert len(digests) == 4
    assert all(0 <= d < 2**62 for d in digests)


def test_a_state_is_used_only_when_every_rank_read_the_same_page() -> None:
    assert read_state_agreed(3, 3)
    assert not read_state_agreed(2, 3)
    assert not read_state_agreed(0, 0)


def _two_ranks(pages: int) -> tuple[TpModel, list[StoreModel]]:
    """Two write-through ranks of one-token pages, ``pages`` pages in each tier, and their stores."""
    identity = ModelIdentity("tiny", "bf16", KVKind.MHA, page_size=1)
    base = CacheConfig(
        page_size=1,
        device_pages=pages,
        host_pages=pages,
        write_policy=WritePolicy.WRITE_THROUGH,
        write_through_threshold=1,
        prefetch_threshold=1,
        keys=KeySpace(identity),
    )
    stores = [StoreModel() for _ in range(2)]
    ranks = [
        CacheModel(
            attrs.evolve(base, keys=KeySpace(identity, shard=Shard(tp_rank=r, tp_size=2))),
            stores[r],
        )
        for r in range(2)
    ]
    return TpModel(ranks), stores


def test_an_agreed_backup_ends_alike_on_every_rank_after_one_ranks_store_lost_an_object() -> None:
    """The fuzz run's find (2026-11-27): a backup op holds a page stored before; one rank's store
    loses an object of it after the jobs returned. The agreed ``stored`` must end the op on every
    rank alike, not by each rank's store as it is now."""
    tp, _stores = _two_ranks(pages=7)
    tokens = (1, 2, 3, 4)
    pages = chain_page_hashes(tokens, 1, DEFAULT_NAMESPACE)

    def insert() -> None:
        result = tp.each("match_prefix", tokens, DEFAULT_NAMESPACE)
        fresh = tp.each("alloc_device", len(pages) - result.device_pages)
        for rank in tp.ranks:
            for slot, page in zip(fresh, pages[result.device_pages :], strict=True):
                rank.write_device(slot, page)
        tp.each("insert", tokens, DEFAULT_NAMESPACE, result.device_slots + fresh)

    def land_everything() -> None:
        for _ in range(3):
            model = tp.ranks[0]
            while any(op.state is BackupState.QUEUED for op in model.backup_ops):
                tp.each("start_backup")
            for reports in tp.reports:
                for op in model.write_ops:
                    reports.copies.setdefault(op.op_id, True)
                for backup in model.backup_ops:
                    reports.backups.setdefault(backup.op_id, True)
            tp.agree()

    insert()
    land_everything()  # every page in L2 and in every rank's store
    tp.each("evict", 1)
    tp.each("evict_host", 1)  # the last page leaves L2 (and L1)
    insert()  # computed again: its write-through, then a backup of the node's pages
    for rank in range(2):
        for _ in tp.ranks[0].write_ops:
            tp.copy_done(rank, write=True, landed=True)
    tp.agree()
    tp.each("start_backup")
    (op,) = [op for op in tp.ranks[0].backup_ops if op.state is BackupState.IN_FLIGHT]
    for rank in range(2):
        tp.backup_done(rank, op.op_id, stored=True)
    lost = next(key for key, (page, _c) in tp.ranks[0].store.visible_items() if page in op.pages)
    tp.ranks[0].store_evict(lost)  # rank 0's shard only, after the jobs returned
    tp.agree()  # no InvariantViolation: the ranks end the op alike
    assert not any(o.state is BackupState.IN_FLIGHT for o in tp.ranks[0].backup_ops)
    assert [len(rank.backup_ops) for rank in tp.ranks] == [0, 0]


def test_an_agreed_read_delivers_each_ranks_bytes_as_read_after_its_store_lost_a_page() -> None:
    """The fuzz run's find (2026-11-28): one rank's read of a prefetch returned, then its store
    lost an object of a page that read delivered, then the other rank's read returned. The agreed
    pages are the bytes each rank read (in its host slots already), not its store as it is now:
    every rank ends the op alike, with the pages' contents."""
    tp, store = _two_ranks(pages=4)
    tokens = (1, 2)
    pages = chain_page_hashes(tokens, 1, DEFAULT_NAMESPACE)
    fresh = tp.each("alloc_device", 2)
    for rank in tp.ranks:
        for slot, page in zip(fresh, pages, strict=True):
            rank.write_device(slot, page)
    tp.each("insert", tokens, DEFAULT_NAMESPACE, fresh)
    for _ in range(3):  # write-through, backup, every rank's store holds both pages
        while any(op.state is BackupState.QUEUED for op in tp.ranks[0].backup_ops):
            tp.each("start_backup")
        for reports in tp.reports:
            for op in tp.ranks[0].write_ops:
                reports.copies.setdefault(op.op_id, True)
            for backup in tp.ranks[0].backup_ops:
                reports.backups.setdefault(backup.op_id, True)
        tp.agree()
    tp.each("evict", 2)
    tp.each("evict_host", 2)  # L1 and L2 forget them; the stores keep them
    op_id = tp.prefetch(tokens, DEFAULT_NAMESPACE)
    assert op_id is not None
    assert tp.read_done(0, op_id) == 2
    lost = next(key for key, (page, _c) in store[0].visible_items() if page == pages[1])
    tp.ranks[0].store_evict(lost)  # after rank 0's read returned
    assert tp.read_done(1, op_id) == 2
    tp.agree()  # no InvariantViolation: both ranks take the 2 pages they read
    ops = [rank.prefetch_ops[op_id] for rank in tp.ranks]
    assert [op.arrived for op in ops] == [2, 2]
    slots = ops[0].host_slots
    assert [rank.host_content(slots) for rank in tp.ranks] == [tuple(pages)] * 2
