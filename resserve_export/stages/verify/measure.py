"""The measurements of `verify` on a loaded model and an opened checkpoint (`evaluate`): the
source model's perplexity, captured inputs and KV-cache error; the linear-output NMSE of every
fused group (`nmse.group_nmse`); the perplexity with the linears emulated from the checkpoint
(`perplexity.emulated`) and, for a checkpoint with KV-cache scales, with the KV cache quantized.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch

from resserve_export.algorithms import kernel
from resserve_export.algorithms.awq.smoothing import Smoothing
from resserve_export.core.errors import UserError
from resserve_export.core.names import natural_key
from resserve_export.formats import registry
from resserve_export.formats.kv import SCALE_DIVISOR
from resserve_export.modeling.experts import ROLES, checkpoint_parameters, is_expert
from resserve_export.observers.capture import InputCapture
from resserve_export.observers.kv import POINT, KVQuantizer
from resserve_export.stages.verify.checks import check_weights_match, linear_weights, smoothed_weights
from resserve_export.stages.verify.nmse import SWEEP, PooledError, group_nmse
from resserve_export.stages.verify.perplexity import emulated, forward_nll
from resserve_export.storage.checkpoint import Checkpoint

Progress = Callable[[str, int, int], None]


@dataclass
class SourcePass:
    """The source model's own pass: its perplexity, the inputs captured for NMSE and the KV-cache
    measurement (None without KV-cache scales)."""

    perplexity: float
    capture: InputCapture
    kv: KVQuantizer | None


@dataclass
class LinearNmse:
    """NMSE of every quantized linear: `layers` one report row per linear (model order),
    `pooled` the errors pooled over all linears and `by_kind` over each `linear_kind`, keyed
    ``plain``, ``checkpoint``, ``full`` and ``ratio_<ρ>``."""

    layers: list[dict]
    pooled: dict[str, PooledError]
    by_kind: dict[str, dict[str, PooledError]]
    unmeasured: list[str] = field(default_factory=list)  # experts no token of the text reached


def linear_kind(module: str) -> str:
    """The report's kind of a quantized linear: ``expert gate/up``, ``expert down`` (routed
    experts), ``attention`` (``self_attn`` / ``attn``), else ``mlp`` (dense and shared experts)."""
    leaf = module.rsplit(".", 1)[-1]
    if is_expert(module):
        return "expert down" if ROLES.get(leaf) == "down" else "expert gate/up"
    return "attention" if ".self_attn." in f".{module}." or ".attn." in f".{module}." else "mlp"


def _reduction(new: float, old: float) -> float:
    return 100.0 * (old - new) / old if old > 0 else float("nan")


def _backend_label(backend: str, device) -> str:
    if backend == "cuda":
        name = torch.cuda.get_device_name(device)
        major, minor = torch.cuda.get_device_capability(device)
        return f"fused CUDA kernel ({name}, sm_{major}{minor})"
    return f"PyTorch reference ({torch.device(device).type})"


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
    progress: Progress | None = None,
    smoothing: Smoothing | None = None,
    experts=None,
    gptq: bool = False,
) -> dict:
    """The measurements of `verify` for a loaded model and an opened checkpoint (no files).

    `check_weights`: first `check_weights_match` (without calibration statistics), which raises
    on a mismatch before anything is measured. `smoothing`: the AWQ smoothing the checkpoint was
    packed with (`checkpoint_smoothing`); the reference stays the unsmoothed `model`. `experts`:
    the `experts.Unfused` handle of a mixture-of-experts model (its experts mounted as per-expert
    linears), told each batch's mask while inputs are captured. `gptq`: the checkpoint holds GPTQ
    weights (``weight_algo`` gptq or awq+gptq): the sweep's extensions are built from its stored
    weights, as `pack` builds them.
    """
    t0 = time.perf_counter()
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
    dtype = next(iter(weights.values())).dtype
    kv_scales = ck.kv_scales()

    # 1. Source-model pass (its own dtype): perplexity, captured inputs and the KV-cache error.
    source = _source_pass(model, ck, batches, groups, kv_scales, device, dtype, max_tokens, experts, progress)
    ppl = {"bf16": source.perplexity}
    # 2. NMSE per fused group.
    backend = kernel.backend_for(torch.empty(0, dtype=dtype, device=device))
    ext_from = {m: pk.base.dequantize() for m, pk in packed_all.items()} if gptq else weights
    nmse = _linear_nmse(ck, groups, source.capture, packed_all, original, ext_from, salience, sweep, smoothing, device, progress)
    # 3. Emulated perplexity (an AWQ checkpoint's smoothed norms, biases and routers in place).
    ppl.update(_emulated_perplexity(model, ck, batches, packed_all, kv_scales, device, smoothing, experts, progress))
    kv_report = None
    if kv_scales:
        kv_report = {"format": ck.kv_cache, "scale": f"amax / {SCALE_DIVISOR:g}", "point": POINT, **source.kv.nmse()}
    algo = ("awq+gptq" if smoothing is not None else "gptq") if gptq else ("awq" if smoothing is not None else "rtn")
    return _report(ck, batches, nmse, ppl, kv_report, sweep, backend, device, dtype, algo, check_weights, t0)


def _source_pass(
    model, ck: Checkpoint, batches, groups, kv_scales, device, dtype, max_tokens: int, experts, progress: Progress | None
) -> SourcePass:
    """The source model over `batches`: perplexity, with the quantized linears' inputs captured
    (at most `max_tokens` rows per group) and the KV cache's error measured."""
    kv_measure = KVQuantizer(model, kv_scales, ck.kv_cache, emulate=False) if kv_scales else None
    cap = InputCapture(model, groups, max_tokens)
    tick = (lambda: progress(f"{str(dtype).removeprefix('torch.')} forward + capture", 1, len(batches))) if progress else None

    def on_batch(b):
        cap.set_mask(b["attention_mask"])
        if experts is not None:
            experts.set_mask(b["attention_mask"])

    try:
        ppl = forward_nll(model, batches, device, on_batch=on_batch, tick=tick, kv=kv_measure)
    finally:
        cap.remove()
        if experts is not None:
            experts.end_batch()
    return SourcePass(ppl, cap, kv_measure)


