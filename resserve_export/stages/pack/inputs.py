"""The inputs of `pack`, read and checked before any work: the calibration (made from these
exact weights, statistics usable as scales), the format, ratio and plan arguments (a plan made
for this format and scale rounding), the KV-cache scales, the device and the pipeline depth.

`size` computes its byte counts from the same `check_format_arg` and `load_ratios`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from resserve_export.algorithms import gptq
from resserve_export.algorithms.awq.smoothing import Smoothing
from resserve_export.core import devices
from resserve_export.core.errors import UserError
from resserve_export.formats import kv as kv_format
from resserve_export.formats import registry
from resserve_export.formats.constants import RATIOS
from resserve_export.formats.mxfp4 import ScaleRounding
from resserve_export.modeling import attention as attention_layers
from resserve_export.modeling import families, modelio
from resserve_export.modeling.experts import ExpertBlock, expert_blocks
from resserve_export.modeling.groups import Group
from resserve_export.stages.layout import model_groups, recorded_groups
from resserve_export.stages.plan import load_plan, module_ratios
from resserve_export.storage import hub_experts
from resserve_export.storage import kv_stats as kv_file
from resserve_export.storage.safetensors import SafetensorsFiles, parse_size

# The read / quantize / write pipeline of `stream.stream`: groups read ahead and quantized groups
# queued for the writer (0 or 1: one stage after another on one thread).
DEPTH_ENV = "RESSERVE_PACK_DEPTH"
_DEPTH = 2


class ModelFingerprint:
    """The fingerprint of the model being packed (`modelio.fingerprint`): known at once when
    every shard's digests are cached, else hashed on a background thread while `pack` works
    (`modelio.FingerprintJob`). `check` refuses a record made from other weights: at once, or
    when `value` is first asked for, which `pack` does before anything is renamed into place."""

    def __init__(self, model_dir: Path):
        self._value = modelio.cached_fingerprint(model_dir)
        self._job = None if self._value is not None else modelio.FingerprintJob(model_dir)
        self._deferred: dict[str, dict] = {}  # what -> record, in the order checked

    def check(self, record: dict, what: str) -> None:
        if self._value is not None:
            modelio.check_fingerprint(record, self._value, what)
            return
        modelio.check_fingerprint_method(record, what)
        self._deferred.setdefault(what, record)

    def value(self) -> str:
        """The fingerprint (waiting for the hashing), after the deferred checks."""
        if self._job is not None:
            self._value = self._job.result()
            self._job = None
            deferred, self._deferred = self._deferred, {}
            for what, record in deferred.items():
                modelio.check_fingerprint(record, self._value, what)
        assert self._value is not None
        return self._value

    def settle(self) -> None:
        """Run the deferred checks (waiting for the hashing) if any are pending."""
        if self._job is not None and self._deferred:
            self.value()

    def stop(self) -> None:
        """End a background hashing that is no longer needed (the pack failed)."""
        if self._job is not None:
            self._job.stop()


def _recorded_architecture(calib: Path) -> dict | None:
    """The `modelio.architecture_key` calibrate recorded in `calib` (None if none can be read;
    `read_calibration` reports what is wrong with the file)."""
    try:
        meta = json.loads((Path(calib) / "calibration.json").read_text())
    except (OSError, ValueError):
        return None
    return meta.get("architecture") if isinstance(meta, dict) else None


def read_calibration(calib: Path, model_fingerprint: ModelFingerprint, allow_other_weights: bool = False) -> dict:
    """calibration.json of `calib`, made from these exact weights (content fingerprint) unless
    `allow_other_weights`."""
    calib = Path(calib)
    meta_path, sal_path = calib / "calibration.json", calib / "salience.safetensors"
    if not meta_path.exists() or not sal_path.exists():
        raise UserError(f"{calib} is not a calibration directory (needs calibration.json and salience.safetensors): run `resserve-export calibrate` first")
    try:
        meta = json.loads(meta_path.read_text())
    except ValueError:
        raise UserError(f"{meta_path} is not valid JSON: re-run calibrate") from None
    if not isinstance(meta, dict):
        raise UserError(f"{meta_path} does not hold a calibration record: re-run calibrate")
    if not allow_other_weights:
        model_fingerprint.check(meta, f"calibration in {calib}")
    return meta


def load_statistics(calib: Path, groups: list[Group]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module: (mean_abs, amax)} of every member of `groups` from the salience file of `calib`
    (a directory `read_calibration` accepted), checked against the groups' shapes.

    Every amax must be finite and positive (it becomes a scale).
    """
    calib = Path(calib)
    sal = SafetensorsFiles([calib / "salience.safetensors"])
    missing = [m for g in groups for m in g.modules if f"{m}.mean_abs" not in sal or f"{m}.amax" not in sal]
    if missing:
        more = f" and {len(missing) - 2} more" if len(missing) > 2 else ""
        raise UserError(f"calibration in {calib} has no statistics for {', '.join(missing[:2])}{more}: re-run calibrate on this model")
    stats = {}
    for g in groups:
        for m in g.modules:
            mean_abs, amax = sal.get(f"{m}.mean_abs").float(), sal.get(f"{m}.amax").float().reshape(())
            if mean_abs.shape != (g.in_features,):
                raise UserError(f"calibration {m}.mean_abs has shape {tuple(mean_abs.shape)}, expected ({g.in_features},): re-run calibrate")
            if not bool(torch.isfinite(amax)) or float(amax) <= 0 or not bool(torch.isfinite(mean_abs).all()):
                raise UserError(
                    f"calibration in {calib} has amax {float(amax)} for {m}: an input scale must be finite and positive; "
                    "re-run calibrate (with --dtype float32 if the model overflows)"
                )
            stats[m] = (mean_abs, amax)
    return stats


