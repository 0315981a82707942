"""Linear-output NMSE of one fused group of a checkpoint: its FP4 weights read back, real inputs
quantized the way the server quantizes them, against the FP32 product of the original operands.

NMSE = Σ‖y − y_ref‖² / Σ‖y_ref‖², pooled over tokens (`PooledError` adds up both sums, so that
layers pool by adding them too), for plain W4A4, the checkpoint's own ratio, full compensation
and a sweep of partial ratios (docs/formats.md, "Residue compensation").
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from resserve_export.algorithms import kernel
from resserve_export.algorithms.kext import extend_weight
from resserve_export.algorithms.selection import PARTIAL_RATIOS, select_mask
from resserve_export.formats import registry
from resserve_export.formats.qtensor import FP4Tensor

SWEEP = PARTIAL_RATIOS


@contextmanager
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


class PooledError:
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
) -> dict[str, dict[str, PooledError]]:
    """Per member: {mode: `PooledError`} for ``plain``, ``checkpoint``, ``full`` and each sweep ratio.

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

    accs = {m: {k: PooledError() for k in ("plain", "checkpoint", "full", *masks)} for m in packed}
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


__all__ = ["SWEEP", "PooledError", "group_nmse"]
