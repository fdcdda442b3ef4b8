"""What a person sees of a replay: a progress bar while it runs and a summary afterwards (rich).

On a terminal the progress is a live bar; elsewhere (CI logs, pipes) it is one plain line per tenth of
the run, so a log shows that a long replay is moving. Numbers in the summary are exactly those of the
JSON result (:mod:`.result`), rounded for reading.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from kvstrata.impl.replay.result import ReplayResult

__all__ = ["ConsoleProgress", "render_summary", "summary"]

_TIERS = (("l1", "L1 device"), ("l2", "L2 host"), ("l3", "L3 store"))
_DIRECTIONS = (
    ("l1_to_l2", "L1 -> L2", "write-through"),
    ("l2_to_l1", "L2 -> L1", "load-back"),
    ("l2_to_l3", "L2 -> L3", "backup"),
    ("l3_to_l2", "L3 -> L2", "prefetch"),
)


class ConsoleProgress:
    """A :class:`~.runner.ProgressSink` on ``console``: a rich bar on a terminal, else plain lines."""

    def __init__(self, console: Console) -> None:
        self._console = console
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        self._total = 0
        self._label = ""
        self._next_line = 0
        self._started = 0.0

    def start(self, total: int, label: str) -> None:
        self._total, self._label, self._started = total, label, time.monotonic()
        self._next_line = max(1, total // 10)
        if self._console.is_terminal:
            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("requests, hit ratio {task.fields[ratio]:.3f}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self._console,
                transient=False,
            )
            self._bar.start()
            self._task = self._bar.add_task(label, total=total, ratio=0.0)

    def advance(self, done: int, hit_ratio: float) -> None:
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=done, ratio=hit_ratio)
        elif done >= self._next_line or done == self._total:
            self._next_line = done + max(1, self._total // 10)
            percent = 100 * done // max(self._total, 1)
            self._console.print(
                f"{self._label}: {done}/{self._total} requests ({percent}%), hit ratio "
                f"{hit_ratio:.3f}, {time.monotonic() - self._started:.1f} s",
                highlight=False,
            )

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def _count(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _bytes(value: int | None) -> str:
    if value is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value} B"


def _hits_table(result: ReplayResult) -> Table:
    table = Table(title="Hits (tokens not recomputed)", title_justify="left")
    for name, justify in (
        ("tier", "left"),
        ("capacity", "right"),
        ("hit tokens", "right"),
        ("hit ratio", "right"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    ratio = result.hit_ratio
    tokens = result.hits.as_dict()
    for key, name in _TIERS:
        tier: dict[str, Any] | None = result.tiers.get(key)
        if tier is None:
            table.add_row(name, "off", "-", "-")
            continue
        label = name if key != "l3" else f"L3 {tier.get('backend', 'store')}"
        capacity = "cluster" if tier.get("tokens") is None else f"{tier['tokens']:,} tok"
        table.add_row(label, capacity, f"{tokens[key]:,}", f"{ratio[key]:.4f}")
    table.add_row("total", "", f"{tokens['total']:,}", f"{ratio['total']:.4f}", style="bold")
    table.add_row(
        "max (unbounded)", "inf", f"{result.max_hit_tokens:,}", f"{result.max_hit_ratio:.4f}"
    )
    return table


def _moved_table(result: ReplayResult) -> Table:
    table = Table(title="Data moved", title_justify="left")
    for name, justify in (
        ("direction", "left"),
        ("by", "left"),
        ("pages", "right"),
        ("bytes", "right"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for key, direction, by in _DIRECTIONS:
        table.add_row(
            direction, by, _count(result.moved.pages[key]), _bytes(result.moved.bytes[key])
        )
    return table


def _run_table(result: ReplayResult) -> Table:
    timings = result.timings.as_dict(result.requests)
    table = Table(title="Run", title_justify="left", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("requests (refused)", f"{result.requests:,} ({result.refused:,})")
    table.add_row("input tokens", f"{result.input_tokens:,}")
    table.add_row("scheduler path", f"{timings['scheduler_us_per_request']:,.1f} µs/request")
    table.add_row("waiting for L2/L3", f"{timings['wait_us_per_request']:,.1f} µs/request")
    table.add_row("synthetic KV", f"{timings['kv_us_per_request']:,.1f} µs/request")
    if result.config.get("verify"):
        table.add_row("pages verified", f"{result.pages_verified:,}")
    table.add_row(
        "wall time",
        f"{timings['wall_s']:.1f} s (start {timings['startup_s']:.1f}, replay "
        f"{timings['replay_s']:.1f}, drain {timings['drain_s']:.1f})",
    )
    return table


def _sweep_table(result: ReplayResult) -> Table | None:
    if not result.sweep:
        return None
    table = Table(title="Hit ratio against L1 capacity", title_justify="left")
    for name in ("L1", "L1 pages", "l1", "l2", "l3", "total", "max"):
        table.add_column(name, justify="right")
    for point in result.sweep:
        ratio = point["hit_ratio"]
        table.add_row(
            str(point["l1"]),
            _count(point["l1_pages"]),
            *(f"{ratio[k]:.4f}" for k in ("l1", "l2", "l3", "total")),
            f"{point['max_hit_ratio']:.4f}",
        )
    return table


def summary(result: ReplayResult) -> Group:
    """The summary as a rich renderable."""
    config = result.config
    shape = config["shape"]
    header = (
        f"[bold]kvstrata replay[/bold] {Path(result.trace).name}: {result.requests:,} requests, page "
        f"{config['page_size']}, {shape['kind'].upper()} {shape['layers']}x{shape['heads']}x"
        f"{shape['head_dim']} {shape['dtype']} ({shape['bytes_per_token']} B/token), "
        f"{config['write_policy']}, prefetch {config['prefetch_policy']}"
    )
    parts: list[Any] = [header, _hits_table(result), _moved_table(result), _run_table(result)]
    sweep = _sweep_table(result)
    if sweep is not None:
        parts.append(sweep)
    return Group(*parts)


def render_summary(result: ReplayResult, console: Console) -> None:
    console.print(summary(result))
