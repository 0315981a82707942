"""`verify`: read a packed checkpoint back and measure what it costs and what compensation buys.

First, unless skipped, every stored tensor is compared bit for bit with a fresh quantization of
the model (`check_weights_match`): measuring a checkpoint against a model it was not packed from
gives numbers about neither, so a mismatch stops the run (`CheckpointMismatch`, exit code 3).

For every quantized linear (SPEC §12): the checkpoint's FP4 weights (base and, for partial
ratios, the stored K-Ext extension) are read back; real inputs are captured from the model,
loaded in the source dtype recorded at pack time (any other dtype would move the reference), on
held-out text (padding excluded); each input is quantized the way the server does it — the
fused CUDA kernel on a GPU, the PyTorch reference on the CPU — with the checkpoint's static
input scale, and the linear output is compared with the FP32 product of the original operands
(TF32 off). NMSE = Σ‖y − y_ref‖² / Σ‖y_ref‖², pooled over tokens, per layer and over all
layers, for: plain W4A4, the checkpoint's own ratios (K-Ext), full compensation, and a sweep of
partial ratios (selection from the calibration salience). Perplexity on the same text for the
source model (key ``bf16`` whatever its dtype), plain W4A4, the checkpoint's ratios and full
compensation uses `emulate.EmulatedLinear`.

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
import math
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable

import torch

from resserve_export.algorithms import kernel
from resserve_export.algorithms.awq.smoothing import Smoothing
from resserve_export.algorithms.kext import extend_weight
from resserve_export.algorithms.selection import PARTIAL_RATIOS, mask_to_bool, select_mask
from resserve_export.core.errors import CheckpointMismatch, UserError
from resserve_export.core.names import EXT_SCALE_SUFFIX, EXT_WEIGHT_SUFFIX, MASK_SUFFIX
from resserve_export.formats import registry
from resserve_export.formats.constants import SELECTION_GROUP
from resserve_export.formats.kv import SCALE_DIVISOR
from resserve_export.formats.ops import quantize
from resserve_export.formats.qtensor import FP4Tensor
from resserve_export.observers.capture import InputCapture
from resserve_export.observers.kv import POINT, KVQuantizer
from resserve_export.storage.checkpoint import Checkpoint, PackedLinear

SWEEP = PARTIAL_RATIOS
DEFAULT_TEXT = "shakespeare:eval"


# ----------------------------------------------------------------------------- capture


def _nll(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[float, int]:
    """Summed next-token negative log-likelihood over valid positions, and their count."""
    lg = logits[:, :-1].float()
    labels = input_ids[:, 1:].to(lg.device)
    valid = (attention_mask[:, 1:] & attention_mask[:, :-1]).bool().to(lg.device)
    ce = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), labels.reshape(-1), reduction="none")
    return float(ce[valid.reshape(-1)].sum()), int(valid.sum())


def _forward_nll(
    model, batches: list[dict], dev, on_batch: Callable | None = None, tick: Callable | None = None, kv=None
) -> float:
    """Perplexity over `batches`; `kv`: a `kvcache.KVQuantizer` that sees (and with ``emulate``
    quantizes) the keys and values every attention layer caches."""
    total, count = 0.0, 0
    with torch.inference_mode():
        for b in batches:
            if on_batch is not None:
                on_batch(b)
            extra = {"use_cache": False}
            if kv is not None:
                kv.set_mask(b["attention_mask"])
                extra = kv.forward_kwargs()
            out = model(input_ids=b["input_ids"].to(dev), attention_mask=b["attention_mask"].to(dev), **extra)
            s, n = _nll(out.logits, b["input_ids"], b["attention_mask"])
            total, count = total + s, count + n
            if tick is not None:
                tick()
    if count == 0:
        raise UserError("the evaluation text has no token pairs to score: pass longer --text or more --samples")
    return math.exp(total / count)


# ----------------------------------------------------------------------------- NMSE


@contextmanager
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


class _Acc:
    """Pooled squared error and reference energy."""

    def __init__(self):
        self.err, self.ref = 0.0, 0.0

    def add(self, y: torch.Tensor, y_ref: torch.Tensor) -> None:
        self.err += float(((y - y_ref) ** 2).sum(dtype=torch.float64))
        self.ref += float((y_ref**2).sum(dtype=torch.float64))

    @property
    def nmse(self) -> float:
        return self.err / self.ref if self.ref > 0 else float("nan")


def group_nmse(
    x: torch.Tensor,
    weights: dict[str, torch.Tensor],
    packed: dict,
    fmt: str,
    rounding: str,
    salience: torch.Tensor | None,
    sweep=SWEEP,
    backend: str = "auto",
    chunk: int = 4096,
    smooth: torch.Tensor | None = None,
    packed_weights: dict[str, torch.Tensor] | None = None,
    row_scales: dict[str, torch.Tensor | None] | None = None,
) -> dict[str, dict[str, _Acc]]:
    """Per member: {mode: _Acc} for ``plain``, ``checkpoint``, ``full`` and each sweep ratio.

    x: captured inputs ``[T, K]`` (model dtype) on the compute device; weights: original weights
    per member, in the source dtype (CPU); packed: `PackedLinear` per member (one fused group:
    shared α_x, ratio and mask). Activations go through `kernel.quantize_extend` / `quantize_full`.
    An AWQ-smoothed group: `smooth` divides the input before it is quantized (as the smoothed
    norm or row produces it, in the model dtype) and `packed_weights` are the smoothed weights
    the sweep's extensions are built from; the reference stays the original product x Wᵀ,
    divided by `row_scales[m]` for a member whose output rows the next group's scales divide.
    """
    packed_weights = weights if packed_weights is None else packed_weights
    dev = x.device
    first = packed[next(iter(packed))]
    alpha = first.input_scale.to(dev) if registry.get(fmt).has_tensor_scale else None
    ratio, mode, mask = first.ratio, first.mode, first.mask
    masks = {r: select_mask(salience, r) for r in sweep} if salience is not None else {}

    # Dequantized weights per member: base, the checkpoint's extended weight, the sweep's.
    w_eff: dict[str, dict[str, torch.Tensor]] = {}
    for m, pk in packed.items():
        base = pk.base
        d = {"base": base.dequantize().to(dev)}
        if mode == "k_ext":
            d["checkpoint"] = FP4Tensor.cat([base, pk.ext]).dequantize().to(dev)
        for r, mk in masks.items():
            ext = extend_weight(packed_weights[m], mk, r, fmt, rounding, alpha=base.global_scale)
            d[r] = FP4Tensor.cat([base, ext]).dequantize().to(dev)
        w_eff[m] = d

    accs = {m: {k: _Acc() for k in ("plain", "checkpoint", "full", *masks)} for m in packed}
    with _no_tf32(), torch.inference_mode():
        for s in range(0, x.shape[0], chunk):
            x_ref = x[s : s + chunk].contiguous()
            xc = x_ref if smooth is None else (x_ref.float() / smooth.to(dev)).to(x_ref.dtype)
            xb, xr = kernel.quantize_full(xc, fmt, alpha=alpha, rounding=rounding, backend=backend)
            xp = xb.dequantize()
            xfull = xp + xr.dequantize()
            xe = {}
            if mode == "k_ext":
                xe["checkpoint"] = kernel.quantize_extend(xc, mask, ratio, fmt, alpha, rounding, backend).dequantize()
            for r, mk in masks.items():
                xe[r] = kernel.quantize_extend(xc, mk, r, fmt, alpha, rounding, backend).dequantize()
            xf = x_ref.float()
            for m in packed:
                wf = weights[m].to(dev).float()
                y_ref = xf @ wf.T
                rs = (row_scales or {}).get(m)
                if rs is not None:
                    y_ref = y_ref / rs.to(dev)
                wq = w_eff[m]["base"]
                y_plain = xp @ wq.T
                y_full = xfull @ wq.T
                a = accs[m]
                a["plain"].add(y_plain, y_ref)
                a["full"].add(y_full, y_ref)
                if mode == "k_ext":
                    a["checkpoint"].add(xe["checkpoint"] @ w_eff[m]["checkpoint"].T, y_ref)
                else:
                    a["checkpoint"].add(y_full if mode == "full" else y_plain, y_ref)
                for r in masks:
                    a[r].add(xe[r] @ w_eff[m][r].T, y_ref)
    return accs


# ----------------------------------------------------------------------------- model swaps


def _emulated_linear(lin, pk, fmt: str, rounding: str, mode: str, cache: dict):
    """An `EmulatedLinear` for `lin` whose weights are the checkpoint's stored tensors.

    `EmulatedLinear` quantizes the bf16 weight itself; here its `QuantizedWeight` is the stored
    base and extension instead (`QuantizedWeight.from_stored`, dequantized once, shared by every
    mode through `cache`), so what is measured is what was packed.
    """
    from resserve_export.algorithms.emulate import EmulatedLinear, QuantizedWeight

    dev = lin.weight.device
    ratio = pk.ratio if mode == "checkpoint" else 0.0
    partial = 0 < ratio < 1
    if "w" not in cache:
        cache["w"] = pk.base.dequantize().to(dev)
    if partial and "w_ext" not in cache:
        cache["w_ext"] = pk.ext.dequantize().to(dev)
    qw = QuantizedWeight.from_stored(
        fmt, ratio, rounding, pk.mask if partial else None, pk.base, cache["w"],
        pk.ext if partial else None, cache["w_ext"] if partial else None,
    )
    input_alpha = pk.input_scale.to(dev) if registry.get(fmt).has_tensor_scale else None
    return EmulatedLinear.from_weight(lin, qw, input_alpha=input_alpha, mode=None if mode == "checkpoint" else mode)


@contextmanager
def emulated(model, ck: Checkpoint, mode: str, packed: dict | None = None, cache: dict | None = None):
    """Replace every quantized linear by an emulated one (``plain``, ``checkpoint`` or ``full``)
    for the duration of the block (`emulate.swapped`)."""
    from resserve_export.algorithms.emulate import swapped

    packed = packed if packed is not None else {m: ck.read(m) for m in ck.modules}
    cache = cache if cache is not None else {}
    swaps = {
        m: _emulated_linear(model.get_submodule(m), packed[m], ck.fmt, ck.rounding, mode, cache.setdefault(m, {}))
        for m in ck.modules
    }
    with swapped(model, swaps):
        yield model


# ----------------------------------------------------------------------------- driver


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
) -> str | None:
    """The first stored tensor of one linear that differs from its reference, or None.

    Weight-derived tensors come first, calibration-derived ones (mask, input scale; None: not
    checked) last, so a reported calibration difference means the weights all matched. The
    extension is rebuilt from the stored mask: whether that mask is the calibration's is a
    separate question.
    """
    f = registry.get(pk.fmt)
    if f.has_tensor_scale and not _same(pk.base.global_scale, alpha):
        return f.tensor_scale_name
    q = quantize(w, f, alpha=alpha, rounding=rounding, backend="reference")
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
) -> list[tuple[str, str]]:
    """``(module, first differing tensor)`` for each stored linear that differs from a fresh
    quantization of `weights` (the model's, in its source dtype), in checkpoint order.

    The reference owes nothing to the checkpoint, or a wrong model would pass: NVFP4's α is
    recomputed per fused group from the model's weights (`registry.Format.weight_alpha`, the rule
    `pack` applies) and compared with the stored ``weight_scale_2``; codes and block scales are
    re-quantized with it, and the K-Ext extension rebuilt with `kext.extend_weight`. With
    calibration statistics `stats` (``{module: {"mean_abs", "amax"}}``, as `calibrate` writes
    them) the masks must also be ``select_mask(mean_abs, ratio)`` and NVFP4's ``input_scale`` the
    group's max amax_x through `global_scale`. Every comparison is bit for bit.
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
            first = _first_difference(ck.read(m), weights[m], alpha, ck.rounding, mask, input_scale)
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
) -> None:
    """Raise `CheckpointMismatch` (one line) unless `weight_mismatches` finds nothing.

    The hint depends on what differs: when only calibration-derived tensors do (masks, input
    scales), the model is right and the calibration is not.
    """
    bad = weight_mismatches(ck, weights, stats, progress)
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
    from resserve_export.formats import kv as kv_format
    from resserve_export.storage import kv_stats as kv_file

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
    from resserve_export.algorithms.awq.smoothing import FILE, file_digest

    algo = (ck.resserve.get("provenance") or {}).get("weight_algo")
    meta = None
    if calib is not None:
        meta_path = Path(calib) / "calibration.json"
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            raise UserError(f"{calib} has no readable calibration.json: pass the --calib the checkpoint was packed with") from None
    calib_algo = ((meta or {}).get("weight_algo") or {}).get("name", "rtn")
    if not algo:
        if calib_algo != "rtn":
            raise CheckpointMismatch(
                f"{calib} holds {calib_algo.upper()} scales but {ck.dir} was packed without them: pass the --calib it was packed with"
            )
        return None
    if calib is None:
        raise UserError(
            f"{ck.dir} holds AWQ-smoothed weights: pass --calib with the calibration it was packed with, whose scales verify needs to reproduce them"
        )
    path = Path(calib) / ((meta or {}).get("weight_algo") or {}).get("file", FILE)
    if calib_algo != "awq" or not path.is_file() or file_digest(path) != algo.get("scales_sha256"):
        raise CheckpointMismatch(f"{ck.dir} was packed with other AWQ scales than those in {calib}: pass the --calib it was packed with")
    return Smoothing.from_calibration(Path(calib), meta, dtypes=dtypes)


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


