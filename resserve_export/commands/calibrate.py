"""`resserve-export calibrate`: activation salience and amax (and optional planner scores)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from resserve_export import api
from resserve_export.stages.calibrate.config import CalibConfig

_D = CalibConfig()  # the defaults without --config: the paper preset's values


def _default(value, preset: bool = True) -> str:
    """The help text's default note (the values come from the preset, so Typer cannot show them)."""
    # Typer renders help as rich markup: "\\[" keeps the bracket literal.
    return f" \\[default: {value} (paper preset)]" if preset else f" \\[default: {value}]"


def command(
    model: Annotated[
        str,
        typer.Argument(help="Hugging Face directory, hub id in the local cache, GGUF file/dir, or 'default' (embedded SmolLM2-135M-Instruct)."),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="Calibration directory to write (built in a temporary sibling, renamed at the end).")],
    config: Annotated[
        Optional[str], typer.Option("--config", "-c", help="Preset: a bare NAME (paper, quick) or a YAML file. Flags override it." + _default("paper", preset=False))
    ] = None,
    dataset: Annotated[
        Optional[str],
        typer.Option(
            help="shakespeare[:calib|:eval], a .txt/.jsonl/.parquet file, a directory of .txt, or NAME[:CONFIG[:SPLIT]] of a cached datasets dataset." + _default(_D.dataset),
        ),
    ] = None,
    num_samples: Annotated[Optional[int], typer.Option(help="Number of sequences." + _default(_D.num_samples))] = None,
    seq_len: Annotated[Optional[int], typer.Option(help="Tokens per sequence, at most." + _default(_D.seq_len))] = None,
    batch_size: Annotated[Optional[int], typer.Option(help="Sequences per forward pass, at most (a GPU runs a batch whose activations would pass 256 MiB in smaller pieces)." + _default(_D.batch_size))] = None,
    seed: Annotated[Optional[int], typer.Option(help="Sampling seed." + _default(_D.seed))] = None,
    device: Annotated[
        Optional[str], typer.Option(help="auto (accelerate device_map over GPUs/CPU/disk), cpu, cuda or cuda:N." + _default(_D.device, preset=False))
    ] = None,
    dtype: Annotated[Optional[str], typer.Option(help="Model dtype: bfloat16, float16, float32 or float64." + _default(_D.dtype, preset=False))] = None,
    scores: Annotated[
        Optional[str], typer.Option(help="Planner scores for `plan`: grad, kl (slow) or none." + _default(_D.scores, preset=False))
    ] = None,
    score_samples: Annotated[Optional[int], typer.Option(help="Sequences used for the scores." + _default(_D.score_samples))] = None,
    score_precision: Annotated[
        Optional[str],
        typer.Option(
            help="Grad scores' candidate products: auto (bf16 GEMMs for bf16 models on GPUs and on CPUs with "
            "AVX512-BF16/AMX, and for fp16 models on GPUs with torch >= 2.8; FP32 elsewhere), fp32, or bf16 "
            "(exact FP4 operands, FP32 accumulation; candidates of ~5 (GPU) to ~9 (CPU) bytes per weight, fp32's ~8.5)." + _default(_D.score_precision, preset=False),
        ),
    ] = None,
    format: Annotated[
        Optional[str], typer.Option("--format", help="FP4 format the scores assume (pack must use the same): nvfp4 or mxfp4." + _default(_D.format, preset=False))
    ] = None,
    mx_scale: Annotated[
        Optional[str],
        typer.Option("--mx-scale", help="MXFP4 scale rounding the scores assume: ceil, floor or even." + _default(_D.mx_scale, preset=False)),
    ] = None,
    weight_algo: Annotated[
        Optional[str],
        typer.Option(
            "--weight-algo",
            help="Weight-side algorithm: rtn (round to nearest), awq (activation-aware per-channel scales, searched under "
            "W4A4 and folded exactly into the norms / rows before each group; pack applies them), gptq (each linear quantized "
            "column by column in the format's blocks, its rounding error spread over the later columns by the inverse input "
            "Hessian of the calibration tokens; --gptq-order; pack writes these weights) or awq+gptq (GPTQ on the AWQ-smoothed model). gptq "
            "quantizes for --format / --mx-scale, which pack must then use." + _default(_D.weight_algo, preset=False),
        ),
    ] = None,
    awq_tokens: Annotated[
        Optional[int], typer.Option("--awq-tokens", help="Tokens per group for the AWQ scale search." + _default(_D.awq_tokens, preset=False))
    ] = None,
    gptq_order: Annotated[
        Optional[str],
        typer.Option(
            "--gptq-order",
            help="GPTQ's column order: activation (every block scale fixed first from the weights by the format's rule, then "
            "the input channels by decreasing Hessian diagonal, as llm-compressor's default) or block (the blocks in order, "
            "each block's scales chosen at its first column from the updated weights)." + _default(_D.gptq_order, preset=False),
        ),
    ] = None,
    gptq_propagate: Annotated[
        Optional[bool],
        typer.Option(
            "--gptq-propagate/--no-gptq-propagate",
            help="GPTQ layer by layer with each layer's outputs recomputed through its GPTQ weights (dequantized, inputs "
            "unquantized), so later layers' Hessians and statistics see the earlier layers' weight error, as llm-compressor's "
            "sequential pipeline does; runs the sequential pipeline." + _default(_D.gptq_propagate, preset=False),
        ),
    ] = None,
    pipeline: Annotated[
        Optional[str],
        typer.Option(
            "--pipeline",
            help="whole (load the model, accelerate offloading what does not fit), sequential (one decoder layer in "
            "memory at a time; statistics and grad scores, bit-identical to whole) or auto (sequential when the weights "
            "do not fit the devices and the run needs neither KL scores nor AWQ)." + _default(_D.pipeline, preset=False),
        ),
    ] = None,
    moe_calib: Annotated[
        Optional[str],
        typer.Option(
            "--moe-calib",
            help="Mixture-of-experts models: the tokens each expert's statistics come from: all (every expert also runs on "
            "every calibration token, the model's output keeping the true routing) or routed (the tokens the router sends it; "
            "an expert that saw none takes its layer's pooled statistics, with a warning)." + _default(_D.moe_calib, preset=False),
        ),
    ] = None,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="Continue an interrupted --pipeline sequential run of the same --out from its last resume point (saved "
            "every RESSERVE_RESUME_SECONDS, default 600; the result equals an uninterrupted run's).",
        ),
    ] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a non-empty --out.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")] = False,
) -> None:
    """Collect per-channel mean |x| and amax of every quantized linear's input, and the planner's sensitivity scores."""
    # Settings left at None take the preset's value (make_config drops them).
    res = api.calibrate(
        model, out, config=config, overwrite=overwrite, progress=not quiet, dataset=dataset, num_samples=num_samples,
        seq_len=seq_len, batch_size=batch_size, seed=seed, device=device, dtype=dtype, scores=scores,
        score_samples=score_samples, score_precision=score_precision, format=format, mx_scale=mx_scale,
        weight_algo=weight_algo, awq_tokens=awq_tokens, gptq_order=gptq_order, gptq_propagate=gptq_propagate, pipeline=pipeline, moe_calib=moe_calib, resume=resume,
    )
    if os.environ.get("RANK", "0") != "0":
        return  # under torchrun, rank 0 reports
    typer.echo(
        f"wrote {res.path}: {len(res.groups)} groups, {res.num_samples} samples, {res.num_tokens} tokens in {res.wall_time_s:.1f} s"
    )
