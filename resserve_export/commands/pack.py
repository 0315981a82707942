"""`resserve-export pack`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from resserve_export.api import pack
from resserve_export.formats.registry import FORMATS


def command(
    model: str = typer.Argument(..., help="HF model directory, GGUF file, cached hub id, or 'default' (embedded SmolLM2-135M-Instruct)"),
    calib: Path = typer.Option(..., "--calib", help="calibration directory written by `calibrate`"),
    out: Path = typer.Option(..., "--out", help="checkpoint directory to write"),
    ratio: Optional[float] = typer.Option(None, "--ratio", help="one prefill ratio for every layer: 0, 0.125, 0.25, 0.5 or 1"),
    plan: Optional[Path] = typer.Option(None, "--plan", help="plan.json from `plan` (per-layer ratios)"),
    fmt: str = typer.Option("nvfp4", "--format", help=f"element format: {' | '.join(FORMATS)}"),
    mx_scale: str = typer.Option("ceil", "--mx-scale", help="MXFP4 scale rounding: ceil | floor | even"),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N"),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="largest safetensors shard, e.g. 5GB, 500MB"),
    kv_cache: str = typer.Option(
        "none", "--kv-cache",
        help="also write KV-cache scales (amax / 448 per attention layer, from the calibration) for a KV cache in: none | fp8 | nvfp4 "
        "(nvfp4 with --format nvfp4 only)",
    ),
    experts_layout: str = typer.Option(
        "per-expert", "--experts-layout",
        help="how gpt-oss's experts are written: per-expert (w13 / w2 per expert, compressed-tensors; with the sidecar) | hub "
        "(the hub's MXFP4 blocks, quant_method mxfp4: stock vLLM's gpt_oss_mxfp4 method loads it, expert biases included; "
        "--format mxfp4 --ratio 0 only, attention kept in bf16)",
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing --out directory"),
    allow_other_weights: bool = typer.Option(
        False,
        "--allow-other-weights",
        help="use a calibration or plan made from other weights than MODEL's (e.g. a base model's for its fine-tune); "
        "refused by default"
    ),
) -> None:
    """Write an FP4 checkpoint (plain part for stock vLLM + resserve sidecar) from calibration and a ratio or plan."""


    res = pack(
        model,
        calib,
        out,
        fmt,
        ratio=ratio,
        plan=plan,
        mx_scale=mx_scale,
        device=device,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        allow_other_weights=allow_other_weights,
        kv_cache=kv_cache,
        experts_layout=experts_layout,
        progress=True,
    )
    Console(stderr=True).print(
        f"wrote {res.out} ({res.bytes_written / 2**30:.3f} GiB, {res.groups} groups, "
        f"{res.model_files} model + {res.sidecar_files} sidecar shards) in {res.seconds:.1f} s"
    )