def linear_kind(module: str) -> str:
    """The report's kind of a quantized linear: ``expert gate/up``, ``expert down`` (routed
    experts), ``attention`` (``self_attn`` / ``attn``), else ``mlp`` (dense and shared experts)."""
    from resserve_export.modeling.experts import ROLES, is_expert

    leaf = module.rsplit(".", 1)[-1]
    if is_expert(module):
        return "expert down" if ROLES.get(leaf) == "down" else "expert gate/up"
    return "attention" if ".self_attn." in f".{module}." or ".attn." in f".{module}." else "mlp"


def _reduction(new: float, old: float) -> float:
    return 100.0 * (old - new) / old if old > 0 else float("nan")


def evaluate(
    model,
    ck: Checkpoint,
    batches: list[dict],
    salience: dict[str, torch.Tensor] | None,
    *,
    device: torch.device,
    sweep=SWEEP,
    max_tokens: int = 4096,
    check_weights: bool = True,
    progress: Callable[[str, int, int], None] | None = None,
    smoothing: Smoothing | None = None,
    experts=None,
) -> dict:
    """The measurements of `verify` for a loaded model and an opened checkpoint (no files).

    `check_weights`: first `check_weights_match` (without calibration statistics), which raises
    on a mismatch before anything is measured. `smoothing`: the AWQ smoothing the checkpoint was
    packed with (`checkpoint_smoothing`); the reference stays the unsmoothed `model`. `experts`:
    the `experts.Unfused` handle of a mixture-of-experts model (its experts mounted as per-expert
    linears), told each batch's mask while inputs are captured.
    """
    t0 = time.perf_counter()
    fmt, rounding = ck.fmt, ck.rounding
    groups = [tuple(g["members"]) for g in ck.groups]
    original = linear_weights(model, ck)
    weights = smoothed_weights(original, smoothing)
    if salience is not None:
        lacking = [g[0] for g in groups if g[0] not in salience]
        if lacking:
            raise UserError(f"the calibration salience has no entry for {lacking[0]}: pass the --calib the checkpoint was packed with")
    if check_weights:
        check_weights_match(ck, weights, progress=progress)
    packed_all = {m: ck.read(m) for m in ck.modules}

    # 1. Source-model pass (its own dtype): perplexity, captured inputs and the KV-cache error.
    dtype = next(iter(weights.values())).dtype
    kv_scales = ck.kv_scales()
    kv_measure = KVQuantizer(model, kv_scales, ck.kv_cache, emulate=False) if kv_scales else None
    cap = InputCapture(model, groups, max_tokens)
    tick = (lambda: progress(f"{str(dtype).removeprefix('torch.')} forward + capture", 1, len(batches))) if progress else None
    def on_batch(b):
        cap.set_mask(b["attention_mask"])
        if experts is not None:
            experts.set_mask(b["attention_mask"])

    try:
        ppl = {"bf16": _forward_nll(model, batches, device, on_batch=on_batch, tick=tick, kv=kv_measure)}
    finally:
        cap.remove()
        if experts is not None:
            experts.end_batch()

    # 2. NMSE per fused group.
    backend = kernel.backend_for(torch.empty(0, dtype=dtype, device=device))
    layers, totals, by_kind = [], {}, {}
    for i, g in enumerate(groups):
        x = cap.inputs(g).to(device)
        packed = {m: packed_all[m] for m in g}
        sal = salience.get(g[0]) if salience else None
        smooth = smoothing.scale_for(g) if smoothing is not None else None
        accs = group_nmse(
            x, original, packed, fmt, rounding, sal, sweep if sal is not None else (), smooth=smooth, packed_weights=weights,
            row_scales={m: smoothing.row_scale(m) for m in g} if smoothing is not None else None,
        )
        for m in g:
            row = {"module": m, "ratio": packed[m].ratio, "mode": packed[m].mode, "tokens": int(x.shape[0])}
            for k, a in accs[m].items():
                key = k if isinstance(k, str) else f"ratio_{k}"
                row[key] = a.nmse
                for tot in (totals.setdefault(key, _Acc()), by_kind.setdefault(linear_kind(m), {}).setdefault(key, _Acc())):
                    tot.err, tot.ref = tot.err + a.err, tot.ref + a.ref
            layers.append(row)
        if progress:
            progress("linear-output NMSE", 1, len(groups))

    # 3. Emulated perplexity (an AWQ checkpoint's smoothed norms, biases and routers in place).
    cache: dict = {}
    params = None
    if smoothing is not None and experts is not None:
        from resserve_export.modeling.experts import checkpoint_parameters

        params = checkpoint_parameters(model, experts.blocks)
    smoothed = smoothing.applied(model, params) if smoothing is not None else nullcontext()
    with smoothed:
        for mode in ("plain", "checkpoint", "full"):
            with emulated(model, ck, mode, packed_all, cache):
                tick = (lambda: progress(f"perplexity ({mode})", 1, len(batches))) if progress else None
                ppl[mode] = _forward_nll(model, batches, device, tick=tick)
    kv_report = None
    if kv_scales:
        # The KV cache quantized with the stored scales, alone and with the checkpoint's linears.
        tick = (lambda: progress("perplexity (KV cache)", 1, 2 * len(batches))) if progress else None
        ppl["bf16_kv"] = _forward_nll(model, batches, device, tick=tick, kv=KVQuantizer(model, kv_scales, ck.kv_cache, emulate=True))
        with (smoothing.applied(model, params) if smoothing is not None else nullcontext()), emulated(model, ck, "checkpoint", packed_all, cache):
            ppl["checkpoint_kv"] = _forward_nll(model, batches, device, tick=tick, kv=KVQuantizer(model, kv_scales, ck.kv_cache, emulate=True))
        kv_report = {"format": ck.kv_cache, "scale": f"amax / {SCALE_DIVISOR:g}", "point": POINT, **kv_measure.nmse()}

    from resserve_export.core.names import natural_key

    layers.sort(key=lambda r: natural_key(r["module"]))
    pooled = {k: a.nmse for k, a in totals.items()}
    keys = [k for k in pooled if k not in ("plain", "checkpoint", "full")]
    mean = {k: sum(r[k] for r in layers) / len(layers) for k in pooled}
    chain = [pooled["plain"], *[pooled[f"ratio_{r}"] for r in sweep if f"ratio_{r}" in pooled], pooled["full"]]
    return {
        "format": fmt,
        "mx_scale_rounding": registry.get(fmt).rounding_record(rounding),
        "activation_quantization": _backend_label(backend, device),
        "perplexity_activation_quantization": f"PyTorch reference in emulate.EmulatedLinear ({torch.device(device).type})",
        "device": str(device),
        "tokens_scored": int(sum(int(b["attention_mask"].sum()) for b in batches)),
        "nmse_tokens_per_layer": min(r["tokens"] for r in layers),
        "model_dtype": str(dtype).removeprefix("torch."),
        "weight_algo": "awq" if smoothing is not None else "rtn",
        "weights_match_reference": True if check_weights else None,
        "nmse": {
            "pooled": pooled,
            "mean_per_layer": mean,
            "sweep_keys": keys,
            "full_vs_plain_reduction_pct": _reduction(pooled["full"], pooled["plain"]),
            "checkpoint_vs_plain_reduction_pct": _reduction(pooled["checkpoint"], pooled["plain"]),
            "falls_as_ratio_rises": all(a > b for a, b in zip(chain, chain[1:])),
            "by_kind": {kind: {k: a.nmse for k, a in accs.items()} for kind, accs in by_kind.items()},
        },
        "perplexity": ppl,
        "kv_cache": kv_report,
        "layers": layers,
        "wall_time_s": round(time.perf_counter() - t0, 1),
    }