def _linear_nmse(
    ck: Checkpoint, groups, cap: InputCapture, packed_all, original, weights, salience, sweep, smoothing, device,
    progress: Progress | None,
) -> LinearNmse:
    """`group_nmse` of every fused group on its captured inputs, as report rows and pooled."""
    layers, totals, by_kind, unmeasured = [], {}, {}, []
    for g in groups:
        if not cap.count[g]:
            unmeasured.extend(g)  # an expert the text routed no token to: nothing to measure it on
            if progress:
                progress("linear-output NMSE", 1, len(groups))
            continue
        x = cap.inputs(g).to(device)
        packed = {m: packed_all[m] for m in g}
        sal = salience.get(g[0]) if salience else None
        smooth = smoothing.scale_for(g) if smoothing is not None else None
        accs = group_nmse(
            x, original, packed, ck.fmt, ck.rounding, sal, sweep if sal is not None else (), smooth=smooth, packed_weights=weights,
            row_scales={m: smoothing.row_scale(m) for m in g} if smoothing is not None else None,
        )
        for m in g:
            row = {"module": m, "ratio": packed[m].ratio, "mode": packed[m].mode, "tokens": int(x.shape[0])}
            for k, a in accs[m].items():
                key = k if isinstance(k, str) else f"ratio_{k}"
                row[key] = a.nmse
                for tot in (totals.setdefault(key, PooledError()), by_kind.setdefault(linear_kind(m), {}).setdefault(key, PooledError())):
                    tot.err, tot.ref = tot.err + a.err, tot.ref + a.ref
            layers.append(row)
        if progress:
            progress("linear-output NMSE", 1, len(groups))
    layers.sort(key=lambda r: natural_key(r["module"]))
    return LinearNmse(layers, totals, by_kind, unmeasured)


