"""A kvstrata storage node: a long-lived process that owns Mooncake segment memory (SPEC §8).

Objects live in the segment of the process that stored them and vanish when it closes or dies, so
the memory that L3 objects are put into belongs to this process rather than to any scheduler::

    python -m kvstrata.impl.storage.mooncake.node --master 127.0.0.1:50051 --segment 4gib

It connects a :class:`~kvstrata.impl.storage.mooncake.client.MooncakeClient` that contributes
``--segment`` bytes, prints one line ``READY <segment name>`` on stdout, and then waits for SIGTERM or
SIGINT (or, with ``--watch-stdin``, for its stdin to close: the launcher died) and closes the client
cleanly (exit status 0). If it cannot connect it prints the reason on stderr and exits with status 2.

This module imports neither torch nor the backend: it starts in a fraction of a second. (Nothing in
the package imports it, so ``python -m`` runs it exactly once.)
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType

from kvstrata.impl.errors import ConfigError, StoreError
from kvstrata.impl.storage.mooncake.client import MooncakeClient
from kvstrata.impl.storage.mooncake.cluster import READY
from kvstrata.impl.storage.mooncake.config import MooncakeConfig

__all__ = ["EXIT_SETUP_FAILED", "main"]

EXIT_SETUP_FAILED = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kvstrata.impl.storage.mooncake.node",
        description="Own Mooncake segment memory for a kvstrata cluster until SIGTERM.",
    )
    parser.add_argument("--master", required=True, help="mooncake_master RPC address host:port")
    parser.add_argument("--segment", default="1gib", help="bytes to contribute (e.g. 4gib)")
    parser.add_argument("--local-buffer", default="0", help="Mooncake staging buffer bytes")
    parser.add_argument("--hostname", default="127.0.0.1", help="address advertised to peers")
    parser.add_argument("--protocol", default="tcp", help="tcp or rdma")
    parser.add_argument("--device", default="", help="RDMA device names")
    parser.add_argument("--metadata-server", default="P2PHANDSHAKE")
    parser.add_argument("--setup-retries", default="2")
    parser.add_argument(
        "--watch-stdin", action="store_true", help="also stop when stdin reaches end of file"
    )
    return parser


def _watch_stdin(stop: threading.Event) -> None:
    try:
        while sys.stdin.buffer.read(4096):
            pass
    except (OSError, ValueError):
        pass
    stop.set()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = MooncakeConfig(
            master=args.master,
            metadata_server=args.metadata_server,
            protocol=args.protocol,
            device_name=args.device,
            local_hostname=args.hostname,
            global_segment_size=args.segment,
            local_buffer_size=args.local_buffer,
            setup_retries=args.setup_retries,
        )
    except ConfigError as error:
        print(f"kvstrata storage node: {error}", file=sys.stderr, flush=True)
        return EXIT_SETUP_FAILED
    client = MooncakeClient(config)
    try:
        client.setup()  # bounded (probe, setup_retries); a signal meanwhile ends the process
    except StoreError as error:
        print(f"kvstrata storage node: {error}", file=sys.stderr, flush=True)
        return EXIT_SETUP_FAILED
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if args.watch_stdin:
        threading.Thread(target=_watch_stdin, args=(stop,), daemon=True).start()
    try:
        print(f"{READY} {client.hostname}", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
