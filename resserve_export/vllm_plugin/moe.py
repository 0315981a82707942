"""Mixture-of-experts layers of FP4 checkpoints on vLLM's CPU platform.

vLLM's CPU platform has no FP4 MoE path: ModelOpt's NVFP4 MoE method finds no backend (its
emulation backend is a Triton kernel), and compressed-tensors' MXFP4 MoE method falls back to
Marlin, a CUDA kernel. The plugin gives both a CPU experts kernel (a modular
``FusedMoEExpertsModular``, so vLLM's own method still creates, loads and checks the
parameters and runs the router):

- NVFP4: :class:`CpuNvFp4Experts` joins the kernel classes of vLLM's NVFP4 ``EMULATION``
  backend, tried first and accepted on the CPU only. It is the arithmetic of vLLM's NVFP4 MoE
  emulation, which it receives already prepared by vLLM's own conversion: one activation global
  scale per layer and GEMM (the largest of the experts' ``input_scale``, vLLM's rule), activations
  quantize-dequantized by vLLM's ``ref_nvfp4_quant_dequant``, weights dequantized by its
  ``dequantize_to_dtype`` (once at load instead of on every call).
- MXFP4: on the CPU, compressed-tensors' W4A4 MXFP4 MoE method is replaced by
  ``CpuCompressedTensorsW4A4Mxfp4MoEMethod`` (:func:`cpu_ct_mxfp4_method`; same parameters and
  loaders), whose
  :class:`CpuMxfp4Experts` compute each expert as :class:`.kernels.CpuMxfp4LinearKernel`
  computes a linear: weights dequantized at load, activations MXFP4 quantize-dequantized per call
  with the checkpoint's scale rounding.

Both kernels run the experts one at a time over the rows routed to them (experts in ascending
order, rows in token order): W13 product, vLLM's native SiLU-and-mul (what its dense MLPs run on
x86 CPUs), W2 product, each in the model dtype; then the routing weight times the expert output is
added into an FP32 sum per token, cast to the model dtype at the end.
"""

from __future__ import annotations

import functools

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.logger import init_logger
from vllm.model_executor.layers.activation import SiluAndMul, SwigluOAIAndMul
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEParallelConfig,
    FusedMoEQuantConfig,
    mxfp4_moe_quant_config,
)
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
    TopKWeightAndReduceNoOP,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
    dequantize_to_dtype,
    ref_nvfp4_quant_dequant,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    QuantKey,
    kMxfp4Dynamic,
    kMxfp4Static,
    kNvfp4Dynamic,
    kNvfp4Static,
)
from vllm.platforms import current_platform

from resserve_export.formats.mxfp4 import ScaleRounding
from resserve_export.vllm_plugin.kernels import checkpoint_rounding, dequantize_mxfp4, qdq_mxfp4

NVFP4_GROUP = 16
# Under vLLM's logger, whose handlers print its INFO lines (ours would be silent otherwise).
logger = init_logger(f"vllm.{__name__}")


def act_and_mul(activation: MoEActivation, x: torch.Tensor) -> torch.Tensor:
    """The gated activation of ``x = [gate | up]`` as vLLM's native ops compute it."""
    if activation == MoEActivation.SILU:
        return SiluAndMul.forward_native(x)
    if activation == MoEActivation.SWIGLUOAI:  # gpt-oss: gate and up rows interleaved; vLLM's fixed α and limit
        return SwigluOAIAndMul.forward_native(SWIGLUOAI, x)
    if activation in (MoEActivation.GELU, MoEActivation.GELU_TANH):
        approx = "tanh" if activation == MoEActivation.GELU_TANH else "none"
        d = x.shape[-1] // 2
        return torch.nn.functional.gelu(x[..., :d], approximate=approx) * x[..., d:]
    raise ValueError(f"resserve: the CPU FP4 experts do not implement the {activation.value} activation")


SUPPORTED_ACTIVATIONS = (MoEActivation.SILU, MoEActivation.GELU, MoEActivation.GELU_TANH)


class _SwigluOAI:  # forward_native's arguments without building a CustomOp (which needs vLLM's config context)
    alpha, limit = 1.702, 7.0


SWIGLUOAI = _SwigluOAI()


