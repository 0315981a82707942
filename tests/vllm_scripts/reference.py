"""The reference a vLLM engine is compared with: the HF model with emulated FP4 linears.

Built from the original bf16 model and the calibration statistics (not from the checkpoint), so a
match also checks `pack`. Each quantized linear becomes an
:class:`resserve_export.emulate.EmulatedLinear` with the group's shared α (NVFP4), mask and ratio.

Two arithmetics:

- ``fp32`` (default): `EmulatedLinear` itself — dequantized operands and the product in FP32, the
  output cast to the model dtype. This is what the plugin's ``resserve`` method computes.
- ``vllm``: what vLLM's stock emulation kernels compute (``EmulationNvFp4LinearKernel`` and our
  ``CpuMxfp4LinearKernel``): the QDQ activation is rounded to the model dtype, the weight is
  dequantized in FP32 and rounded to the model dtype, and the product is a matmul in the model
  dtype. vLLM's NVFP4 activation QDQ orders its FP32 operations differently from docs/formats.md, "NVFP4" (it
  multiplies by reciprocals of the inverse tensor scale, see :func:`vllm_nvfp4_qdq`), which
  changes a code now and then, so this arithmetic reproduces that order too.

Attention: ``hf`` (default) keeps the HF model's rotary embedding and attention; ``vllm-cpu``
replaces them by the arithmetic of vLLM's CPU kernels (:mod:`.cpu_attention`, FP32 models only),
the only non-linear ops in which that engine and the HF model differ at FP32. With both
``vllm`` arithmetic and ``vllm-cpu`` attention the reference computes, bit for bit, what a stock
FP32 vLLM CPU engine computes for a plain checkpoint.

Imports neither vLLM nor anything heavy at module import time.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from resserve_export.formats import registry
from resserve_export.algorithms.emulate import EmulatedLinear, replace_linear
from resserve_export.formats.constants import F4_E2M1_MAX, F8_E4M3_MAX, NVFP4_BLOCK
from resserve_export.formats.ops import dequantize, quantize
from resserve_export.formats.fp4 import decode_e2m1, encode_e2m1
from resserve_export.algorithms.selection import select_mask

ARITHMETICS = ("fp32", "vllm")
ATTENTIONS = ("hf", "vllm-cpu")


def _reciprocal(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (x + (x == 0) * 1e8)


def vllm_nvfp4_qdq(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """NVFP4 activation QDQ in the operation order of vLLM 0.32's CPU emulation, FP32 result.

    With g = 1/α (FP32): s = E4M3(clamp(g · (amax_block · 1/6), ±448)); the element is
    E2M1(clamp(x · 1/(s · 1/g), ±6)) (round to nearest even, as its threshold table does) and its
    value code · (s / g). A zero block scale gives a zero block.
    """
    m, k = x.shape
    g = (1.0 / alpha.float()).reshape(())
    xb = x.float().reshape(m, k // NVFP4_BLOCK, NVFP4_BLOCK)
    vmax = xb.abs().amax(dim=-1, keepdim=True)
    s = (g * (vmax * (1.0 / F4_E2M1_MAX))).clamp(-F8_E4M3_MAX, F8_E4M3_MAX).to(torch.float8_e4m3fn).float()
    scaled = (xb * _reciprocal(s * _reciprocal(g))).clamp(-F4_E2M1_MAX, F4_E2M1_MAX)
    return (decode_e2m1(encode_e2m1(scaled)) * (s / g)).reshape(m, k)


class VllmArithmeticLinear(EmulatedLinear):
    """Plain W4A4 with vLLM's emulation-kernel arithmetic (see the module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        dt = x.dtype
        qw = self.qw
        if registry.get(qw.fmt).has_tensor_scale:
            # vLLM's emulation of a format with a static tensor scale (NVFP4) has its own order.
            xd = vllm_nvfp4_qdq(x2, self.input_alpha).to(dt)
        else:
            xd = dequantize(quantize(x2.float(), qw.fmt, rounding=qw.rounding, backend="reference")).to(dt)
        w = qw.w.to(dt)
        y = torch.matmul(xd, w.T)
        if self.bias is not None:
            y = y + self.bias.to(dt)
        return y.reshape(*shape[:-1], self.out_features)


def load_salience(calib_dir: str | Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{module: (mean_abs, amax)}`` from a calibration directory's ``salience.safetensors``."""
    from safetensors.torch import load_file

    sal = load_file(str(Path(calib_dir) / "salience.safetensors"))
    mods = {k[: -len(".mean_abs")] for k in sal if k.endswith(".mean_abs")}
    return {m: (sal[f"{m}.mean_abs"].float(), sal[f"{m}.amax"].float().reshape(())) for m in mods}


def emulate_model(
    model: nn.Module,
    salience: dict[str, tuple[torch.Tensor, torch.Tensor]],
    fmt: str,
    ratios: float | dict[str, float] = 0.0,
    *,
    rounding: str = "ceil",
    arithmetic: str = "fp32",
    decode_rows: int | None = None,
    attention: str = "hf",
) -> nn.Module:
    """Replace every quantized linear of `model` in place; `ratios` is one ρ or ``{group name: ρ}``;
    ``attention="vllm-cpu"`` also swaps in the CPU engine's rotary / attention arithmetic."""
    from resserve_export.modeling.groups import group_linears, linears_of

    if arithmetic not in ARITHMETICS:
        raise ValueError(f"unknown arithmetic {arithmetic!r}, choose one of {list(ARITHMETICS)}")
    if attention not in ATTENTIONS:
        raise ValueError(f"unknown attention {attention!r}, choose one of {list(ATTENTIONS)}")
    f = registry.get(fmt)
    modules = dict(model.named_modules())
    for g in group_linears(linears_of(model)):
        ratio = ratios if isinstance(ratios, (int, float)) else ratios[g.name]
        if arithmetic == "vllm" and ratio != 0:
            raise ValueError("the 'vllm' arithmetic models stock vLLM, which serves plain W4A4 only")
        amax_x = torch.stack([salience[m][1] for m in g.modules]).max()
        alpha = f.weight_alpha(modules[m].weight.detach() for m in g.modules)  # the group's shared α, as `pack`'s
        mask = select_mask(salience[g.modules[0]][0], ratio) if ratio > 0 else None
        cls = VllmArithmeticLinear if arithmetic == "vllm" else EmulatedLinear
        for m in g.modules:
            new = cls(
                modules[m], fmt, input_amax=amax_x, ratio=ratio, mask=mask, weight_alpha=alpha,
                rounding=rounding, decode_rows=decode_rows,
            )
            replace_linear(model, m, new)
    if attention == "vllm-cpu":
        from cpu_attention import use_cpu_engine_attention

        use_cpu_engine_attention(model)
    return model
