"""The ``kvstrata`` entry point: the click group and the one place errors become exit statuses.

Exit statuses: 0 success; 1 an error (bad input, a store that cannot be reached, a file that cannot
be written); 2 a usage error (click); 3 a KV verification failure (a correctness bug: the cache served
bytes that differ from what was written); 130 interrupted.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Sequence

import click

from kvstrata.impl.cli.bench import bench
from kvstrata.impl.cli.master import master
from kvstrata.impl.cli.replay import replay
from kvstrata.impl.errors import KvStrataError
from kvstrata.impl.replay.errors import VerifyError

__all__ = ["EXIT_ERROR", "EXIT_INTERRUPTED", "EXIT_VERIFY", "cli", "main"]

EXIT_ERROR = 1
EXIT_VERIFY = 3
EXIT_INTERRUPTED = 130


@click.group(
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog="Exit status: 0 ok, 1 error, 2 usage error, 3 KV verification failed, 130 interrupted.",
)
@click.version_option(package_name="kvstrata", prog_name="kvstrata")
def cli() -> None:
    """kvstrata: a hierarchical KV cache (L1 device, L2 host, L3 Mooncake) for LLM schedulers."""


cli.add_command(replay)
cli.add_command(master)
cli.add_command(bench)


def _one_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    first, _, rest = text.partition("\n")
    return first + (" (KVSTRATA_DEBUG=1 shows more)" if rest.strip() else "")


def _fail(error: BaseException, status: int) -> int:
    if os.environ.get("KVSTRATA_DEBUG"):
        traceback.print_exception(error)
    click.echo(f"kvstrata: error: {_one_line(error)}", err=True)
    return status


def run(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); the exit status."""
    try:
        status = cli.main(args=argv, prog_name="kvstrata", standalone_mode=False)
    except click.ClickException as error:
        error.show()
        return error.exit_code
    except click.exceptions.Abort:
        click.echo("kvstrata: interrupted", err=True)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        click.echo("kvstrata: interrupted", err=True)
        return EXIT_INTERRUPTED
    except VerifyError as error:
        return _fail(error, EXIT_VERIFY)
    except (KvStrataError, OSError) as error:
        return _fail(error, EXIT_ERROR)
    return status if isinstance(status, int) else 0


def main() -> None:
    """The console script ``kvstrata``."""
    sys.exit(run())


if __name__ == "__main__":
    main()
