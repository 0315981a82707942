"""The checks `verify` runs before measuring: a checkpoint is measured only against the model (and
calibration) it was packed from.

Every stored tensor is compared bit for bit with a fresh quantization of the model's weights
(`check_weights_match`); with the calibration directory, the masks, input scales and KV-cache
scales are redone from its statistics too. An AWQ checkpoint's smoothing is rebuilt from the
calibration's scales (`checkpoint_smoothing`, whose file must be the one recorded at pack time)
and the tensors it folds into are checked (`check_smoothed_tensors`). A mismatch raises
`CheckpointMismatch` (exit code 3) with a one-line hint at what to pass instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from resserve_export.algorithms import gptq
from resserve_export.algorithms.awq.smoothing import FILE, Smoothing, file_digest
from resserve_export.algorithms.kext import extend_weight
from resserve_export.algorithms.selection import mask_to_bool, select_mask
from resserve_export.core.errors import CheckpointMismatch, UserError
from resserve_export.core.names import EXT_SCALE_SUFFIX, EXT_WEIGHT_SUFFIX, MASK_SUFFIX
from resserve_export.formats import kv as kv_format
from resserve_export.formats import registry
from resserve_export.formats.constants import SELECTION_GROUP
from resserve_export.formats.ops import quantize
from resserve_export.formats.qtensor import FP4Tensor
from resserve_export.storage import kv_stats as kv_file
from resserve_export.storage.checkpoint import Checkpoint, PackedLinear


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of `t`, so that equality is bit for bit (-0 ≠ +0, NaN = the same NaN)."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same(stored: torch.Tensor | None, ref: torch.Tensor | None) -> bool:
    if stored is None or ref is None:
        return stored is None and ref is None
    return stored.dtype == ref.dtype and stored.shape == ref.shape and torch.equal(_bits(stored), _bits(ref.to(stored.device)))


def _valid_mask(mask: torch.Tensor, K: int, ratio: float) -> bool:
    """Whether `mask` selects 8ρ channels in every group of 8 of K (else no extension can be
    rebuilt from it)."""
    if mask.dtype != torch.uint8 or tuple(mask.shape) != (K // SELECTION_GROUP,):
        return False
    per_group = mask_to_bool(mask).reshape(-1, SELECTION_GROUP).sum(-1)
    return bool((per_group == round(ratio * SELECTION_GROUP)).all())


def _first_difference(
    pk: PackedLinear,
    w: torch.Tensor,
    alpha: torch.Tensor | None,
    rounding: str,
    mask: torch.Tensor | None,
    input_scale: torch.Tensor | None,
    ref: FP4Tensor | None = None,
) -> str | None:
    """The first stored tensor of one linear that differs from its reference, or None.

    Weight-derived tensors come first, calibration-derived ones (mask, input scale; None: not
    checked) last, so a reported calibration difference means the weights all matched. The
    extension is rebuilt from the stored mask: whether that mask is the calibration's is a
    separate question. `ref`: the calibration's GPTQ quantization of the linear, which replaces
    the round-to-nearest one (its tensor scale must still be the one `w` gives) and whose
    dequantized weights the extension is built from.
    """
    f = registry.get(pk.fmt)
    if f.has_tensor_scale and not _same(pk.base.global_scale, alpha):
        return f.tensor_scale_name
    if ref is not None and f.has_tensor_scale and not _same(ref.global_scale.reshape(()), alpha.reshape(())):
        return f.tensor_scale_name
    q = quantize(w, f, alpha=alpha, rounding=rounding, backend="reference") if ref is None else ref
    if ref is not None:
        w = ref.dequantize()
    if not _same(pk.base.codes, q.codes):
        return f.weight_name
    if not _same(pk.base.scales, q.scales):
        return f.scale_name
    if (pk.mask is not None) != (pk.ratio > 0) or (pk.mask is not None and not _valid_mask(pk.mask, w.shape[-1], pk.ratio)):
        return MASK_SUFFIX
    ext = extend_weight(w, pk.mask, pk.ratio, f, rounding, alpha=alpha, backend="reference") if pk.mask is not None else None
    if not _same(None if pk.ext is None else pk.ext.codes, None if ext is None else ext.codes):
        return EXT_WEIGHT_SUFFIX
    if ext is not None and not _same(pk.ext.scales, ext.scales):
        return EXT_SCALE_SUFFIX
    if mask is not None and not _same(pk.mask, mask):
        return MASK_SUFFIX
    if input_scale is not None and not _same(pk.input_scale, input_scale):
        return f.input_scale_name
    return None


def weight_mismatches(
    ck: Checkpoint,
    weights: dict[str, torch.Tensor],
    stats: dict[str, dict] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    quantized: gptq.Stored | None = None,
) -> list[tuple[str, str]]:
    """``(module, first differing tensor)`` for each stored linear that differs from a fresh
    quantization of `weights` (the model's, in its source dtype), in checkpoint order.

    The reference owes nothing to the checkpoint, or a wrong model would pass: NVFP4's α is
    recomputed per fused group from the model's weights (`registry.Format.weight_alpha`, the rule
    `pack` applies) and compared with the stored ``weight_scale_2``; codes and block scales are
    re-quantized with it, and the K-Ext extension rebuilt with `kext.extend_weight`. With
    calibration statistics `stats` (``{module: {"mean_abs", "amax"}}``, as `calibrate` writes
    them) the masks must also be ``select_mask(mean_abs, ratio)`` and NVFP4's ``input_scale`` the
    group's max amax_x through `global_scale`. Every comparison is bit for bit. `quantized`: a
    GPTQ calibration's tensors, the reference of the codes and block scales of the linears it holds.
    """
    f = registry.get(ck.fmt)
    bad = []
    for g in ck.groups:
        members, ratio = g["members"], float(g["ratio"])
        alpha = f.weight_alpha(weights[m] for m in members)
        mask = input_scale = None
        if stats is not None:
            lacking = [m for m in members if "mean_abs" not in stats.get(m, {}) or "amax" not in stats.get(m, {})]
            if lacking:
                raise UserError(f"the calibration has no statistics for {lacking[0]}: pass the --calib the checkpoint was packed with")
            mask = select_mask(stats[members[0]]["mean_abs"], ratio) if ratio > 0 else None
            input_scale = f.input_alpha(torch.stack([stats[m]["amax"].float().reshape(()) for m in members]).max())
        for m in members:
            ref = quantized.get(m, tuple(weights[m].shape)) if quantized is not None else None
            first = _first_difference(ck.read(m), weights[m], alpha, ck.rounding, mask, input_scale, ref)
            if first is not None:
                bad.append((m, first))
            if progress:
                progress("checking stored weights", 1, len(ck.modules))
    return bad


def check_weights_match(
    ck: Checkpoint,
    weights: dict[str, torch.Tensor],
    stats: dict[str, dict] | None = None,
    *,
    model: str = "the model",
    progress: Callable[[str, int, int], None] | None = None,
    quantized: gptq.Stored | None = None,
) -> None:
    """Raise `CheckpointMismatch` (one line) unless `weight_mismatches` finds nothing.

    The hint depends on what differs: when only calibration-derived tensors do (masks, input
    scales), the model is right and the calibration is not.
    """
    bad = weight_mismatches(ck, weights, stats, progress, quantized)
    if not bad:
        return
    m, name = bad[0]
    head = f"{len(bad)} of {len(ck.modules)} stored linears differ from a fresh quantization of {model} (first: {m}: {name})"
    calib_only = {MASK_SUFFIX, "input_scale"}
    if stats is not None and all(n in calib_only for _, n in bad):
        raise CheckpointMismatch(f"{head} with the given --calib: the checkpoint was packed with another calibration; pass the --calib it was packed with")
    raise CheckpointMismatch(f"{head}: the checkpoint was not packed from this model; pass the --model it was packed from")


def check_kv_scales(ck: Checkpoint, calib: Path) -> None:
    """Every stored KV-cache scale equals amax / 448 of the calibration's KV statistics, bit for
    bit; `CheckpointMismatch` names the first that does not."""
    stored = ck.kv_scales()
    if not stored:
        return
    amax = kv_file.load(calib, list(stored))
    for attn, scales in stored.items():
        for which, s, a in zip("kv", scales, amax[attn]):
            if not _same(s, kv_format.scale_from_amax(a)):
                raise CheckpointMismatch(
                    f"{attn} {which}_scale {float(s)!r} is not the calibration's amax / {kv_format.SCALE_DIVISOR:g} "
                    f"({float(kv_format.scale_from_amax(a))!r}): pass the --calib the checkpoint was packed with"
                )


def linear_weights(model, ck: Checkpoint) -> dict[str, torch.Tensor]:
    """The model's weight of every quantized linear of `ck` (CPU, model dtype), checked to exist
    with the checkpoint's shapes."""
    mods = dict(model.named_modules())
    missing = [m for m in ck.modules if m not in mods]
    if missing:
        raise UserError(f"the model has no module {missing[0]} of the checkpoint: pass the --model the checkpoint was packed from")
    weights = {m: mods[m].weight.detach().to("cpu") for m in ck.modules}
    for g in ck.groups:
        for m in g["members"]:
            if tuple(weights[m].shape) != (mods[m].out_features, g["K"]):
                raise UserError(f"{m} has shape {tuple(weights[m].shape)} in the model but K={g['K']} in the checkpoint: pass the model it was packed from")
    return weights


