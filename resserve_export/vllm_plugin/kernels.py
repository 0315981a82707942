"""CPU linear kernels for FP4 checkpoints in vLLM.

NVFP4: :class:`CachedEmulationNvFp4LinearKernel` is vLLM's own ``EmulationNvFp4LinearKernel``
with the weight dequantization hoisted to load time: vLLM's kernel dequantizes every weight on
every call, which makes each decode step dequantize the whole model. The cached weight is computed
by vLLM's own ``dequantize_to_dtype`` and the activation QDQ by its ``ref_nvfp4_quant_dequant``,
so the result is bit-identical to the stock kernel, only faster.

MXFP4: :class:`CpuMxfp4LinearKernel`, pure torch.

vLLM's ``EmulationMxfp4LinearKernel`` dequantizes weights and quantizes activations through
``amd-quark`` kernels that exist only for CUDA devices. This one does the same arithmetic with
our reference quantizer: the weight is dequantized once at load to the model dtype (E2M1 values
times a power of two are exact in bf16/fp16/fp32), activations are quantized and dequantized per
call in FP32 and cast back to the model dtype, and the product is one ``F.linear`` in that dtype.

Activation scale rounding: the checkpoint's ``resserve.mx_scale_rounding`` when it has one (so
serving rounds like `pack` and `verify` do), otherwise ``even``, the rule of vLLM's own MXFP4
emulation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn import Parameter
from vllm.model_executor.kernels.linear.mxfp4.base import MxFp4LinearKernel, MxFp4LinearLayerConfig
from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
    dequantize_to_dtype,
    ref_nvfp4_quant_dequant,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import kMxfp4Dynamic
from vllm.platforms import current_platform

from resserve_export.formats.ops import dequantize, quantize
from resserve_export.formats.mxfp4 import ScaleRounding
from resserve_export.formats.qtensor import FP4Tensor
from resserve_export.formats.registry import MXFP4

DEFAULT_ROUNDING = ScaleRounding.EVEN


def checkpoint_quant_config() -> dict | None:
    """``quantization_config`` of the model being built, if vLLM's config context has one."""
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    mc = getattr(cfg, "model_config", None)
    qc = getattr(getattr(mc, "hf_config", None), "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(qc)
    return qc


def checkpoint_rounding() -> ScaleRounding:
    qc = checkpoint_quant_config() or {}
    rnd = (qc.get("resserve") or {}).get("mx_scale_rounding")
    return ScaleRounding(rnd) if rnd else DEFAULT_ROUNDING


def dequantize_mxfp4(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """FP32 ``[N, K]`` from packed codes ``[N, K/2]`` and E8M0 scales ``[N, K/32]``."""
    return dequantize(FP4Tensor(MXFP4.name, codes, MXFP4.as_scales(scales), None))


def qdq_mxfp4(x: torch.Tensor, rounding: ScaleRounding) -> torch.Tensor:
    """MXFP4 quantize-dequantize of activations along the last dim, FP32 result."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).float()
    q = quantize(x2, MXFP4, rounding=rounding, backend="reference")
    return dequantize(q).reshape(shape)


class CpuMxfp4LinearKernel(MxFp4LinearKernel):
    """MXFP4 W4A4 (or W4A16) linear on CPU by emulation, no external kernels."""

    def __init__(self, config: MxFp4LinearLayerConfig) -> None:
        super().__init__(config)
        self.quantize_input = config.activation_quant_key is not None
        self.rounding = checkpoint_rounding()

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        if not current_platform.is_cpu():
            return False, "only for the CPU platform"
        return True, None

    @classmethod
    def can_implement(cls, config: MxFp4LinearLayerConfig) -> tuple[bool, str | None]:
        if config.activation_quant_key not in (None, kMxfp4Dynamic):
            return False, "only MXFP4 or unquantized activations"
        return True, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        dtype = getattr(layer, "params_dtype", torch.bfloat16)
        w = dequantize_mxfp4(layer.weight.data, layer.weight_scale.data).to(dtype)
        layer.weight = Parameter(w.contiguous(), requires_grad=False)

    def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.quantize_input:
            x = qdq_mxfp4(x, self.rounding).to(x.dtype)
        return F.linear(x, layer.weight.to(x.dtype), bias)


class CachedEmulationNvFp4LinearKernel(EmulationNvFp4LinearKernel):
    """vLLM's NVFP4 emulation (QDQ activation, dequantized weight, matmul in the model dtype)
    with the weight dequantized once at load instead of on every call."""

    NVFP4_GROUP = 16

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        if not current_platform.is_cpu():
            return False, "only for the CPU platform"
        return True, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        super().process_weights_after_loading(layer)
        dtype = getattr(layer, "params_dtype", torch.bfloat16)
        w = dequantize_to_dtype(
            layer.weight.data.view(torch.uint8), layer.weight_scale.data, layer.weight_global_scale,
            dtype, self.NVFP4_GROUP, swizzle=False,
        )
        layer.register_buffer("resserve_w_dq", w.contiguous(), persistent=False)

    def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x_dq = ref_nvfp4_quant_dequant(x, layer.input_global_scale_inv, block_size=self.NVFP4_GROUP)
        out = torch.matmul(x_dq, layer.resserve_w_dq.to(x.dtype).t())
        if bias is not None:
            out = out + bias
        return out
