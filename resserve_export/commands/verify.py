"""`resserve-export verify`."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer


@contextmanager
def progress_bar(console):
    """A rich progress display; yields ``tick(phase, advance, total)`` (one bar per phase)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
        console=console, transient=False,
    ) as prog:
        tasks: dict[str, int] = {}

        def tick(phase: str, advance: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = prog.add_task(phase, total=total)
            prog.advance(tasks[phase], advance)

        yield tick


def command(
    ckpt: Path = typer.Argument(..., help="checkpoint directory written by `pack`"),
    model: str = typer.Option(..., "--model", help="the model the checkpoint was packed from: HF dir, GGUF file, hub id or 'default'"),
    text: Optional[str] = typer.Option(None, "--text", help="held-out text: .txt/.jsonl/.parquet file, directory of .txt (default: the held-out plays)"),
    samples: int = typer.Option(4, "--samples", help="evaluation sequences"),
    seq_len: int = typer.Option(256, "--seq-len", help="tokens per sequence"),
    calib: Optional[Path] = typer.Option(None, "--calib", help="calibration directory for the ratio sweep's selection"),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N"),
    max_tokens: int = typer.Option(4096, "--max-tokens", help="captured input rows per layer for NMSE"),
    check_weights: bool = typer.Option(True, "--check-weights/--no-check-weights", help="re-quantize the model's weights and compare with the stored ones"),
    out: Path = typer.Option(Path("verify-out"), "--out", help="directory for verify.json and nmse.png"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing --out directory"),
) -> None:
    """Measure the checkpoint: linear-output NMSE (plain, its ratios, full, a ratio sweep) and perplexity."""
    from rich.console import Console
    from rich.table import Table

    from ..ui import console
    from ..verify import verify

    err = Console(stderr=True)
    with progress_bar(err) as tick:
        rep = verify(
            ckpt, model, text=text, samples=samples, seq_len=seq_len, calib=calib, device=device,
            max_tokens=max_tokens, check_weights=check_weights, out=out, overwrite=overwrite, progress=tick,
        )
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
    pt = Table(title=f"perplexity on {rep['text']} ({rep['tokens_scored']} tokens)")
    for k in ("bf16", "plain", "checkpoint", "full"):
        pt.add_column(k, justify="right")
    pt.add_row(*(f"{rep['perplexity'][k]:.3f}" for k in ("bf16", "plain", "checkpoint", "full")))
    con.print(pt)
    ok = "yes" if n["falls_as_ratio_rises"] else "NO"
    con.print(
        f"activation quantization: {rep['activation_quantization']}; NMSE falls as the ratio rises: {ok}; "
        "stored weights equal the reference quantization: "
        + {True: "yes", False: "NO", None: "not checked"}[rep["weights_match_reference"]]
    )
    con.print(f"wrote {out}/verify.json and {out}/nmse.png")
