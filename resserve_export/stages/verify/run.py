"""`verify`: read a packed checkpoint back and measure what it costs and what compensation buys.

First, unless skipped, every stored tensor is compared bit for bit with a fresh quantization of
the model (`check_weights_match`): measuring a checkpoint against a model it was not packed from
gives numbers about neither, so a mismatch stops the run (`CheckpointMismatch`, exit code 3).

For every quantized linear (docs/formats.md, "Verification metrics"): the checkpoint's FP4
weights (base and, for partial ratios, the stored K-Ext extension) are read back; real inputs are captured from the model,
loaded in the source dtype recorded at pack time (any other dtype would move the reference), on
held-out text (padding excluded); each input is quantized the way the server does it — the
fused CUDA kernel on a GPU, the PyTorch reference on the CPU — with the checkpoint's static
input scale, and the linear output is compared with the FP32 product of the original operands
(TF32 off). NMSE = Σ‖y − y_ref‖² / Σ‖y_ref‖², pooled over tokens, per layer and over all
layers, for: plain W4A4, the checkpoint's own ratios (K-Ext), full compensation, and a sweep of
partial ratios (selection from the calibration salience). Perplexity on the same text for the
source model (key ``bf16`` whatever its dtype), plain W4A4, the checkpoint's ratios and full
compensation uses `emulate.EmulatedLinear`.

The parts: `checks` (the checkpoint against the model and calibration), `nmse` (one fused
group's NMSE), `perplexity` (forward passes, emulated linears), `measure` (`evaluate`: all the
measurements), `report` (the chart); this module loads the inputs and writes verify.json.

An AWQ checkpoint (``calibrate --weight-algo awq``) stores smoothed weights and norms; its scales
stay in the calibration directory, so `verify` needs ``--calib`` (the scales file's SHA-256 must
be the one recorded at pack time). The weight check then quantizes the model's weights smoothed
by those scales (`awq.Smoothing`) and checks the smoothed norms, biases and (mixture-of-experts
models) routers too; NMSE compares the quantized product of the smoothed operands with the
original model's FP32 product (a linear whose output rows the next group's scales divide is
compared with that exact smoothed output); the emulated perplexity runs with the smoothed norms
and routers. The bf16 reference stays the original model: smoothing is exact in real arithmetic.

A checkpoint with KV-cache scales (``pack --kv-cache``) also gets the KV cache's error: per
attention layer and pooled NMSE of the cached keys and values after the FP8 / NVFP4
quantize-dequantize with the stored scales, and perplexity with that quantization applied in
attention, alone (``bf16_kv``) and with the checkpoint's linears (``checkpoint_kv``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from resserve_export.algorithms.awq.smoothing import Smoothing, storage_dtypes
from resserve_export.core import devices
from resserve_export.core.errors import CheckpointMismatch, UserError
from resserve_export.core.outputs import check_out_dir, write_dir_atomic
from resserve_export.modeling import data, modelio
from resserve_export.modeling.experts import (
    checkpoint_parameters,
    expert_blocks,
    is_expert,
    unfused,
)
from resserve_export.modeling.groups import Group
from resserve_export.observers.stats import collect
from resserve_export.stages.verify.checks import (
    check_kv_scales,
    check_smoothed_tensors,
    check_weights_match,
    checkpoint_gptq,
    checkpoint_smoothing,
    linear_weights,
    smoothed_weights,
)
from resserve_export.stages.verify.measure import evaluate
from resserve_export.stages.verify.report import write_chart
from resserve_export.storage.calibration import load_stats
from resserve_export.storage.checkpoint import Checkpoint
from resserve_export.storage.hub_experts import HUB

DEFAULT_TEXT = "shakespeare:eval"
# Without a calibration directory, the sweep's selection comes from this many samples of text.
SALIENCE_SAMPLES = 16


@dataclass(frozen=True)
class VerifyRequest:
    """What `verify` was asked: the checkpoint, the model and the measurement's settings."""

    ckpt: str | Path
    model: str
    text: str | None
    samples: int
    seq_len: int
    batch_size: int
    seed: int
    calib: str | Path | None  # as given: verify.json names it so
    max_tokens: int
    check_weights: bool
    out: Path | None
    overwrite: bool
    progress: Callable[[str, int, int], None] | None

    @property
    def calib_dir(self) -> Path | None:
        return Path(self.calib) if self.calib is not None else None


