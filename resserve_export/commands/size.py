"""`resserve-export size`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from resserve_export.api import size
from resserve_export.core.ui import console
from resserve_export.formats.registry import FORMATS


def command(
    config: Path = typer.Argument(..., help="config.json of the source model (or its directory)"),
    fmt: str = typer.Option("nvfp4", "--format", help=f"element format: {' | '.join(FORMATS)}"),
    ratio: Optional[float] = typer.Option(None, "--ratio", help="one prefill ratio for every layer: 0, 0.125, 0.25, 0.5 or 1"),
    plan: Optional[Path] = typer.Option(None, "--plan", help="plan.json from `plan` (per-layer ratios)"),
    tokenizer_bytes: Optional[int] = typer.Option(
        None, "--tokenizer-bytes", help="bytes of config, tokenizer and other copied files (default: measured beside CONFIG)"
    ),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="largest safetensors shard, as for pack"),
    kv_cache: str = typer.Option("none", "--kv-cache", help="KV-cache scales, as for pack: none | fp8 | nvfp4"),
    experts_layout: str = typer.Option("per-expert", "--experts-layout", help="gpt-oss's experts, as for pack: per-expert | hub"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
) -> None:
    """Bytes of the checkpoint `pack` would write, per tensor class and in total, from config.json alone."""


    rep = size(config, fmt, ratio=ratio, plan=plan, other_bytes=tokenizer_bytes, max_shard_size=max_shard_size, kv_cache=kv_cache,
               experts_layout=experts_layout)
    if as_json:
        print(json.dumps(rep.as_dict(), indent=2, sort_keys=True))
        return
    kv = f", {kv_cache.upper()} KV-cache scales" if kv_cache != "none" else ""
    t = Table(title=f"{fmt.upper()} checkpoint size ({'plan ' + str(plan) if plan else f'ratio {ratio}'}{kv})")
    t.add_column("class")
    t.add_column("bytes", justify="right")
    t.add_column("GiB", justify="right")
    t.add_column("share", justify="right")
    for name, b in rep.classes.items():
        t.add_row(name, f"{b:,}", f"{b / 2**30:.4f}", f"{100 * b / rep.total:.2f}%")
    t.add_row("[bold]total[/]", f"[bold]{rep.total:,}[/]", f"[bold]{rep.total / 2**30:.3f}[/]", "100.00%")
    console().print(t)