def routed_rows(topk_ids: torch.Tensor, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token rows, top-k positions) routed to `expert`, in token order."""
    return torch.where(topk_ids == expert)


class CpuFp4Experts(mk.FusedMoEExpertsModular):
    """Shared part of the CPU FP4 experts: the expert loop over routed rows (see the module
    docstring); subclasses quantize-dequantize activations and dequantize weights."""

    def __init__(self, moe_config: FusedMoEConfig, quant_config: FusedMoEQuantConfig):
        super().__init__(moe_config, quant_config)
        logger.info_once("Using %s for FP4 MoE on the CPU", type(self).__name__)
        self.w13: torch.Tensor | None = None  # [E, 2I, H] dequantized, model dtype
        self.w2: torch.Tensor | None = None  # [E, H, I]

    # -- what the oracle checks ---------------------------------------------------------------
    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def _supports_current_device() -> bool:
        return current_platform.is_cpu()

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation in SUPPORTED_ACTIVATIONS

    @staticmethod
    def _supports_parallel_config(moe_parallel_config: FusedMoEParallelConfig) -> bool:
        return not moe_parallel_config.use_all2all_kernels

    @staticmethod
    def supports_lora() -> bool:
        return False

    @property
    def expects_unquantized_inputs(self) -> bool:
        return True  # activations are quantized per GEMM inside apply()

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta, activation):
        return (0,), (0,), (M, K)

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceNoOP()  # apply() writes the weighted sum

    # -- arithmetic ---------------------------------------------------------------------------
    def qdq13(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def qdq2(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def apply(
        self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts, expert_map,
        a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta, apply_router_weight_on_input,
    ) -> None:
        assert self.w13 is not None and self.w2 is not None, "process_weights_after_loading did not run"
        dt = hidden_states.dtype
        acc = torch.zeros(output.shape, dtype=torch.float32, device=output.device)
        x_dq = self.qdq13(hidden_states)
        for e in range(self.w13.shape[0]):
            glob = e
            if expert_map is not None:
                hits = (expert_map == e).nonzero()
                if not hits.numel():
                    continue
                glob = int(hits[0, 0])
            rows, pos = routed_rows(topk_ids, glob)
            if not rows.numel():
                continue
            h = torch.matmul(x_dq[rows], self.w13[e].to(dt).t())
            a = act_and_mul(activation, h)
            y = torch.matmul(self.qdq2(a), self.w2[e].to(dt).t())
            if apply_router_weight_on_input:  # the prepare step has weighted the input already
                acc.index_add_(0, rows, y.float())
            else:
                acc.index_add_(0, rows, y.float() * topk_weights[rows, pos, None].float())
        output.copy_(acc.to(output.dtype))


class CpuNvFp4Experts(CpuFp4Experts):
    """vLLM's NVFP4 MoE emulation on the CPU (see the module docstring)."""

    @staticmethod
    def _supports_quant_scheme(weight_key: QuantKey | None, activation_key: QuantKey | None) -> bool:
        return (weight_key, activation_key) == (kNvfp4Static, kNvfp4Dynamic)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        qc = self.quant_config
        dtype = getattr(layer, "params_dtype", torch.bfloat16)
        self.w13 = dequantize_to_dtype(
            layer.w13_weight.data, qc.w1_scale, qc.g1_alphas.float(), dtype, NVFP4_GROUP, swizzle=False
        ).contiguous()
        self.w2 = dequantize_to_dtype(
            layer.w2_weight.data, qc.w2_scale, qc.g2_alphas.float(), dtype, NVFP4_GROUP, swizzle=False
        ).contiguous()

    def qdq13(self, x: torch.Tensor) -> torch.Tensor:
        return ref_nvfp4_quant_dequant(x, self.quant_config.a1_gscale, NVFP4_GROUP)

    def qdq2(self, x: torch.Tensor) -> torch.Tensor:
        return ref_nvfp4_quant_dequant(x, self.quant_config.a2_gscale, NVFP4_GROUP)