def check_format_arg(fmt: str) -> registry.Format:
    """The format named `fmt`, or a `UserError` listing the choices."""
    try:
        return registry.get(fmt)
    except ValueError:
        raise UserError(f"unknown format {fmt!r}: choose one of {', '.join(registry.FORMATS)}") from None


def check_ratio_arg(ratio: float) -> float:
    if float(ratio) not in RATIOS:
        raise UserError(f"ratio {ratio} is not allowed: choose one of {', '.join(str(r) for r in RATIOS)}")
    return float(ratio)


def load_ratios(
    groups: list[Group],
    ratio: float | None,
    plan: Path | None,
    model_fingerprint: ModelFingerprint | None,
    fmt: str | None = None,
    rounding: str | None = None,
    allow_other_weights: bool = False,
) -> tuple[dict[str, float], dict | None]:
    """({group name: ρ}, plan provenance or None) from ``--ratio`` or ``--plan``.

    A plan must come from scores of this model's weights (unless `allow_other_weights`) and of
    the format (and MXFP4 scale rounding) being packed.
    """
    if (ratio is None) == (plan is None):
        raise UserError("pass exactly one of --ratio R or --plan plan.json")
    if plan is None:
        r = check_ratio_arg(ratio)
        return {g.name: r for g in groups}, None
    check = None
    if model_fingerprint is not None and not allow_other_weights:
        def check(record: dict) -> None:
            model_fingerprint.check(record, f"plan {plan}")
    data = load_plan(Path(plan), modules=[m for g in groups for m in g.modules], check_weights=check)
    if fmt is not None:
        check_plan_format(data, Path(plan), fmt, rounding)
    per_module = module_ratios(data)
    out = {}
    for g in groups:
        rs = {per_module[m] for m in g.modules}
        if len(rs) > 1:
            raise UserError(f"plan {plan} gives fused members {', '.join(g.modules)} different ratios: they share one input, plan again")
        out[g.name] = rs.pop()
    prov = {k: data.get(k) for k in ("budget", "achieved_bits", "satisfied", "method") if k in data}
    return out, prov


def _check_recorded_format(what: str, recorded: str | None, recorded_rounding: str | None, fmt: str, rounding: str | None, redo: str) -> None:
    """Refuse what was computed for one format (`what`: a sentence with ``{fmt}``, e.g. a plan's
    scores or AWQ scales) when --format / --mx-scale differ."""
    if recorded != fmt:
        raise UserError(f"{what.format(fmt=recorded)} but --format is {fmt}: pack with --format {recorded}, or calibrate with --format {fmt}{redo}")
    if registry.get(fmt).has_rounding and recorded_rounding != rounding:
        raise UserError(
            f"{what.format(fmt=fmt.upper())} with scale rounding {recorded_rounding} but --mx-scale is {rounding}: "
            f"pack with --mx-scale {recorded_rounding}, or calibrate with --mx-scale {rounding}{redo}"
        )


def check_plan_format(plan: dict, path: Path, fmt: str, rounding: str | None) -> None:
    """Refuse a plan whose scores were computed for another format or MXFP4 scale rounding."""
    if plan.get("format") is None:
        raise UserError(f"plan {path} does not record the format its scores were computed for: re-run `resserve-export plan`")
    _check_recorded_format(f"plan {path} was made from {{fmt}} scores", plan["format"], plan.get("mx_scale_rounding"), fmt, rounding, " and plan again")


