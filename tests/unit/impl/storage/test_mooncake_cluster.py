"""LocalCluster and the storage node: start, readiness, port clashes, failures that show the child's
stderr, and a clean stop of exactly the processes it started."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator

import pytest

from kvstrata.impl.errors import ConfigError, MisuseError, StoreUnavailable
from kvstrata.impl.storage.mooncake import LocalCluster, LocalClusterConfig
from kvstrata.impl.storage.mooncake import node as node_module
from kvstrata.impl.storage.mooncake.cluster import ClusterState, find_master_binary, free_port


def _accepts(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


def test_the_session_cluster_is_up(mooncake_cluster: LocalCluster) -> None:
    cluster = mooncake_cluster
    assert cluster.state is ClusterState.RUNNING
    assert cluster.master_address.startswith("127.0.0.1:")
    assert _accepts(cluster.master_address)
    assert cluster.master_pid is not None and cluster.node_pid is not None
    assert cluster.segment_name is not None and cluster.segment_name.startswith("127.0.0.1:")
    config = cluster.config
    assert (config.master, config.global_segment_size) == (cluster.master_address, 0)
    assert cluster.settings.segment_size == 128 << 20
    assert repr(cluster) == f"LocalCluster({cluster.master_address}, running)"
    with pytest.raises(MisuseError, match="start"):
        cluster.start()


@pytest.fixture
def held_port() -> Iterator[int]:
    """A loopback port that a listening socket of this test holds."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_port_clash_is_retried_and_stop_ends_both_children(held_port: int) -> None:
    offered: list[int] = []

    def ports() -> int:
        offered.append(held_port if not offered else free_port())
        return offered[-1]

    cluster = LocalCluster(segment_size=16 << 20, ports=ports)
    with cluster:
        assert len(offered) == 2  # the master exited on the held port; the launcher tried another
        assert cluster.master_address == f"127.0.0.1:{offered[1]}"
        master, node = cluster.master_pid, cluster.node_pid
        assert master is not None and node is not None
    assert cluster.state is ClusterState.STOPPED
    assert cluster.master_pid is None and cluster.node_pid is None
    assert not _accepts(f"127.0.0.1:{offered[1]}")
    cluster.stop()  # idempotent
    for call in (cluster.start, cluster.kill_master, cluster.restart_master):
        with pytest.raises(MisuseError):
            call()


def test_a_master_that_cannot_start_is_reported_with_its_stderr() -> None:
    # the Python interpreter in place of the master: it refuses the master's flags on stderr
    cluster = LocalCluster(master_binary=sys.executable)
    with pytest.raises(StoreUnavailable, match=r"(?s)did not start in 5 attempts.*usage"):
        cluster.start()
    assert cluster.state is ClusterState.STOPPED
    assert cluster.master_pid is None


def test_the_storage_node_reports_a_master_it_cannot_reach(
    capsys: pytest.CaptureFixture[str],
) -> None:
    address = f"127.0.0.1:{free_port()}"
    assert node_module.main(["--master", address, "--segment", "16mib"]) == 2
    assert f"master {address} is not reachable" in capsys.readouterr().err
    assert node_module.main(["--master", "nowhere"]) == 2
    assert "master: expected 'host:port'" in capsys.readouterr().err


def test_cluster_settings_are_validated() -> None:
    assert LocalClusterConfig(segment_size="64mib").segment_size == 64 << 20
    for bad in (
        {"segment_size": 0},
        {"segment_size": "8mib"},
        {"segment_size": "big"},
        {"host": "127.0.0.1:80"},
        {"lease_ttl_ms": 0},
        {"lease_ttl_ms": 1.5},
        {"stop_timeout": -1},
    ):
        with pytest.raises(ConfigError):
            LocalClusterConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(MisuseError, match="either"):
        LocalCluster(LocalClusterConfig(), segment_size=1)
    with pytest.raises(MisuseError, match="not started"):
        _ = LocalCluster().master_address


def test_the_master_binary_is_found() -> None:
    assert find_master_binary().endswith("mooncake_master")