@dataclass
class Loaded:
    """The opened checkpoint and the loaded model (its experts, if any, as per-expert linears)."""

    ck: Checkpoint
    model_dir: Path
    net: torch.nn.Module
    fingerprint: str
    device: torch.device
    experts: object | None  # `experts.Unfused`


def _source_dtype(ck: Checkpoint, model_dir: Path) -> str:
    """The dtype to load the model in: the one `pack` quantized from (recorded in the
    provenance), else, for checkpoints that predate the record, that of the model's own
    safetensors weights of the quantized linears. Any other dtype re-quantizes differently and
    moves the NMSE reference."""
    recorded = (ck.resserve.get("provenance") or {}).get("source_dtype")
    if recorded is not None:
        if recorded not in ("bfloat16", "float16", "float32"):
            raise UserError(f"{ck.dir} records source dtype {recorded!r}, not bfloat16, float16 or float32: re-run pack")
        return recorded
    shapes = modelio.tensor_shapes(model_dir)
    # A module the model lacks is reported by `linear_weights` once the model is loaded.
    present = [m for m in ck.modules if f"{m}.weight" in shapes]
    return modelio.source_dtype(shapes, present, model_dir) if present else "bfloat16"


def verify(
    ckpt: str | Path,
    model: str,
    *,
    text: str | None = None,
    samples: int = 4,
    seq_len: int = 256,
    batch_size: int = 4,
    seed: int = 0,
    calib: str | Path | None = None,
    device: str = "auto",
    max_tokens: int = 4096,
    check_weights: bool = True,
    out: str | Path | None = None,
    overwrite: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict:
    """Run the whole verification (module docstring); write verify.json and nmse.png to `out`.

    The stored weights are checked right after the model is loaded, before the text, the
    tokenizer or any forward pass: a mismatch (`CheckpointMismatch`) costs one quantization pass
    and leaves nothing written.
    """
    if samples < 1:
        raise UserError(f"--samples must be at least 1, got {samples}")
    if out is not None:
        check_out_dir(Path(out), overwrite)
    req = VerifyRequest(
        ckpt, model, text, samples, seq_len, batch_size, seed, calib, max_tokens,
        check_weights, Path(out) if out is not None else None, overwrite, progress,
    )
    ck = Checkpoint(ckpt)
    if ck.experts_layout == HUB:
        raise UserError(
            f"{ckpt} holds gpt-oss's experts in the hub's MXFP4 layout (pack --experts-layout hub), which stock vLLM runs as W4A16 with "
            "bf16 attention, and verify measures this tool's W4A4 layout: verify a checkpoint packed from the same calibration "
            "without --experts-layout hub (its experts have the same codes and scales)"
        )
    has_experts = any(is_expert(m) for g in ck.groups for m in g["members"])
    if has_experts and calib is None:
        raise UserError(f"{ckpt} quantizes mixture-of-experts linears: pass --calib (the sweep's masks come from its per-expert salience)")
    model_dir = modelio.resolve_model(model)
    prov = ck.resserve.get("provenance") or {}
    fp = modelio.fingerprint(model_dir)
    if prov.get("fingerprint_method") == modelio.FINGERPRINT_METHOD and prov.get("model_fingerprint") != fp:
        raise CheckpointMismatch(
            f"{ckpt} was packed from other weights than {modelio.model_label(model)} (their fingerprints differ): "
            "pass the --model it was packed from"
        )
    dev = devices.resolve_device(device)
    dtype = _source_dtype(ck, model_dir)
    # Imported here: transformers.utils takes 3 to 5 s to import (python -X importtime, after
    # torch), which every command would pay, since the CLI imports this stage at start-up.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # verify shows its own progress; an error stays one line
    net = modelio.load_model(model_dir, dtype).to(dev)
    with unfused(net, expert_blocks(modelio.tensor_shapes(model_dir)) if has_experts else []) as experts:
        return _verify_loaded(req, Loaded(ck, model_dir, net, fp, dev, experts if has_experts else None))


def _check(req: VerifyRequest, run: Loaded, stats: dict | None, smoothing: Smoothing | None, quantized=None) -> None:
    """The checks against the model (and the calibration, when given) before any measurement."""
    ck, net, experts = run.ck, run.net, run.experts
    weights = smoothed_weights(linear_weights(net, ck), smoothing)
    check_weights_match(ck, weights, stats, model=modelio.model_label(req.model), progress=req.progress, quantized=quantized)
    del weights
    if smoothing is not None:
        check_smoothed_tensors(ck, net, smoothing, checkpoint_parameters(net, experts.blocks if experts is not None else []))
    if req.calib is not None:
        check_kv_scales(ck, req.calib_dir)


def _sweep_salience(req: VerifyRequest, run: Loaded, stats: dict | None, tok, docs) -> tuple[dict, str]:
    """Salience for the sweep's masks and where it came from: the calibration directory; without
    one, a short pass over 16 other samples (another seed) of --text when given, else of the
    default calibration text."""
    if stats is not None:
        return {m: v["mean_abs"] for m, v in stats.items() if "mean_abs" in v}, f"calibration directory {req.calib}"
    source = req.text or "shakespeare:calib"
    cal_docs = docs if req.text else data.load_documents(source)
    seed, seq_len = req.seed + 1, req.seq_len
    cal = data.batches(data.make_samples(tok, cal_docs, SALIENCE_SAMPLES, seq_len, seed), req.batch_size, data.pad_id(tok))
    groups = [Group(tuple(g["members"]), g["K"], ()) for g in run.ck.groups]
    collected, _ = collect(run.net, cal, groups)
    salience = {m: v["mean_abs"] for m, v in collected.items()}
    return salience, f"salience from {SALIENCE_SAMPLES} samples (seed {seed}) of {source} (seq_len {seq_len})"


def _verify_loaded(req: VerifyRequest, run: Loaded) -> dict:
    """`verify` once the model is loaded (its experts, if any, as per-expert linears)."""
    ck = run.ck
    stats = load_stats(req.calib_dir) if req.calib is not None else None
    smoothing = checkpoint_smoothing(ck, req.calib_dir, storage_dtypes(modelio.tensor_shapes(run.model_dir)))
    quantized = checkpoint_gptq(ck, req.calib_dir)
    if req.check_weights:
        _check(req, run, stats, smoothing, quantized)
    tok = modelio.load_tokenizer(run.model_dir)
    spec = req.text or DEFAULT_TEXT
    docs = data.load_documents(spec)
    batches = data.batches(data.make_samples(tok, docs, req.samples, req.seq_len, req.seed), req.batch_size, data.pad_id(tok))
    salience, selection = _sweep_salience(req, run, stats, tok, docs)
    report = evaluate(
        run.net, ck, batches, salience, device=run.device, max_tokens=req.max_tokens, check_weights=False, progress=req.progress,
        smoothing=smoothing, experts=run.experts, gptq=quantized is not None,
    )
    report = {
        "checkpoint": str(req.ckpt),
        "model": modelio.model_label(req.model),
        "model_fingerprint": run.fingerprint,
        "text": spec,
        "samples": req.samples,
        "seq_len": req.seq_len,
        "seed": req.seed,
        "sweep_selection": selection,
        **report,
        # Checked above, with the calibration when given; a mismatch raised there.
        "weights_match_reference": True if req.check_weights else None,
    }
    if req.out is not None:

        def write(tmp: Path) -> None:
            (tmp / "verify.json").write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
            write_chart(report, tmp / "nmse.png")

        write_dir_atomic(req.out, write, overwrite=req.overwrite)
    return report


__all__ = ["verify", "DEFAULT_TEXT", "VerifyRequest"]