def check_awq_format(record: dict, calib: Path, fmt: str, rounding: str) -> None:
    """Refuse to pack AWQ scales searched for another format (or MXFP4 scale rounding): the
    search scored them under that format's arithmetic."""
    _check_recorded_format(f"the AWQ scales in {calib} were searched for {{fmt}}", record.get("format"), record.get("mx_scale_rounding"), fmt, rounding, "")


def check_gptq_format(record: dict, calib: Path, fmt: str, rounding: str) -> None:
    """Refuse to pack GPTQ weights quantized in another format (or MXFP4 scale rounding): their
    codes and block scales are that format's."""
    _check_recorded_format(f"the GPTQ weights in {calib} were quantized to {{fmt}}", record.get("format"), record.get("mx_scale_rounding"), fmt, rounding, "")


def kv_tensors(calib: Path, shapes, f: registry.Format, kv_cache: str) -> dict[str, torch.Tensor]:
    """{name: stored scale} of the KV-cache scales (empty for ``none``): amax / 448 of the
    calibration's per-layer key and value amax (see `formats.kv`)."""
    if kv_cache == "none":
        return {}
    attention = attention_layers.attention_modules(shapes)
    amax = kv_file.load(calib, attention)
    shape = kv_format.scale_shape(f.kv_style)
    out = {}
    for a in attention:
        for name, x in zip(kv_format.scale_names(a, f.kv_style), amax[a]):
            out[name] = kv_format.scale_from_amax(x).reshape(shape).contiguous()
    return out


def pipeline_depth() -> int:
    """The pack pipeline's depth: ``RESSERVE_PACK_DEPTH``, else `_DEPTH`."""
    raw = os.environ.get(DEPTH_ENV, "").strip()
    if not raw:
        return _DEPTH
    try:
        depth = int(raw)
    except ValueError:
        depth = -1
    if depth < 0:
        raise UserError(f"{DEPTH_ENV}={raw!r} is not a whole number ≥ 0: unset it, or set 0 to read, quantize and write one after another")
    return depth


def check_experts_layout(layout: str, fmt: str, ratio: float | None, plan, kv_cache: str) -> str:
    """``--experts-layout``, checked against the other arguments before any work (``hub``: the
    hub's MXFP4 gpt-oss experts, which stock vLLM runs W4A16 with no place for a sidecar or
    KV-cache scales)."""
    if layout not in hub_experts.LAYOUTS:
        raise UserError(f"unknown --experts-layout {layout!r}: choose one of {', '.join(hub_experts.LAYOUTS)}")
    if layout != hub_experts.HUB:
        return layout
    if fmt != "mxfp4":
        raise UserError(f"--experts-layout hub writes the hub's MXFP4 expert blocks, not {fmt}: use --format mxfp4")
    if plan is not None or ratio is None or float(ratio) != 0:
        raise UserError(
            "--experts-layout hub writes no residue-compensation sidecar (stock vLLM's gpt-oss MXFP4 method has no place for one): "
            "use --ratio 0, or leave out --experts-layout hub to compensate"
        )
    if kv_cache != "none":
        raise UserError("--experts-layout hub writes no KV-cache scales (the hub's mxfp4 quantization_config declares none): use --kv-cache none")
    return layout


@dataclass
class PackArgs:
    """`pack`'s arguments that need no file, checked before any work."""

    format: registry.Format
    rounding: ScaleRounding
    max_bytes: int  # --max-shard-size
    device: torch.device
    depth: int  # `pipeline_depth`
    experts_layout: str = "per-expert"  # `check_experts_layout`


def check_args(
    fmt: str, kv_cache: str, mx_scale: str, ratio: float | None, max_shard_size: str | int, device: str,
    experts_layout: str = "per-expert", plan=None,
) -> PackArgs:
    """The checked format, KV-cache format, scale rounding, ratio, shard size, device, pipeline
    depth and experts layout (a one-line `UserError` for the first bad one)."""
    f = check_format_arg(fmt)
    kv_format.check_for_format(kv_cache, f)  # before any work; build_layout relies on it too
    try:
        rounding = ScaleRounding(mx_scale)
    except ValueError:
        raise UserError(f"unknown --mx-scale {mx_scale!r}: choose one of {', '.join(r.value for r in ScaleRounding)}") from None
    if ratio is not None:
        check_ratio_arg(ratio)
    layout = check_experts_layout(experts_layout, f.name, ratio, plan, kv_cache)
    return PackArgs(f, rounding, parse_size(max_shard_size), devices.resolve_device(device), pipeline_depth(), layout)