def smoothed_weights(weights: dict[str, torch.Tensor], smoothing: Smoothing | None) -> dict[str, torch.Tensor]:
    """The weights a checkpoint quantized: `weights` themselves, or smoothed by the AWQ scales."""
    if smoothing is None:
        return weights
    return {m: smoothing.apply(f"{m}.weight", w) for m, w in weights.items()}


def checkpoint_smoothing(ck: Checkpoint, calib: Path | None, dtypes: dict | None = None) -> Smoothing | None:
    """The AWQ smoothing `ck` was packed with, rebuilt from its calibration directory (the scales
    are not in the checkpoint: it stays a plain one), or None for a round-to-nearest checkpoint.
    The calibration's scales file must be the one recorded at pack time (its SHA-256). `dtypes`:
    the source's tensor dtypes (`awq.storage_dtypes`), which the checkpoint stores them in."""
    algo = (ck.resserve.get("provenance") or {}).get("weight_algo")
    meta = None
    if calib is not None:
        meta_path = Path(calib) / "calibration.json"
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            raise UserError(f"{calib} has no readable calibration.json: pass the --calib the checkpoint was packed with") from None
    calib_algo = ((meta or {}).get("weight_algo") or {}).get("name", "rtn")
    if not algo or "scales_sha256" not in algo:
        if "awq" in calib_algo.split("+"):
            raise CheckpointMismatch(
                f"{calib} holds {calib_algo.upper()} scales but {ck.dir} was packed without them: pass the --calib it was packed with"
            )
        return None
    if calib is None:
        raise UserError(
            f"{ck.dir} holds AWQ-smoothed weights: pass --calib with the calibration it was packed with, whose scales verify needs to reproduce them"
        )
    path = Path(calib) / ((meta or {}).get("weight_algo") or {}).get("file", FILE)
    if "awq" not in calib_algo.split("+") or not path.is_file() or file_digest(path) != algo.get("scales_sha256"):
        raise CheckpointMismatch(f"{ck.dir} was packed with other AWQ scales than those in {calib}: pass the --calib it was packed with")
    return Smoothing.from_calibration(Path(calib), meta, dtypes=dtypes)


