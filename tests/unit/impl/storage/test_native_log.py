"""The native log filter (issue 17): glog lines leave stderr, everything else passes unchanged; with
KVSTRATA_DEBUG=1 nothing is filtered. Each case runs in a subprocess of its own (fd 2 is the
process's; pytest captures it in this one), and one case against a real dead Mooncake master."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from kvstrata.impl.storage.mooncake.native_log import GLOG_LINE

SCRIPT = textwrap.dedent(
    """
    import os, sys, logging
    from kvstrata.impl.storage.mooncake.native_log import quiet_native_logs
    quiet = quiet_native_logs()
    os.write(2, b"E1126 00:18:51.575129  2168 master_client.cpp:406] Client not available\\n")
    os.write(2, b"WARNING: Logging before InitGoogleLogging() is written to STDERR\\n")
    os.write(2, b"I1126 00:18:51.575129 12 a.cpp:1] info\\nplain line from C\\n")
    print("python stderr line", file=sys.stderr, flush=True)
    os.write(2, b"progress 50%\\r")
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("kvstrata.storage").warning("L3 store down")
    quiet.uninstall()
    print("after uninstall", file=sys.stderr, flush=True)
    print(quiet.lines, quiet.installed)
    """
)


def run(debug: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "KVSTRATA_DEBUG"}
    if debug:
        env["KVSTRATA_DEBUG"] = "1"
    return subprocess.run(
        [sys.executable, "-c", SCRIPT],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_glog_lines_are_counted_and_kept_off_stderr() -> None:
    done = run(debug=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["3", "False"]
    assert "Client not available" not in done.stderr
    assert "InitGoogleLogging" not in done.stderr and "] info" not in done.stderr
    for kept in ("plain line from C", "python stderr line", "progress 50%", "L3 store down"):
        assert kept in done.stderr
    assert done.stderr.rstrip().endswith("after uninstall")


def test_debug_keeps_every_native_line() -> None:
    done = run(debug=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "False"]
    assert "Client not available" in done.stderr and "InitGoogleLogging" in done.stderr


@pytest.mark.parametrize(
    ("line", "native"),
    [
        (b"E1126 00:18:51.575129  2168 master_client.cpp:406] Client not available", True),
        (b"W1126 00:18:51.5 1 x.h:1] w", True),
        (b"WARNING: Logging before InitGoogleLogging() is written to STDERR", True),
        (b"E1126 is not a glog line", False),
        (b"Traceback (most recent call last):", False),
        (b"WARNING:kvstrata.storage:L3 store down", False),
    ],
)
def test_which_lines_are_native(line: bytes, native: bool) -> None:
    assert bool(GLOG_LINE.match(line)) is native


MOONCAKE_SCRIPT = textwrap.dedent(
    """
    import sys
    from kvstrata.impl.storage.mooncake import LocalCluster, MooncakeClient
    from kvstrata.impl.storage.mooncake.native_log import quiet_native_logs
    from kvstrata.model.keys import DEFAULT_NAMESPACE, KeySpace, KVKind, ModelIdentity
    from kvstrata.model.keys import chain_page_hashes
    keys = KeySpace(ModelIdentity(name="q", dtype="float16", kind=KVKind.MHA, page_size=1), tag="q")
    page_keys = [k for p in chain_page_hashes([1, 2], 1) for k in keys.page_keys(DEFAULT_NAMESPACE, p)]
    with LocalCluster(segment_size="16mib") as cluster:
        client = MooncakeClient(cluster.config).setup()
        cluster.kill_master()
        codes = [client.batch_is_exist(page_keys) for _ in range(2)]
        client.close()
    print(min(min(c) for c in codes), quiet_native_logs().lines)
    """
)


def test_a_dead_master_writes_nothing_native_on_stderr() -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVSTRATA_DEBUG"}
    done = subprocess.run(
        [sys.executable, "-c", MOONCAKE_SCRIPT],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    code, lines = (int(x) for x in done.stdout.split())
    assert code == -900 and lines >= 2  # the native client did complain, off stderr
    assert not [line for line in done.stderr.splitlines() if GLOG_LINE.match(line.encode())], (
        done.stderr
    )