def _backend_label(backend: str, device) -> str:
    if backend == "cuda":
        name = torch.cuda.get_device_name(device)
        major, minor = torch.cuda.get_device_capability(device)
        return f"fused CUDA kernel ({name}, sm_{major}{minor})"
    return f"PyTorch reference ({torch.device(device).type})"


def write_chart(report: dict, path: Path) -> None:
    """Per-layer NMSE (log scale) for plain, the sweep, the checkpoint and full compensation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = report["layers"]
    xs = list(range(len(layers)))
    fig, ax = plt.subplots(figsize=(max(8, len(layers) * 0.06), 4.5))
    series = [("plain", "plain W4A4")] + [(k, k.replace("ratio_", "K-Ext ρ=")) for k in report["nmse"]["sweep_keys"]]
    series += [("full", "full compensation"), ("checkpoint", "checkpoint ratios")]
    for key, label in series:
        ax.plot(xs, [r[key] for r in layers], label=label, linewidth=1, marker="." if key == "checkpoint" else None)
    ax.set_yscale("log")
    ax.set_xlabel("quantized linear (model order)")
    ax.set_ylabel("output NMSE vs FP32")
    ax.set_title(f"{Path(str(report.get('model', '')).split(' ')[0]).name} {report['format'].upper()}: per-layer linear-output NMSE")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _source_dtype(ck: Checkpoint, model_dir: Path) -> str:
    """The dtype to load the model in: the one `pack` quantized from (recorded in the
    provenance), else, for checkpoints that predate the record, that of the model's own
    safetensors weights of the quantized linears. Any other dtype re-quantizes differently and
    moves the NMSE reference."""
    from resserve_export.modeling import modelio
    from resserve_export.modeling.modelio import source_dtype

    recorded = (ck.resserve.get("provenance") or {}).get("source_dtype")
    if recorded is not None:
        if recorded not in ("bfloat16", "float16", "float32"):
            raise UserError(f"{ck.dir} records source dtype {recorded!r}, not bfloat16, float16 or float32: re-run pack")
        return recorded
    shapes = modelio.tensor_shapes(model_dir)
    # A module the model lacks is reported by `linear_weights` once the model is loaded.
    present = [m for m in ck.modules if f"{m}.weight" in shapes]
    return source_dtype(shapes, present, model_dir) if present else "bfloat16"


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
    from resserve_export.core.outputs import check_out_dir
    from resserve_export.modeling import modelio

    if samples < 1:
        raise UserError(f"--samples must be at least 1, got {samples}")
    if out is not None:
        check_out_dir(Path(out), overwrite)
    ck = Checkpoint(ckpt)
    from resserve_export.modeling.experts import expert_blocks, is_expert, unfused

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
    d = modelio.parse_device(device)
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if d == "auto" else d)
    dtype = _source_dtype(ck, model_dir)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # verify shows its own progress; an error stays one line
    net = modelio.load_model(model_dir, dtype).to(dev)
    with unfused(net, expert_blocks(modelio.tensor_shapes(model_dir)) if has_experts else []) as experts:
        return _verify_loaded(
            ck, ckpt, model, model_dir, net, fp, dev, text, samples, seq_len, batch_size, seed, calib, max_tokens, check_weights,
            out, overwrite, progress, experts if has_experts else None,
        )


def _verify_loaded(
    ck, ckpt, model, model_dir, net, fp, dev, text, samples, seq_len, batch_size, seed, calib, max_tokens, check_weights, out, overwrite,
    progress, experts,
) -> dict:
    """`verify` once the model is loaded (its experts, if any, as per-expert linears)."""
    from resserve_export.algorithms.awq.smoothing import storage_dtypes
    from resserve_export.core.outputs import write_dir_atomic
    from resserve_export.modeling import data, modelio
    from resserve_export.modeling.experts import checkpoint_parameters
    from resserve_export.modeling.groups import Group
    from resserve_export.observers.stats import collect
    from resserve_export.storage.calibration import load_stats

    stats = load_stats(Path(calib)) if calib is not None else None
    smoothing = checkpoint_smoothing(ck, Path(calib) if calib is not None else None, storage_dtypes(modelio.tensor_shapes(model_dir)))
    if check_weights:
        weights = smoothed_weights(linear_weights(net, ck), smoothing)
        check_weights_match(ck, weights, stats, model=modelio.model_label(model), progress=progress)
        del weights
        if smoothing is not None:
            check_smoothed_tensors(ck, net, smoothing, checkpoint_parameters(net, experts.blocks if experts is not None else []))
        if calib is not None:
            check_kv_scales(ck, Path(calib))
    tok = modelio.load_tokenizer(model_dir)
    spec = text or DEFAULT_TEXT
    docs = data.load_documents(spec)
    batches = data.batches(data.make_samples(tok, docs, samples, seq_len, seed), batch_size, data.pad_id(tok))

    # Salience for the sweep's masks: the calibration directory; without one, a short pass over
    # 16 other samples (another seed) of --text when given, else of the default calibration text.
    if stats is not None:
        salience = {m: v["mean_abs"] for m, v in stats.items() if "mean_abs" in v}
        selection = f"calibration directory {calib}"
    else:
        source = text or "shakespeare:calib"
        cal_docs = docs if text else data.load_documents(source)
        cal = data.batches(data.make_samples(tok, cal_docs, 16, seq_len, seed + 1), batch_size, data.pad_id(tok))
        groups = [Group(tuple(g["members"]), g["K"], ()) for g in ck.groups]
        collected, _ = collect(net, cal, groups)
        salience = {m: v["mean_abs"] for m, v in collected.items()}
        selection = f"salience from 16 samples (seed {seed + 1}) of {source} (seq_len {seq_len})"

    report = evaluate(
        net, ck, batches, salience, device=dev, max_tokens=max_tokens, check_weights=False, progress=progress, smoothing=smoothing,
        experts=experts,
    )
    report = {
        "checkpoint": str(ckpt),
        "model": modelio.model_label(model),
        "model_fingerprint": fp,
        "text": spec,
        "samples": samples,
        "seq_len": seq_len,
        "seed": seed,
        "sweep_selection": selection,
        **report,
        # Checked above, with the calibration when given; a mismatch raised there.
        "weights_match_reference": True if check_weights else None,
    }
    if out is not None:

        def write(tmp: Path) -> None:
            (tmp / "verify.json").write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
            write_chart(report, tmp / "nmse.png")

        write_dir_atomic(Path(out), write, overwrite=overwrite)
    return report


__all__ = [
    "verify",
    "evaluate",
    "check_weights_match",
    "weight_mismatches",
    "linear_weights",
    "group_nmse",
    "emulated",
    "write_chart",
    "InputCapture",
    "SWEEP",
]
