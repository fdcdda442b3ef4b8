"""``kvstrata master``: a local Mooncake cluster (``mooncake_master`` and a kvstrata storage node that
owns the segment memory) in the foreground, until Ctrl-C or SIGTERM (SPEC §8).

It prints the master's address and the environment a client needs (``KVSTRATA_MOONCAKE_*``, read by
``MooncakeConfig.load`` and by ``kvstrata replay``), then waits. On SIGINT or SIGTERM it stops the
storage node and the master (bounded) and exits 0; if either child dies meanwhile it says so and
exits 1.
"""

from __future__ import annotations

import signal
import socket
import threading
from types import FrameType

import click

from kvstrata.impl.errors import ConfigError, StoreUnavailable

__all__ = ["check_flags", "master"]


def check_flags(segment: str, host: str) -> None:
    """:class:`ConfigError` naming the flag, before any process starts: ``--host`` must be an
    address of this machine, ``--segment`` must fit in its memory (issue 17: these used to end as
    ``[Errno 99]`` and as "the storage node did not start (said '')")."""
    from kvstrata.impl.pools.sizes import check_host_fits, parse_size  # noqa: PLC0415

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.bind((host, 0))
    except OSError as error:
        raise ConfigError(
            f"--host {host}: not an address this machine can bind to ({error.strerror or error})"
        ) from error
    check_host_fits(parse_size(segment, what="--segment"), what=f"--segment {segment}")


@click.command()
@click.option(
    "--segment",
    default="1gib",
    show_default=True,
    help="Memory the storage node contributes (e.g. 256mib, 4gib; at least 16mib).",
)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address the master and the storage node bind to and advertise.",
)
@click.option(
    "--lease-ttl-ms",
    default=2000,
    show_default=True,
    type=click.IntRange(min=1),
    help="The master's object lease after a read (blocks eviction meanwhile).",
)
def master(segment: str, host: str, lease_ttl_ms: int) -> None:
    """Run a Mooncake master and a storage node on this machine until Ctrl-C / SIGTERM."""
    from kvstrata.impl.storage.mooncake import ENV_VARS, LocalCluster  # noqa: PLC0415

    check_flags(segment, host)

    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with LocalCluster(segment_size=segment, host=host, lease_ttl_ms=lease_ttl_ms) as cluster:
            config = cluster.config
            size = cluster.settings.segment_size
            click.echo(
                f"mooncake master at {cluster.master_address} (pid {cluster.master_pid}); storage "
                f"node {cluster.segment_name or '?'} with a {size / 2**30:.2f} GiB segment "
                f"(pid {cluster.node_pid})"
            )
            click.echo("clients (kvstrata replay, MooncakeConfig.load) need:")
            click.echo(f"  export {ENV_VARS['master']}={config.master}")
            click.echo(f"  export {ENV_VARS['local_hostname']}={config.local_hostname}")
            click.echo(
                "e.g. kvstrata replay --sample   (Ctrl-C or SIGTERM stops the cluster)", nl=True
            )
            while not stop.wait(0.5):
                if cluster.master_pid is None or cluster.node_pid is None:
                    which = "mooncake_master" if cluster.master_pid is None else "storage node"
                    raise StoreUnavailable(f"the {which} exited; stopping the cluster")
            click.echo("stopping the cluster ...", err=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    click.echo("stopped", err=True)
