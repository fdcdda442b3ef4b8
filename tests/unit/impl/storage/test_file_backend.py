"""What only the file backend does (``kvstrata.impl.storage.file``): file naming and format, atomic
writes (a crash before the rename leaves nothing visible), damaged files treated as misses and
removed, the size cap with LRU order kept across restarts, I/O errors turned into statuses, and one
root shared by two processes. The contract it shares with every backend is in
``test_backend_contract.py``.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvstrata.impl.errors import ConfigError, MisuseError
from kvstrata.impl.pools import HostKVPool, KVShape
from kvstrata.impl.storage import file as file_module
from kvstrata.impl.storage.base import GetStatus, PutStatus
from kvstrata.impl.storage.counters import BackendCounters
from kvstrata.impl.storage.file import FileBackend, object_name
from kvstrata.model.keys import (
    KeySpace,
    KVKind,
    ModelIdentity,
    Namespace,
    PageHash,
    Shard,
    StoreKey,
    chain_page_hashes,
)

NS = Namespace(extra_key="lora-1", salt="s")
MHA = KVShape(kind=KVKind.MHA, layers=2, heads=2, head_dim=4, dtype=torch.float16, page_size=4)
MLA = KVShape(kind=KVKind.MLA, layers=3, heads=1, head_dim=8, dtype=torch.bfloat16, page_size=2)
SLOTS = 8
HEADER = 24
SECOND = 10**9


def space(shape: KVShape, name: str = "tiny") -> KeySpace:
    model = ModelIdentity(
        name, str(shape.dtype).removeprefix("torch."), shape.kind, shape.page_size
    )
    shard = Shard.replicated() if shape.kind is KVKind.MLA else Shard(tp_rank=1, tp_size=2)
    return KeySpace(model=model, shard=shard, tag="t1")


def pages(shape: KVShape, count: int) -> list[PageHash]:
    return list(chain_page_hashes(list(range(count * shape.page_size)), shape.page_size, NS))


def make_host(shape: KVShape, seed: int = 0) -> HostKVPool:
    host = HostKVPool(shape, SLOTS, "page_first", pin_memory=False)
    for slot in range(SLOTS):
        generator = torch.Generator().manual_seed(seed + slot)
        raw = torch.randint(0, 256, (shape.nbytes(1),), dtype=torch.uint8, generator=generator)
        host.write_pages([slot], raw.view(shape.dtype).reshape(shape.canonical(1)))
    return host


def slot_bits(host: HostKVPool, slot: int) -> bytes:
    return host.read_pages([slot]).reshape(-1).view(torch.uint8).numpy().tobytes()


def file_size(backend: FileBackend, shape: KVShape) -> int:
    """Bytes of one object file of ``backend``'s key space (every key has the same length)."""
    key = backend.keyspace.page_keys(NS, pages(shape, 1)[0])[0]
    return HEADER + len(key.text.encode()) + shape.bytes_per_page // shape.planes


class Tick:
    """A clock (nanoseconds) that advances one second per reading: deterministic recency."""

    def __init__(self, start: int = 1_700_000_000 * SECOND) -> None:
        self.now = start

    def __call__(self) -> int:
        self.now += SECOND
        return self.now


def backend(
    shape: KVShape, root: Path, host: HostKVPool | None = None, **kwargs: object
) -> FileBackend:
    made = FileBackend(space(shape), root, **kwargs)  # type: ignore[arg-type]
    made.attach(make_host(shape) if host is None else host)
    return made


def host_of(b: FileBackend) -> HostKVPool:
    assert b.host is not None
    return b.host


def object_files(root: Path) -> list[Path]:
    return sorted(root.glob("*/*.kvs"))


def temp_files(root: Path) -> list[Path]:
    return sorted(root.glob("*/.*.tmp"))


# ------------------------------------------------------------------------------------- names, format
def test_objects_are_files_named_by_a_digest_of_their_key(tmp_path: Path) -> None:
    long_space = space(MHA, name="m" * 300)  # a rendered key longer than NAME_MAX
    b = FileBackend(long_space, tmp_path)
    b.attach(make_host(MHA))
    p = pages(MHA, 1)
    assert b.put(NS, p, [0]) == [PutStatus.STORED]

    keys = long_space.page_keys(NS, p[0])
    assert len(keys[0].text) > 255
    assert object_files(tmp_path) == sorted(b.path_of(key) for key in keys)
    for key in keys:
        path = b.path_of(key)
        assert path.name == object_name(key) + ".kvs"
        assert len(object_name(key)) == 40 and path.parent.name == object_name(key)[:2]
        data = path.read_bytes()
        assert data[:4] == b"KVSF"
        assert key.text.encode() in data
        assert len(data) == HEADER + len(key.text.encode()) + MHA.bytes_per_page // 2
    assert b.get(NS, p, [5]) == [GetStatus.LOADED]
    assert slot_bits(host_of(b), 5) == slot_bits(host_of(b), 0)
    assert temp_files(tmp_path) == []
    with pytest.raises(MisuseError):
        object_name(keys[0].text)  # type: ignore[arg-type]