def checkpoint_gptq(ck: Checkpoint, calib: Path | None) -> gptq.Stored | None:
    """The GPTQ tensors `ck` was packed with, from its calibration directory (whose GPTQ file must
    be the one recorded at pack time, by its SHA-256), or None for a checkpoint packed without."""
    algo = (ck.resserve.get("provenance") or {}).get("weight_algo") or {}
    meta = None
    if calib is not None:
        try:
            meta = json.loads((Path(calib) / "calibration.json").read_text())
        except (OSError, ValueError):
            raise UserError(f"{calib} has no readable calibration.json: pass the --calib the checkpoint was packed with") from None
    stored = gptq.from_calibration(calib, meta) if meta is not None else None
    if "gptq_sha256" not in algo:
        if stored is not None:
            raise CheckpointMismatch(f"{calib} holds GPTQ weights but {ck.dir} was packed without them: pass the --calib it was packed with")
        return None
    if calib is None:
        raise UserError(f"{ck.dir} holds GPTQ-quantized weights: pass --calib with the calibration it was packed with, whose GPTQ weights verify checks")
    if stored is None or file_digest(stored.path) != algo["gptq_sha256"]:
        raise CheckpointMismatch(f"{ck.dir} was packed with other GPTQ weights than those in {calib}: pass the --calib it was packed with")
    return stored


def check_smoothed_tensors(ck: Checkpoint, model, smoothing: Smoothing, params: dict | None = None) -> None:
    """The unquantized tensors the AWQ scales fold into (norms, producer biases, the routers of a
    mixture-of-experts model) are stored as `smoothing` makes them from `model`'s own, bit for
    bit. `params`: the model's tensors under the checkpoint's names (`experts.checkpoint_parameters`),
    default its named parameters."""
    params = dict(model.named_parameters()) if params is None else params
    quantized = {f"{m}.weight" for m in ck.modules}
    for name in smoothing.tensors:
        if name in quantized or name not in params:
            continue
        if name not in ck.model:
            raise CheckpointMismatch(f"{ck.dir} has no {name}, which the AWQ scales fold into: pass the checkpoint and --calib that belong together")
        ref = smoothing.stored(name, params[name].detach().to("cpu"))
        if not _same(ck.model.get(name), ref):
            raise CheckpointMismatch(
                f"{name} in {ck.dir} is not the model's, smoothed by the calibration's AWQ scales: pass the --model and --calib it was packed from"
            )


__all__ = [
    "weight_mismatches",
    "check_weights_match",
    "check_kv_scales",
    "linear_weights",
    "smoothed_weights",
    "checkpoint_smoothing",
    "checkpoint_gptq",
    "check_smoothed_tensors",
]
