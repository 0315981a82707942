"""Residues, the K-Ext extended weight and the extended activation (docs/formats.md, "The extended
weight (K-Ext)").

`extended_activation` is the reference the fused CUDA kernel is checked against bit for bit.
"""

from __future__ import annotations

import math

import torch

from resserve_export.formats import registry
from resserve_export.formats.ops import dequantize, quantize
from resserve_export.formats.mxfp4 import ScaleRounding
from resserve_export.formats.qtensor import FP4Tensor
from resserve_export.algorithms.selection import check_ratio, mask_to_indices


def ext_width(K: int, ratio: float, fmt: str) -> int:
    """K_E: width of the stored extension ``[W_S | 0]`` (0 for plain and full compensation)."""
    ratio = check_ratio(ratio)
    if ratio in (0.0, 1.0):
        return 0
    pad = registry.get(fmt).ext_pad
    total = K + int(ratio * K)
    return math.ceil(total / pad) * pad - K


def extended_width(K: int, ratio: float, fmt: str) -> int:
    """Width of ``[W | W_S | 0]``: K + K_E."""
    return K + ext_width(K, ratio, fmt)


def compact(x: torch.Tensor, mask: torch.Tensor, width: int) -> torch.Tensor:
    """``[x[..., S] | 0]`` of the given width, S in ascending channel order, FP32."""
    idx = mask_to_indices(mask).to(x.device)
    out = x.new_zeros((*x.shape[:-1], width), dtype=torch.float32)
    out[..., : idx.numel()] = x.index_select(-1, idx).float()
    return out


def residue(x: torch.Tensor, q: FP4Tensor) -> torch.Tensor:
    """r = x − QDQ(x) in FP32, from the scales of the base quantization `q`."""
    return x.float() - dequantize(q)


def extend_weight(
    weight: torch.Tensor,
    mask: torch.Tensor,
    ratio: float,
    fmt: str,
    rounding: ScaleRounding | str = ScaleRounding.CEIL,
    alpha: torch.Tensor | None = None,
    backend: str = "auto",
) -> FP4Tensor | None:
    """The stored extension: quantized ``[W_S | 0]`` of width K_E (None for plain/full).

    Quantizing ``[W | W_S | 0]`` over its full width gives the plain quantization in its first K
    columns (K is block-aligned and amax is unchanged), so only the extension is computed, with
    the base weight's α (pass the group's shared α for fused linears).
    """
    K = weight.shape[-1]
    K_E = ext_width(K, ratio, fmt)
    if K_E == 0:
        return None
    if alpha is None:
        alpha = registry.get(fmt).tensor_alpha(weight)  # None without a tensor scale
    return quantize(compact(weight, mask, K_E), fmt, alpha=alpha, rounding=rounding, backend=backend)


def extended_activation(
    x: torch.Tensor,
    mask: torch.Tensor,
    ratio: float,
    fmt: str,
    alpha: torch.Tensor | None = None,
    rounding: ScaleRounding | str = ScaleRounding.CEIL,
    backend: str = "reference",
) -> FP4Tensor:
    """``[X̂ | R̂_S | 0]``: base codes and scales, then the selected residues quantized with the
    base α (NVFP4) in their own blocks, width K + K_E. Plain and full ratios return X̂ alone.
    `backend`: that of `formats.quantize` (``auto`` takes its compiled, bit-identical path for
    large CPU tensors)."""
    base = quantize(x, fmt, alpha=alpha, rounding=rounding, backend=backend)
    K_E = ext_width(x.shape[-1], ratio, fmt)
    if K_E == 0:
        return base
    r = residue(x, base)
    ext = quantize(compact(r, mask, K_E), fmt, alpha=base.global_scale, rounding=rounding, backend=backend)
    return FP4Tensor.cat([base, ext])


def full_residue(
    x: torch.Tensor,
    fmt: str,
    alpha: torch.Tensor | None = None,
    rounding: ScaleRounding | str = ScaleRounding.CEIL,
    backend: str = "reference",
) -> tuple[FP4Tensor, FP4Tensor]:
    """(X̂, R̂) for full compensation (M-Ext): every channel's residue, base α (`backend` as in
    `extended_activation`)."""
    base = quantize(x, fmt, alpha=alpha, rounding=rounding, backend=backend)
    res = quantize(residue(x, base), fmt, alpha=base.global_scale, rounding=rounding, backend=backend)
    return base, res


__all__ = ["ext_width", "extended_width", "compact", "residue", "extend_weight", "extended_activation", "full_residue"]