def test_fsync_mode_round_trips(tmp_path: Path) -> None:
    b = backend(MLA, tmp_path, fsync=True)
    p = pages(MLA, 2)
    assert b.put(NS, p, [0, 1]) == [PutStatus.STORED] * 2
    assert b.get(NS, p, [2, 3]) == [GetStatus.LOADED] * 2
    assert [slot_bits(host_of(b), s) for s in (2, 3)] == [slot_bits(host_of(b), s) for s in (0, 1)]


# ------------------------------------------------------------------------------------ damaged files
def _flip(offset: int) -> Callable[[Path, Path], None]:
    def damage(path: Path, _other: Path) -> None:
        data = bytearray(path.read_bytes())
        data[offset] ^= 0x40
        path.write_bytes(bytes(data))

    return damage


DAMAGE: dict[str, Callable[[Path, Path], None]] = {
    "flip-payload": _flip(-1),
    "flip-key": _flip(HEADER + 3),
    "flip-crc": _flip(HEADER - 1),
    "version": _flip(4),
    "magic": _flip(0),
    "truncated": lambda path, _: path.write_bytes(path.read_bytes()[:-1]),
    "extended": lambda path, _: path.write_bytes(path.read_bytes() + b"\0"),
    "empty": lambda path, _: path.write_bytes(b""),
    "foreign": lambda path, other: shutil.copyfile(other, path),  # another key's object
    "garbage": lambda path, _: path.write_bytes(bytes(i % 251 for i in range(path.stat().st_size))),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_file_is_a_miss_and_is_removed(tmp_path: Path, damage: str) -> None:
    b = backend(MHA, tmp_path)
    host = host_of(b)
    p = pages(MHA, 2)
    b.put(NS, p, [0, 1])
    victim = b.path_of(b.keyspace.page_keys(NS, p[0])[1])
    DAMAGE[damage](victim, b.path_of(b.keyspace.page_keys(NS, p[1])[1]))
    before = slot_bits(host, 4)

    assert b.get(NS, p, [4, 5]) == [GetStatus.MISSING, GetStatus.LOADED]
    assert not victim.exists()
    assert slot_bits(host, 4) == before  # a miss never writes its slot
    assert b.counters.objects_discarded == 1
    assert b.exists(NS, p) == 0

    assert b.put(NS, p, [0, 1]) == [PutStatus.STORED, PutStatus.EXISTED]  # rewritten
    assert b.get(NS, p[:1], [4]) == [GetStatus.LOADED]
    assert slot_bits(host, 4) == slot_bits(host, 0)


def test_a_file_of_the_wrong_size_does_not_exist(tmp_path: Path) -> None:
    b = backend(MLA, tmp_path)
    p = pages(MLA, 1)
    b.put(NS, p, [0])
    path = b.path_of(b.keyspace.page_keys(NS, p[0])[0])
    path.write_bytes(path.read_bytes()[:-8])
    assert b.exists(NS, p) == 0  # one stat, no read
    assert b.put(NS, p, [0]) == [PutStatus.STORED]  # replaced
    assert b.exists(NS, p) == 1


def test_removing_a_damaged_file_spares_a_fresh_rewrite(tmp_path: Path) -> None:
    b = backend(MLA, tmp_path)
    p = pages(MLA, 1)
    b.put(NS, p, [0])
    key = b.keyspace.page_keys(NS, p[0])[0]
    path = b.path_of(key)
    stale_identity = path.stat()
    b.evict(NS, p[0])
    b.put(NS, p, [0])  # another writer replaced the file between our read and our removal
    b._discard(path, object_name(key), stale_identity)
    assert path.exists()
    assert b.get(NS, p, [3]) == [GetStatus.LOADED]


def test_a_full_disk_evicts_the_oldest_files_or_answers_full(tmp_path: Path) -> None:
    """Whatever the cap, puts keep ``min_free_bytes`` free on the file system (issue 17): the
    oldest files go first; when nothing can go the put is FULL and what is stored stays intact."""
    disk = {"free": 10 << 20}
    b = backend(
        MHA, tmp_path, clock=Tick(), min_free_bytes=1 << 20, free_bytes=lambda: disk["free"]
    )
    size = file_size(b, MHA)  # one object file (a page is two)
    p = pages(MHA, 3)
    host = host_of(b)
    assert b.put(NS, p[:2], [0, 1]) == [PutStatus.STORED] * 2
    disk["free"] = (1 << 20) + 2 * size  # room for one more page above the reserve
    assert b.put(NS, p[2:], [2]) == [PutStatus.STORED]
    assert b.exists(NS, p) == 3
    disk["free"] = (1 << 20) + size  # one object short: the oldest page's files go
    fresh = pages(MHA, 4)[3:]
    assert b.put(NS, fresh, [3]) == [PutStatus.STORED]
    assert b.exists(NS, p[:1]) == 0 and b.exists(NS, p[1:]) == 2
    assert b.counters.snapshot().objects_evicted >= 1
    disk["free"] = 0  # a disk filled by someone else, and nothing of ours can make room enough
    keep = {page: b.exists(NS, [page]) for page in (*p[1:], *fresh)}
    b._index.clear()  # this instance knows no file it could evict
    assert b.put(NS, pages(MHA, 5)[4:], [4]) == [PutStatus.FULL]
    assert {page: b.exists(NS, [page]) for page in keep} == keep
    assert b.get(NS, fresh, [0]) == [GetStatus.LOADED]
    assert torch.equal(
        host.read_pages([0]).view(torch.int16), host.read_pages([3]).view(torch.int16)
    )


# ------------------------------------------------------------------------------ atomic writes, crashes
def test_a_failed_write_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = backend(MHA, tmp_path, capacity_bytes="1MiB")
    p = pages(MHA, 1)

    def no_rename(*_args: object) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(file_module.os, "replace", no_rename)
    assert b.put(NS, p, [0]) == [PutStatus.FAILED]
    assert object_files(tmp_path) == [] and temp_files(tmp_path) == []
    assert b.used_bytes == 0 and b.indexed() == ()
    monkeypatch.undo()
    assert b.put(NS, p, [0]) == [PutStatus.STORED]
    assert b.counters.snapshot() == BackendCounters(
        puts_stored=1, puts_failed=1, bytes_written=MHA.bytes_per_page, io_errors=1
    )


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (errno.ENOSPC, PutStatus.FULL),
        (errno.EDQUOT, PutStatus.FULL),
        (errno.EACCES, PutStatus.FAILED),
        (errno.EROFS, PutStatus.FAILED),
    ],
)
def test_io_errors_become_statuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, status: PutStatus
) -> None:
    b = backend(MLA, tmp_path)
    p = pages(MLA, 2)
    b.put(NS, p[:1], [0])

    def refuse(*_args: object, **_kwargs: object) -> tuple[int, str]:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(file_module.tempfile, "mkstemp", refuse)
    assert b.put(NS, p, [0, 1]) == [PutStatus.EXISTED, status]
    assert b.counters.io_errors == 1