@dataclass
class PackInputs:
    """The model to pack and what its calibration and ratio or plan say of it, checked against
    each other."""

    model_dir: Path
    source: SafetensorsFiles
    config: dict  # config.json
    shapes: dict[str, tuple[str, tuple[int, ...]]]
    blocks: list[ExpertBlock]  # mixture-of-experts blocks (refused when they cannot be packed)
    fingerprint: ModelFingerprint
    groups: list[Group]
    calibration: dict  # calibration.json
    stats: dict[str, tuple[torch.Tensor, torch.Tensor]]  # {module: (mean_abs, amax)}
    smoothing: Smoothing | None
    gptq: gptq.Stored | None  # the calibration's GPTQ-quantized linears
    ratios: dict[str, float]  # {group name: ρ}
    plan: dict | None  # the plan's provenance


def read_inputs(
    model, calib: Path, fmt: str, rounding: str, ratio: float | None, plan: Path | None, allow_other_weights: bool,
    experts_layout: str = "per-expert",
) -> PackInputs:
    """The bf16 / fp16 model `model` (a directory or a hub name), its calibration `calib` and the
    ratios of ``--ratio`` or ``--plan``, or a one-line `UserError`."""
    model_dir = modelio.resolve_model(model)
    fingerprint = ModelFingerprint(model_dir)  # hashing (if not cached) starts now, in the background
    try:
        return _read_inputs(model_dir, fingerprint, calib, fmt, rounding, ratio, plan, allow_other_weights, experts_layout)
    except BaseException as e:
        try:
            if isinstance(e, UserError):
                # A calibration or plan of other weights is the likelier cause of what went
                # wrong: say so, as when the fingerprint was known up front.
                fingerprint.settle()
        finally:
            fingerprint.stop()
        raise


def _read_inputs(
    model_dir: Path, fingerprint: ModelFingerprint, calib: Path, fmt: str, rounding: str, ratio: float | None, plan: Path | None,
    allow_other_weights: bool, experts_layout: str,
) -> PackInputs:
    if _recorded_architecture(calib) != modelio.architecture_key(model_dir):
        modelio.check_architecture(model_dir, "pack")  # else calibrate checked this config already
    source = modelio.source_files(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg.get("quantization_config"):
        raise UserError(f"{model_dir} is already quantized ({cfg['quantization_config'].get('quant_method')}): pack needs a bf16/fp16 model")
    shapes = source.shapes()
    blocks = expert_blocks(shapes, "packed")
    families.check_format(cfg, fmt, "packed")
    families.check_experts_layout(cfg, experts_layout, "packed")
    # The quantized linears and their fused groups are the ones calibrate found on the loaded
    # model (one rule), not re-derived from the headers.
    calib_meta = read_calibration(calib, fingerprint, allow_other_weights)
    recorded = calib_meta.get("groups")
    groups = recorded_groups(recorded, shapes) if recorded else model_groups(shapes)
    stats = load_statistics(calib, groups)
    smoothing = Smoothing.from_calibration(calib, calib_meta, shapes)
    if smoothing is not None:
        check_awq_format(calib_meta["weight_algo"], calib, fmt, rounding)
    quantized = gptq.from_calibration(calib, calib_meta)
    if quantized is not None:
        check_gptq_format(calib_meta["weight_algo"], calib, fmt, rounding)
        missing = [m for g in groups for m in g.modules if m not in quantized]
        if missing:
            raise UserError(f"{calib}'s GPTQ weights have no {missing[0]}, which this model quantizes: pack the model the calibration was made from")
    ratios, plan_prov = load_ratios(groups, ratio, plan, fingerprint, fmt, rounding, allow_other_weights)
    return PackInputs(model_dir, source, cfg, shapes, blocks, fingerprint, groups, calib_meta, stats, smoothing, quantized, ratios, plan_prov)


__all__ = [
    "DEPTH_ENV", "read_calibration", "load_statistics", "check_format_arg", "check_ratio_arg", "load_ratios",
    "check_plan_format", "check_awq_format", "check_gptq_format", "kv_tensors", "pipeline_depth", "check_experts_layout", "PackArgs", "check_args",
    "PackInputs", "read_inputs", "ModelFingerprint",
]
