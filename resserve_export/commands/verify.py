"""`resserve-export verify`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from resserve_export import api
from resserve_export.core.ui import console, phases


def command(
    ckpt: Path = typer.Argument(..., help="checkpoint directory written by `pack`"),
    model: str = typer.Option(..., "--model", help="the model the checkpoint was packed from: HF dir, GGUF file, hub id or 'default'"),
    text: Optional[str] = typer.Option(None, "--text", help="held-out text: .txt/.jsonl/.parquet file, directory of .txt (default: the held-out plays)"),
    samples: int = typer.Option(4, "--samples", help="evaluation sequences"),
    seq_len: int = typer.Option(256, "--seq-len", help="tokens per sequence"),
    calib: Optional[Path] = typer.Option(None, "--calib", help="the calibration directory the checkpoint was packed with: the ratio sweep's channel selection, and the "
        "masks and input scales are checked against it. Without it the sweep's selection comes from 16 other samples "
        "of --text (or, without --text, of the default calibration text)"),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N"),
    max_tokens: int = typer.Option(4096, "--max-tokens", help="captured input rows per layer for NMSE"),
    check_weights: bool = typer.Option(
        True, "--check-weights/--no-check-weights",
        help="re-quantize the model's weights (and, with --calib, redo the masks and input scales) and stop with exit code 3 unless every stored tensor matches",
    ),
    out: Path = typer.Option(Path("verify-out"), "--out", help="directory for verify.json and nmse.png"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing --out directory"),
) -> None:
    """Measure the checkpoint: linear-output NMSE (plain, its ratios, full, a ratio sweep) and perplexity.

    First checks that every stored tensor equals a fresh quantization of --model (skip with
    --no-check-weights). Exit codes: 0 checked and written; 2 usage or input error; 3 the
    checkpoint does not match --model (or --calib), nothing written; 130 interrupted.
    """
    with phases() as tick:
        rep = api.verify(
            ckpt, model, text=text, samples=samples, seq_len=seq_len, calib=calib, device=device,
            max_tokens=max_tokens, check_weights=check_weights, out=out, overwrite=overwrite, progress=tick,
        ).report
    con = console()
    n = rep["nmse"]
    t = Table(title=f"linear-output NMSE vs FP32, pooled over {len(rep['layers'])} linears ({rep['format'].upper()})")
    t.add_column("activations")
    t.add_column("pooled NMSE", justify="right")
    t.add_column("vs plain", justify="right")
    t.add_column("mean per layer", justify="right")
    p = n["pooled"]
    rows = [("plain W4A4", "plain")] + [(k.replace("ratio_", "K-Ext ρ="), k) for k in n["sweep_keys"]]
    rows += [("checkpoint ratios", "checkpoint"), ("full compensation", "full")]
    for label, key in rows:
        red = 100 * (p["plain"] - p[key]) / p["plain"]
        t.add_row(label, f"{p[key]:.4e}", f"{-red:+.1f}%", f"{n['mean_per_layer'][key]:.4e}")
    con.print(t)
    kinds = n.get("by_kind") or {}
    if len(kinds) > 1:
        kt = Table(title="pooled NMSE by kind of linear")
        for col in ("kind", "plain W4A4", "checkpoint ratios", "full compensation"):
            kt.add_column(col, justify="left" if col == "kind" else "right")
        for kind, v in kinds.items():
            kt.add_row(kind, f"{v['plain']:.4e}", f"{v['checkpoint']:.4e}", f"{v['full']:.4e}")
        con.print(kt)
    pt = Table(title=f"perplexity on {rep['text']} ({rep['tokens_scored']} tokens)")
    # The source model's perplexity is stored under "bf16" whatever its dtype: show the real one.
    for k in (rep["model_dtype"], "plain", "checkpoint", "full"):
        pt.add_column(k, justify="right")
    pt.add_row(*(f"{rep['perplexity'][k]:.3f}" for k in ("bf16", "plain", "checkpoint", "full")))
    con.print(pt)
    kv = rep.get("kv_cache")
    if kv:
        kt = Table(title=f"{kv['format'].upper()} KV cache (scales {kv['scale']}): NMSE of cached keys / values, and perplexity")
        for col in ("attention layer", "k_scale", "v_scale", "keys NMSE", "values NMSE"):
            kt.add_column(col, justify="left" if col == "attention layer" else "right")
        for r in kv["layers"]:
            kt.add_row(r["module"].replace("model.layers.", "layers."), f"{r['k_scale']:.3e}", f"{r['v_scale']:.3e}", f"{r['k']:.3e}", f"{r['v']:.3e}")
        kt.add_row("[bold]pooled[/]", "", "", f"[bold]{kv['pooled']['k']:.3e}[/]", f"[bold]{kv['pooled']['v']:.3e}[/]")
        con.print(kt)
        pp = rep["perplexity"]
        con.print(
            f"perplexity with the KV cache quantized: {rep['model_dtype']} linears {pp['bf16_kv']:.3f} (vs {pp['bf16']:.3f}), "
            f"checkpoint linears {pp['checkpoint_kv']:.3f} (vs {pp['checkpoint']:.3f} with linears only)"
        )
    ok = "yes" if n["falls_as_ratio_rises"] else "NO"
    con.print(
        f"activation quantization: {rep['activation_quantization']}; NMSE falls as the ratio rises: {ok}; "
        "stored weights equal the reference quantization: "
        + ("yes" if rep["weights_match_reference"] else "not checked")
    )
    con.print(f"wrote {out}/verify.json and {out}/nmse.png")