def test_read_errors_are_misses_not_exceptions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = backend(MLA, tmp_path)
    p = pages(MLA, 1)
    b.put(NS, p, [0])

    def unreadable(*_args: object, **_kwargs: object) -> object:
        raise PermissionError(errno.EACCES, "denied")

    monkeypatch.setattr(file_module, "open", unreadable, raising=False)
    assert b.get(NS, p, [1]) == [GetStatus.FAILED]
    monkeypatch.setattr(file_module.Path, "stat", unreadable)
    assert b.exists(NS, p) == 0
    assert b.put(NS, p, [0]) == [PutStatus.FAILED]
    assert b.counters.io_errors == 3
    monkeypatch.undo()
    assert b.exists(NS, p) == 1


_CHILD = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from kvstrata.impl.pools import HostKVPool, KVShape
    from kvstrata.impl.storage import file as file_module
    from kvstrata.impl.storage.file import FileBackend
    from kvstrata.model.keys import KeySpace, KVKind, Namespace, PageHash, parse_store_key

    spec = json.loads(sys.argv[1])
    parts = parse_store_key(spec["key"])
    space = KeySpace(model=parts.model, shard=parts.shard, tag=parts.tag)
    shape = KVShape(kind=KVKind(spec["kind"]), layers=spec["layers"], heads=spec["heads"],
                    head_dim=spec["head_dim"], dtype=getattr(torch, spec["dtype"]),
                    page_size=spec["page_size"])
    ns = Namespace(extra_key=spec["extra_key"], salt=spec["salt"])
    host = HostKVPool(shape, 8, "page_first_direct", pin_memory=False)
    generator = torch.Generator().manual_seed(spec["seed"])
    raw = torch.randint(0, 256, (shape.nbytes(8),), dtype=torch.uint8, generator=generator)
    host.write_pages(list(range(8)), raw.view(shape.dtype).reshape(shape.canonical(8)))
    backend = FileBackend(space, spec["root"])
    backend.attach(host)
    mine = [PageHash.from_hex(text) for text in spec["mine"]]
    theirs = [PageHash.from_hex(text) for text in spec["theirs"]]

    def bits(slots):
        return [host.read_pages([s]).reshape(-1).view(torch.uint8).numpy().tobytes().hex()
                for s in slots]

    if spec["mode"] == "crash":
        file_module.os.replace = lambda *args, **kwargs: os._exit(17)
        backend.put(ns, mine, list(range(len(mine))))
        raise SystemExit("unreachable: the put should have crashed the process")
    seen = backend.exists(ns, theirs)
    loaded = backend.get(ns, theirs, [4 + i for i in range(len(theirs))])
    stored = backend.put(ns, mine, list(range(len(mine))))
    print(json.dumps({
        "seen": seen,
        "loaded": [status.value for status in loaded],
        "loaded_bits": bits([4 + i for i in range(len(theirs))]),
        "stored": [status.value for status in stored],
        "stored_bits": bits(range(len(mine))),
    }))
    """
)


def run_child(
    mode: str, root: Path, shape: KVShape, mine: list[PageHash], theirs: list[PageHash]
) -> subprocess.CompletedProcess[str]:
    """Run a FileBackend on ``root`` in a fresh Python process (see ``_CHILD``)."""
    key: StoreKey = space(shape).page_keys(NS, mine[0])[0]
    spec = {
        "mode": mode,
        "root": str(root),
        "key": key.text,
        "kind": shape.kind.value,
        "layers": shape.layers,
        "heads": shape.heads,
        "head_dim": shape.head_dim,
        "dtype": str(shape.dtype).removeprefix("torch."),
        "page_size": shape.page_size,
        "extra_key": NS.extra_key,
        "salt": NS.salt,
        "seed": 4242,
        "mine": [page.hex() for page in mine],
        "theirs": [page.hex() for page in theirs],
    }
    return subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(spec)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )


@pytest.mark.slow
def test_a_crash_before_the_rename_leaves_no_visible_object(tmp_path: Path) -> None:
    p = pages(MHA, 1)
    child = run_child("crash", tmp_path, MHA, mine=p, theirs=[])
    assert child.returncode == 17, child.stderr
    assert len(temp_files(tmp_path)) == 1  # the crash left its complete-looking temp file
    assert object_files(tmp_path) == []

    (temp,) = temp_files(tmp_path)
    clock = Tick(start=temp.stat().st_mtime_ns)  # just after the crash
    b = backend(MHA, tmp_path, clock=clock)
    assert b.exists(NS, p) == 0
    assert b.get(NS, p, [4]) == [GetStatus.MISSING]
    assert b.indexed() == ()
    assert b.put(NS, p, [0]) == [PutStatus.STORED]
    assert b.get(NS, p, [4]) == [GetStatus.LOADED]
    assert len(temp_files(tmp_path)) == 1  # not stale yet: it could be a live writer's

    clock.now = temp.stat().st_mtime_ns + 2 * 3600 * SECOND
    b.rescan()
    assert temp_files(tmp_path) == []
    assert b.exists(NS, p) == 1


@pytest.mark.slow
def test_two_processes_share_one_root(tmp_path: Path) -> None:
    b = backend(MHA, tmp_path)
    host = host_of(b)
    ours, theirs = pages(MHA, 4)[:2], pages(MHA, 4)[2:]
    assert b.put(NS, ours, [0, 1]) == [PutStatus.STORED] * 2

    child = run_child("share", tmp_path, MHA, mine=theirs, theirs=ours)
    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["seen"] == 2
    assert report["loaded"] == ["loaded", "loaded"]
    assert report["loaded_bits"] == [slot_bits(host, 0).hex(), slot_bits(host, 1).hex()]
    assert report["stored"] == ["stored", "stored"]

    assert b.exists(NS, ours + theirs) == 4
    assert b.get(NS, theirs, [6, 7]) == [GetStatus.LOADED] * 2
    assert [slot_bits(host, 6).hex(), slot_bits(host, 7).hex()] == report["stored_bits"]


# ---------------------------------------------------------------------------------- capacity, LRU
def test_lru_order_survives_a_restart(tmp_path: Path) -> None:
    clock = Tick()
    first = backend(MLA, tmp_path, clock=clock)
    size = file_size(first, MLA)
    p = pages(MLA, 4)
    names = [object_name(first.keyspace.page_keys(NS, page)[0]) for page in p]
    first.put(NS, p[:3], [0, 1, 2])
    assert first.get(NS, p[:1], [5]) == [GetStatus.LOADED]  # p0 becomes the most recent
    first.close()

    again = backend(MLA, tmp_path, clock=clock, capacity_bytes=3 * size)
    assert again.indexed() == (names[1], names[2], names[0])
    assert again.used_bytes == 3 * size
    assert again.put(NS, p[3:], [3]) == [PutStatus.STORED]
    assert [again.exists(NS, [page]) for page in p] == [1, 0, 1, 1]
    assert again.counters.objects_evicted == 1
    again.close()

    smaller = backend(MLA, tmp_path, clock=clock, capacity_bytes=2 * size)  # the cap shrank
    assert smaller.indexed() == (names[0], names[3])
    assert [smaller.exists(NS, [page]) for page in p] == [1, 0, 0, 1]
    assert smaller.counters.objects_evicted == 1


def test_a_put_that_cannot_fit_is_full_and_evicts_nothing(tmp_path: Path) -> None:
    probe = backend(MHA, tmp_path / "probe")
    size = file_size(probe, MHA)
    b = backend(MHA, tmp_path / "l3", clock=Tick(), capacity_bytes=3 * size)
    p = pages(MHA, 3)
    assert b.put(NS, p[:1], [0]) == [PutStatus.STORED]
    assert b.put(NS, p[1:2], [1]) == [PutStatus.STORED]  # p0's k (older) makes room
    assert b.exists(NS, p[:1]) == 0 and b.exists(NS, p[1:2]) == 1
    assert len(object_files(tmp_path / "l3")) == 3

    tiny = backend(MHA, tmp_path / "tiny", capacity_bytes=size)  # a page is two files
    assert tiny.put(NS, p[:1], [0]) == [PutStatus.FULL]
    assert object_files(tmp_path / "tiny") == [] and tiny.used_bytes == 0


def test_eviction_by_another_process_is_a_miss(tmp_path: Path) -> None:
    a = backend(MLA, tmp_path, capacity_bytes="1MiB")
    b = backend(MLA, tmp_path)
    p = pages(MLA, 2)
    a.put(NS, p, [0, 1])
    assert b.indexed() == ()
    assert b.exists(NS, p) == 2  # another writer's files are hits ...
    assert len(b.indexed()) == 2  # ... and now steer b's eviction too
    assert b.evict(NS, p[0]) == 1
    assert a.exists(NS, p) == 0
    assert a.get(NS, p, [4, 5]) == [GetStatus.MISSING, GetStatus.LOADED]
    assert a.used_bytes == file_size(a, MLA)  # a forgot the file it found gone


def test_rescan_ignores_foreign_files_and_keeps_fresh_temp_files(tmp_path: Path) -> None:
    clock = Tick()
    shard = tmp_path / "ab"
    shard.mkdir()
    stale, fresh = shard / (".ab" + "0" * 38 + ".x.tmp"), shard / (".ab" + "1" * 38 + ".y.tmp")
    stale.write_bytes(b"half")
    fresh.write_bytes(b"half")
    old = clock.now - 7200 * SECOND
    os.utime(stale, ns=(old, old))
    os.utime(fresh, ns=(clock.now, clock.now))
    (tmp_path / "README").write_text("not ours")
    (shard / "notes.txt").write_text("not ours")
    (tmp_path / "zz").mkdir()
    (tmp_path / "cd").write_text("a file where a shard directory could be")

    b = backend(MLA, tmp_path, clock=clock)
    assert not stale.exists() and fresh.exists()
    assert (tmp_path / "README").exists() and (shard / "notes.txt").exists()
    assert b.indexed() == () and b.used_bytes == 0
    assert b.counters.io_errors == 0


def test_constructor_refuses_bad_arguments(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    cases: list[dict[str, object]] = [
        {"root": tmp_path / "file"},
        {"root": tmp_path / "file" / "below"},
        {"root": 42},
        {"fsync": "yes"},
        {"clock": 5},
        {"stale_temp_s": 0},
        {"capacity_bytes": "lots"},
        {"writer": None},
    ]
    for kwargs in cases:
        arguments: dict[str, object] = {"root": tmp_path / "ok", **kwargs}
        with pytest.raises(ConfigError):
            FileBackend(space(MLA), **arguments)  # type: ignore[arg-type]
