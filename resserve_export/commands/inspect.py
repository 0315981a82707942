"""`resserve-export inspect`."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from resserve_export.core.ui import console
from resserve_export.formats.registry import get as get_format
from resserve_export.stages.inspect import inspect_checkpoint


def command(
    ckpt: Path = typer.Argument(..., help="checkpoint directory written by `pack`"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of tables"),
) -> None:
    """Format, per-layer ratio and mode, bytes and the extension's share of a packed checkpoint."""


    info = inspect_checkpoint(ckpt)
    if as_json:
        print(json.dumps(info, indent=2, sort_keys=True))
        return
    con = console()
    b = info["bytes"]
    rnd = f", MX scale rounding {info['mx_scale_rounding']}" if get_format(info["format"]).has_rounding else ""
    con.print(
        f"[bold]{info['path']}[/]: {info['format'].upper()} ({info['quant_method']}{rnd}), "
        f"{len(info['groups'])} groups ({', '.join(f'{k} {v}' for k, v in sorted(info['modes'].items()))}), "
        f"{b['all_files'] / 2**30:.3f} GiB on disk, extension share {100 * info['extension_share']:.2f}%"
    )
    t = Table()
    t.add_column("group", no_wrap=True)
    for col, just in ( ("ratio", "right"), ("mode", "left"), ("K", "right"), ("K_E", "right"),
                      ("base bytes", "right"), ("ext bytes", "right"), ("ext share", "right")):
        t.add_column(col, justify=just)
    for r in info["groups"]:
        members = r["members"]
        name = members[0] if len(members) == 1 else members[0].rsplit(".", 1)[0] + "." + "+".join(m.rsplit(".", 1)[1] for m in members)
        name = name.replace("model.layers.", "layers.")
        share = r["extension_bytes"] / (r["base_bytes"] + r["extension_bytes"]) if r["base_bytes"] else 0.0
        t.add_row(name, f"{r['ratio']:g}", r["mode"], str(r["K"]), str(r["K_E"]), f"{r['base_bytes']:,}",
                  f"{r['extension_bytes']:,}", f"{100 * share:.1f}%")
    con.print(t)
    kv = info["kv_cache"]
    if kv["layers"]:
        kt = Table(title=f"{kv['format'].upper()} KV-cache scales (amax / 448)")
        for col in ("attention layer", "k_scale", "v_scale"):
            kt.add_column(col, justify="left" if col == "attention layer" else "right")
        for r in kv["layers"]:
            kt.add_row(r["module"].replace("model.layers.", "layers."), f"{r['k_scale']:.4e}", f"{r['v_scale']:.4e}")
        con.print(kt)
    wa = info["weight_algo"]
    if "awq" in wa["name"].split("+"):
        con.print(f"weights: AWQ-smoothed ({wa.get('smoothed_groups')} groups; scales in the calibration directory, SHA-256 {wa.get('scales_sha256', '')[:12]}…)")
    if "gptq" in wa["name"].split("+"):
        con.print(
            f"weights: GPTQ in {wa.get('gptq_order', 'block')} order (codes and scales from the calibration directory's GPTQ "
            f"weights, SHA-256 {wa.get('gptq_sha256', '')[:12]}…)"
        )
    con.print(
        f"quantized linears {b['quantized_linears']:,} B, unquantized {b['unquantized']:,} B, "
        f"KV-cache scales {b['kv_cache_scales']:,} B, sidecar {b['sidecar']:,} B, all files {b['all_files']:,} B"
    )