class CpuMxfp4Experts(CpuFp4Experts):
    """MXFP4 W4A4 experts on the CPU, each expert computed as :class:`.kernels.CpuMxfp4LinearKernel`
    computes a linear."""

    rounding: ScaleRounding = ScaleRounding.EVEN

    @staticmethod
    def _supports_quant_scheme(weight_key: QuantKey | None, activation_key: QuantKey | None) -> bool:
        return (weight_key, activation_key) == (kMxfp4Static, kMxfp4Dynamic)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        dtype = getattr(layer, "params_dtype", torch.bfloat16)

        def dq(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
            return torch.stack([dequantize_mxfp4(codes[e], scales[e]) for e in range(codes.shape[0])]).to(dtype)

        self.w13 = dq(layer.w13_weight.data, layer.w13_weight_scale.data).contiguous()
        self.w2 = dq(layer.w2_weight.data, layer.w2_weight_scale.data).contiguous()

    def qdq13(self, x: torch.Tensor) -> torch.Tensor:
        return qdq_mxfp4(x, self.rounding).to(x.dtype)

    qdq2 = qdq13


@functools.cache
def cpu_ct_mxfp4_method() -> type:
    """``CpuCompressedTensorsW4A4Mxfp4MoEMethod``: compressed-tensors' W4A4 MXFP4 MoE method
    with :class:`CpuMxfp4Experts` instead of Marlin (same parameters and weight loaders, the
    checkpoint layout kept, W4A4 as declared). Defined on first use: its base class's module
    imports the modules of vLLM's GPU MoE kernels, which plugin loading need not pay for."""
    from vllm.model_executor.layers.fused_moe.all2all_utils import (
        maybe_make_prepare_finalize,
    )
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe import (
        CompressedTensorsMoEMethod,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_w4a4_mxfp4 import (
        CompressedTensorsW4A4Mxfp4MoEMethod,
    )

    class CpuCompressedTensorsW4A4Mxfp4MoEMethod(CompressedTensorsW4A4Mxfp4MoEMethod):
        def __init__(self, moe):
            # The stock __init__ only picks a GPU backend (and announces Marlin): skipped.
            CompressedTensorsMoEMethod.__init__(self, moe)
            self.group_size = 32
            self.mxfp4_backend = Mxfp4MoeBackend.EMULATION
            self.experts_cls = CpuMxfp4Experts
            self.use_cutlass_mxfp4 = False
            self.rounding = checkpoint_rounding()  # read while vLLM's config context is set

        def get_fused_moe_quant_config(self, layer):
            return mxfp4_moe_quant_config(w1_scale=layer.w13_weight_scale, w2_scale=layer.w2_weight_scale)

        def process_weights_after_loading(self, layer) -> None:
            layer.w13_weight = torch.nn.Parameter(layer.w13_weight_packed.data, requires_grad=False)
            delattr(layer, "w13_weight_packed")
            layer.w2_weight = torch.nn.Parameter(layer.w2_weight_packed.data, requires_grad=False)
            delattr(layer, "w2_weight_packed")
            self.moe_quant_config = self.get_fused_moe_quant_config(layer)
            prepare_finalize = maybe_make_prepare_finalize(
                moe=self.moe, quant_config=self.moe_quant_config, routing_tables=layer._expert_routing_tables(),
                allow_new_interface=True, use_monolithic=False,
            )
            experts = CpuMxfp4Experts(moe_config=self.moe, quant_config=self.moe_quant_config)
            experts.rounding = self.rounding
            self.moe_kernel = mk.FusedMoEKernel(prepare_finalize, experts)
            experts.process_weights_after_loading(layer)

    return CpuCompressedTensorsW4A4Mxfp4MoEMethod


_patched = False


def register_cpu_moe() -> None:
    """Give vLLM's FP4 MoE methods the CPU kernels above (no-op off the CPU platform)."""
    global _patched
    if _patched or not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.fused_moe.oracle import nvfp4 as nvfp4_oracle

    stock_classes = nvfp4_oracle.backend_to_kernel_cls

    def backend_to_kernel_cls(backend):
        classes = stock_classes(backend)
        if backend == nvfp4_oracle.NvFp4MoeBackend.EMULATION:
            classes = [CpuNvFp4Experts, *classes]
        return classes

    nvfp4_oracle.backend_to_kernel_cls = backend_to_kernel_cls

    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe import (
        CompressedTensorsMoEMethod,
    )

    stock_get = CompressedTensorsMoEMethod.get_moe_method

    def get_moe_method(quant_config, layer, layer_name):
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_w4a4_mxfp4 import (
            CompressedTensorsW4A4Mxfp4MoEMethod,
        )

        method = stock_get(quant_config, layer, layer_name)
        if type(method) is CompressedTensorsW4A4Mxfp4MoEMethod:
            return cpu_ct_mxfp4_method()(layer.moe_config)
        return method

    CompressedTensorsMoEMethod.get_moe_method = staticmethod(get_moe_method)
    _patched = True