def _emulated_perplexity(
    model, ck: Checkpoint, batches, packed_all, kv_scales, device, smoothing: Smoothing | None, experts, progress: Progress | None
) -> dict[str, float]:
    """Perplexity with every quantized linear emulated from the checkpoint (``plain``,
    ``checkpoint``, ``full``) and, with KV-cache scales, with the KV cache quantized by them,
    alone (``bf16_kv``) and with the checkpoint's linears (``checkpoint_kv``)."""
    ppl = {}
    cache: dict = {}
    params = None
    if smoothing is not None and experts is not None:
        params = checkpoint_parameters(model, experts.blocks)
    smoothed = smoothing.applied(model, params) if smoothing is not None else nullcontext()
    with smoothed:
        for mode in ("plain", "checkpoint", "full"):
            with emulated(model, ck, mode, packed_all, cache):
                tick = (lambda: progress(f"perplexity ({mode})", 1, len(batches))) if progress else None
                ppl[mode] = forward_nll(model, batches, device, tick=tick)
    if kv_scales:
        # The KV cache quantized with the stored scales, alone and with the checkpoint's linears.
        tick = (lambda: progress("perplexity (KV cache)", 1, 2 * len(batches))) if progress else None
        ppl["bf16_kv"] = forward_nll(model, batches, device, tick=tick, kv=KVQuantizer(model, kv_scales, ck.kv_cache, emulate=True))
        with (smoothing.applied(model, params) if smoothing is not None else nullcontext()), emulated(model, ck, "checkpoint", packed_all, cache):
            ppl["checkpoint_kv"] = forward_nll(model, batches, device, tick=tick, kv=KVQuantizer(model, kv_scales, ck.kv_cache, emulate=True))
    return ppl


def _report(
    ck: Checkpoint, batches, nmse: LinearNmse, ppl: dict, kv_report: dict | None, sweep, backend: str, device, dtype,
    algo: str, check_weights: bool, t0: float,
) -> dict:
    """verify.json's measurements (without the run's inputs, which `verify` adds)."""
    layers = nmse.layers
    pooled = {k: a.nmse for k, a in nmse.pooled.items()}
    keys = [k for k in pooled if k not in ("plain", "checkpoint", "full")]
    mean = {k: sum(r[k] for r in layers) / len(layers) for k in pooled}
    chain = [pooled["plain"], *[pooled[f"ratio_{r}"] for r in sweep if f"ratio_{r}" in pooled], pooled["full"]]
    return {
        "format": ck.fmt,
        "mx_scale_rounding": registry.get(ck.fmt).rounding_record(ck.rounding),
        "activation_quantization": _backend_label(backend, device),
        "perplexity_activation_quantization": f"PyTorch reference in emulate.EmulatedLinear ({torch.device(device).type})",
        "device": str(device),
        "tokens_scored": int(sum(int(b["attention_mask"].sum()) for b in batches)),
        "nmse_tokens_per_layer": min(r["tokens"] for r in layers),
        **({"nmse_unmeasured": nmse.unmeasured} if nmse.unmeasured else {}),
        "model_dtype": str(dtype).removeprefix("torch."),
        "weight_algo": algo,
        "weights_match_reference": True if check_weights else None,
        "nmse": {
            "pooled": pooled,
            "mean_per_layer": mean,
            "sweep_keys": keys,
            "full_vs_plain_reduction_pct": _reduction(pooled["full"], pooled["plain"]),
            "checkpoint_vs_plain_reduction_pct": _reduction(pooled["checkpoint"], pooled["plain"]),
            "falls_as_ratio_rises": all(a > b for a, b in zip(chain, chain[1:])),
            "by_kind": {kind: {k: a.nmse for k, a in accs.items()} for kind, accs in nmse.by_kind.items()},
        },
        "perplexity": ppl,
        "kv_cache": kv_report,
        "layers": layers,
        "wall_time_s": round(time.perf_counter() - t0, 1),
    }


__all__ = ["evaluate", "linear_kind", "SourcePass", "LinearNmse"]
