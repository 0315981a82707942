"""Emulated W4A4 linears with residue compensation: the numerical reference of what a server runs.

Weights are quantized once (base and, for partial ratios, the K-Ext extension) and kept
dequantized in FP32; activations are quantized per call with the static α_x (NVFP4), and the
product is computed in FP32:

  plain   Y = X̂ Ŵᵀ
  k_ext   Y = X̂ Ŵᵀ + R̂_S Ŵ_Sᵀ      (R̂_S: selected residues in the extension blocks, docs/formats.md)
  full    Y = X̂ Ŵᵀ + R̂ Ŵᵀ         (every channel's residue, M-Ext)

Scores, `verify` and the vLLM plugin's reference all use this module (no second implementation).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from resserve_export.formats import registry
from resserve_export.formats.ops import dequantize, quantize
from resserve_export.algorithms import kernel
from resserve_export.algorithms.kext import compact, ext_width, residue
from resserve_export.formats.mxfp4 import ScaleRounding
from resserve_export.formats.qtensor import FP4Tensor
from resserve_export.algorithms.selection import check_ratio, mode_of


class QuantizedWeight:
    """A linear's weight in FP4 (base + optional extension), dequantized once to FP32."""

    def __init__(
        self,
        weight: torch.Tensor,
        fmt: str,
        *,
        ratio: float = 0.0,
        mask: torch.Tensor | None = None,
        weight_alpha: torch.Tensor | None = None,
        rounding: ScaleRounding | str = ScaleRounding.CEIL,
    ):
        f = registry.get(fmt)
        self.fmt, self.ratio, self.rounding = f.name, check_ratio(ratio), ScaleRounding(rounding)
        self.mask = mask
        if weight_alpha is None:
            weight_alpha = f.tensor_alpha(weight)  # None without a tensor scale
        # The fused kernel on CUDA (bit for bit the reference's codes and scales), else the reference.
        self.base = kernel.quantize(weight, f, alpha=weight_alpha, rounding=self.rounding)
        self.ext = None
        self._w = self._w_ext = None
        if ext_width(weight.shape[-1], self.ratio, f):
            if mask is None:
                raise ValueError("a partial ratio needs a mask")
            self.ext = kernel.extend_weight(weight, mask, self.ratio, f, self.rounding, alpha=self.base.global_scale)

    # The FP32 dequantized weights, made on first use: the bf16 scoring path and `pack` never
    # read them, and they are twice a bf16 model's bytes.
    @property
    def w(self) -> torch.Tensor:
        if self._w is None:
            self._w = dequantize(self.base)
        return self._w

    @w.setter
    def w(self, value: torch.Tensor) -> None:
        self._w = value

    @property
    def w_ext(self) -> torch.Tensor | None:
        if self._w_ext is None and self.ext is not None:
            self._w_ext = dequantize(self.ext)
        return self._w_ext

    @w_ext.setter
    def w_ext(self, value: torch.Tensor | None) -> None:
        self._w_ext = value

    @classmethod
    def from_stored(
        cls,
        fmt: str,
        ratio: float,
        rounding: ScaleRounding | str,
        mask: torch.Tensor | None,
        base: FP4Tensor,
        w: torch.Tensor | None,
        ext: FP4Tensor | None = None,
        w_ext: torch.Tensor | None = None,
    ) -> "QuantizedWeight":
        """A weight already quantized (a checkpoint's stored tensors): `base` and, for a partial
        ratio, the extension `ext`, with their dequantized FP32 values `w` and `w_ext` (which the
        caller may share between weights; None: dequantized on first use); nothing else is computed."""
        qw = cls.__new__(cls)
        qw.fmt, qw.ratio, qw.rounding = registry.get(fmt).name, check_ratio(ratio), ScaleRounding(rounding)
        qw.mask = mask
        qw.base, qw.ext, qw._w, qw._w_ext = base, ext, w, w_ext
        return qw


def quantized_residue_operand(
    res: torch.Tensor,
    xq: FP4Tensor,
    mode: str,
    *,
    mask: torch.Tensor | None = None,
    width: int = 0,
    rounding: ScaleRounding | str = ScaleRounding.CEIL,
    backend: str = "reference",
) -> FP4Tensor:
    """The residue operand of a compensated product in FP4, with the base α of `xq`: R for
    ``full``, ``[R_S | 0]`` of the extension's `width` for ``k_ext``."""
    src = res if mode == "full" else compact(res, mask, width)
    return quantize(src, xq.fmt, alpha=xq.global_scale, rounding=rounding, backend=backend)


