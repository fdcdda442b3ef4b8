"""The TP agreement's rules (``kvstrata.model.tp``): the minimum is the agreed fact, and a layout
that differs between ranks is detected, never applied."""

from __future__ import annotations

import pytest

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
