"""``kvstrata replay``: replay a trace through L1 / L2 / L3 and report hit ratios, bytes moved and
timings (SPEC §11).

Order of work, so that bad input fails fast and before anything is started: options become a
:class:`~kvstrata.impl.replay.config.ReplayConfig` (capacity syntax, policies), the trace is read
(missing file, malformed line), the capacities are resolved to pages (one page at least), a configured
master is probed (bounded), and only then are torch, the pools and the store brought up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from kvstrata.impl.replay.capacity import Capacity

__all__ = ["replay"]

_POLICIES = ("write_through", "write_through_selective", "write_back")
_PREFETCH = ("best_effort", "wait_complete", "timeout")


def _capacities(text: str, flag: str) -> list[Capacity]:
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise click.BadParameter("expected a comma-separated list like 1M,2M,4M", param_hint=flag)
    return [Capacity.parse(part, flag=flag, allow_off=False) for part in parts]


@click.command()
@click.argument("trace", required=False, type=click.Path(path_type=Path))
@click.option("--sample", is_flag=True, help="Replay the sample trace shipped with kvstrata.")
@click.option("--limit", type=click.IntRange(min=1), help="Replay only the first N requests.")
@click.option(
    "--l1",
    "l1",
    default="256k",
    show_default=True,
    help="L1 (device) capacity: tokens (3M), bytes (4gb) or inf.",
)
@click.option(
    "--l2",
    "l2",
    default="1M",
    show_default=True,
    help="L2 (host) capacity; 0 turns L2 (and L3) off.",
)
@click.option(
    "--l3",
    "l3",
    default=None,
    help="L3 capacity (sizes the local cluster's segment); 0 turns L3 off. "
    "[default: 4M, off when L2 is off]",
)
@click.option("--no-l3", is_flag=True, help="Run without L3 (same as --l3 0).")
@click.option(
    "--sweep-l1",
    "sweep_l1",
    metavar="LIST",
    help="Also replay with each L1 capacity of LIST (e.g. 256k,512k,1M) and plot the "
    "hit ratio against it; the summary and JSON describe the run at --l1.",
)
@click.option(
    "--page-size",
    default=64,
    show_default=True,
    type=click.IntRange(min=1),
    help="Tokens per page.",
)
@click.option(
    "--kv",
    "kind",
    type=click.Choice(["mha", "mla"]),
    default="mha",
    show_default=True,
    help="Synthetic model: K and V planes (mha) or one latent (mla).",
)
@click.option("--layers", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--heads", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--head-dim", default=2, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--dtype",
    default="float16",
    show_default=True,
    type=click.Choice(["float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2"]),
)
@click.option(
    "--l3-backend",
    type=click.Choice(["mooncake", "memory", "file"]),
    default="mooncake",
    show_default=True,
    help="mooncake: a local cluster (or --master); memory: "
    "in-process; file: one file per object under --l3-dir.",
)
@click.option(
    "--master",
    envvar="KVSTRATA_MOONCAKE_MASTER",
    metavar="HOST:PORT",
    help="Use this Mooncake cluster instead of starting one [env: KVSTRATA_MOONCAKE_MASTER].",
)
@click.option(
    "--l3-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Root directory of the file backend (default: a temporary one).",
)
@click.option(
    "--key-schema",
    type=click.Choice(["1", "2"]),
    default="2",
    show_default=True,
    help="L3 key schema: 2 stores a page as one object (page_major host pool); 1 as one object "
    "per K and V plane (page_first_direct).",
)
@click.option(
    "--write-policy",
    type=click.Choice(_POLICIES),
    default="write_through",
    show_default=True,
    help="When L1 pages are copied to L2.",
)
@click.option(
    "--prefetch-policy",
    type=click.Choice(_PREFETCH),
    default="wait_complete",
    show_default=True,
    help="How long a request waits for its L3 prefetch.",
)
@click.option(
    "--prefetch-threshold",
    default=256,
    show_default=True,
    type=click.IntRange(min=0),
    help="Tokens that must remain before L3 is asked.",
)
@click.option(
    "--timestamps",
    type=click.Choice(["ignore", "honour"]),
    default="ignore",
    show_default=True,
    help="honour: start each request at its timestamp / --speed.",
)
@click.option(
    "--speed",
    default=1.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Time scaling when honouring timestamps (10 = ten times faster).",
)
@click.option(
    "--verify/--no-verify",
    default=True,
    show_default=True,
    help="Check every KV byte served against the KV written for those tokens.",
)
@click.option(
    "--settle/--overlap",
    default=False,
    show_default=True,
    help="Wait after each request until its copies and backups finished (hit ratios independent "
    "of machine speed) instead of overlapping them with later requests.",
)
@click.option(
    "--seed",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="Salt of the synthetic KV bytes (part of the store keys).",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the result as JSON here.",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write a PNG plot here.",
)
@click.option(
    "--progress/--no-progress", default=True, show_default=True, help="Show progress on stderr."
)
@click.option(
    "--tp",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Tensor-parallel ranks: N processes (gloo on loopback), each with its own pools and shard "
    "of the store, agreeing at every check_events; they must report the same hits.",
)
@click.pass_context
def replay(ctx: click.Context, /, **options: Any) -> None:
    """Replay a Mooncake-format TRACE (JSON lines: timestamp, input_length, output_length, hash_ids)
    through L1, L2 and L3 and report the hit ratio per tier next to the trace's theoretical maximum.

    \b
    Examples:
      kvstrata replay --sample
      kvstrata replay trace.jsonl --limit 2000 --l1 1M --l2 4M --l3 16M --json out.json
      kvstrata replay trace.jsonl --l1 inf --l2 0          # the trace's maximum, L1 only
    """
    from kvstrata.impl.replay import sample_trace  # noqa: PLC0415
    from kvstrata.impl.replay.config import ModelShape, ReplayConfig  # noqa: PLC0415
    from kvstrata.impl.replay.trace import read_trace  # noqa: PLC0415

    trace: Path | None = options["trace"]
    if options["sample"] == (trace is not None):
        raise click.UsageError("give a TRACE file or --sample (one of the two)")
    path = Path(sample_trace()) if options["sample"] else trace
    assert path is not None
    master = options["master"]
    from_env = ctx.get_parameter_source("master") is ParameterSource.ENVIRONMENT
    if options["l3_backend"] != "mooncake" and from_env:
        master = None  # a cluster exported for Mooncake does not apply to other backends
    l3 = "0" if options["no_l3"] else options["l3"]
    fields: dict[str, Any] = {"key_schema": int(options["key_schema"])}
    if l3 is not None:
        fields["l3"] = l3
    config = ReplayConfig(
        l1=options["l1"],
        l2=options["l2"],
        page_size=options["page_size"],
        shape=ModelShape(
            kind=options["kind"],
            layers=options["layers"],
            heads=options["heads"],
            head_dim=options["head_dim"],
            dtype=options["dtype"],
        ),
        l3_backend=options["l3_backend"],
        master=master,
        l3_dir=None if options["l3_dir"] is None else str(options["l3_dir"]),
        write_policy=options["write_policy"],
        prefetch_policy=options["prefetch_policy"],
        prefetch_threshold=options["prefetch_threshold"],
        timestamps=options["timestamps"],
        speed=options["speed"],
        verify=options["verify"],
        settle=options["settle"],
        seed=options["seed"],
        tp=options["tp"],
        **fields,
    )
    sweep_l1 = _capacities(options["sweep_l1"], "--sweep-l1") if options["sweep_l1"] else []
    requests = read_trace(path, options["limit"])
    config.tier_pages(requests)  # every tier holds a page, before anything starts
    for capacity in sweep_l1:
        config.with_l1(capacity).tier_pages(requests)
    if config.has_l3 and config.master is not None:
        _probe(config.master)
    _run(config, requests, sweep_l1, path, options)


def _probe(master: str) -> None:
    """Fail fast (within the probe timeout, 2 s by default) when a configured master does not
    answer, before torch, the pools and the store are brought up."""
    from kvstrata.impl.storage.mooncake.config import MooncakeConfig  # noqa: PLC0415
    from kvstrata.impl.storage.mooncake.connect import probe_master  # noqa: PLC0415

    probe_master(MooncakeConfig.load(master=master))


def _run(
    config: Any, requests: Any, sweep_l1: list[Capacity], path: Path, options: dict[str, Any]
) -> None:
    from rich.console import Console  # noqa: PLC0415

    from kvstrata.impl.replay.report import ConsoleProgress, render_summary  # noqa: PLC0415
    from kvstrata.impl.replay.runner import replay as run_replay  # noqa: PLC0415
    from kvstrata.impl.replay.runner import sweep  # noqa: PLC0415

    progress = ConsoleProgress(Console(stderr=True)) if options["progress"] else None
    label = str(path)
    if config.tp > 1:
        from kvstrata.impl.replay.tp import replay_tp  # noqa: PLC0415

        if sweep_l1:
            raise click.UsageError("--sweep-l1 runs one process per capacity; use it with --tp 1")
        if progress is not None:
            Console(stderr=True).print(f"replaying as {config.tp} TP ranks (gloo, loopback)...")
        result = replay_tp(config, requests, trace=label, limit=options["limit"])
    elif sweep_l1:
        result = sweep(
            config, requests, sweep_l1, trace=label, limit=options["limit"], progress=progress
        )
    else:
        result = run_replay(
            config, requests, trace=label, limit=options["limit"], progress=progress
        )
    render_summary(result, Console())
    if options["json_path"] is not None:
        result.write_json(options["json_path"])
    if options["plot_path"] is not None:
        from kvstrata.impl.replay.plot import write_plot  # noqa: PLC0415

        write_plot(result, options["plot_path"])