def exact_operand(q: FP4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The values of `q` without its tensor scale α, in `dtype`: E2M1 value × block scale.

    ``dequantize(q) == α · exact_operand(q)`` up to the FP32 rounding of the product. The values are
    exact in bfloat16: an E2M1 value has at most 2 significant bits and an E4M3 scale at most 4
    (MXFP4: a power of two), so products of these operands are exact and a bf16 GEMM with FP32
    accumulation rounds only its sums and its output.
    """
    if q.global_scale is None:
        return dequantize(q).to(dtype)
    one = torch.ones((), dtype=torch.float32, device=q.codes.device)
    return dequantize(FP4Tensor(q.fmt, q.codes, q.scales, one)).to(dtype)


def residue_weight(qw: QuantizedWeight, mode: str) -> torch.Tensor:
    """The weight the residue operand multiplies: Ŵ for ``full``, the extension Ŵ_S for ``k_ext``."""
    if mode == "full":
        return qw.w
    if qw.w_ext is None:
        raise ValueError("k_ext needs a partial ratio with an extension")
    return qw.w_ext


def quantized_matmul(
    x: torch.Tensor,
    qw: QuantizedWeight,
    *,
    input_alpha: torch.Tensor | None,
    mode: str | None = None,
) -> torch.Tensor:
    """FP32 ``[M, N]`` output of the emulated FP4 linear for x ``[M, K]``.

    `mode` overrides the weight's own mode (``plain``, ``k_ext`` or ``full``); ``k_ext`` needs an
    extension (a partial ratio).
    """
    mode = mode or mode_of(qw.ratio)
    xq = quantize(x, qw.fmt, alpha=input_alpha, rounding=qw.rounding, backend="reference")
    y = dequantize(xq) @ qw.w.T
    if mode == "plain":
        return y
    w_res = residue_weight(qw, mode)
    r = residue(x, xq)
    rq = quantized_residue_operand(r, xq, mode, mask=qw.mask, width=w_res.shape[-1], rounding=qw.rounding)
    return y + dequantize(rq) @ w_res.T


class EmulatedLinear(nn.Module):
    """Drop-in replacement for an ``nn.Linear`` that runs the emulated FP4 path.

    decode_rows: when set, inputs with at most this many rows use full compensation and larger
    ones the layer's own mode (the serving rule of docs/formats.md,
    "Ratio planner": decode full, prefill ratio).
    """

    def __init__(
        self,
        linear: nn.Linear,
        fmt: str,
        *,
        input_amax: torch.Tensor | float | None,
        ratio: float = 0.0,
        mask: torch.Tensor | None = None,
        weight_alpha: torch.Tensor | None = None,
        input_alpha: torch.Tensor | None = None,
        rounding: ScaleRounding | str = ScaleRounding.CEIL,
        mode: str | None = None,
        decode_rows: int | None = None,
    ):
        super().__init__()
        f = registry.get(fmt)
        qw = QuantizedWeight(linear.weight.detach(), f, ratio=ratio, mask=mask, weight_alpha=weight_alpha, rounding=rounding)
        if f.has_tensor_scale and input_alpha is None:
            if input_amax is None:
                raise ValueError(f"{f.name.upper()} activations need a calibrated amax")
            input_alpha = f.input_alpha(input_amax)
        self._bind(linear, qw, input_alpha, mode or mode_of(ratio), decode_rows)

    @classmethod
    def from_weight(
        cls,
        linear: nn.Linear,
        qw: QuantizedWeight,
        *,
        input_alpha: torch.Tensor | None,
        mode: str | None = None,
        decode_rows: int | None = None,
    ) -> "EmulatedLinear":
        """An emulated `linear` (its shape and bias) whose weight is `qw` as given (e.g.
        `QuantizedWeight.from_stored`), with the activation α `input_alpha` (None without a tensor
        scale); `mode` defaults to that of the weight's ratio."""
        em = cls.__new__(cls)
        nn.Module.__init__(em)
        em._bind(linear, qw, input_alpha, mode or mode_of(qw.ratio), decode_rows)
        return em

    def _bind(self, linear: nn.Linear, qw: QuantizedWeight, input_alpha, mode: str, decode_rows: int | None) -> None:
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.qw = qw
        self.bias = None if linear.bias is None else linear.bias.detach().float()
        self.input_alpha = input_alpha
        self.mode = mode
        self.decode_rows = decode_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        mode = self.mode
        if self.decode_rows is not None and x2.shape[0] <= self.decode_rows and mode != "plain":
            mode = "full"
        y = quantized_matmul(x2, self.qw, input_alpha=self.input_alpha, mode=mode)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)


def replace_linear(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Put `new` at module path `name` of `model`; returns the module it replaced."""
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, leaf)
    setattr(parent, leaf, new)
    return old


class DequantizedLinear(nn.Module):
    """Drop-in replacement for an ``nn.Linear`` whose weight is its FP4 quantization, dequantized,
    and whose input is left as it comes: the weights' error alone, in the model's own dtype and
    GEMM (``F.linear``), where `EmulatedLinear` also quantizes the input and computes in FP32."""

    def __init__(self, linear: nn.Linear, qw: QuantizedWeight):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = qw.w.to(linear.weight.dtype)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


@contextmanager
def swapped(model: nn.Module, replacements: dict[str, nn.Module]):
    """Swap modules of `model` (``{module path: replacement}``, e.g. emulated linears) for the
    duration of the block; the originals are back on exit, whatever happens inside."""
    originals: dict[str, nn.Module] = {}
    try:
        for name, new in replacements.items():
            originals[name] = replace_linear(model, name, new)
        yield model
    finally:
        for name, old in originals.items():
            replace_linear(model, name, old)
