"""`resserve-export calibrate`: activation salience and amax (and optional planner scores)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer


def command(
    model: Annotated[
        str,
        typer.Argument(help="Hugging Face directory, hub id in the local cache, GGUF file/dir, or 'default' (embedded SmolLM2-135M-Instruct)."),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="Calibration directory to write (built in a temporary sibling, renamed at the end).")],
    config: Annotated[Optional[str], typer.Option("--config", "-c", help="Preset: calib_configs/NAME.yaml or a bare NAME (paper, quick).")] = None,
    dataset: Annotated[
        Optional[str],
        typer.Option(help="shakespeare[:calib|:eval], a .txt/.jsonl/.parquet file, a directory of .txt, or NAME[:CONFIG[:SPLIT]] of a cached datasets dataset."),
    ] = None,
    num_samples: Annotated[Optional[int], typer.Option(help="Number of sequences (paper: 1024).")] = None,
    seq_len: Annotated[Optional[int], typer.Option(help="Tokens per sequence, at most (paper: 2048).")] = None,
    batch_size: Annotated[Optional[int], typer.Option(help="Sequences per forward pass (paper: 8).")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Sampling seed (paper: 42).")] = None,
    device: Annotated[Optional[str], typer.Option(help="auto (accelerate device_map over GPUs/CPU/disk), cpu, cuda or cuda:N.")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="Model dtype: bfloat16, float16, float32 or float64.")] = None,
    scores: Annotated[Optional[str], typer.Option(help="Planner scores: none, grad or kl.")] = None,
    score_samples: Annotated[Optional[int], typer.Option(help="Sequences used for the scores.")] = None,
    score_precision: Annotated[
        Optional[str],
        typer.Option(
            help="Grad scores' candidate products: auto (bf16 GEMMs for bf16 models on GPUs and on CPUs with "
            "AVX512-BF16/AMX, and for fp16 models on GPUs with torch >= 2.8; FP32 elsewhere), fp32, or bf16 "
            "(exact FP4 operands, FP32 accumulation; ~4 (GPU) to ~8 (CPU) more bytes per weight)."
        ),
    ] = None,
    format: Annotated[Optional[str], typer.Option("--format", help="FP4 format the scores assume: nvfp4 or mxfp4.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a non-empty --out.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
) -> None:
    """Collect per-channel mean |x| and amax of every quantized linear's input (SPEC §5, §9)."""
    from .. import calibrate as cal

    cfg = cal.make_config(
        config,
        dataset=dataset,
        num_samples=num_samples,
        seq_len=seq_len,
        batch_size=batch_size,
        seed=seed,
        device=device,
        dtype=dtype,
        scores=scores,
        score_samples=score_samples,
        score_precision=score_precision,
        format=format,
    )
    path = cal.calibrate(model, out, cfg, overwrite=overwrite, show_progress=not quiet)
    rec = json.loads((path / "calibration.json").read_text())
    typer.echo(
        f"wrote {path}: {len(rec['groups'])} groups, {rec['num_samples']} samples, "
        f"{rec['num_tokens']} tokens in {rec['wall_time_s']:.1f} s"
    )
